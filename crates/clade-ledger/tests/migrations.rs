//! Schema versioning: a new file is migrated to the current schema, reopening changes nothing, a
//! file from a newer clade or another program is refused without a byte changed, and a failing
//! migration step leaves the file at the version it had.

use std::path::{Path, PathBuf};

use clade_ledger::schema::{Migration, MIGRATIONS, SCHEMA_VERSION};
use clade_ledger::{Ledger, LedgerError, LedgerOptions, NewBranch};

fn fixture(name: &str, dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let dst = dir.join(name);
    std::fs::copy(&src, &dst).expect("copy fixture");
    dst
}

fn siblings(path: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn new_file_gets_current_schema_and_reopen_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/dir/ledger.db");
    let l = Ledger::open(&path).unwrap();
    assert_eq!(l.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(SCHEMA_VERSION, MIGRATIONS.len() as i64);
    let b = l.create_branch(&NewBranch::default()).unwrap();
    drop(l);
    let l = Ledger::open(&path).unwrap();
    assert_eq!(l.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(l.branch(&b.id).unwrap().id, b.id, "reopening must keep the data");
}

#[test]
fn newer_schema_fixture_is_refused_and_left_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let path = fixture("newer-schema.db", dir.path());
    let before = std::fs::read(&path).unwrap();
    let files_before = siblings(&path);

    let err = Ledger::open(&path).unwrap_err();
    match &err {
        LedgerError::NewerSchema { found, supported, .. } => {
            assert_eq!(*found, 99);
            assert_eq!(*supported, SCHEMA_VERSION);
        }
        other => panic!("expected NewerSchema, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("99") && msg.contains("upgrade clade"), "message says what to do: {msg}");

    assert_eq!(std::fs::read(&path).unwrap(), before, "the file must not change");
    assert_eq!(siblings(&path), files_before, "no -wal/-shm/-journal left behind");
}

#[test]
fn foreign_sqlite_file_and_garbage_are_refused_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = fixture("foreign.db", dir.path());
    let before = std::fs::read(&path).unwrap();
    let err = Ledger::open(&path).unwrap_err();
    assert!(matches!(err, LedgerError::NotALedger { .. }), "{err:?}");
    assert_eq!(std::fs::read(&path).unwrap(), before);

    let junk = dir.path().join("junk.db");
    std::fs::write(&junk, b"this is not an SQLite file at all, just some text long enough........").unwrap();
    let before = std::fs::read(&junk).unwrap();
    let err = Ledger::open(&junk).unwrap_err();
    assert!(matches!(err, LedgerError::NotALedger { .. }), "{err:?}");
    assert_eq!(std::fs::read(&junk).unwrap(), before);
}

const V2_ADD_NOTES: &str = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL);";
const V3_BROKEN: &str = "CREATE TABLE later (id INTEGER); INSERT INTO no_such_table VALUES (1);";

#[test]
fn migrations_apply_in_order_each_in_its_own_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    // Written by this build (its SCHEMA_VERSION), with a branch in it.
    let n = SCHEMA_VERSION;
    let l = Ledger::open(&path).unwrap();
    let b = l.create_branch(&NewBranch::default()).unwrap();
    drop(l);

    // A later build adds a step: it is applied on open and the data survives.
    let mut next: Vec<Migration> = MIGRATIONS.to_vec();
    next.push(Migration { name: "notes", sql: V2_ADD_NOTES });
    let l = Ledger::open_migrating(&path, LedgerOptions::default(), &next).unwrap();
    assert_eq!(l.schema_version().unwrap(), n + 1);
    assert_eq!(l.branch(&b.id).unwrap().id, b.id);
    drop(l);

    // A build with a broken step after that: the error names the step, the file stays as it was.
    let mut broken = next.clone();
    broken.push(Migration { name: "broken", sql: V3_BROKEN });
    let err = Ledger::open_migrating(&path, LedgerOptions::default(), &broken).unwrap_err();
    match err {
        LedgerError::Migration { from, to, .. } => assert_eq!((from, to), (n + 1, n + 2)),
        other => panic!("expected Migration error, got {other:?}"),
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let v: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, n + 1);
    let later: i64 =
        conn.query_row("SELECT count(*) FROM sqlite_master WHERE name = 'later'", [], |r| r.get(0)).unwrap();
    assert_eq!(later, 0, "the failed step's table must be rolled back");
    drop(conn);

    // And this build now refuses the newer file.
    let err = Ledger::open(&path).unwrap_err();
    assert!(matches!(err, LedgerError::NewerSchema { found, .. } if found == n + 1), "{err:?}");
}

#[test]
fn a_version_1_ledger_is_migrated_to_this_build() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = Ledger::open_migrating(&path, LedgerOptions::default(), &MIGRATIONS[..1]).unwrap();
    let b = l.create_branch(&NewBranch::default()).unwrap();
    drop(l);
    let l = Ledger::open(&path).unwrap();
    assert_eq!(l.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(l.branch(&b.id).unwrap().id, b.id);
    assert_eq!(l.collecting("anything").unwrap(), None, "the v2 table exists");
}

#[test]
fn ledger_file_is_in_wal_mode_with_foreign_keys_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = Ledger::open(&path).unwrap();
    drop(l);
    let conn = rusqlite::Connection::open(&path).unwrap();
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
    assert_eq!(mode, "wal");
    // A mark naming a branch that does not exist is refused by the schema (through our API
    // the same holds: see tests/ledger.rs).
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    let r = conn.execute("INSERT INTO marks (id, branch, backend, created_ms) VALUES ('m', 'nope', 'vm', 0)", []);
    assert!(r.is_err(), "foreign keys must reject an orphan mark");
}
