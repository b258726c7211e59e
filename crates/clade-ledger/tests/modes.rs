//! The ledger holds every sandbox's record: its file and SQLite's -wal/-shm beside it are 0600, whether the
//! ledger is new or an older clade left it 0644. (Under the usual umask SQLite makes all three 0644, so this
//! fails unless the ledger sets the mode itself.)

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use clade_ledger::*;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn a_new_ledger_and_its_wal_are_0600() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    let l = Ledger::open(&db).unwrap();
    l.create_branch(&NewBranch::default()).unwrap();
    for f in ["ledger.db", "ledger.db-wal", "ledger.db-shm"] {
        assert_eq!(mode(&dir.path().join(f)), 0o600, "{f}");
    }
}

#[test]
fn an_open_ledger_left_by_an_older_clade_is_tightened() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    drop(Ledger::open(&db).unwrap());
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    let l = Ledger::open(&db).unwrap();
    l.create_branch(&NewBranch::default()).unwrap();
    assert_eq!(mode(&db), 0o600);
}
