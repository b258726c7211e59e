//! Facts about the host that decide what clade can run: kernel, cgroup version, userfaultfd, overlayfs, KSM,
//! tmpfs and disk space. Backend-specific probes (QEMU and KVM, CRIU) live in their backend crates; `clade doctor`
//! puts them together.

use std::path::Path;

use serde::Serialize;

/// One line of the doctor's report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Short name, e.g. `overlayfs`.
    pub name: String,
    pub ok: bool,
    /// What was found.
    pub detail: String,
    /// When not ok: how to get it, in one line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// Which backends cannot work without it (empty: informational).
    pub needed_by: Vec<String>,
}

impl Check {
    pub fn ok(name: &str, detail: impl Into<String>) -> Self {
        Self { name: name.into(), ok: true, detail: detail.into(), fix: None, needed_by: vec![] }
    }
    pub fn missing(name: &str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { name: name.into(), ok: false, detail: detail.into(), fix: Some(fix.into()), needed_by: vec![] }
    }
    pub fn needed_by(mut self, backends: &[&str]) -> Self {
        self.needed_by = backends.iter().map(|s| s.to_string()).collect();
        self
    }
}

/// Whether this kernel tracks the pages a process dirties (`CONFIG_MEM_SOFT_DIRTY`), which CRIU's pre-dump
/// needs to take incremental marks (only what changed since the last one is copied while frozen). Tried, not read
/// from the kernel's config: this process clears its soft-dirty bits (`/proc/self/clear_refs`, "4"), writes a
/// page, and reads that page's soft-dirty bit (55) in `/proc/self/pagemap`. Without the option the clear is
/// accepted but the bit is never set. `None` when the files cannot be used at all.
pub fn tracks_dirty_pages() -> Option<bool> {
    use std::io::{Read, Seek, SeekFrom};
    const PAGE: usize = 4096;
    let mut buf = vec![1u8; 4 * PAGE];
    // A whole page inside the buffer, touched first so it is mapped.
    let addr = (buf.as_ptr() as usize).div_ceil(PAGE) * PAGE;
    let at = addr - buf.as_ptr() as usize;
    buf[at] = 2;
    std::fs::write("/proc/self/clear_refs", "4").ok()?;
    buf[at] = std::hint::black_box(3);
    let mut pagemap = std::fs::File::open("/proc/self/pagemap").ok()?;
    pagemap.seek(SeekFrom::Start((addr / PAGE * 8) as u64)).ok()?;
    let mut entry = [0u8; 8];
    pagemap.read_exact(&mut entry).ok()?;
    std::hint::black_box(&buf);
    Some(u64::from_le_bytes(entry) & (1 << 55) != 0)
}

/// `uname -r`.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_else(|_| "unknown".into())
}

/// The boot id: a cache key for facts that hold until the next reboot (the KVM probe).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The cgroup hierarchy mounted at /sys/fs/cgroup: `v2`, `v1` (or hybrid), or none. Read once per process
/// (it does not change while a host runs; /proc/self/mounts grows with every sandbox's mounts).
pub fn cgroup_version() -> Option<&'static str> {
    static VERSION: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    *VERSION.get_or_init(probe_cgroup_version)
}

fn probe_cgroup_version() -> Option<&'static str> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let mut v1 = false;
    for line in mounts.lines() {
        let mut f = line.split_whitespace();
        let (_dev, mnt, fstype) = (f.next()?, f.next()?, f.next()?);
        if mnt == "/sys/fs/cgroup" && fstype == "cgroup2" {
            return Some("v2");
        }
        if mnt.starts_with("/sys/fs/cgroup/") && fstype == "cgroup" {
            v1 = true;
        }
    }
    v1.then_some("v1")
}

fn filesystem_known(name: &str) -> bool {
    std::fs::read_to_string("/proc/filesystems")
        .map(|s| s.lines().any(|l| l.split_whitespace().last() == Some(name)))
        .unwrap_or(false)
}

