//! The typed API against a real SQLite file: templates and bases, sandboxes and their states,
//! branches, marks and heads, leases and GC roots, the operations log, and a collection run with a
//! fake clock (what it keeps, deletes, reports unreferenced and frees).

use std::collections::BTreeSet;
use std::sync::Arc;

use clade_ledger::clock::{DAY_MS, HOUR_MS, MINUTE_MS};
use clade_ledger::*;
use serde_json::json;

const T0: i64 = 20_424 * DAY_MS;

fn ledger() -> (tempfile::TempDir, Ledger, ManualClock) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::at(T0);
    let l = Ledger::open_with_clock(dir.path().join("ledger.db"), Arc::new(clock.clone())).unwrap();
    (dir, l, clock)
}

fn root(l: &Ledger, policy: RetentionPolicy) -> Branch {
    l.create_branch(&NewBranch { policy, ..Default::default() }).unwrap()
}

fn mark(l: &Ledger, b: &Branch, label: &str, ram: &str, disk: &str, stored: u64) -> Mark {
    l.add_mark(
        &NewMark::on(b.id.clone(), Backend::Vm)
            .label(label)
            .manifest("ram", ram)
            .manifest("disk", disk)
            .sizes(1 << 30, stored),
    )
    .unwrap()
}

#[test]
fn templates_are_idempotent_and_conflicts_named() {
    let (_d, l, _c) = ledger();
    let id = TemplateId::new("tp-abc");
    let spec = json!({"debootstrap": "bookworm", "packages": ["curl"]});
    let t = l.put_template(&id, "debian", &spec).unwrap();
    assert_eq!(l.put_template(&id, "debian", &spec).unwrap(), t);
    let err = l.put_template(&id, "debian", &json!({"other": 1})).unwrap_err();
    assert!(matches!(err, LedgerError::Conflict(_)), "{err:?}");
    assert_eq!(l.template(&id).unwrap().spec, spec);
    assert_eq!(l.template_by_name("debian").unwrap().unwrap().id, id);
    assert!(l.template_by_name("nope").unwrap().is_none());
    assert!(matches!(l.template(&TemplateId::new("x")), Err(LedgerError::NotFound { .. })));
    assert_eq!(l.templates().unwrap().len(), 1);
}

#[test]
fn bases_per_template_and_backend() {
    let (_d, l, _c) = ledger();
    let tp = TemplateId::new("tp-1");
    l.put_template(&tp, "t", &json!({})).unwrap();
    let b = root(&l, RetentionPolicy::retain(0));
    let m1 = mark(&l, &b, "base", "r1", "d1", 10);
    assert_eq!(l.put_base(&tp, Backend::Vm, &m1.id).unwrap(), None);
    assert_eq!(l.base_for(&tp, Backend::Vm).unwrap().unwrap().mark, m1.id);
    assert!(l.base_for(&tp, Backend::Ct).unwrap().is_none());
    // A vm mark cannot be the ct base; an unknown template or mark is named.
    assert!(matches!(l.put_base(&tp, Backend::Ct, &m1.id), Err(LedgerError::Invalid(_))));
    assert!(matches!(
        l.put_base(&TemplateId::new("no"), Backend::Vm, &m1.id),
        Err(LedgerError::NotFound { kind: "template", .. })
    ));
    assert!(matches!(
        l.put_base(&tp, Backend::Vm, &MarkId::new("no")),
        Err(LedgerError::NotFound { kind: "mark", .. })
    ));
    let m2 = mark(&l, &b, "base2", "r2", "d2", 10);
    assert_eq!(l.put_base(&tp, Backend::Vm, &m2.id).unwrap(), Some(m1.id.clone()));
    assert_eq!(l.bases().unwrap().len(), 1);
    assert!(l.remove_base(&tp, Backend::Vm).unwrap());
    assert!(!l.remove_base(&tp, Backend::Vm).unwrap());
}

