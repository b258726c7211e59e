//! The CLI on the `vm` backend, end to end with real guests and real supervisors: a base built once, then
//! `clade fork --count 3`, `exec` (distinct hostnames, exit codes passed through), `mark`, `retake`, `suspend`,
//! `resume`, a supervisor killed with SIGKILL reported as lost and cleaned up by `kill`, and nothing left behind.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

mod common;
use common::clade;

fn ok(home: &Path, args: &[&str]) -> String {
    let (code, out, err) = clade(home, args);
    assert_eq!(code, 0, "clade {args:?} failed: {err}{out}");
    out
}

#[test]
fn guest_cli_fork_exec_mark_retake_suspend_resume_kill() {
    let Some(t) = common::vm_home("clade-cli-vm") else { return };
    let h = t.path();

    // Naming a template without a backend is a usage error.
    let (code, _, err) = clade(h, &["fork", "busybox", "--count", "2"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = clade(h, &["fork", "no-such-template", "--backend", "vm"]);
    assert_eq!(code, 3);

    let out = ok(h, &["fork", "busybox", "--backend", "vm", "--count", "3", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    eprintln!("fork 3: {} ms", v["total_ms"]);
    let ids: Vec<String> =
        v["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 3);
    let names: Vec<String> = ids.iter().map(|i| ok(h, &["exec", i, "--", "hostname"]).trim().to_string()).collect();
    assert!(names[0] != names[1] && names[1] != names[2] && names[0] != names[2], "{names:?}");
    let (code, _, _) = clade(h, &["exec", &ids[0], "--", "sh", "-c", "exit 7"]);
    assert_eq!(code, 7, "exec passes the exit status through");

    // The security audit reads each sandbox's QEMU from the host: its own uid, no capabilities, seccomp, the
    // -sandbox flags, a chroot and a mount namespace of its own (docs/security.md).
    let sec: serde_json::Value = serde_json::from_str(&ok(h, &["audit", "--security", "--json"])).unwrap();
    assert_eq!(sec["ok"], true, "{sec}");
    let rows = sec["sandboxes"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{sec}");
    let uids: std::collections::BTreeSet<&str> = rows.iter().map(|r| r["uid"].as_str().unwrap()).collect();
    assert_eq!(uids.len(), 3, "one uid per QEMU: {sec}");
    assert!(rows.iter().all(|r| r["seccomp"] == "2" && r["own_mount_namespace"] == true), "{sec}");

    // mark, change, retake: the change is gone.
    ok(h, &["exec", &ids[0], "--", "sh", "-c", "echo x > /root/f"]);
    let m: serde_json::Value = serde_json::from_str(&ok(h, &["mark", &ids[0], "--label", "first", "--json"])).unwrap();
    let mark_id = m["id"].as_str().unwrap().to_string();
    ok(h, &["exec", &ids[0], "--", "sh", "-c", "echo y > /root/f"]);
    assert_eq!(ok(h, &["exec", &ids[0], "--", "cat", "/root/f"]).trim(), "y");
    let r: serde_json::Value = serde_json::from_str(&ok(h, &["retake", &ids[0], "--to", &mark_id, "--json"])).unwrap();
    eprintln!("retake: {} ms", r["retake_ms"]);
    assert_eq!(ok(h, &["exec", &ids[0], "--", "cat", "/root/f"]).trim(), "x");
    assert_eq!(ok(h, &["exec", &ids[0], "--", "hostname"]).trim(), names[0], "retake keeps the sandbox's identity");

    // suspend and resume.
    ok(h, &["exec", &ids[1], "--", "sh", "-c", "echo kept > /root/s"]);
    ok(h, &["suspend", &ids[1]]);
    // The end is recorded before the answer: the old supervisor's directory is already gone, so a resume
    // right away cannot meet it (nor its ledger row, below).
    assert!(!h.join("run").join(format!("{}.sup", ids[1])).exists(), "the suspended supervisor's dir is left");
    let ls: serde_json::Value = serde_json::from_str(&ok(h, &["ls", "--json"])).unwrap();
    let state = |ls: &serde_json::Value, id: &str| {
        ls.as_array().unwrap().iter().find(|r| r["id"] == id).map(|r| r["state"].as_str().unwrap().to_string())
    };
    assert_eq!(state(&ls, &ids[1]).as_deref(), Some("suspended"));
    ok(h, &["resume", &ids[1]]);
    assert_eq!(ok(h, &["exec", &ids[1], "--", "cat", "/root/s"]).trim(), "kept");

    // A supervisor killed outright: reported lost, and `kill` cleans up what it left.
    let info = Command::new("pgrep").args(["-f", &format!("supervise --sandbox {}", ids[2])]).output().unwrap();
    let pid: i32 = String::from_utf8_lossy(&info.stdout).trim().lines().next().unwrap().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let ls: serde_json::Value = serde_json::from_str(&ok(h, &["ls", "--json"])).unwrap();
    assert!(state(&ls, &ids[2]).unwrap().starts_with("lost"), "{ls}");

    // A QEMU that dies under a running sandbox: the supervisor notices, records the sandbox as failed with
    // QEMU's exit status, and ends; `kill` then finds nothing running and cleans up.
    let run = clade_core::CladeHome::at(h).run_dir().join(&ids[0]);
    let q = Command::new("pgrep").args(["-f", &format!("qemu-system.*{}", run.display())]).output().unwrap();
    let qpid: i32 = String::from_utf8_lossy(&q.stdout).trim().lines().next().unwrap().parse().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(qpid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let start = std::time::Instant::now();
    let failed = loop {
        let ls: serde_json::Value = serde_json::from_str(&ok(h, &["ls", "--json"])).unwrap();
        let row = ls.as_array().unwrap().iter().find(|r| r["id"] == ids[0].as_str()).cloned();
        if row.as_ref().is_some_and(|r| r["state"] == "failed") {
            break row.unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(10), "QEMU killed, sandbox still {row:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let why = failed["error"].as_str().unwrap_or_default();
    assert!(why.contains("QEMU exited") && why.contains("SIGKILL"), "{failed}");
    assert!(!run.exists(), "the failed sandbox's run dir is left");

    for i in &ids {
        ok(h, &["kill", i]);
    }
    let (code, _, _) = clade(h, &["exec", &ids[0], "--", "true"]);
    assert_eq!(code, 3, "exec on a killed sandbox is not found");
    std::thread::sleep(Duration::from_millis(300));
    let ps = Command::new("pgrep").args(["-f", &h.display().to_string()]).output().unwrap();
    assert!(String::from_utf8_lossy(&ps.stdout).trim().is_empty(), "processes left behind");
    let ls: serde_json::Value = serde_json::from_str(&ok(h, &["ls", "--json"])).unwrap();
    assert!(ls.as_array().unwrap().is_empty(), "{ls}");
}
