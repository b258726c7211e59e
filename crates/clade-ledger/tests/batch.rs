//! `Ledger::batch` (several calls as one transaction) and `Ledger::close_idle` (the connection closed until the
//! next call), which a fork of many siblings and an idle supervisor rely on (docs/scale.md).

use clade_ledger::{Backend, Ledger, NewBranch, NewSandbox, SandboxId};

fn sandbox(l: &Ledger, id: &str) -> clade_ledger::Result<()> {
    let b = l.create_branch(&NewBranch::default())?;
    l.create_sandbox(&NewSandbox {
        id: Some(SandboxId::new(id)),
        backend: Backend::Ct,
        branch: b.id,
        origin_mark: None,
        supervisor_pid: None,
        host: None,
    })?;
    Ok(())
}

#[test]
fn a_batch_writes_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let l = Ledger::open(dir.path().join("ledger.db")).unwrap();
    l.batch(|l| {
        for i in 0..50 {
            sandbox(l, &format!("sb-{i:032}"))?;
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(l.sandboxes(None).unwrap().len(), 50);
    // The 3rd call fails (an id taken): the two before it are not written either.
    let err = l
        .batch(|l| {
            sandbox(l, &format!("sb-{:032}", 100))?;
            sandbox(l, &format!("sb-{:032}", 101))?;
            sandbox(l, &format!("sb-{:032}", 0))
        })
        .unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    assert_eq!(l.sandboxes(None).unwrap().len(), 50);
    // And the connection is usable after the rollback.
    sandbox(&l, &format!("sb-{:032}", 100)).unwrap();
    assert_eq!(l.sandboxes(None).unwrap().len(), 51);
}

#[test]
fn a_closed_connection_opens_again_on_the_next_call() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = Ledger::open(&path).unwrap();
    sandbox(&l, &format!("sb-{:032}", 1)).unwrap();
    l.close_idle();
    // Another connection writes meanwhile; the reopened one sees it.
    let other = Ledger::open(&path).unwrap();
    sandbox(&other, &format!("sb-{:032}", 2)).unwrap();
    assert_eq!(l.sandboxes(None).unwrap().len(), 2);
    l.quick_check().unwrap();
}
