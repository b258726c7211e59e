//! Suspend on one host, resume on another (docs/roam.md), on both backends: two `$CLADE_HOME`s that share
//! only a blob tier (a real 3-node Garage cluster on loopback). Host A runs a sandbox, changes its files,
//! suspends and pushes it; host B, which has never seen the sandbox, its template or its base, resumes it by
//! name: the same files, hostname and machine-id come back, and B reports the bytes it fetched. A third pull is
//! refused while B holds it; B pushes it back and A resumes it again.

use std::path::Path;

mod common;

fn ok(home: &Path, env: &[(&str, &str)], args: &[&str]) -> serde_json::Value {
    let (code, out, err) = common::clade_with(home, env, args);
    assert_eq!(code, 0, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

fn sh(home: &Path, env: &[(&str, &str)], sbx: &str, script: &str) -> String {
    let out = ok(home, env, &["exec", sbx, "--json", "--", "sh", "-c", script]);
    assert_eq!(out["code"], 0, "{script}: {out}");
    out["stdout"].as_str().unwrap_or("").trim().to_string()
}

#[test]
fn guest_roam_ct_suspend_on_a_resume_on_b_and_back() {
    let Some(tier) = common::garage("clade-roam-ct") else { return };
    let Some(a) = common::ct_home("clade-roam-ct-a") else { return };
    let b = tempfile::Builder::new().prefix("clade-roam-ct-b").tempdir_in("/var/tmp").unwrap();
    std::os::unix::fs::symlink(common::real_home().join("criu"), b.path().join("criu")).unwrap();
    round_trip(&tier, a.path(), b.path(), "ctbox", "ct");
}

#[test]
fn guest_roam_vm_suspend_on_a_resume_on_b_and_back() {
    let Some(tier) = common::garage("clade-roam-vm") else { return };
    let Some(a) = common::vm_home("clade-roam-vm-a") else { return };
    let b = common::vm_bare_home("clade-roam-vm-b");
    round_trip(&tier, a.path(), b.path(), "busybox", "vm");
}

/// Run, change, suspend and push on `a`; resume on `b` by name; back again as a disk-only mark.
fn round_trip(tier: &clade_store::testkit::Garage, a: &Path, b: &Path, template: &str, backend: &str) {
    let owned = tier.env();
    let env: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
    // Host B keeps its guest RAM files apart from A's, as another machine would.
    let shm = ShmDir(Path::new("/dev/shm").join(b.file_name().unwrap()));
    let shm_b = shm.0.display().to_string();
    let mut env_b = env.clone();
    env_b.push(("CLADE_SHM", shm_b.as_str()));
    let env_b = env_b;

    // Host A: a sandbox with a change of its own, suspended, pushed.
    let run = ok(a, &env, &["run", template, "--backend", backend, "--json"]);
    let sbx = run["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    sh(a, &env, &sbx, "mkdir -p /root && echo travelled > /root/note && head -c 65536 /dev/urandom > /root/blob");
    let before = sh(a, &env, &sbx, "cat /etc/hostname /etc/machine-id; md5sum < /root/blob");
    ok(a, &env, &["suspend", &sbx, "--json"]);
    let pushed = ok(a, &env, &["roam", "push", &sbx, "--json"]);
    assert!(pushed["full_bytes"].as_u64().unwrap() > 0, "{pushed}");
    let (code, _, _) = common::clade_with(a, &env, &["exec", &sbx, "--", "true"]);
    assert_eq!(code, 3, "host A forgot the sandbox it pushed");
    let listed = ok(b, &env_b, &["roam", "ls", "--json"]);
    assert!(listed.as_array().unwrap().iter().any(|r| r["sandbox"] == sbx.as_str() && r["owner"]["state"] == "pushed"));

    // A home without the blob tier cannot see it, and says how to name one.
    let (code, _, err) = common::clade(b, &["resume", &sbx]);
    assert_eq!(code, 3, "{err}");

    // Host B: resume by name pulls it, restores it, and it is the same machine with the same files.
    let res = ok(b, &env_b, &["resume", &sbx, "--json"]);
    assert_eq!(res["ok"], true, "{res}");
    assert!(res["pulled"]["full_bytes"].as_u64().unwrap() > 0, "{res}");
    // Its supervisor's reads and the resuming command's (the pull, the fetch-ahead, the heartbeat).
    let fetched = res["blob_bytes"].as_u64().unwrap() + res["pulled"]["blob_bytes"].as_u64().unwrap();
    assert!(fetched > 0, "host B read the sandbox from the blob tier: {res}");
    eprintln!(
        "{backend}: resume on B: {:.0} ms, fetched {} bytes of {} (pull {:.0} ms)",
        res["resume_ms"].as_f64().unwrap(),
        fetched,
        res["pulled"]["full_bytes"],
        res["pulled"]["pull_ms"].as_f64().unwrap()
    );
    if backend == "vm" {
        // B never held the sandbox's root RAM: it is mapped from a lazy file fetching pages on first touch.
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        assert!(
            mounts.lines().any(|l| l.contains("clade-lazy") && l.contains(&sbx)),
            "no lazy RAM mount for {sbx}: {mounts}"
        );
    }
    assert_eq!(sh(b, &env_b, &sbx, "cat /etc/hostname /etc/machine-id; md5sum < /root/blob"), before);
    assert_eq!(sh(b, &env_b, &sbx, "cat /root/note"), "travelled");

    // While B holds it, A cannot take it back.
    let (code, _, err) = common::clade_with(a, &env, &["roam", "pull", &sbx]);
    assert_eq!(code, 4, "taken by B: {err}");
    assert!(err.contains("taken by host"), "{err}");
    let (code, _, err) = common::clade_with(b, &env_b, &["roam", "push", &sbx]);
    assert_eq!(code, 4, "a running sandbox must be suspended before it moves: {err}");

    // B changes it and sends it back as a disk-only mark (docs/ct.md, docs/vm.md): A boots B's disk cold, with
    // B's change and a new boot (vm: the guest reads the blocks B wrote from the blob tier as it boots).
    sh(b, &env_b, &sbx, "echo back >> /root/note; sync");
    let boot_b = sh(b, &env_b, &sbx, "cat /proc/sys/kernel/random/boot_id");
    ok(b, &env_b, &["suspend", &sbx, "--disk-only", "--json"]);
    ok(b, &env_b, &["roam", "push", &sbx, "--json"]);
    let res = ok(a, &env, &["resume", &sbx, "--json"]);
    assert_eq!(res["ok"], true, "{res}");
    assert_eq!(sh(a, &env, &sbx, "cat /root/note"), "travelled\nback");
    assert_ne!(sh(a, &env, &sbx, "cat /proc/sys/kernel/random/boot_id"), boot_b, "a disk-only resume boots");
    ok(a, &env, &["kill", &sbx, "--json"]);
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(!mounts.lines().any(|l| l.contains(&sbx)), "a mount of {sbx} is left: {mounts}");
    let audit = ok(a, &env, &["audit", "--json"]);
    assert_eq!(audit["findings"].as_array().unwrap().len(), 0, "{audit}");
}

/// Removes a host's guest-RAM directory (unmounting what a failed run left in it).
struct ShmDir(std::path::PathBuf);

impl Drop for ShmDir {
    fn drop(&mut self) {
        for e in std::fs::read_dir(self.0.join("lazy")).into_iter().flatten().flatten() {
            let _ = nix::mount::umount2(&e.path(), nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