#[test]
fn sandbox_lifecycle() {
    let (_d, l, clock) = ledger();
    let b = root(&l, RetentionPolicy::KEEP_ALL);
    let s = l
        .create_sandbox(&NewSandbox {
            id: None,
            backend: Backend::Ct,
            branch: b.id.clone(),
            origin_mark: None,
            supervisor_pid: Some(4242),
            host: Some("host-a".into()),
        })
        .unwrap();
    assert_eq!(s.state, SandboxState::Starting);
    assert_eq!(s.supervisor_pid, Some(4242));
    clock.advance(5_000);
    let s2 = l.set_sandbox_state(&s.id, SandboxState::Running, None).unwrap();
    assert_eq!(s2.state, SandboxState::Running);
    assert_eq!(s2.last_active_ms, T0 + 5_000);
    let f = l.set_sandbox_state(&s.id, SandboxState::Failed, Some("qemu exited 1")).unwrap();
    assert_eq!(f.error.as_deref(), Some("qemu exited 1"));
    assert_eq!(l.sandboxes(Some(SandboxState::Failed)).unwrap().len(), 1);
    assert_eq!(l.sandboxes(Some(SandboxState::Running)).unwrap().len(), 0);
    l.set_sandbox_state(&s.id, SandboxState::Dead, None).unwrap();
    let err = l.set_sandbox_state(&s.id, SandboxState::Running, None).unwrap_err();
    assert!(matches!(err, LedgerError::Invalid(_)), "dead is final: {err:?}");
    l.set_supervisor(&s.id, None, None).unwrap();
    l.remove_sandbox(&s.id).unwrap();
    assert!(matches!(l.sandbox(&s.id), Err(LedgerError::NotFound { .. })));
    // Unknown branch, duplicate id.
    let bad = NewSandbox {
        id: None,
        backend: Backend::Vm,
        branch: BranchId::new("nope"),
        origin_mark: None,
        supervisor_pid: None,
        host: None,
    };
    assert!(matches!(l.create_sandbox(&bad), Err(LedgerError::NotFound { kind: "branch", .. })));
    let dup = NewSandbox { id: Some(SandboxId::new("sb-x")), branch: b.id.clone(), ..bad };
    l.create_sandbox(&dup).unwrap();
    assert!(matches!(l.create_sandbox(&dup), Err(LedgerError::Conflict(_))));
    assert!(matches!(l.remove_sandbox(&SandboxId::new("sb-x")), Err(LedgerError::Invalid(_))), "a live sandbox stays");
}

