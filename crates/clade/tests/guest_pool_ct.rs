//! The warm pool end to end on the `ct` backend (embedded CLI, real supervisors and CRIU): `pool fill` waits for
//! its members, a fork claims one (a working sandbox) and refills the pool in the background, and a drain right
//! after the fork ends the waiting member and the one still preparing alike: no member process is left behind
//! (a member that finished preparing after a drain used to wait forever, an idle sandbox nobody could claim).

use std::path::Path;
use std::time::{Duration, Instant};

mod common;

fn ok(home: &Path, args: &[&str]) -> serde_json::Value {
    let (code, out, err) = common::clade(home, args);
    assert_eq!(code, 0, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

/// Pool members (`clade supervise --pool`) started for this home.
fn members_alive(home: &Path) -> Vec<u32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        let ours = format!("CLADE_HOME={}", home.display());
        if cmd.contains("supervise") && cmd.contains("--pool") && String::from_utf8_lossy(&env).contains(&ours) {
            v.push(pid);
        }
    }
    v
}

#[test]
fn guest_pool_ct_fill_claim_and_drain_leave_no_member() {
    let Some(t) = common::ct_home("clade-pool-ct") else { return };
    let h = t.path();

    let fill = ok(h, &["pool", "fill", "ctbox", "--backend", "ct", "--size", "2", "--json"]);
    assert_eq!(fill["ready"], 2, "fill returns once its members wait: {fill}");
    assert_eq!(members_alive(h).len(), 2, "two member processes");

    // A fork claims a waiting member; the pool starts a new one in the background, and the drain comes while
    // that one is still preparing.
    let fork = ok(h, &["fork", "ctbox", "--backend", "ct", "--json"]);
    let drained = ok(h, &["pool", "drain", "ctbox", "--backend", "ct", "--json"]);
    assert_eq!(drained["ended"], 1, "the one member left waiting was ended: {drained}");
    let sbx = fork["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let ops = ok(h, &["exec", &sbx, "--json", "--", "hostname"]);
    assert_eq!(ops["code"], 0, "the claimed member runs as a sandbox: {ops}");

    // The claimed member is now the sandbox's supervisor (its command line still says --pool): it ends with
    // the sandbox, so what is left after the kill is members.
    ok(h, &["exec", &sbx, "--json", "--", "true"]);
    ok(h, &["kill", &sbx, "--json"]);
    let t0 = Instant::now();
    loop {
        let left = members_alive(h);
        let pools = ok(h, &["pool", "ls", "--json"]);
        let waiting: u64 = pools.as_array().unwrap().iter().map(|p| p["ready"].as_u64().unwrap()).sum();
        if left.is_empty() {
            assert_eq!(waiting, 0, "no member socket outlives its process: {pools}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "pool members still alive 60 s after the drain: {left:?}, pools {pools}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A member whose supervisor died (a host restart, an OOM kill) is skipped by the next fork, which starts its
/// sibling cold, and what the dead member left on the host (its sandbox's processes in their cgroups, its
/// cgroups, its run dir) is taken down then, not left for `clade audit --fix`.
#[test]
fn guest_pool_ct_dead_member_is_skipped_and_taken_down() {
    let Some(t) = common::ct_home("clade-pool-dead") else { return };
    let h = t.path();
    let fill = ok(h, &["pool", "fill", "ctbox", "--backend", "ct", "--size", "1", "--json"]);
    assert_eq!(fill["ready"], 1, "{fill}");
    let mark = fill["mark"].as_str().unwrap_or_else(|| panic!("fill names its mark: {fill}")).to_string();
    let member: String = std::fs::read_dir(h.join("run/pool").join(&mark))
        .unwrap()
        .flatten()
        .find_map(|e| e.file_name().to_str()?.strip_suffix(".sock").map(str::to_string))
        .expect("the waiting member's socket");
    let leftovers = || clade_core::cgroup::leftover_dirs(&member).into_iter().filter(|d| d.is_dir()).count();
    assert!(leftovers() > 0, "a prepared member holds its cgroups (the control for the take-down below)");
    let pids = members_alive(h);
    assert_eq!(pids.len(), 1);
    // Drop the pool's size first, so the fork does not refill it while the dead member is looked at.
    let pool_size = h.join("run/pool").join(&mark).join("size");
    std::fs::remove_file(&pool_size).unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pids[0] as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let t0 = Instant::now();
    while !members_alive(h).is_empty() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }

    let (code, out, err) = common::clade(h, &["fork", "ctbox", "--backend", "ct", "--json"]);
    assert_eq!(code, 0, "{err}{out}");
    assert!(err.contains(&format!("pool member {member}")) && err.contains("took down"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let sbx = v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    assert_ne!(sbx, member, "the sibling was started cold, not claimed from the dead member");
    assert_eq!(ok(h, &["exec", &sbx, "--json", "--", "true"])["code"], 0);
    assert_eq!(leftovers(), 0, "the dead member's cgroups were taken down by the fork");
    assert!(!h.join("run").join(&member).exists(), "and its run dir");
    ok(h, &["kill", &sbx, "--json"]);
}