/// Free and total bytes of the filesystem holding `path` (or its nearest existing ancestor).
pub fn space(path: &Path) -> Option<(u64, u64)> {
    let mut p = path;
    loop {
        if p.exists() {
            let s = nix::sys::statvfs::statvfs(p).ok()?;
            let frag = s.fragment_size() as u64;
            return Some((s.blocks_available() as u64 * frag, s.blocks() as u64 * frag));
        }
        p = p.parent()?;
    }
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The host checks that belong to no single backend.
pub fn checks(home: &Path) -> Vec<Check> {
    let mut out = vec![Check::ok("kernel", kernel_release())];
    out.push(match cgroup_version() {
        Some(v) => Check::ok("cgroup", v),
        None => Check::missing("cgroup", "no cgroup hierarchy at /sys/fs/cgroup", "mount cgroup2 at /sys/fs/cgroup")
            .needed_by(&["ct"]),
    });
    out.push(
        if Path::new("/proc/sys/vm/unprivileged_userfaultfd").exists() || Path::new("/dev/userfaultfd").exists() {
            Check::ok("userfaultfd", "available (lazy restore)")
        } else {
            Check::missing(
                "userfaultfd",
                "not in this kernel",
                "a kernel with CONFIG_USERFAULTFD; restores will be eager",
            )
        },
    );
    out.push(if filesystem_known("overlay") {
        Check::ok("overlayfs", "available")
    } else {
        Check::missing("overlayfs", "not in /proc/filesystems", "modprobe overlay").needed_by(&["ct"])
    });
    out.push(match space(Path::new("/dev/shm")) {
        Some((free, total)) if total > 0 => {
            Check::ok("tmpfs", format!("/dev/shm {} free of {}", gib(free), gib(total)))
        }
        _ => Check::missing("tmpfs", "no /dev/shm", "mount -t tmpfs tmpfs /dev/shm").needed_by(&["vm"]),
    });
    out.push(match tracks_dirty_pages() {
        Some(true) => Check::ok("soft-dirty", "tracked: ct marks of a running sandbox can pre-dump (incremental)"),
        Some(false) => Check::missing(
            "soft-dirty",
            "this kernel does not track dirty pages (CONFIG_MEM_SOFT_DIRTY): every ct mark copies all memory while frozen",
            "a kernel with CONFIG_MEM_SOFT_DIRTY (Debian's have it) for incremental ct marks",
        ),
        None => Check::missing("soft-dirty", "cannot read /proc/self/pagemap", "mount /proc"),
    });
    out.push(if Path::new("/sys/kernel/mm/ksm/run").exists() {
        let run = std::fs::read_to_string("/sys/kernel/mm/ksm/run").unwrap_or_default();
        Check::ok("ksm", format!("available (run={})", run.trim()))
    } else {
        Check::missing(
            "ksm",
            "no /sys/kernel/mm/ksm",
            "a kernel with CONFIG_KSM; restored ct siblings will not share memory",
        )
    });
    out.push(match space(home) {
        Some((free, _)) if free >= 4 << 30 => Check::ok("disk", format!("{} free under {}", gib(free), home.display())),
        Some((free, _)) => Check::missing(
            "disk",
            format!("only {} free under {}", gib(free), home.display()),
            "free space or point CLADE_HOME at a larger filesystem (at least 4 GiB)",
        )
        .needed_by(&["vm", "ct"]),
        None => Check::missing("disk", format!("cannot stat {}", home.display()), "create CLADE_HOME"),
    });
    out
}

/// Proportional and resident set size of a process, in bytes (from /proc/PID/smaps_rollup).
pub fn pss_rss(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("Pss:")?, field("Rss:")?))
}

/// Tasks the kernel allows at once (the lower of `kernel.pid_max` and `kernel.threads-max`) and tasks on the
/// host now (the fourth field of /proc/loadavg, `running/total`): three small reads.
pub fn tasks() -> Option<(u64, u64)> {
    let num = |p: &str| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok();
    let max = num("/proc/sys/kernel/pid_max")?.min(num("/proc/sys/kernel/threads-max")?);
    let load = std::fs::read_to_string("/proc/loadavg").ok()?;
    let now = load.split_whitespace().nth(3)?.split('/').nth(1)?.parse().ok()?;
    Some((max, now))
}

/// Threads of a process (the `Threads:` line of /proc/PID/status).
pub fn threads(pid: u32) -> Option<u64> {
    proc_status(pid)?.get("Threads")?.parse().ok()
}