#[test]
fn marks_heads_retake_and_fork() {
    let (_d, l, clock) = ledger();
    let b = root(&l, RetentionPolicy::KEEP_ALL);
    assert!(l.head(&b.id).unwrap().is_none());
    let m1 = mark(&l, &b, "one", "r1", "d1", 100);
    clock.advance(1_000);
    let mut nm = NewMark::on(b.id.clone(), Backend::Vm).label("two").manifest("ram", "r2").sizes(10, 5);
    nm.pause_ms = Some(42);
    nm.timings = json!({"dump_ms": 30, "store_ms": 12});
    nm.clean = true;
    let m2 = l.add_mark(&nm).unwrap();
    assert_eq!(m2.parent.as_ref(), Some(&m1.id), "parent defaults to the head");
    assert_eq!(l.head(&b.id).unwrap().unwrap().id, m2.id);
    let back = l.mark(&m2.id).unwrap();
    assert_eq!(back, m2);
    assert_eq!(back.timings["dump_ms"], 30);
    assert_eq!(back.manifests.get("ram").map(|m| m.as_str()), Some("r2"));
    assert!(back.clean);
    assert_eq!(l.marks(&b.id).unwrap().iter().map(|m| m.label.clone().unwrap()).collect::<Vec<_>>(), ["one", "two"]);
    assert_eq!(l.mark_by_label(&b.id, "one").unwrap().unwrap().id, m1.id);

    // Retake: the head goes back; the next mark's parent is the retaken one.
    l.set_head(&b.id, &m1.id).unwrap();
    let m3 = mark(&l, &b, "three", "r3", "d3", 1);
    assert_eq!(m3.parent.as_ref(), Some(&m1.id));

    // Fork: a new branch whose head starts at the fork mark.
    let f = l
        .create_branch(&NewBranch { name: Some("fork".into()), parent_mark: Some(m2.id.clone()), ..Default::default() })
        .unwrap();
    assert_eq!(l.head(&f.id).unwrap().unwrap().id, m2.id);
    assert_eq!(l.branch_by_name("fork").unwrap().unwrap().id, f.id);
    assert!(matches!(
        l.create_branch(&NewBranch { name: Some("fork".into()), ..Default::default() }),
        Err(LedgerError::Conflict(_))
    ));
    // A head can only move to the branch's own marks or its fork mark.
    assert!(matches!(l.set_head(&f.id, &m1.id), Err(LedgerError::Invalid(_))));
    l.set_head(&f.id, &m2.id).unwrap();
    // Marks are immutable: the same id twice is a conflict; thin needs retain.
    let mut again = NewMark::on(b.id.clone(), Backend::Vm);
    again.id = Some(m1.id.clone());
    assert!(matches!(l.add_mark(&again), Err(LedgerError::Conflict(_))));
    assert!(matches!(l.set_policy(&b.id, RetentionPolicy { retain: None, thin: true }), Err(LedgerError::Invalid(_))));
    let mut bad = NewMark::on(b.id.clone(), Backend::Vm);
    bad.timings = json!([1, 2]);
    assert!(matches!(l.add_mark(&bad), Err(LedgerError::Invalid(_))));
}

#[test]
fn leases_and_live_manifests() {
    let (_d, l, clock) = ledger();
    let b = root(&l, RetentionPolicy::KEEP_ALL);
    mark(&l, &b, "a", "ram-a", "disk-shared", 1);
    mark(&l, &b, "b", "ram-b", "disk-shared", 1);
    let pending =
        l.add_lease("put in flight", &LeaseTarget::Manifest(ManifestId::new("ram-pending")), Some(60_000)).unwrap();
    let forever = l.add_lease("debug", &LeaseTarget::Manifest(ManifestId::new("ram-forever")), None).unwrap();
    let live: BTreeSet<String> = l.live_manifests().unwrap().into_iter().map(|m| m.into_string()).collect();
    assert_eq!(live, ["disk-shared", "ram-a", "ram-b", "ram-forever", "ram-pending"].map(String::from).into());
    clock.advance(60_000);
    assert!(!l.live_manifests().unwrap().contains(&ManifestId::new("ram-pending")), "an expired lease is no root");
    assert_eq!(l.leases().unwrap().len(), 2);
    assert_eq!(l.expire_leases().unwrap(), 1);
    assert!(!l.release_lease(&pending.id).unwrap(), "already expired and collected");
    let r = l.renew_lease(&forever.id, Some(1_000)).unwrap();
    assert_eq!(r.expires_ms, Some(clock.now_ms() + 1_000));
    assert!(l.release_lease(&forever.id).unwrap());
    assert!(matches!(
        l.add_lease("x", &LeaseTarget::Mark(MarkId::new("nope")), None),
        Err(LedgerError::NotFound { kind: "mark", .. })
    ));
}

