//! Everything a sandbox holds on the host, in one drop guard: its processes (the init of its PID namespace),
//! the tmpfs that carries its overlay upper, its memory cgroup and its run directory. A start or restore that
//! fails half-way drops the guard and leaves nothing behind (seed 000 leaked veth links and cgroups this way and
//! later restores failed with EEXIST); a running sandbox owns the same guard, so dropping it ends the sandbox.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// cgroup v1: one hierarchy per controller, clade's sandboxes under `clade/` in each (the first one listed is
/// where processes are counted). The devices controller carries the jail's device allow-list.
const V1_ROOT: &str = "/sys/fs/cgroup";
const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "devices"];
/// cgroup v2: one unified tree; `clade/` gets the controllers enabled in every ancestor's subtree_control.
const CGROUP_V2: &str = "/sys/fs/cgroup/clade";
const V2_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

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

/// What a sandbox's cgroups hold it to. Zero means no limit.
#[derive(Debug, Clone, Default)]
pub struct Limits {
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU time per 100 ms period, in ms (100 per vCPU).
    pub cpu_ms_per_100ms: u64,
    /// Apply the device allow-list (cgroup v1; a jailed sandbox).
    pub devices: bool,
}

/// A sandbox's cgroups: one directory on v2, one per controller on v1.
#[derive(Debug)]
pub struct Cgroup {
    pub dirs: Vec<PathBuf>,
    v2: bool,
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), String> {
    std::fs::write(dir.join(file), value).map_err(|e| format!("set {file} of {}: {e}", dir.display()))
}

/// cgroup v2: a child gets a controller's files only once every ancestor below the root lists it in
/// `cgroup.subtree_control` (a fresh Debian 12 or Ubuntu 24.04 host enables none for new groups).
fn enable_v2_controllers(clade_root: &Path) -> Result<(), String> {
    let top = Path::new("/sys/fs/cgroup");
    let mut chain = vec![clade_root.to_path_buf()];
    let mut p = clade_root.parent();
    while let Some(dir) = p {
        if dir == top || !dir.starts_with(top) {
            break;
        }
        chain.push(dir.to_path_buf());
        p = dir.parent();
    }
    chain.push(top.to_path_buf());
    for dir in chain.iter().rev() {
        let have = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
        let missing: Vec<String> = V2_CONTROLLERS
            .iter()
            .filter(|c| !have.split_whitespace().any(|h| h == **c))
            .map(|c| format!("+{c}"))
            .collect();
        if !missing.is_empty() {
            write(dir, "cgroup.subtree_control", &missing.join(" ")).map_err(|e| {
                format!("{e} (enable the controllers for clade's cgroups; a cgroup with processes of its own cannot delegate them)")
            })?;
        }
    }
    Ok(())
}