/// CPU seconds a process has used (all its threads, user and system) and seconds since it started, from
/// /proc/PID/stat (fields 14, 15 and 22, in clock ticks) and /proc/uptime.
pub fn cpu_seconds(pid: u32) -> Option<(f64, f64)> {
    let (num, tck) = proc_stat(pid)?;
    let used = (num(14)? + num(15)?) as f64 / tck;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime").ok()?.split_whitespace().next()?.parse().ok()?;
    Some((used, (uptime - num(22)? as f64 / tck).max(0.0)))
}

/// CPU seconds a process and the children it reaped have used (fields 14 to 17 of /proc/PID/stat): what a
/// cgroup would count for the short-lived commands a sandbox's agent runs.
pub fn cpu_seconds_with_reaped(pid: u32) -> Option<f64> {
    let (num, tck) = proc_stat(pid)?;
    Some((14..=17).map(num).sum::<Option<u64>>()? as f64 / tck)
}

/// /proc/PID/stat as a lookup of its numeric fields by their 1-based number in proc(5), and the clock ticks
/// per second they count in.
fn proc_stat(pid: u32) -> Option<(impl Fn(usize) -> Option<u64>, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields are counted after its last ')', where
    // field 3 (state) starts.
    let rest = stat[stat.rfind(')')? + 1..].to_string();
    let tck = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().filter(|t| *t > 0)? as f64;
    let num = move |field: usize| rest.split_whitespace().nth(field.checked_sub(3)?).and_then(|v| v.parse().ok());
    Some((num, tck))
}

/// Proportional and resident set size, in bytes, of the mappings of a process whose file lies under `dir`
/// (from /proc/PID/smaps). The vm bench uses it for the guest RAM alone: the mappings of the root RAM files,
/// the part that siblings share, apart from QEMU's own code and heap. `(0, 0)` when nothing there is mapped.
pub fn mapped_pss_rss(pid: u32, dir: &Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let (mut pss, mut rss, mut inside) = (0u64, 0u64, false);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && first.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
            // A mapping's header: range perms offset dev inode [path]; the path is the sixth field on.
            let path = line.split_whitespace().nth(5).unwrap_or_default();
            inside = !path.is_empty() && Path::new(path).starts_with(dir);
            continue;
        }
        if !inside {
            continue;
        }
        let kb = words.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 1024;
        match first {
            "Pss:" => pss += kb,
            "Rss:" => rss += kb,
            _ => {}
        }
    }
    Some((pss, rss))
}

/// Where `./x` puts the static agent, relative to cargo's target directory (scripts/static-agent.sh, docs/agent.md).
pub const STATIC_AGENT: &str = "static/clade-agent";

/// The clade-agent binary that templates, ct sandboxes and vm guests get: `$CLADE_AGENT_BIN`; else, looking
/// beside the running executable and up to two directories above it (a test binary runs from cargo's
/// `target/*/deps`), the static build `./x` makes ([`STATIC_AGENT`]) unless a `clade-agent` there is newer (a
/// plain `cargo build` after the agent changed), else that `clade-agent`. The static one runs in any rootfs,
/// with or without glibc.
pub fn agent_binary() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_AGENT_BIN") {
        return Some(p.into());
    }
    let exe = std::env::current_exe().ok()?;
    let found = |name: &str| exe.ancestors().skip(1).take(3).map(|dir| dir.join(name)).find(|p| p.is_file());
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    match (found(STATIC_AGENT), found("clade-agent")) {
        (Some(s), Some(d)) if modified(&d) > modified(&s) => Some(d),
        (Some(s), _) => Some(s),
        (None, d) => d,
    }
}

/// Whether the ELF file at `path` asks for a dynamic loader (has a `PT_INTERP` program header): false for a
/// static binary, `None` when it is not a 64-bit little-endian ELF file.
pub fn elf_is_dynamic(path: &std::path::Path) -> Option<bool> {
    let b = std::fs::read(path).ok()?;
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| b.get(o..o + 2).map(|s| u16::from_le_bytes([s[0], s[1]]));
    let phoff = u64::from_le_bytes(b.get(32..40)?.try_into().ok()?) as usize;
    let (phentsize, phnum) = (u16_at(54)? as usize, u16_at(56)? as usize);
    const PT_INTERP: u32 = 3;
    Some((0..phnum).any(|i| {
        let o = phoff + i * phentsize;
        b.get(o..o + 4).is_some_and(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]) == PT_INTERP)
    }))
}