#[test]
fn ops_log_records_timings() {
    let (_d, l, clock) = ledger();
    let sb = SandboxId::new("sb-1");
    l.record_op(&NewOp::ok("restore", 80).sandbox(sb.clone()).details(json!({"load_ms": 60, "resume_ms": 20})))
        .unwrap();
    clock.advance(1_000);
    l.record_op(&NewOp::failed("mark", 5, "criu dump: no space").sandbox(sb.clone())).unwrap();
    clock.advance(1_000);
    l.record_op(&NewOp::ok("boot", 900)).unwrap();
    let all = l.ops(&OpQuery::default()).unwrap();
    assert_eq!(all.iter().map(|o| o.op.as_str()).collect::<Vec<_>>(), ["boot", "mark", "restore"], "newest first");
    let mine = l.ops(&OpQuery { sandbox: Some(sb), ..Default::default() }).unwrap();
    assert_eq!(mine.len(), 2);
    assert!(!mine[0].ok);
    assert_eq!(mine[0].error.as_deref(), Some("criu dump: no space"));
    assert_eq!(mine[1].details["load_ms"], 60);
    assert_eq!(mine[1].started_ms, T0 - 80, "started defaults to now minus the duration");
    let restores = l.ops(&OpQuery { op: Some("restore".into()), ..Default::default() }).unwrap();
    assert_eq!(restores.len(), 1);
    assert_eq!(l.prune_ops(T0).unwrap(), 1);
    assert_eq!(l.ops(&OpQuery::default()).unwrap().len(), 2);
}

/// Ten marks an hour apart, retain 2 (the head and two more): the seven oldest go except the base, the fork point, the
/// leased one and a pin; shared manifests are reported unreferenced only once nothing names them.
#[test]
fn collect_applies_retention_and_reports() {
    let (_d, l, clock) = ledger();
    let tp = TemplateId::new("tp-1");
    l.put_template(&tp, "t", &json!({})).unwrap();
    let b = root(&l, RetentionPolicy::retain(2));
    let mut ms = Vec::new();
    for i in 0..10 {
        // Every mark shares "disk-base"; m0 and m1 share "ram-01".
        let ram = if i < 2 { "ram-01".to_string() } else { format!("ram-{i}") };
        ms.push(mark(&l, &b, &format!("m{i}"), &ram, "disk-base", 1000 + i as u64));
        clock.advance(HOUR_MS);
    }
    l.put_base(&tp, Backend::Vm, &ms[0].id).unwrap();
    let fork = l.create_branch(&NewBranch { parent_mark: Some(ms[2].id.clone()), ..Default::default() }).unwrap();
    let lease = l.add_lease("restore", &LeaseTarget::Mark(ms[3].id.clone()), Some(10 * MINUTE_MS as u64)).unwrap();
    l.pin(&ms[4].id, true).unwrap();
    let sb = l
        .create_sandbox(&NewSandbox {
            id: None,
            backend: Backend::Vm,
            branch: b.id.clone(),
            origin_mark: Some(ms[5].id.clone()),
            supervisor_pid: None,
            host: None,
        })
        .unwrap();

    // Dry run: the report, and nothing changed.
    let dry = l.collect(&CollectOptions { dry_run: true, branch: None }).unwrap();
    assert_eq!(l.marks(&b.id).unwrap().len(), 10);
    assert!(l.ops(&OpQuery::default()).unwrap().is_empty(), "a dry run logs nothing");

    let r = l.collect(&CollectOptions::default()).unwrap();
    assert_eq!(r.deleted, dry.deleted, "the dry run says exactly what the real one does");
    assert_eq!(r.unreferenced_manifests, dry.unreferenced_manifests);
    let deleted: Vec<&str> = r.deleted.iter().map(|d| d.label.as_deref().unwrap()).collect();
    assert_eq!(
        deleted,
        ["m6", "m1"],
        "newest first; m0 base, m2 fork, m3 lease, m4 pin, m5 sandbox, m7-8 newest, m9 head"
    );
    assert_eq!(r.bytes_freed, 1006 + 1001);
    // ram-01 is still named by m0 (the base); disk-base by everyone.
    assert_eq!(r.unreferenced_manifests, vec![ManifestId::new("ram-6")]);
    let reasons = |i: usize| r.kept.iter().find(|k| k.mark == ms[i].id).unwrap().reasons.clone();
    assert_eq!(reasons(0), vec![KeepReason::Base]);
    assert_eq!(reasons(2), vec![KeepReason::Head, KeepReason::ForkPoint], "the fork's head starts at its fork point");
    assert_eq!(reasons(3), vec![KeepReason::Lease]);
    assert_eq!(reasons(4), vec![KeepReason::Pinned]);
    assert_eq!(reasons(5), vec![KeepReason::LiveSandbox]);
    assert_eq!(reasons(9), vec![KeepReason::Head]);
    assert_eq!(reasons(8), vec![KeepReason::Newest]);
    assert_eq!(l.marks(&b.id).unwrap().len(), 8);
    assert!(!l.live_manifests().unwrap().contains(&ManifestId::new("ram-6")));
    assert_eq!(l.ops(&OpQuery { op: Some("collect".into()), ..Default::default() }).unwrap()[0].details["deleted"], 2);

    // The lease expires, the sandbox dies, the pin goes, the base is replaced, the fork is deleted.
    clock.advance(HOUR_MS);
    l.set_sandbox_state(&sb.id, SandboxState::Dead, None).unwrap();
    l.pin(&ms[4].id, false).unwrap();
    l.put_base(&tp, Backend::Vm, &ms[9].id).unwrap();
    l.delete_branch(&fork.id).unwrap();
    let r = l.collect(&CollectOptions::default()).unwrap();
    assert_eq!(r.leases_expired, 1);
    assert!(!l.release_lease(&lease.id).unwrap());
    let deleted: BTreeSet<&str> = r.deleted.iter().map(|d| d.label.as_deref().unwrap()).collect();
    assert_eq!(deleted, ["m0", "m2", "m3", "m4", "m5"].into());
    let unref: BTreeSet<&str> = r.unreferenced_manifests.iter().map(|m| m.as_str()).collect();
    assert_eq!(unref, ["ram-01", "ram-2", "ram-3", "ram-4", "ram-5"].into());
    assert_eq!(r.branches_purged, vec![fork.id.clone()], "the deleted fork had no marks of its own");
    assert!(matches!(l.branch(&fork.id), Err(LedgerError::NotFound { .. })));
    assert_eq!(l.marks(&b.id).unwrap().len(), 3);
    assert_eq!(l.sandbox(&sb.id).unwrap().origin_mark, None, "a dead sandbox's origin is let go");
    let live: BTreeSet<String> = l.live_manifests().unwrap().into_iter().map(|m| m.into_string()).collect();
    assert_eq!(live, ["disk-base", "ram-7", "ram-8", "ram-9"].map(String::from).into());
}

