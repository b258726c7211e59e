//! A sandbox's cgroups, for both backends (a ct sandbox's processes, a vm sandbox's QEMU): `clade/<name>` in
//! each v1 hierarchy it uses (memory, pids, cpu, devices when an allow-list is given, freezer where the host
//! mounts it: what [`Cgroup::freeze`] uses; v2 has `cgroup.freeze` in every group), or once under
//! `/sys/fs/cgroup/clade` on v2, with the limits written in. Removed on drop, whatever is left in it killed
//! first. Both backends use the same layout, so `clade audit` finds the leftovers of either.
//!
//! cgroup v2 (Debian 12's and Ubuntu 24.04's default): a child gets a controller's files (`memory.max`,
//! `pids.max`, `cpu.max`) only once every ancestor below the root lists the controller in
//! `cgroup.subtree_control`; a fresh host enables none for new groups, so [`Cgroup::create`] does.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const V1_ROOT: &str = "/sys/fs/cgroup";
const V1_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];
const V2_ROOT: &str = "/sys/fs/cgroup/clade";
const V2_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

/// What a sandbox's cgroups hold it to. Zero (or `None`) means no limit.
#[derive(Debug, Clone, Default)]
pub struct Limits {
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU time per 100 ms period, in ms (100 per CPU).
    pub cpu_ms_per_100ms: u64,
    /// cgroup v1's devices controller: everything denied, then these `devices.allow` lines.
    pub devices: Option<&'static [&'static str]>,
}

/// One sandbox's cgroups: one directory on v2, one per controller on v1 (the memory one first: processes are
/// listed there).
#[derive(Debug)]
pub struct Cgroup {
    pub dirs: Vec<PathBuf>,
    v2: bool,
}

fn write(dir: &Path, file: &str, value: &str) -> Result<(), String> {
    std::fs::write(dir.join(file), value).map_err(|e| format!("set {file} of {}: {e}", dir.display()))
}

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
                format!(
                    "{e} (enable the controllers for clade's cgroups; a cgroup with processes of its own cannot \
                     delegate them)"
                )
            })?;
        }
    }
    Ok(())
}

impl Cgroup {
    /// Create `clade/<name>` with `limits`. One left empty by a process that died is taken over; one with
    /// processes is refused.
    pub fn create(name: &str, limits: &Limits) -> Result<Cgroup, String> {
        let v2 = crate::host::cgroup_version() == Some("v2");
        let mut cg = Cgroup { dirs: Vec::new(), v2 };
        let parents: Vec<PathBuf> = if v2 {
            vec![PathBuf::from(V2_ROOT)]
        } else {
            let devices = limits.devices.map(|_| "devices");
            let freezer = Path::new(V1_ROOT).join("freezer").is_dir().then_some("freezer");
            V1_CONTROLLERS
                .iter()
                .copied()
                .chain(devices)
                .chain(freezer)
                .map(|c| Path::new(V1_ROOT).join(c).join("clade"))
                .collect()
        };
        for parent in &parents {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("create {}: {e} (is the cgroup controller mounted?)", parent.display()))?;
            if v2 {
                enable_v2_controllers(parent)?;
            }
            let dir = parent.join(name);
            if let Err(e) = std::fs::create_dir(&dir) {
                // rmdir works only on an empty cgroup: a live one stays and is refused.
                if e.kind() != std::io::ErrorKind::AlreadyExists
                    || std::fs::remove_dir(&dir).and_then(|_| std::fs::create_dir(&dir)).is_err()
                {
                    return Err(format!(
                        "create cgroup {}: {e} (a sandbox with this id exists or was not cleaned up)",
                        dir.display()
                    ));
                }
            }
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
        self.dirs
            .iter()
            .find(|d| d.parent().and_then(Path::parent).is_some_and(|p| p.ends_with(controller)))
            .map(PathBuf::as_path)
    }

    fn apply(&self, l: &Limits) -> Result<(), String> {
        if let (Some(d), true) = (self.dir_of("memory"), l.memory_bytes > 0) {
            write(d, if self.v2 { "memory.max" } else { "memory.limit_in_bytes" }, &l.memory_bytes.to_string())?;
        }
        if let (Some(d), true) = (self.dir_of("pids"), l.pids > 0) {
            write(d, "pids.max", &l.pids.to_string())?;
        }
        if l.cpu_ms_per_100ms > 0 {
            self.set_cpu(l.cpu_ms_per_100ms)?;
        }
        if let (Some(allow), false) = (l.devices, self.v2) {
            if let Some(d) = self.dir_of("devices") {
                write(d, "devices.deny", "a")?;
                for line in allow {
                    write(d, "devices.allow", line)?;
                }
            }
        }
        Ok(())
    }

    /// CPU time per 100 ms period, in ms (0: no limit). A backend lifts it while it works on a sandbox from
    /// inside its cgroup (CRIU's parasite and restorer), so the limit bounds the sandbox's programs only.
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

    /// The files a process writes its pid into to join every one of the cgroups.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Host pids of every process in the cgroup (its groups' too: on v2 a process in a group is listed only
    /// there).
    pub fn pids(&self) -> Vec<u32> {
        let Some(d) = self.dirs.first() else { return Vec::new() };
        let mut pids = procs_of(d);
        if self.v2 {
            for g in subdirs(d) {
                pids.extend(procs_of(&g));
            }
        }
        pids
    }

