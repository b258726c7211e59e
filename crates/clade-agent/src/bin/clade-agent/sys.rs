//! Identity, clock, env file, and the few ioctls the agent needs (each `unsafe` is a single syscall).

use crate::Agent;
use clade_agent::{AgentError, ClockReading, Hello, HookReport, Identity, IdentityReport, Reply, Response, ScriptRun};
use nix::time::{clock_gettime, clock_settime, ClockId};
use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// `_IOW('R', 0x03, int[2])`: add entropy to the input pool and credit it (needs CAP_SYS_ADMIN).
const RNDADDENTROPY: u64 = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the pool now (Linux 4.17+).
const RNDRESEEDCRNG: u64 = 0x5207;
const MAX_ENTROPY: usize = 64 * 1024;
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(30);

fn ns(c: ClockId) -> Result<i64, AgentError> {
    let t = clock_gettime(c).map_err(|e| AgentError::os("clock_gettime", &e.into()))?;
    Ok(t.tv_sec() * 1_000_000_000 + t.tv_nsec())
}

pub fn clock_read() -> Result<ClockReading, AgentError> {
    Ok(ClockReading {
        realtime_ns: ns(ClockId::CLOCK_REALTIME)?,
        monotonic_ns: ns(ClockId::CLOCK_MONOTONIC)?,
        boottime_ns: ns(ClockId::CLOCK_BOOTTIME)?,
    })
}

/// The clock shift: read our own clock and set it `by_ns` later, so transit time does not matter.
pub fn clock_shift(by_ns: i64) -> Result<ClockReading, AgentError> {
    let target = ns(ClockId::CLOCK_REALTIME)?.saturating_add(by_ns);
    let ts = nix::sys::time::TimeSpec::new(target.div_euclid(1_000_000_000), target.rem_euclid(1_000_000_000));
    clock_settime(ClockId::CLOCK_REALTIME, ts)
        .map_err(|e| AgentError::os("clock_settime (the agent needs CAP_SYS_TIME)", &e.into()))?;
    clock_read()
}

/// The kernel's boot id. Read once per connection, not per `hello`: under TCG the open, read and close of
/// this procfs file cost ~90 us, most of a round trip (docs/agent.md). It can change under a running agent
/// only when CRIU restores it onto another boot, and the host connects anew after every restore.
pub fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_owned()).unwrap_or_default()
}

pub fn hello(agent: &Agent, boot_id: &str) -> Hello {
    Hello {
        wire_version: clade_agent::WIRE_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").into(),
        role: agent.role.into(),
        boot_id: boot_id.to_owned(),
        uptime_ms: ns(ClockId::CLOCK_BOOTTIME).map(|n| n as u64 / 1_000_000).unwrap_or(0),
        generation: agent.generation.load(Ordering::Relaxed),
        pid: std::process::id(),
        services_ready: agent.services_ready.load(Ordering::Relaxed),
        shared_kernel: agent.shared_kernel,
    }
}

/// Writes `path` through a temp file and a rename, so readers see the old or the new content only.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_replace(path, data, mode, true)
}

/// As [`write_atomic`] without the fsync: readers see the old or the new file, never half of one, but a
/// crash may lose it. For identity files rewritten on every restore, where an fsync (a journal commit through
/// the guest's disk) would be most of hygiene's time.
pub fn write_replace(path: &Path, data: &[u8], mode: u32, durable: bool) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    fs::create_dir_all(dir)?;
    let tmp = crate::fsops::tmp_path(path);
    let res = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
        f.write_all(data)?;
        if durable {
            f.sync_all()?;
        }
        fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))?;
        fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

fn shell_quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', "'\\''"))
}