#[test]
fn deleted_branch_marks_go_but_a_live_forks_point_stays() {
    let (_d, l, clock) = ledger();
    let b = root(&l, RetentionPolicy::KEEP_ALL);
    let a = mark(&l, &b, "a", "ra", "da", 7);
    clock.advance(1);
    let fp = mark(&l, &b, "fp", "rf", "df", 11);
    clock.advance(1);
    mark(&l, &b, "c", "rc", "dc", 13);
    let child = l.create_branch(&NewBranch { parent_mark: Some(fp.id.clone()), ..Default::default() }).unwrap();
    let cm = mark(&l, &child, "child", "rx", "df", 17);
    assert_eq!(cm.parent.as_ref(), Some(&fp.id));
    // A live sandbox blocks deleting its branch.
    let sb = l
        .create_sandbox(&NewSandbox {
            id: None,
            backend: Backend::Vm,
            branch: b.id.clone(),
            origin_mark: None,
            supervisor_pid: None,
            host: None,
        })
        .unwrap();
    assert!(matches!(l.delete_branch(&b.id), Err(LedgerError::Invalid(_))));
    l.set_sandbox_state(&sb.id, SandboxState::Dead, None).unwrap();
    l.delete_branch(&b.id).unwrap();
    assert!(l.branches().unwrap().iter().all(|x| x.id != b.id));
    assert!(matches!(l.add_mark(&NewMark::on(b.id.clone(), Backend::Vm)), Err(LedgerError::Invalid(_))));

    // Scoped to the child: nothing of the deleted branch is touched.
    let r = l.collect(&CollectOptions { dry_run: false, branch: Some(child.id.clone()) }).unwrap();
    assert!(r.deleted.is_empty());
    assert_eq!(l.marks(&b.id).unwrap().len(), 3);

    let r = l.collect(&CollectOptions::default()).unwrap();
    let deleted: BTreeSet<&str> = r.deleted.iter().map(|d| d.label.as_deref().unwrap()).collect();
    assert_eq!(deleted, ["a", "c"].into());
    assert_eq!(r.bytes_freed, 7 + 13);
    // "df" is still named by the child's mark.
    let unref: BTreeSet<&str> = r.unreferenced_manifests.iter().map(|m| m.as_str()).collect();
    assert_eq!(unref, ["da", "dc", "ra", "rc"].into());
    assert!(r.branches_purged.is_empty(), "the fork point keeps the deleted branch's row");
    assert!(l.mark(&a.id).is_err());
    assert_eq!(l.mark(&fp.id).unwrap().id, fp.id);

    // Once the child goes too, the fork point and the deleted parent go at the next collection.
    l.delete_branch(&child.id).unwrap();
    let r = l.collect(&CollectOptions::default()).unwrap();
    let deleted: BTreeSet<&str> = r.deleted.iter().map(|d| d.label.as_deref().unwrap()).collect();
    assert_eq!(deleted, ["child", "fp"].into());
    let purged: BTreeSet<BranchId> = r.branches_purged.into_iter().collect();
    assert_eq!(purged, [b.id.clone(), child.id.clone()].into());
    assert!(l.live_manifests().unwrap().is_empty());
    assert!(matches!(l.sandbox(&sb.id), Err(LedgerError::NotFound { .. })), "the dead sandbox went with its branch");
}