/// The fields of `/proc/PID/status` (`Uid`, `CapEff`, `Seccomp`, ...), each value's first word; `None` once the
/// process is gone.
pub fn proc_status(pid: u32) -> Option<std::collections::BTreeMap<String, String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(
        text.lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_string(), v.split_whitespace().next().unwrap_or("").to_string()))
            .collect(),
    )
}

#[cfg(test)]
mod dirty_tests {
    /// The probe agrees with the kernel's own config where the kernel publishes it.
    #[test]
    fn the_dirty_page_probe_agrees_with_the_kernel_config() {
        let probed = super::tracks_dirty_pages().expect("/proc/self/pagemap is readable");
        let gz = std::process::Command::new("sh").args(["-c", "zcat /proc/config.gz 2>/dev/null"]).output();
        let config = gz.ok().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).filter(|c| !c.is_empty());
        match config {
            Some(c) => assert_eq!(probed, c.contains("CONFIG_MEM_SOFT_DIRTY=y"), "probe {probed} vs the kernel config"),
            None => eprintln!("no /proc/config.gz to compare with; the probe says {probed}"),
        }
    }
}

#[cfg(test)]
mod mapped_tests {
    use super::*;

    #[test]
    fn mapped_pss_rss_counts_only_mappings_under_the_dir() {
        let me = std::process::id();
        let exe = std::env::current_exe().expect("own exe");
        let dir = exe.parent().expect("exe dir");
        let (pss, rss) = mapped_pss_rss(me, dir).expect("own smaps");
        assert!(rss > 0, "the test binary is mapped from {}", dir.display());
        assert!(pss <= rss && pss > 0, "pss {pss} rss {rss}");
        let (_, all_rss) = pss_rss(me).expect("own rollup");
        assert!(rss < all_rss, "the binary alone ({rss}) is less than the whole process ({all_rss})");
        let none = mapped_pss_rss(me, Path::new("/nonexistent-clade-dir")).expect("own smaps");
        assert_eq!(none, (0, 0));
        assert!(mapped_pss_rss(u32::MAX, dir).is_none(), "no such process");
    }

    #[test]
    fn elf_is_dynamic_tells_static_from_dynamic() {
        let me = std::env::current_exe().unwrap();
        assert_eq!(super::elf_is_dynamic(&me), Some(true), "a cargo test binary asks for ld.so");
        // busybox-static (installed by ./x setup) has no loader.
        let busybox = ["/bin/busybox", "/usr/bin/busybox"].into_iter().map(std::path::Path::new).find(|p| p.exists());
        assert_eq!(busybox.and_then(super::elf_is_dynamic), busybox.map(|_| false));
        let tmp = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(tmp.path(), "#!/bin/sh\n").unwrap();
        assert_eq!(super::elf_is_dynamic(tmp.path()), None);
    }

    #[test]
    fn tasks_of_this_host_and_threads_of_this_process() {
        let (max, now) = super::tasks().expect("/proc/loadavg and kernel.pid_max");
        assert!(now >= 1 && max >= now, "{now} of {max}");
        let before = super::threads(std::process::id()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || rx.recv().ok());
        assert_eq!(super::threads(std::process::id()), Some(before + 1));
        drop(tx);
        t.join().unwrap();
        assert!(super::threads(u32::MAX).is_none());
    }

    #[test]
    fn cpu_seconds_of_this_process_grow_with_work() {
        let (before, age) = super::cpu_seconds(std::process::id()).expect("own /proc/PID/stat");
        assert!(before >= 0.0 && age >= 0.0);
        let t0 = std::time::Instant::now();
        let mut x = 0u64;
        while t0.elapsed() < std::time::Duration::from_millis(200) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let (after, _) = super::cpu_seconds(std::process::id()).unwrap();
        assert!(after - before >= 0.05, "{before} -> {after}");
        assert!(super::cpu_seconds(u32::MAX).is_none());
        // With the children it reaped: at least its own time (what the shim's stats report).
        let with_reaped = super::cpu_seconds_with_reaped(std::process::id()).unwrap();
        assert!(with_reaped >= after - 0.02, "{with_reaped} vs {after}");
        assert!(super::cpu_seconds_with_reaped(u32::MAX).is_none());
    }
}
