//! Everything a sandbox holds on the host, in one drop guard: its processes (the init of its PID namespace),
//! the tmpfs that carries its overlay upper, its memory cgroup and its run directory. A start or restore that
//! fails half-way drops the guard and leaves nothing behind (veth links and cgroups leaked this way make later
//! restores fail with EEXIST); a running sandbox owns the same guard, so dropping it ends the sandbox.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

pub use clade_core::cgroup::{Cgroup, Limits};

/// The devices a jailed sandbox may open (cgroup v1 `devices.allow` lines): null, zero, full, random,
/// urandom, tty, ptmx and the pseudo-terminals; `mknod` of any node is allowed (as Docker does), opening
/// anything else is refused. On v2 the same holds through `nodev` mounts (crate::spawn).
pub const DEVICE_ALLOW: [&str; 10] = [
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
    "c *:* m",
    "b *:* m",
];

/// The drop guard of one sandbox's host resources.
#[derive(Debug)]
pub struct Resources {
    pub run_dir: PathBuf,
    /// The tmpfs mounted at `run_dir/rw` (upper, work, dump staging).
    pub rw_mounted: bool,
    pub cgroup: Option<Cgroup>,
    /// Host pid of the sandbox's init (our child, or adopted by us as subreaper).
    pub init: Option<u32>,
    /// A CRIU helper serving the sandbox (lazy-pages daemon).
    pub helper: Option<std::process::Child>,
    /// The sandbox's network namespace, veth pair and NAT entry (`network = "egress"`, crate::net).
    pub net: Option<crate::net::SandboxNet>,
    /// Lower layers mounted lazily from store trees (crate::lower).
    pub lowers: Vec<clade_lazyfs::LazyTree>,
    released: bool,
}

impl Resources {
    pub fn new(run_dir: PathBuf) -> Resources {
        Resources {
            run_dir,
            rw_mounted: false,
            cgroup: None,
            init: None,
            helper: None,
            net: None,
            lowers: Vec::new(),
            released: false,
        }
    }

    pub fn rw(&self) -> PathBuf {
        self.run_dir.join("rw")
    }

    /// Kill the sandbox's init and wait for it: killing a PID namespace's init kills the whole namespace. The
    /// rest (mounts, cgroup, run dir) stays for [`Resources::release`].
    pub fn kill_processes(&mut self) {
        if let Some(pid) = self.init.take() {
            let pid = Pid::from_raw(pid as i32);
            let _ = kill(pid, Signal::SIGKILL);
            reap(pid, Duration::from_secs(5));
        }
    }

    /// Kill the processes, then take down the mount, the cgroup and the run directory. Returns every step
    /// that failed (the rest still ran).
    pub fn release(&mut self) -> Result<(), String> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let mut errors = Vec::new();
        self.kill_processes();
        if let Some(mut h) = self.helper.take() {
            let _ = h.kill();
            let _ = h.wait();
        }
        // After the processes: nothing reads the lazily mounted lower layers any more.
        self.lowers.clear();
        // After the processes: nothing holds the namespace any more, deleting the host link removes both ends.
        if let Some(mut net) = self.net.take() {
            if let Err(e) = net.release() {
                errors.push(e);
            }
        }
        if let Some(cg) = &self.cgroup {
            if let Err(e) = cg.remove() {
                errors.push(e);
            }
        }
        self.cgroup = None;
        if self.rw_mounted {
            let rw = self.rw();
            if let Err(e) = nix::mount::umount2(&rw, nix::mount::MntFlags::MNT_DETACH) {
                errors.push(format!("unmount {}: {e}", rw.display()));
            }
            self.rw_mounted = false;
        }
        if self.run_dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.run_dir) {
                errors.push(format!("remove {}: {e}", self.run_dir.display()));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

impl Drop for Resources {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// Wait for a child (or adopted) process to end; gives up quietly after `timeout` (it was SIGKILLed).
pub fn reap(pid: Pid, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(_) | Err(_) => return,
        }
        if Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Mount a tmpfs of `size` bytes at `dir` (in the host's mount namespace, so the host can read the upper).
pub fn mount_tmpfs(dir: &Path, size: u64) -> Result<(), String> {
    use nix::mount::{mount, MsFlags};
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let data = format!("size={size},mode=0700");
    mount(Some("tmpfs"), dir, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(data.as_str()))
        .map_err(|e| format!("mount tmpfs on {}: {e}", dir.display()))?;
    // Keep it out of other namespaces' propagation groups.
    let _ = mount(None::<&str>, dir, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>);
    Ok(())
}