#[test]
fn thinning_through_the_ledger_with_a_fake_clock() {
    let (_d, l, clock) = ledger();
    let b = root(&l, RetentionPolicy::thin(2));
    // Marks every 20 minutes for 3 days.
    for i in 0..(3 * 24 * 3) {
        mark(&l, &b, &format!("m{i}"), &format!("r{i}"), "d", 1);
        clock.advance(20 * MINUTE_MS);
    }
    let r = l.collect(&CollectOptions::default()).unwrap();
    let kept = l.marks(&b.id).unwrap();
    let now = clock.now_ms();
    let hour = kept.iter().filter(|m| now - m.created_ms < DAY_MS).count();
    let day = kept.iter().filter(|m| now - m.created_ms >= DAY_MS).count();
    // Newest 2 + one per hour of the last 24 h (the newest two may share an hour with a keeper).
    assert!((24..=26).contains(&hour), "hour tier kept {hour}");
    // Three UTC days touched past 24 h at most.
    assert!((2..=3).contains(&day), "day tier kept {day}");
    assert_eq!(r.deleted.len() + kept.len(), 3 * 24 * 3);
    assert_eq!(r.bytes_freed, r.deleted.len() as u64);
    // Each day-tier keeper is the oldest mark of its UTC day.
    for m in kept.iter().filter(|m| now - m.created_ms >= DAY_MS) {
        assert!(
            r.deleted.iter().all(|d| d.created_ms.div_euclid(DAY_MS) != m.created_ms.div_euclid(DAY_MS)
                || d.created_ms > m.created_ms
                || now - d.created_ms < DAY_MS),
            "a day keeper must be its day's oldest"
        );
    }
}

#[test]
fn hand_edited_rows_are_named_not_panicked_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let l = Ledger::open(&path).unwrap();
    let b = root(&l, RetentionPolicy::KEEP_ALL);
    let s = l
        .create_sandbox(&NewSandbox {
            id: None,
            backend: Backend::Vm,
            branch: b.id.clone(),
            origin_mark: None,
            supervisor_pid: Some(1),
            host: None,
        })
        .unwrap();
    let raw = rusqlite::Connection::open(&path).unwrap();
    raw.execute("UPDATE sandboxes SET supervisor_pid = -7", []).unwrap();
    let err = l.sandbox(&s.id).unwrap_err();
    assert!(matches!(err, LedgerError::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("edited by hand"), "{err}");
    assert!(matches!(l.sandbox(&SandboxId::new("nope")).unwrap_err(), LedgerError::NotFound { .. }));
}