pub fn write_env(agent: &Agent, vars: &BTreeMap<String, String>) -> Response {
    for k in vars.keys() {
        let ok = k.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(AgentError::BadRequest { detail: format!("{k:?} is not a valid variable name") });
        }
    }
    if vars.values().any(|v| v.contains('\0')) {
        return Err(AgentError::BadRequest { detail: "a value contains a NUL byte".into() });
    }
    let mut env = String::from("# written by clade-agent\n");
    let mut profile = String::from("# written by clade-agent: the sandbox's env for login shells\n");
    for (k, v) in vars {
        env.push_str(&format!("{k}={}\n", shell_quote(v)));
        profile.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    let env_path = agent.sys_path("/etc/clade/env");
    write_atomic(&env_path, env.as_bytes(), 0o644)
        .map_err(|e| AgentError::os(format!("writing {}", env_path.display()), &e))?;
    let prof = agent.sys_path("/etc/profile.d/clade.sh");
    write_atomic(&prof, profile.as_bytes(), 0o644)
        .map_err(|e| AgentError::os(format!("writing {}", prof.display()), &e))?;
    Ok(Reply::Done)
}

pub fn register_restore_signal(agent: &Agent, pid: u32, signal: i32) -> Response {
    if nix::sys::signal::Signal::try_from(signal).is_err() {
        return Err(AgentError::BadRequest { detail: format!("{signal} is not a signal number") });
    }
    let mut regs = agent.restore_signals.lock();
    regs.retain(|(p, _)| *p != pid);
    regs.push((pid, signal));
    Ok(Reply::Done)
}

fn add_entropy(bytes: &[u8]) -> io::Result<()> {
    let f = OpenOptions::new().write(true).open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }, built as u32 words.
    let mut words = vec![0u32; 2 + bytes.len().div_ceil(4)];
    words[0] = (bytes.len() * 8) as u32;
    words[1] = bytes.len() as u32;
    for (i, c) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        words[2 + i] = u32::from_ne_bytes(w);
    }
    // SAFETY: `words` is a live, correctly sized rand_pool_info (header + buf_size bytes) for the whole
    // call; the kernel only reads from it.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, words.as_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn reseed_crng() -> io::Result<()> {
    let f = OpenOptions::new().write(true).open("/dev/urandom")?;
    // SAFETY: RNDRESEEDCRNG takes no argument and touches no user memory.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `/etc/hosts` text with `127.0.1.1` naming `hostname` (the line replaced if there was one, appended if not; the
