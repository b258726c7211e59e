//! Housekeeping end to end on the `ct` backend (embedded CLI, real supervisors and CRIU): a branch deleted and
//! collected, a fork of a mark being collected refused with a conflict (4 / 409), the collecting `clade gc`
//! killed mid-way and the next run finishing the job (the fork then a miss, 3), the base untouched; `clade
//! audit` finding a leaked process, cgroup and run dir of a dead sandbox, `--fix` taking them down; completions.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

fn ok(home: &Path, args: &[&str]) -> serde_json::Value {
    let (code, out, err) = common::clade(home, args);
    assert_eq!(code, 0, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

/// The ct restore caches under `$CLADE_HOME/cache` (kind, tree id).
fn tree_caches(h: &Path) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for kind in ["ct-uppers", "ct-images"] {
        for e in std::fs::read_dir(h.join("cache").join(kind)).into_iter().flatten().flatten() {
            v.push((kind.to_string(), e.file_name().to_string_lossy().into_owned()));
        }
    }
    v.sort();
    v
}

#[test]
fn guest_house_ct_gc_conflict_crash_and_audit() {
    let Some(t) = common::ct_home("clade-house-ct") else { return };
    let h = t.path();

    // A sandbox, a labelled mark on its branch, then the sandbox ends and its branch is deleted.
    let run = ok(h, &["run", "ctbox", "--backend", "ct", "--json"]);
    let sbx = run["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    ok(h, &["exec", &sbx, "--json", "--", "sh", "-c", "echo doomed > /tmp/f"]);
    let m = ok(h, &["mark", &sbx, "--label", "doomed", "--json"]);
    let mark = m["id"].as_str().unwrap().to_string();
    let branch = m["branch"].as_str().unwrap().to_string();
    // One restore of it lays its upper and CRIU images out in the host's caches (which gc must clear later).
    let sib = ok(h, &["fork", &mark, "--json"]);
    let sib = sib["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let listed = ok(h, &["ls", "--json"]);
    let sib_branch = listed.as_array().unwrap().iter().find(|r| r["id"] == sib.as_str()).unwrap()["branch"].clone();
    ok(h, &["kill", &sib, "--json"]);
    // Its branch would keep the mark (a fork point); it goes too.
    ok(h, &["branches", "rm", sib_branch.as_str().unwrap(), "--json"]);
    let cached = tree_caches(h);
    assert!(cached.len() >= 4, "the base's and the doomed mark's uppers and images are cached: {cached:?}");
    let (code, _, err) = common::clade(h, &["branches", "rm", &branch]);
    assert_eq!(code, 4, "a branch with a live sandbox is refused as a conflict: {err}");
    ok(h, &["kill", &sbx, "--json"]);
    ok(h, &["branches", "rm", &branch, "--json"]);
    let dry = ok(h, &["gc", "--dry-run", "--json"]);
    let doomed: Vec<&str> =
        dry["ledger"]["deleted"].as_array().unwrap().iter().map(|d| d["mark"].as_str().unwrap()).collect();
    assert_eq!(doomed, [mark.as_str()], "{dry}");

    // A warm pool of the doomed mark: its member is not in the ledger, so it does not keep the mark; gc ends it.
    let fill = ok(h, &["pool", "fill", &mark, "--size", "1", "--json"]);
    assert_eq!(fill["ready"], 1, "{fill}");

    // A gc paused between the ledger and the store: the mark is being collected, a fork of it is a conflict.
    let mut gc = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["gc", "--json"])
        .env("CLADE_HOME", h)
        .env("CLADE_GC_PAUSE_MS", "60000")
        .spawn()
        .unwrap();
    // Wait for its ledger step to commit without forking (a live sibling would make the mark needed again):
    // until then a dry run would still delete the mark. (`clade marks` is no sign: the mark left that list
    // with its branch, before gc ran.)
    let start = Instant::now();
    let pending =
        |d: &serde_json::Value| d["ledger"]["deleted"].as_array().unwrap().iter().any(|x| x["mark"] == mark.as_str());
    while pending(&ok(h, &["gc", "--dry-run", "--json"])) {
        assert!(start.elapsed() < Duration::from_secs(30), "gc's ledger step did not commit");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, _, err) = common::clade(h, &["fork", "doomed", "--json"]);
    assert_eq!(code, 4, "fork of a mark being collected: {err}");
    assert!(err.contains("being collected"), "{err}");
    let (code, _, err) = common::clade(h, &["fork", &mark, "--json"]);
    assert_eq!(code, 4, "by id too: {err}");
    // Killed mid-way (crash safety): the next run finishes the job.
    gc.kill().unwrap();
    gc.wait().unwrap();
    let (code, _, _) = common::clade(h, &["fork", "doomed"]);
    assert_eq!(code, 4, "still being collected after the crash");
    let done = ok(h, &["gc", "--json"]);
    assert!(done["manifests_deleted"].as_u64().unwrap() >= 1, "the mark's manifests were unpublished: {done}");
    assert_eq!(done["pool_members_ended"], 1, "the collected mark's pool member was ended: {done}");
    let pools = ok(h, &["pool", "ls", "--json"]);
    assert_eq!(pools.as_array().unwrap().len(), 0, "no pool of a collected mark is left: {pools}");
    // The doomed mark's caches went with it (two trees); what is left is a tree the store still publishes.
    let left = tree_caches(h);
    assert_eq!(done["cache_dirs_deleted"], 2, "{done}");
    assert_eq!(left.len(), cached.len() - 2, "{left:?} vs {cached:?}");
    for (kind, tree) in &left {
        let published = h.join("store/trees").join(&tree[..2]).join(tree);
        assert!(published.exists(), "cache {kind}/{tree} is of a tree the store no longer has");
    }
    let (code, _, err) = common::clade(h, &["fork", "doomed"]);
    assert_eq!(code, 3, "collected: now unknown: {err}");
    // The base was needed elsewhere: still forks.
    let again = ok(h, &["run", "ctbox", "--backend", "ct", "--json"]);
    let sbx2 = again["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let out = ok(h, &["exec", &sbx2, "--json", "--", "cat", "/etc/hostname"]);
    assert_eq!(out["code"], 0, "{out}");
    ok(h, &["kill", &sbx2, "--json"]);

    // Audit: clean, then leftovers of the dead sandbox planted (as a crashed supervisor would leave them).
    let a = ok(h, &["audit", "--json"]);
    assert_eq!(a["findings"].as_array().unwrap().len(), 0, "{a}");
    let rundir = h.join("run").join(&sbx);
    std::fs::create_dir_all(&rundir).unwrap();
    let cg = Path::new("/sys/fs/cgroup/memory/clade").join(&sbx);
    let cg_made = std::fs::create_dir_all(&cg).is_ok();
    let qemu = format!("{}/qemu", rundir.display());
    let mut orphan = Command::new("bash").args(["-c", &format!("exec -a {qemu} sleep 300")]).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // And a group of its processes frozen inside its cgroup (a pod member paused when the supervisor died).
    let group = Path::new("/sys/fs/cgroup/freezer/clade").join(&sbx).join("g5");
    let frozen = std::fs::create_dir_all(&group).is_ok()
        && std::fs::write(group.join("cgroup.procs"), orphan.id().to_string()).is_ok()
        && std::fs::write(group.join("freezer.state"), "FROZEN").is_ok();
    let env = [("CLADE_AUDIT_SETTLE_MS", "0")];
    let (code, out, err) = common::clade_with(h, &env, &["audit", "--json"]);
    assert_eq!(code, 1, "leftovers found: {err}{out}");
    let found: serde_json::Value = serde_json::from_str(&out).unwrap();
    let kinds: Vec<&str> = found["findings"].as_array().unwrap().iter().map(|f| f["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"orphan-process"), "{found}");
    assert!(kinds.contains(&"leftover-run-dir"), "{found}");
    if cg_made {
        assert!(kinds.contains(&"leftover-cgroup"), "{found}");
    }
    let (code, out, err) = common::clade_with(h, &env, &["audit", "--fix", "--json"]);
    assert_eq!(code, 0, "all fixed: {err}{out}");
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = orphan.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the orphan (frozen: {frozen}) was not killed");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "the orphan was killed");
    assert!(!rundir.exists() && !cg.exists());
    assert!(!group.parent().unwrap().exists(), "the frozen group and its cgroup are gone");
    let (code, out, _) = common::clade_with(h, &env, &["audit"]);
    assert_eq!(code, 0, "clean after --fix: {out}");
}

/// A ct sandbox whose supervisor is killed outright: reported lost, and `clade kill` takes down at once what it
/// left (its processes, which sit in its cgroup and name no run dir, the cgroup, its tmpfs and run dirs);
/// `clade audit` is clean right after, without waiting for anything to settle.
#[test]
fn guest_house_ct_lost_supervisor_kill_takes_everything_down() {
    let Some(t) = common::ct_home("clade-lost-ct") else { return };
    let h = t.path();
    let run = ok(h, &["run", "ctbox", "--backend", "ct", "--json"]);
    let sbx = run["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let ls = ok(h, &["ls", "--json"]);
    let sup =
        ls.as_array().unwrap().iter().find(|r| r["id"] == sbx.as_str()).unwrap()["supervisor_pid"].as_i64().unwrap();
    let cg = Path::new("/sys/fs/cgroup/memory/clade").join(&sbx);
    let procs: Vec<i32> = std::fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert!(!procs.is_empty(), "the sandbox's processes are in its cgroup");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(sup as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let ls = ok(h, &["ls", "--json"]);
    let state = ls.as_array().unwrap().iter().find(|r| r["id"] == sbx.as_str()).unwrap()["state"].to_string();
    assert!(state.contains("lost"), "{ls}");
    let killed = ok(h, &["kill", &sbx, "--json"]);
    assert!(killed["taken_down"].as_u64().unwrap() >= 2, "{killed}");
    // Gone, or a zombie waiting for the host's init to reap it (its parent, the supervisor, is dead).
    let running = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|st| st.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
    };
    for pid in procs {
        assert!(!running(pid), "process {pid} of the lost sandbox still runs");
    }
    let rundir = h.join("run").join(&sbx);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!cg.exists() && !rundir.exists(), "cgroup or run dir left");
    assert!(!mounts.contains(&rundir.display().to_string()), "a mount under {} left", rundir.display());
    let (code, out, err) = common::clade(h, &["audit"]);
    assert_eq!(code, 0, "clean right after kill: {err}{out}");
}

#[test]
fn guest_house_completions_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let (code, out, err) = common::clade(Path::new("/nonexistent"), &["completions", shell]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("fork") && out.contains("retake") && out.contains("audit"), "{shell}: {out:.200}");
    }
    let (code, _, _) = common::clade(Path::new("/nonexistent"), &["completions", "tcsh"]);
    assert_eq!(code, 2, "an unknown shell is a usage error");
}
