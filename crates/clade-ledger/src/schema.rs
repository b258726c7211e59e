//! The schema and its migrations.
//!
//! The file's schema version is SQLite's `PRAGMA user_version`; `PRAGMA application_id` marks the
//! file as a clade ledger so a stray SQLite file is refused rather than "migrated". Migrations are an
//! ordered list: entry `i` takes the file from version `i` to `i + 1`, each in its own `BEGIN
//! IMMEDIATE` transaction together with the version bump, so a failed step leaves the file at the
//! version it had. The version is read, and a newer one refused, before anything writes (not even
//! the switch to WAL), so a ledger written by a newer clade is left byte for byte as it was.

use std::path::Path;

use rusqlite::Connection;

use crate::error::{LedgerError, Result};

/// `PRAGMA application_id` of a clade ledger ("CLAD").
pub const APPLICATION_ID: i64 = 0x434c_4144;

/// One step of the schema's history.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// What the step does, for error messages and docs.
    pub name: &'static str,
    /// The SQL, run as one batch inside the step's transaction.
    pub sql: &'static str,
}

/// The schema this build writes: every migration, oldest first. Never edit a released entry;
/// append a new one.
pub const MIGRATIONS: &[Migration] =
    &[Migration { name: "initial schema", sql: V1 }, Migration { name: "marks being collected", sql: V2 }];

/// The schema version this build knows (the number of migrations).
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Marks a collection deleted whose store objects may not be gone yet: a fork of one is refused as a
/// conflict ("being collected"), not as unknown, until the collection's store sweep has finished.
const V2: &str = r#"
CREATE TABLE collecting (
    mark       TEXT PRIMARY KEY,
    label      TEXT,
    manifests  TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(manifests)),
    since_ms   INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX collecting_label ON collecting(label);
"#;

const V1: &str = r#"
CREATE TABLE templates (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    spec        TEXT NOT NULL CHECK (json_valid(spec)),
    created_ms  INTEGER NOT NULL
);
CREATE INDEX templates_name ON templates(name, created_ms);

CREATE TABLE branches (
    id           TEXT PRIMARY KEY,
    name         TEXT UNIQUE,
    parent_mark  TEXT REFERENCES marks(id) ON DELETE RESTRICT,
    head_mark    TEXT REFERENCES marks(id) ON DELETE RESTRICT,
    retain       INTEGER CHECK (retain IS NULL OR retain >= 0),
    thin         INTEGER NOT NULL DEFAULT 0 CHECK (thin IN (0, 1)),
    created_ms   INTEGER NOT NULL,
    deleted_ms   INTEGER
);
CREATE INDEX branches_parent ON branches(parent_mark);

CREATE TABLE marks (
    id             TEXT PRIMARY KEY,
    branch         TEXT NOT NULL REFERENCES branches(id) ON DELETE RESTRICT,
    label          TEXT,
    parent         TEXT REFERENCES marks(id) ON DELETE SET NULL,
    backend        TEXT NOT NULL CHECK (backend IN ('vm', 'ct')),
    logical_bytes  INTEGER NOT NULL DEFAULT 0 CHECK (logical_bytes >= 0),
    stored_bytes   INTEGER NOT NULL DEFAULT 0 CHECK (stored_bytes >= 0),
    pause_ms       INTEGER,
    timings        TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(timings)),
    created_ms     INTEGER NOT NULL,
    pinned         INTEGER NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1)),
    clean          INTEGER NOT NULL DEFAULT 0 CHECK (clean IN (0, 1))
);
CREATE INDEX marks_branch ON marks(branch, created_ms);
CREATE INDEX marks_parent ON marks(parent);

-- A mark's manifests (role -> store object id), one row each, so "who names this manifest" is an
-- index lookup for the store's GC.
CREATE TABLE mark_manifests (
    mark      TEXT NOT NULL REFERENCES marks(id) ON DELETE CASCADE,
    role      TEXT NOT NULL,
    manifest  TEXT NOT NULL,
    PRIMARY KEY (mark, role)
) WITHOUT ROWID;
CREATE INDEX mark_manifests_manifest ON mark_manifests(manifest);

CREATE TABLE bases (
    template    TEXT NOT NULL REFERENCES templates(id) ON DELETE RESTRICT,
    backend     TEXT NOT NULL CHECK (backend IN ('vm', 'ct')),
    mark        TEXT NOT NULL REFERENCES marks(id) ON DELETE RESTRICT,
    created_ms  INTEGER NOT NULL,
    PRIMARY KEY (template, backend)
) WITHOUT ROWID;
CREATE INDEX bases_mark ON bases(mark);