/// localhost lines written first when the file was empty); every other line kept.
fn hosts_naming(old: &str, hostname: &str) -> String {
    let mut out = String::new();
    if old.trim().is_empty() {
        out.push_str("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    }
    let mut named = false;
    for line in old.lines() {
        if line.split_whitespace().next() == Some("127.0.1.1") {
            if !named {
                out.push_str(&format!("127.0.1.1\t{hostname}\n"));
                named = true;
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    if !named {
        out.push_str(&format!("127.0.1.1\t{hostname}\n"));
    }
    out
}

pub fn set_identity(agent: &Agent, id: &Identity) -> IdentityReport {
    let mut rep = IdentityReport::default();
    if let Some(h) = &id.hostname {
        let valid =
            !h.is_empty() && h.len() <= 64 && h.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
        if !valid {
            rep.errors.push(format!("hostname {h:?} refused: use 1-64 of [A-Za-z0-9.-]"));
        } else {
            // A jailed ct sandbox may not set its hostname; its host already did (through the namespace).
            let current = nix::unistd::gethostname().ok().and_then(|n| n.into_string().ok());
            let set = if current.as_deref() == Some(h.as_str()) { Ok(()) } else { nix::unistd::sethostname(h) };
            match set {
                Err(e) => rep.errors.push(format!("sethostname: {e} (needs CAP_SYS_ADMIN in its uts namespace)")),
                Ok(()) => {
                    let p = agent.sys_path("/etc/hostname");
                    match write_replace(&p, format!("{h}\n").as_bytes(), 0o644, false) {
                        Ok(()) => rep.hostname_set = true,
                        Err(e) => rep.errors.push(format!("writing {}: {e}", p.display())),
                    }
                    // The name resolves inside the sandbox as on Debian (`127.0.1.1 NAME`): sudo and other tools
                    // look it up and warn or wait when it does not.
                    let hosts = agent.sys_path("/etc/hosts");
                    let old = std::fs::read_to_string(&hosts).unwrap_or_default();
                    let new = hosts_naming(&old, h);
                    if new != old {
                        if let Err(e) = write_replace(&hosts, new.as_bytes(), 0o644, false) {
                            rep.errors.push(format!("writing {}: {e}", hosts.display()));
                        }
                    }
                }
            }
        }
    }
    if let Some(m) = &id.machine_id {
        if m.len() != 32 || !m.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()) {
            rep.errors.push(format!("machine id {m:?} refused: use 32 lowercase hex digits"));
        } else {
            let p = agent.sys_path("/etc/machine-id");
            match write_replace(&p, format!("{m}\n").as_bytes(), 0o444, false) {
                Ok(()) => rep.machine_id_set = true,
                Err(e) => rep.errors.push(format!("writing {}: {e}", p.display())),
            }
        }
    }
    if !id.entropy.is_empty() {
        let bytes = &id.entropy[..id.entropy.len().min(MAX_ENTROPY)];
        match add_entropy(bytes) {
            Ok(()) => rep.entropy_added = bytes.len() as u32,
            Err(e) => rep.errors.push(format!("RNDADDENTROPY: {e} (needs CAP_SYS_ADMIN)")),
        }
        match reseed_crng() {
            Ok(()) => rep.crng_reseeded = true,
            Err(e) => rep.errors.push(format!("RNDRESEEDCRNG: {e}")),
        }
    }
    if let Some(g) = id.generation {
        agent.generation.store(g, Ordering::Relaxed);
    }
    if id.run_on_restore {
        run_on_restore(agent, id.continues, &mut rep);
    }
    if id.signal_registered {
        signal_registered(agent, &mut rep);
    }
    rep
}

fn run_on_restore(agent: &Agent, continues: bool, rep: &mut IdentityReport) {
    let generation = agent.generation.load(Ordering::Relaxed).to_string();
    let env =
        [("CLADE_GENERATION", generation.as_str()), ("CLADE_RESTORE", if continues { "continue" } else { "sibling" })];
    let dir = agent.sys_path("/etc/clade/on-restore.d");
    run_hooks(agent, &dir, &env, &mut rep.scripts, &mut rep.errors);
}

/// `pre-mark.d`: what the sandbox's programs want done before a mark (the request's doc says more).
pub fn pre_mark(agent: &Agent, clean: bool) -> HookReport {
    let mut rep = HookReport::default();
    let generation = agent.generation.load(Ordering::Relaxed).to_string();
    let env = [("CLADE_GENERATION", generation.as_str()), ("CLADE_MARK_CLEAN", if clean { "1" } else { "0" })];
    let dir = agent.sys_path("/etc/clade/pre-mark.d");
    run_hooks(agent, &dir, &env, &mut rep.scripts, &mut rep.errors);
    // On a shared kernel the mark is a CRIU dump, which cannot take an inotify descriptor on an overlay: the
    // watches close theirs and arm again at their next read (crate::watch). A vm guest's are in its memory.
    if agent.shared_kernel {
        agent.watches.disarm_all();
    }
    rep
}

/// Runs the executable files of `dir` (not hidden ones) in name order, each in its own process group with
/// stdin closed, and waits for each up to `SCRIPT_TIMEOUT` (then kills it). A missing `dir` runs nothing.
fn run_hooks(agent: &Agent, dir: &Path, env: &[(&str, &str)], scripts: &mut Vec<ScriptRun>, errors: &mut Vec<String>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    let mut paths: Vec<_> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let exec = fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        if name.starts_with('.') || !exec {
            continue;
        }
        let t0 = Instant::now();
        let mut cmd = Command::new(&p);
        cmd.envs(env.iter().copied()).stdin(Stdio::null()).process_group(0);
        let status = match agent.reaper.spawn(&mut cmd) {
            Err(e) => {
                errors.push(format!("starting {}: {e}", p.display()));
                None
            }
            Ok(child) => {
                let s = agent.reaper.wait(child.id(), Some(SCRIPT_TIMEOUT));
                if s.is_none() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(child.id() as i32),
                        nix::sys::signal::SIGKILL,
                    );
                    agent.reaper.forget(child.id());
                    errors.push(format!("{} ran over {} s and was killed", p.display(), SCRIPT_TIMEOUT.as_secs()));
                }
                s
            }
        };
        if let Some(s) = status.filter(|s| !s.success()) {
            errors.push(format!("{} failed: {s:?}", p.display()));
        }
        scripts.push(ScriptRun { name, status, ms: t0.elapsed().as_millis() as u64 });
    }
}

fn signal_registered(agent: &Agent, rep: &mut IdentityReport) {
    let mut targets: Vec<(u32, i32)> = agent.restore_signals.lock().clone();
    // Programs in the sandbox register themselves with a file named by their pid holding a signal number.
    if let Ok(rd) = fs::read_dir(agent.sys_path("/run/clade/restore-signal.d")) {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let sig = fs::read_to_string(e.path()).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(libc::SIGUSR1);
            targets.push((pid, sig));
        }
    }
    let mut gone = Vec::new();
    for (pid, sig) in targets {
        let Ok(s) = nix::sys::signal::Signal::try_from(sig) else { continue };
        match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), s) {
            Ok(()) => rep.signalled += 1,
            Err(e) => {
                rep.errors.push(format!("signalling {pid} with {sig}: {e}"));
                gone.push(pid);
            }
        }
    }
    agent.restore_signals.lock().retain(|(p, _)| !gone.contains(p));
}

