//! Ctrl-C and SIGTERM: ct-bench's sandboxes live in a private home and belong to this process only (neither
//! the ledger nor `clade audit` knows them), and their guards do not run when a signal ends the process. So a
//! thread waits for the signal and takes the run down itself: every process in the run's memory cgroups
//! (`b<pid>-*`), those cgroups, their network namespaces, the peer's restored tree, the tmpfs mounts under
//! the private home, the home, and the peer's images in /dev/shm.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, SigSet, Signal};
use nix::unistd::Pid;

/// Per-sandbox memory cgroups, v1 and v2 (as clade-ct's resources name them).
const CGROUP_ROOTS: [&str; 2] = ["/sys/fs/cgroup/memory/clade", "/sys/fs/cgroup/clade"];

/// Blocks SIGINT and SIGTERM in this thread (and so in every thread started after it: call it first) and
/// starts the thread that waits for them.
pub fn install(home: PathBuf, prefix: String, shm: PathBuf) -> Result<(), String> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.thread_block().map_err(|e| format!("block SIGINT/SIGTERM: {e}"))?;
    std::thread::spawn(move || {
        if let Ok(sig) = set.wait() {
            eprintln!("ct-bench: {sig}: taking this run's sandboxes down");
            take_down(&home, &prefix, &shm);
            std::process::exit(130);
        }
    });
    Ok(())
}

fn take_down(home: &Path, prefix: &str, shm: &Path) {
    // The peer's restore by hand (no cgroup of its own): its tree's init, named by CRIU's pidfile; the rest of
    // its pid namespace ends with it.
    for e in std::fs::read_dir(shm).into_iter().flatten().flatten() {
        if let Some(pid) = std::fs::read_to_string(e.path().join("pid")).ok().and_then(|s| s.trim().parse().ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    for root in CGROUP_ROOTS {
        let Ok(rd) = std::fs::read_dir(root) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(prefix) {
                empty_and_remove(&e.path());
                let _ = clade_ct::net::release_by_id(&name);
            }
        }
    }
    let mut mounts: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(PathBuf::from))
        .filter(|m| m.starts_with(home))
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    for m in mounts {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    let _ = std::fs::remove_dir_all(home);
    let _ = std::fs::remove_dir_all(shm);
}

/// Kill what is in a cgroup until it is empty (a process may still be forking), then rmdir it.
fn empty_and_remove(cg: &Path) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
        if procs.trim().is_empty() && std::fs::remove_dir(cg).is_ok() {
            return;
        }
        for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("ct-bench: {} did not empty within 10 s", cg.display());
}
