//! The PID 1 role: make a bare root usable (mounts, lo), start the template's services, and never die.
//!
//! In a `vm` guest the initramfs has mounted only the root disk; in a `ct` sandbox the backend already
//! mounted proc, /dev, /dev/shm and /run before exec'ing us. So every mount here is "where missing".

use crate::{log, Agent, Listen};
use nix::mount::{mount, MsFlags};
use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const SERVICE_TIMEOUT: Duration = Duration::from_secs(60);

fn mounted() -> HashSet<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .map(|s| s.lines().filter_map(|l| l.split(' ').nth(4).map(PathBuf::from)).collect())
        .unwrap_or_default()
}

fn mount_missing(have: &HashSet<PathBuf>, src: &str, target: &str, fstype: &str, flags: MsFlags, data: &str) {
    if have.contains(Path::new(target)) {
        return;
    }
    let _ = fs::create_dir_all(target);
    if let Err(e) = mount(Some(src), target, Some(fstype), flags, Some(data)) {
        log(&format!("mounting {fstype} on {target}: {e} (continuing without it)"));
    }
}

/// Mounts proc, sys, dev, devpts, /dev/shm, /run and /tmp where they are not mounted yet.
pub fn mount_system() {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if !Path::new("/proc/self/mountinfo").exists() {
        let _ = fs::create_dir_all("/proc");
        if let Err(e) = mount(Some("proc"), "/proc", Some("proc"), nosuid | MsFlags::MS_NOEXEC, None::<&str>) {
            log(&format!("mounting /proc: {e}"));
        }
    }
    let have = mounted();
    mount_missing(&have, "sysfs", "/sys", "sysfs", nosuid | MsFlags::MS_NOEXEC, "");
    mount_missing(&have, "devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, "mode=0755");
    mount_missing(
        &have,
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    );
    if !Path::new("/dev/ptmx").exists() {
        let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    }
    mount_missing(&have, "tmpfs", "/dev/shm", "tmpfs", nosuid, "mode=1777");
    mount_missing(&have, "tmpfs", "/run", "tmpfs", nosuid, "mode=0755");
    mount_missing(&have, "tmpfs", "/tmp", "tmpfs", nosuid, "mode=1777");
}

pub use clade_agent::netif::loopback_up;

/// Runs `/etc/clade/services.d/*` in name order, each to completion: a service script starts its daemon
/// and returns once it listens. One that hangs is abandoned after 60 s, and the next starts.
pub fn start_services(agent: &Agent) {
    let dir = agent.sys_path("/etc/clade/services.d");
    let mut paths: Vec<PathBuf> =
        fs::read_dir(&dir).map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    paths.sort();
    for p in paths {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let exec = fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        if name.starts_with('.') || !exec {
            continue;
        }
        let t0 = Instant::now();
        let mut cmd = Command::new(&p);
        cmd.stdin(Stdio::null());
        match agent.reaper.spawn(&mut cmd) {
            Err(e) => log(&format!("service {name}: cannot start: {e}")),
            Ok(child) => match agent.reaper.wait(child.id(), Some(SERVICE_TIMEOUT)) {
                Some(s) if s.success() => log(&format!("service {name}: ready in {} ms", t0.elapsed().as_millis())),
                Some(s) => log(&format!("service {name}: failed {s:?}")),
                None => {
                    agent.reaper.forget(child.id());
                    log(&format!("service {name}: not ready after {} s, going on", SERVICE_TIMEOUT.as_secs()));
                }
            },
        }
    }
    agent.services_ready.store(true, Ordering::Relaxed);
}

/// The channel named on the kernel command line (`clade.agent=virtio:/dev/...`) or in
/// `/etc/clade/agent.conf` (`listen=unix:/run/clade/agent.sock`).
pub fn configured_listen(agent: &Agent) -> Option<Listen> {
    let key = format!("{}=", clade_agent::CMDLINE_KEY);
    if let Ok(cmdline) = fs::read_to_string("/proc/cmdline") {
        if let Some(v) = cmdline.split_whitespace().find_map(|w| w.strip_prefix(&key)) {
            match Listen::parse(v) {
                Ok(l) => return Some(l),
                Err(e) => log(&format!("kernel command line: {e}")),
            }
        }
    }
    let conf = fs::read_to_string(agent.sys_path("/etc/clade/agent.conf")).ok()?;
    let v = conf.lines().find_map(|l| l.trim().strip_prefix("listen="))?;
    Listen::parse(v.trim()).map_err(|e| log(&format!("agent.conf: {e}"))).ok()
}