    /// The directory of the group `name` inside the sandbox's cgroup where it can be frozen on its own: v2's
    /// one directory, or v1's freezer hierarchy (none without it).
    fn group_dir(&self, name: &str) -> Option<PathBuf> {
        let ok = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        let parent = if self.v2 { self.dirs.first().map(PathBuf::as_path) } else { self.dir_of("freezer") };
        parent.filter(|_| ok).map(|p| p.join(name))
    }

    /// Moves the processes `pids` (host pids, of this cgroup) into its group `name` (made on first use) and
    /// freezes (`true`) or thaws the group: a part of the sandbox stopped while the rest runs (a pod member's
    /// processes, containerd's Pause of one container). A process moved into a frozen group freezes.
    pub fn freeze_group(&self, name: &str, pids: &[u32], frozen: bool) -> Result<(), String> {
        let dir = self.group_dir(name).ok_or_else(|| {
            format!("no group {name:?} can be frozen here (a name of letters, digits, '-', '_'; v1 needs the freezer)")
        })?;
        if frozen {
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(format!("create cgroup {}: {e}", dir.display())),
            }
            for p in pids {
                // A process that ended meanwhile is not an error.
                let _ = write(&dir, "cgroup.procs", &p.to_string());
            }
        } else if !dir.is_dir() {
            return Ok(());
        }
        freeze_dir(&dir, self.v2, frozen)
    }

    /// Stop (`true`) or continue (`false`) every process inside where it stands, and wait (up to 5 s) until the
    /// kernel says it is done: v2's `cgroup.freeze` and `cgroup.events`, v1's `freezer.state`.
    pub fn freeze(&self, frozen: bool) -> Result<(), String> {
        let dir = if self.v2 {
            self.dirs.first().map(PathBuf::as_path).ok_or("no cgroup")?
        } else {
            self.dir_of("freezer").ok_or("no v1 freezer hierarchy on this host (/sys/fs/cgroup/freezer)")?
        };
        freeze_dir(dir, self.v2, frozen)
    }

    /// Bytes charged to the cgroup now.
    pub fn memory_usage(&self) -> Option<u64> {
        let file = if self.v2 { "memory.current" } else { "memory.usage_in_bytes" };
        std::fs::read_to_string(self.dir_of("memory")?.join(file)).ok()?.trim().parse().ok()
    }

    /// The value of one of the cgroups' files (`pids.max`, `memory.limit_in_bytes`, ...).
    pub fn read(&self, controller: &str, file: &str) -> Option<String> {
        std::fs::read_to_string(self.dir_of(controller)?.join(file)).ok().map(|s| s.trim().to_string())
    }

    /// Kill what is left inside and remove every directory (each tried for up to 5 s); the errors of those
    /// that stayed. A frozen cgroup is thawed first (v1 holds a frozen process's SIGKILL until it thaws).
    pub fn remove(&self) -> Result<(), String> {
        // Fails at once where there is no freezer (v1 without the hierarchy): nothing can be frozen there.
        let _ = self.freeze(false);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut errors = Vec::new();
        for dir in &self.dirs {
            remove_groups(dir);
            loop {
                for p in self.pids() {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), nix::sys::signal::SIGKILL);
                }
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if Instant::now() > deadline => {
                        errors.push(format!(
                            "remove cgroup {}: {e} (processes left: {:?})",
                            dir.display(),
                            self.pids()
                        ));
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

/// Takes down the groups inside a sandbox's cgroup directory (`Cgroup::freeze_group`; a cgroup with children
/// cannot be removed): each thawed (v1 holds a frozen process's SIGKILL until it thaws), its processes killed,
/// its directory removed (tried for up to 5 s). For [`Cgroup::remove`] and for the cleanup of what a dead
/// supervisor left, which has only the directory.
pub fn remove_groups(dir: &Path) {
    for g in subdirs(dir) {
        // Whichever of v1's and v2's files the group has.
        let _ = std::fs::write(g.join("freezer.state"), "THAWED");
        let _ = std::fs::write(g.join("cgroup.freeze"), "0");
        for p in procs_of(&g) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), nix::sys::signal::SIGKILL);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::remove_dir(&g).is_err() && g.is_dir() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The processes listed in one cgroup directory.
fn procs_of(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// The child cgroups of a cgroup directory.
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// Freezes or thaws one cgroup directory and waits (up to 5 s) until the kernel says it is done: v2's
/// `cgroup.freeze` and `cgroup.events`, v1's `freezer.state`.
fn freeze_dir(dir: &Path, v2: bool, frozen: bool) -> Result<(), String> {
    let (file, want) = if v2 {
        write(dir, "cgroup.freeze", if frozen { "1" } else { "0" })?;
        ("cgroup.events", if frozen { "frozen 1" } else { "frozen 0" })
    } else {
        write(dir, "freezer.state", if frozen { "FROZEN" } else { "THAWED" })?;
        ("freezer.state", if frozen { "FROZEN" } else { "THAWED" })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        if now.lines().any(|l| l.trim() == want) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{}: not {want} after 5 s ({})", dir.join(file).display(), now.trim()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = self.remove();
    }
}

/// Every place a sandbox named `name` may have a cgroup on this host (for cleanup of leftovers): the v2
/// directory, or one per v1 hierarchy clade uses.
pub fn leftover_dirs(name: &str) -> Vec<PathBuf> {
    if crate::host::cgroup_version() == Some("v2") {
        vec![Path::new(V2_ROOT).join(name)]
    } else {
        V1_CONTROLLERS
            .iter()
            .chain(["devices", "freezer"].iter())
            .map(|c| Path::new(V1_ROOT).join(c).join("clade").join(name))
            .collect()
    }
}