CREATE TABLE sandboxes (
    id              TEXT PRIMARY KEY,
    backend         TEXT NOT NULL CHECK (backend IN ('vm', 'ct')),
    branch          TEXT NOT NULL REFERENCES branches(id) ON DELETE CASCADE,
    origin_mark     TEXT REFERENCES marks(id) ON DELETE SET NULL,
    state           TEXT NOT NULL
                    CHECK (state IN ('starting', 'running', 'suspended', 'failed', 'dead')),
    supervisor_pid  INTEGER,
    host            TEXT,
    error           TEXT,
    created_ms      INTEGER NOT NULL,
    last_active_ms  INTEGER NOT NULL
);
CREATE INDEX sandboxes_branch ON sandboxes(branch);
CREATE INDEX sandboxes_state ON sandboxes(state);
CREATE INDEX sandboxes_origin ON sandboxes(origin_mark);

CREATE TABLE leases (
    id          TEXT PRIMARY KEY,
    holder      TEXT NOT NULL,
    mark        TEXT REFERENCES marks(id) ON DELETE RESTRICT,
    manifest    TEXT,
    created_ms  INTEGER NOT NULL,
    expires_ms  INTEGER,
    CHECK ((mark IS NULL) <> (manifest IS NULL))
);
CREATE INDEX leases_mark ON leases(mark);
CREATE INDEX leases_manifest ON leases(manifest);

CREATE TABLE ops (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    op           TEXT NOT NULL,
    sandbox      TEXT,
    mark         TEXT,
    started_ms   INTEGER NOT NULL,
    duration_ms  INTEGER NOT NULL CHECK (duration_ms >= 0),
    ok           INTEGER NOT NULL CHECK (ok IN (0, 1)),
    error        TEXT,
    details      TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(details))
);
CREATE INDEX ops_sandbox ON ops(sandbox, started_ms);
CREATE INDEX ops_op ON ops(op, started_ms);
"#;

fn read_ids(conn: &Connection) -> rusqlite::Result<(i64, i64)> {
    let app: i64 = conn.query_row("PRAGMA application_id", [], |r| r.get(0))?;
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    Ok((app, version))
}

/// Identity, version and number of schema objects, read in one snapshot (another process may be
/// creating the file at this very moment).
fn read_identity(conn: &Connection) -> rusqlite::Result<(i64, i64, i64)> {
    let tx = rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Deferred)?;
    let objects: i64 = tx.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))?;
    let (app, version) = read_ids(&tx)?;
    Ok((app, version, objects)) // dropping `tx` ends the read; nothing was written
}

/// Reads the file's identity and version without writing anything, and refuses a file that is not
/// a clade ledger or is newer than `supported`. Returns the file's version (0 for a new file).
pub(crate) fn check(conn: &Connection, path: &Path, supported: i64) -> Result<i64> {
    let not_a_ledger = |why: String| LedgerError::NotALedger { path: path.to_owned(), why };
    let (app, version, tables) = read_identity(conn).map_err(|e| match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) => not_a_ledger("not an SQLite file".into()),
        _ => LedgerError::Open { path: path.to_owned(), source: e },
    })?;
    if app != 0 && app != APPLICATION_ID {
        return Err(not_a_ledger(format!("application_id is {app:#x}")));
    }
    if app == 0 && (tables > 0 || version != 0) {
        return Err(not_a_ledger(format!(
            "it has {tables} schema objects and user_version {version} but no clade application_id"
        )));
    }
    if version > supported {
        return Err(LedgerError::NewerSchema { path: path.to_owned(), found: version, supported });
    }
    Ok(version)
}

/// Brings the file up to `migrations.len()`, one transaction per step. Safe against another
/// process migrating at the same time: each step re-reads the version under the write lock.
pub(crate) fn migrate(conn: &Connection, path: &Path, migrations: &[Migration]) -> Result<i64> {
    let supported = migrations.len() as i64;
    for (i, step) in migrations.iter().enumerate() {
        let from = i as i64;
        let to = from + 1;
        let tx = rusqlite::Transaction::new_unchecked(conn, rusqlite::TransactionBehavior::Immediate)?;
        let (_, current) = read_ids(&tx)?;
        if current > supported {
            return Err(LedgerError::NewerSchema { path: path.to_owned(), found: current, supported });
        }
        if current >= to {
            continue; // someone else applied it; the transaction rolls back on drop, changing nothing
        }
        let apply = || -> rusqlite::Result<()> {
            tx.execute_batch(step.sql)?;
            tx.execute_batch(&format!("PRAGMA user_version = {to}; PRAGMA application_id = {APPLICATION_ID};"))?;
            Ok(())
        };
        apply().map_err(|source| LedgerError::Migration { path: path.to_owned(), from, to, source })?;
        tx.commit().map_err(|source| LedgerError::Migration { path: path.to_owned(), from, to, source })?;
    }
    Ok(supported)
}