#[test]
fn a_failed_sandbox_on_a_deleted_branch_cannot_come_back() {
    let (_d, l, _c) = ledger();
    let b = root(&l, RetentionPolicy::KEEP_ALL);
    let s = l
        .create_sandbox(&NewSandbox {
            id: None,
            backend: Backend::Vm,
            branch: b.id.clone(),
            origin_mark: None,
            supervisor_pid: None,
            host: None,
        })
        .unwrap();
    l.set_sandbox_state(&s.id, SandboxState::Failed, Some("boom")).unwrap();
    l.delete_branch(&b.id).unwrap();
    let err = l.set_sandbox_state(&s.id, SandboxState::Running, None).unwrap_err();
    assert!(matches!(err, LedgerError::Invalid(_)), "{err:?}");
    l.set_sandbox_state(&s.id, SandboxState::Dead, None).unwrap();
}

#[test]
fn a_scoped_collection_lets_go_of_a_deleted_forks_point() {
    let (_d, l, clock) = ledger();
    let b = root(&l, RetentionPolicy::retain(0));
    let fp = mark(&l, &b, "fp", "r1", "d1", 1);
    clock.advance(1);
    mark(&l, &b, "head", "r2", "d2", 1);
    let fork = l.create_branch(&NewBranch { parent_mark: Some(fp.id.clone()), ..Default::default() }).unwrap();
    l.delete_branch(&fork.id).unwrap();
    // Only b is in scope, yet the deleted fork's head and parent (both fp) must not hold fp.
    let r = l.collect(&CollectOptions { dry_run: false, branch: Some(b.id.clone()) }).unwrap();
    assert_eq!(r.deleted.iter().map(|d| d.mark.clone()).collect::<Vec<_>>(), vec![fp.id.clone()]);
    assert!(r.branches_purged.is_empty(), "the fork is out of scope");
    let r = l.collect(&CollectOptions::default()).unwrap();
    assert_eq!(r.branches_purged, vec![fork.id]);
}

#[test]
fn collected_marks_are_known_as_collecting_until_the_sweep_finishes() {
    let (_d, l, _c) = ledger();
    let b = root(&l, RetentionPolicy::retain(0));
    let old = mark(&l, &b, "old", "r1", "d1", 10);
    let head = mark(&l, &b, "head", "r2", "d2", 10);
    assert_eq!(l.collecting("old").unwrap(), None, "a live mark is not being collected");
    let dry = l.collect(&CollectOptions { dry_run: true, branch: None }).unwrap();
    assert_eq!(dry.deleted.len(), 1);
    assert_eq!(l.collecting(old.id.as_str()).unwrap(), None, "a dry run records nothing");
    let r = l.collect(&CollectOptions::default()).unwrap();
    let deleted: Vec<_> = r.deleted.iter().map(|d| d.mark.clone()).collect();
    assert_eq!(deleted, std::slice::from_ref(&old.id));
    assert!(l.mark(&old.id).is_err(), "the mark itself is gone");
    assert!(l.collecting(old.id.as_str()).unwrap().is_some(), "by id");
    assert!(l.collecting("old").unwrap().is_some(), "by label");
    assert_eq!(l.collecting(head.id.as_str()).unwrap(), None);
    let left: Vec<String> = l.collecting_manifests().unwrap().into_iter().map(|m| m.into_string()).collect();
    assert_eq!(left, ["d1", "r1"], "the collected mark's manifests, for the store to unpublish");
    assert_eq!(l.finish_collecting().unwrap(), 1);
    assert!(l.collecting_manifests().unwrap().is_empty());
    assert_eq!(l.collecting("old").unwrap(), None, "unknown once swept");
}
