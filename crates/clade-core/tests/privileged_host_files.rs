//! The escape suite's host-file probes (docs/security.md): a local unprivileged user (uid 65534, run as a real
//! `cat`) cannot read what a clade home keeps — the E2B records file, a store pack, a RAM file under
//! `CLADE_SHM` — even where a file itself were left 0644, because the engine makes the directories 0700. The
//! control: the same probe reads such a file in a world-readable directory, so it does detect a readable file.
//! Needs root (tier name: `privileged`).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;

const NOBODY: u32 = 65534;

/// Whether uid/gid 65534 can read `path` (a real process doing a real open).
fn nobody_reads(path: &Path) -> bool {
    std::process::Command::new("cat")
        .arg(path)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run cat")
        .success()
}

fn leave_open(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, b"envd-token-or-guest-memory").unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

#[test]
fn privileged_unprivileged_user_reads_no_host_file() {
    if !nix_is_root() {
        eprintln!("skipping: needs root to switch to uid {NOBODY}");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    // The temp dir itself world-traversable, as /var/lib or /dev/shm are.
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let home = clade_core::CladeHome::at(t.path().join("home")).with_shm(t.path().join("shm"));
    home.ensure_private().expect("private dirs");
    let secrets = [
        home.e2b_dir().join("sandboxes.json"),
        home.store_dir().join("packs/p-0001.pack"),
        home.shm_dir().join("ram/base.ram"),
        home.root().join("ledger.db"),
    ];
    for p in &secrets {
        leave_open(p);
        assert!(!nobody_reads(p), "uid {NOBODY} read {}", p.display());
    }
    // Control: the same 0644 file in a 0755 directory is read by the same probe.
    let open = t.path().join("open/sandboxes.json");
    leave_open(&open);
    std::fs::set_permissions(open.parent().unwrap(), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(nobody_reads(&open), "control: uid {NOBODY} must read a 0644 file in a 0755 directory");
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0")))
        .unwrap_or(false)
}