impl Cgroup {
    /// Create `clade/<id>` (in each v1 controller, or once on v2) with `limits`.
    pub fn create(id: &str, limits: &Limits) -> Result<Cgroup, String> {
        let v2 = clade_core::host::cgroup_version() == Some("v2");
        let mut cg = Cgroup { dirs: Vec::new(), v2 };
        let parents: Vec<PathBuf> = if v2 {
            vec![PathBuf::from(CGROUP_V2)]
        } else {
            V1_CONTROLLERS
                .iter()
                .filter(|c| **c != "devices" || limits.devices)
                .map(|c| Path::new(V1_ROOT).join(c).join("clade"))
                .collect()
        };
        for parent in &parents {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("create {}: {e} (is the cgroup controller mounted?)", parent.display()))?;
            if v2 {
                enable_v2_controllers(parent)?;
            }
            let dir = parent.join(id);
            std::fs::create_dir(&dir).map_err(|e| {
                format!("create cgroup {}: {e} (a sandbox with this id exists or was not cleaned up)", dir.display())
            })?;
            // Pushed first: a failure below drops `cg`, which removes what was made.
            cg.dirs.push(dir);
        }
        cg.apply(limits)?;
        Ok(cg)
    }

    fn dir_of(&self, controller: &str) -> Option<&Path> {
        if self.v2 {
            return self.dirs.first().map(PathBuf::as_path);
        }
        self.dirs.iter().find(|d| d.parent().and_then(Path::parent).is_some_and(|p| p.ends_with(controller))).map(PathBuf::as_path)
    }

    fn apply(&self, l: &Limits) -> Result<(), String> {
        let (mem, pids) = (self.dir_of("memory"), self.dir_of("pids"));
        if let (Some(d), true) = (mem, l.memory_bytes > 0) {
            write(d, if self.v2 { "memory.max" } else { "memory.limit_in_bytes" }, &l.memory_bytes.to_string())?;
        }
        if let (Some(d), true) = (pids, l.pids > 0) {
            write(d, "pids.max", &l.pids.to_string())?;
        }
        if l.cpu_ms_per_100ms > 0 {
            self.set_cpu(l.cpu_ms_per_100ms)?;
        }
        if l.devices && !self.v2 {
            if let Some(d) = self.dir_of("devices") {
                write(d, "devices.deny", "a")?;
                for line in DEVICE_ALLOW {
                    write(d, "devices.allow", line)?;
                }
            }
        }
        Ok(())
    }

    /// CPU time per 100 ms period, in ms (0: no limit). CRIU's work for a sandbox (the parasite of a dump, the
    /// restorer) runs inside its cgroup: the backend lifts the quota around a dump and sets it only after a
    /// restore, so the template's vCPU count limits the sandbox's programs, not clade's own work on them.
    pub fn set_cpu(&self, ms_per_100ms: u64) -> Result<(), String> {
        let Some(d) = self.dir_of("cpu") else { return Ok(()) };
        if self.v2 {
            let max = if ms_per_100ms == 0 { "max".to_string() } else { (ms_per_100ms * 1000).to_string() };
            write(d, "cpu.max", &format!("{max} 100000"))
        } else {
            write(d, "cpu.cfs_period_us", "100000")?;
            let quota = if ms_per_100ms == 0 { "-1".to_string() } else { (ms_per_100ms * 1000).to_string() };
            write(d, "cpu.cfs_quota_us", &quota)
        }
    }

    /// The files a process writes its pid into to join every one of the sandbox's cgroups.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// The first cgroup's directory (the memory controller's on v1): where processes are listed.
    pub fn dir(&self) -> &Path {
        self.dirs.first().map(PathBuf::as_path).unwrap_or(Path::new("/nonexistent"))
    }

    /// Host pids of every process in the cgroup.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.dir().join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Bytes charged to the cgroup now.
    pub fn memory_usage(&self) -> Option<u64> {
        let file = if self.v2 { "memory.current" } else { "memory.usage_in_bytes" };
        std::fs::read_to_string(self.dir_of("memory")?.join(file)).ok()?.trim().parse().ok()
    }

    /// The value of one of the cgroups' files (`pids.max`, `memory.limit_in_bytes`, ...), for the audit.
    pub fn read(&self, controller: &str, file: &str) -> Option<String> {
        std::fs::read_to_string(self.dir_of(controller)?.join(file)).ok().map(|s| s.trim().to_string())
    }

    fn remove(&self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut errors = Vec::new();
        // The process-counting cgroup first: once it is empty, the others are too.
        for dir in &self.dirs {
            loop {
                for p in self.pids() {
                    let _ = kill(Pid::from_raw(p as i32), Signal::SIGKILL);
                }
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if Instant::now() > deadline => {
                        errors.push(format!("remove cgroup {}: {e} (processes left: {:?})", dir.display(), self.pids()));
                        break;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = self.remove();
    }
}

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

    /// Kill the processes, then take down the mount, the cgroup and the run directory. Returns every step
    /// that failed (the rest still ran).
    pub fn release(&mut self) -> Result<(), String> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let mut errors = Vec::new();
        if let Some(pid) = self.init.take() {
            let pid = Pid::from_raw(pid as i32);
            // Killing a PID namespace's init kills the whole namespace.
            let _ = kill(pid, Signal::SIGKILL);
            reap(pid, Duration::from_secs(5));
        }
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