fn set_cloexec(fd: &OwnedFd) -> io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).map_err(io::Error::from)?;
    Ok(())
}

/// A new PTY pair (master, slave), both close-on-exec (the child gets dups on 0/1/2).
pub fn open_pty(rows: u16, cols: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let ws = nix::pty::Winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    let r = nix::pty::openpty(&ws, None).map_err(io::Error::from)?;
    set_cloexec(&r.master)?;
    set_cloexec(&r.slave)?;
    Ok((r.master, r.slave))
}

pub fn set_winsize(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> io::Result<()> {
    let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads one `struct winsize` from the pointer, which lives for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the child a session leader with its PTY (already its stdin) as the controlling terminal.
pub fn pre_exec_controlling_tty(cmd: &mut Command) {
    // SAFETY: the hook runs in the forked child before exec and only makes two async-signal-safe
    // syscalls; it allocates nothing and touches no shared state.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn hosts_name_the_sandbox_once_and_keep_the_rest() {
        let debian = "127.0.0.1\tlocalhost\n127.0.1.1\ttemplate\n::1\tlocalhost\n# comment\n";
        assert_eq!(
            super::hosts_naming(debian, "clade-ab12"),
            "127.0.0.1\tlocalhost\n127.0.1.1\tclade-ab12\n::1\tlocalhost\n# comment\n"
        );
        let plain = "127.0.0.1 localhost\n";
        assert_eq!(super::hosts_naming(plain, "n"), "127.0.0.1 localhost\n127.0.1.1\tn\n");
        let empty = super::hosts_naming("", "n");
        assert!(empty.starts_with("127.0.0.1\tlocalhost\n") && empty.ends_with("127.0.1.1\tn\n"), "{empty}");
        let twice = "127.0.1.1 a\n127.0.1.1 b\n";
        assert_eq!(super::hosts_naming(twice, "n"), "127.0.1.1\tn\n", "one line naming it");
        // Idempotent: a sibling restored again writes nothing new.
        let once = super::hosts_naming(debian, "x");
        assert_eq!(super::hosts_naming(&once, "x"), once);
    }
}
