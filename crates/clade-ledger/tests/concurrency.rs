//! Two writers on one ledger file, as the daemon and a CLI are: two connections in two threads,
//! and two real processes (the bench binary's `writer` mode as the second), all writing at once
//! with no lost write and no `Busy`; a reader is never blocked by a writer (WAL), and a writer held
//! up past the busy timeout gets a typed `Busy` error rather than a hang.

use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clade_ledger::*;

fn add(l: &Ledger, b: &BranchId, i: usize) -> Mark {
    l.add_mark(&NewMark::on(b.clone(), Backend::Ct).label(format!("m{i}")).manifest("criu", format!("c-{b}-{i}")))
        .unwrap()
}

#[test]
fn two_connections_write_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let setup = Ledger::open(&path).unwrap();
    let a = setup.create_branch(&NewBranch { policy: RetentionPolicy::retain(5), ..Default::default() }).unwrap();
    let b = setup.create_branch(&NewBranch::default()).unwrap();
    drop(setup);

    let n = 150;
    let barrier = Arc::new(Barrier::new(2));
    let spawn = |branch: BranchId, collect: bool| {
        let path = path.clone();
        let barrier = barrier.clone();
        std::thread::spawn(move || {
            let l = Ledger::open(&path).unwrap();
            barrier.wait();
            for i in 0..n {
                add(&l, &branch, i);
                l.record_op(&NewOp::ok("mark", 1)).unwrap();
                if collect && i % 25 == 0 {
                    l.collect(&CollectOptions::default()).unwrap();
                }
            }
        })
    };
    let ta = spawn(a.id.clone(), true);
    let tb = spawn(b.id.clone(), false);
    ta.join().expect("writer a");
    tb.join().expect("writer b");

    let l = Ledger::open(&path).unwrap();
    assert_eq!(l.marks(&b.id).unwrap().len(), n, "no write of b lost");
    assert_eq!(
        l.ops(&OpQuery { op: Some("mark".into()), limit: Some(10_000), ..Default::default() }).unwrap().len(),
        2 * n
    );
    // Branch a was collected while both wrote; a final collection leaves the head and 5 more.
    l.collect(&CollectOptions::default()).unwrap();
    let kept = l.marks(&a.id).unwrap();
    assert_eq!(kept.len(), 6);
    assert_eq!(kept.last().unwrap().label.as_deref(), Some("m149"));
    assert_eq!(l.head(&a.id).unwrap().unwrap().id, kept.last().unwrap().id);
}

#[test]
fn two_processes_write_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = Ledger::open(&path).unwrap();
    let theirs = l.create_branch(&NewBranch::default()).unwrap();
    let mine = l.create_branch(&NewBranch::default()).unwrap();
    let n = 120;
    let theirs_n = 300;
    let child = Command::new(env!("CARGO_BIN_EXE_ledger-writer"))
        .args([path.to_str().unwrap(), theirs.id.as_str(), &theirs_n.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the second process");
    // Start once the other process is writing, so the two really overlap.
    let deadline = Instant::now() + Duration::from_secs(30);
    while l.marks(&theirs.id).unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the second process never wrote");
        std::thread::sleep(Duration::from_millis(5));
    }
    let seen_first = l.marks(&theirs.id).unwrap().len();
    let mut seen_theirs = seen_first;
    for i in 0..n {
        add(&l, &mine.id, i);
        // Reading what the other process committed so far never fails.
        seen_theirs = seen_theirs.max(l.marks(&theirs.id).unwrap().len());
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "second process failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["marks"], theirs_n);
    assert_eq!(report["busy_retries"], 0, "the busy timeout absorbs every wait");
    assert_eq!(l.marks(&theirs.id).unwrap().len(), theirs_n);
    assert_eq!(l.marks(&mine.id).unwrap().len(), n);
    assert!(seen_theirs > seen_first, "the other process wrote while this one did ({seen_first} -> {seen_theirs})");
    println!("while writing, saw the other process go from {seen_first} to {seen_theirs} of {theirs_n} marks");
}

#[test]
fn readers_are_not_blocked_and_a_stuck_writer_gives_busy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let opts = LedgerOptions { busy_timeout: Duration::from_millis(200), ..Default::default() };
    let l = Ledger::open_with(&path, opts).unwrap();
    let b = l.create_branch(&NewBranch::default()).unwrap();
    add(&l, &b.id, 0);

    // Another process holds the write lock (an uncommitted transaction).
    let other = rusqlite::Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE; UPDATE marks SET label = 'hidden';").unwrap();

    // Reads go on, and see the last committed state.
    assert_eq!(l.marks(&b.id).unwrap()[0].label.as_deref(), Some("m0"));
    let t = Instant::now();
    let err = l.add_mark(&NewMark::on(b.id.clone(), Backend::Ct)).unwrap_err();
    assert!(matches!(err, LedgerError::Busy(_)), "{err:?}");
    assert!(t.elapsed() >= Duration::from_millis(150), "it waited for the busy timeout");
    assert!(err.to_string().contains("retry"), "{err}");

    other.execute_batch("ROLLBACK").unwrap();
    add(&l, &b.id, 1);
    assert_eq!(l.marks(&b.id).unwrap().len(), 2);
}

#[test]
fn many_connections_creating_the_same_new_file_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (path, barrier) = (path.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let l = Ledger::open(&path).expect("every opener migrates or sees it migrated");
                l.create_branch(&NewBranch { name: Some(format!("b{i}")), ..Default::default() }).unwrap();
                l.schema_version().unwrap()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), SCHEMA_VERSION);
    }
    assert_eq!(Ledger::open(&path).unwrap().branches().unwrap().len(), 4);
}

/// Opening the ledger a second time in one process (base building does it inside the daemon) must not take the
/// first connection's locks away: closing any descriptor of a file drops every POSIX lock the process holds on
/// it. Without its shared lock, another process's connection that closes last checkpoints and truncates the WAL
/// under the first connection, whose next read fails (SQLITE_IOERR_SHORT_READ) or misses committed rows.
#[test]
fn a_second_open_in_one_process_keeps_the_first_connections_locks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let first = Ledger::open(&path).unwrap();
    let b = first.create_branch(&NewBranch::default()).unwrap();
    add(&first, &b.id, 0);
    let second = Ledger::open(&path).unwrap();
    assert_eq!(second.marks(&b.id).unwrap().len(), 1);
    for round in 0..3 {
        let out = Command::new(env!("CARGO_BIN_EXE_ledger-writer"))
            .args([path.to_str().unwrap(), b.id.as_str(), "20"])
            .output()
            .expect("run the second process");
        assert!(out.status.success(), "round {round}: {}", String::from_utf8_lossy(&out.stderr));
        let seen = first.marks(&b.id).unwrap_or_else(|e| panic!("round {round}: the first connection: {e}"));
        assert_eq!(seen.len(), 1 + 20 * (round + 1), "round {round}: the first connection sees every commit");
    }
}
