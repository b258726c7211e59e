//! Processes started for the host: spawn (pipes or a PTY), stream their output, deliver their exit.
//!
//! Each process gets one supervisor thread that polls its output fds and sends `Data` frames tagged with
//! its pid; when the output has ended (or stayed open 2 s after the exit, e.g. held by a daemon it
//! forked) it sends the exit event, so a host sees all of the output before the exit.

use crate::conn::Conn;
use crate::Agent;
use clade_agent::wire::{encode_header, Chan, Kind, FLAG_END};
use clade_agent::{AgentError, Event, ExecSpec, ExitStatus, ProcInfo, Reply, Response};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEEP_EXITED: usize = 256;
const OUTPUT_GRACE: Duration = Duration::from_secs(2);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct Entry {
    pid: u32,
    argv: Vec<String>,
    tag: Option<String>,
    stdin: Mutex<Option<File>>,
    master: Option<Arc<File>>,
    exit: Mutex<Option<ExitStatus>>,
    cv: Condvar,
}

/// The table of processes the agent started.
#[derive(Default)]
pub struct Procs {
    map: Mutex<BTreeMap<u32, Arc<Entry>>>,
}

impl Procs {
    fn get(&self, pid: u32) -> Result<Arc<Entry>, AgentError> {
        self.map.lock().get(&pid).cloned().ok_or(AgentError::NoSuchProcess { pid })
    }

    fn insert(&self, e: Arc<Entry>) {
        let mut map = self.map.lock();
        map.insert(e.pid, e);
        let exited: Vec<u32> = map.values().filter(|e| e.exit.lock().is_some()).map(|e| e.pid).collect();
        if exited.len() > KEEP_EXITED {
            for pid in &exited[..exited.len() - KEEP_EXITED] {
                map.remove(pid);
            }
        }
    }

    pub fn list(&self) -> Vec<ProcInfo> {
        self.map
            .lock()
            .values()
            .map(|e| ProcInfo {
                pid: e.pid,
                argv: e.argv.clone(),
                tag: e.tag.clone(),
                pty: e.master.is_some(),
                exit: *e.exit.lock(),
            })
            .collect()
    }

    pub fn wait(&self, pid: u32) -> Response {
        let e = self.get(pid)?;
        let mut exit = e.exit.lock();
        loop {
            if let Some(s) = *exit {
                return Ok(Reply::Exited(s));
            }
            e.cv.wait(&mut exit);
        }
    }

    pub fn write_stdin(&self, pid: u32, data: &[u8], end: bool) {
        let Ok(e) = self.get(pid) else { return };
        if let Some(m) = &e.master {
            let _ = (&**m).write_all(data);
            return;
        }
        let mut stdin = e.stdin.lock();
        if let Some(f) = stdin.as_mut() {
            if f.write_all(data).is_err() {
                *stdin = None;
            }
        }
        if end {
            *stdin = None;
        }
    }

    pub fn close_stdin(&self, pid: u32) -> Response {
        let e = self.get(pid)?;
        if let Some(m) = &e.master {
            // A PTY has no separate stdin: EOF is the terminal's ^D.
            (&**m).write_all(&[4]).map_err(|err| AgentError::os("writing EOF to the pty", &err))?;
        } else {
            *e.stdin.lock() = None;
        }
        Ok(Reply::Done)
    }

    pub fn signal(&self, pid: u32, signal: i32) -> Response {
        let e = self.get(pid)?;
        if e.exit.lock().is_some() {
            return Err(AgentError::NoSuchProcess { pid });
        }
        let sig = nix::sys::signal::Signal::try_from(signal)
            .map_err(|_| AgentError::BadRequest { detail: format!("{signal} is not a signal number") })?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig)
            .map_err(|e| AgentError::os(format!("kill({pid}, {signal})"), &e.into()))?;
        Ok(Reply::Done)
    }

    /// Sends `signal` to every process of the group `leader` leads (`clade_agent::procgroup`), as this agent's
    /// `/proc` lists them; never the agent itself. The leader may have ended: what it left in its process
    /// group is still its group.
    pub fn signal_group(&self, leader: u32, signal: i32) -> Response {
        if leader <= 1 {
            return Err(AgentError::BadRequest { detail: format!("{leader} leads no group of processes") });
        }
        let sig = nix::sys::signal::Signal::try_from(signal)
            .map_err(|_| AgentError::BadRequest { detail: format!("{signal} is not a signal number") })?;
        let all: Vec<u32> = std::fs::read_dir("/proc")
            .map_err(|e| AgentError::os("reading /proc", &e))?
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        let me = std::process::id();
        let members: Vec<u32> =
            clade_agent::procgroup::members(&all, leader).into_iter().filter(|p| *p != me && *p > 1).collect();
        for p in &members {
            // One that ended meanwhile is not an error.
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p as i32), sig);
        }
        Ok(Reply::Signalled { processes: members.len() as u32 })
    }

    pub fn resize(&self, pid: u32, rows: u16, cols: u16) -> Response {
        let e = self.get(pid)?;
        let Some(m) = &e.master else {
            return Err(AgentError::BadRequest { detail: format!("process {pid} has no pty to resize") });
        };
        crate::sys::set_winsize(m.as_fd(), rows, cols).map_err(|err| AgentError::os("TIOCSWINSZ", &err))?;
        Ok(Reply::Done)
    }
}

/// A spawned process whose supervisor has not started yet (it starts after the `started` reply).
pub struct Started {
    agent: Arc<Agent>,
    conn: Arc<Conn>,
    entry: Arc<Entry>,
    outs: Vec<(Chan, File)>,
}

/// The user `name` of the `/etc/passwd` under `root` (the sandbox's own: `/`).
fn resolve_user(root: &std::path::Path, name: &str) -> Result<crate::passwd::User, AgentError> {
    let path = root.join("etc/passwd");
    let text = std::fs::read_to_string(&path).map_err(|e| AgentError::os(format!("reading {}", path.display()), &e))?;
    crate::passwd::find(&text, name)
        .ok_or_else(|| AgentError::BadRequest { detail: format!("no user {name:?} in {}", path.display()) })
}

/// What a process needs done by its own hook between fork and exec: a root of its own (`ExecSpec::root`, then
/// `cwd` inside it), fewer capabilities (`ExecSpec::caps`, crate::caps) or `no_new_privs`. std would take the
/// ids and the directory before any `pre_exec` hook, and a process that is no longer root can neither `chroot`
/// nor drop a bounding capability, so all of it happens in this one hook.
struct OwnSteps {
    root: Option<std::path::PathBuf>,
    cwd: Option<std::path::PathBuf>,
    ids: (Option<u32>, Option<u32>),
    keep_caps: Option<u64>,
    no_new_privs: bool,
}

fn own_steps(cmd: &mut Command, steps: OwnSteps) {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: std::path::PathBuf| std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap_or_default();
    let (root, cwd) = (steps.root.map(c), steps.cwd.map(c));
    let (ids, keep, nnp) = (steps.ids, steps.keep_caps, steps.no_new_privs);
    // SAFETY: the hook runs in the forked child before exec and only makes system calls (chroot, chdir,
    // prctl, setgroups, setgid, setuid, capget, capset) on C strings and integers made before the fork; it
    // allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let check = |r: libc::c_int| if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) };
            if let Some(root) = &root {
                check(libc::chroot(root.as_ptr()))?;
            }
            if let Some(cwd) = &cwd {
                check(libc::chdir(cwd.as_ptr()))?;
            }
            if let Some(keep) = keep {
                crate::caps::drop_bounding(keep)?;
            }
            if let Some(gid) = ids.1 {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setgid(gid))?;
            }
            if let Some(uid) = ids.0 {
                check(libc::setuid(uid))?;
            }
            if let Some(keep) = keep {
                crate::caps::narrow_sets(keep)?;
            }
            if nnp {
                crate::caps::set_no_new_privs()?;
            }
            Ok(())
        });
    }
}

/// Spawns a process as `spec` says.
pub fn spawn(agent: &Arc<Agent>, conn: &Arc<Conn>, spec: ExecSpec) -> Result<Started, AgentError> {
    let Some(prog) = spec.argv.first() else {
        return Err(AgentError::BadRequest { detail: "exec needs a non-empty argv".into() });
    };
    if spec.argv.iter().any(|a| a.contains('\0')) {
        return Err(AgentError::BadRequest { detail: "argv contains a NUL byte".into() });
    }
    let mut cmd = Command::new(prog);
    cmd.args(&spec.argv[1..]);
    let root = spec.root.as_deref().map(crate::fsops::check_path).transpose()?;
    if let Some(r) = root.as_ref().filter(|r| !r.is_dir()) {
        return Err(AgentError::NotFound { path: r.display().to_string() });
    }
    let user_root = root.clone().unwrap_or_else(|| "/".into());
    let user = spec.user.as_deref().map(|u| resolve_user(&user_root, u)).transpose()?;
    if spec.clear_env {
        cmd.env_clear().env("PATH", DEFAULT_PATH);
        cmd.env("HOME", user.as_ref().map(|u| u.dir.to_string_lossy().into_owned()).unwrap_or("/root".into()));
        cmd.env("USER", user.as_ref().map(|u| u.name.clone()).unwrap_or("root".into()));
    } else if let Some(u) = &user {
        cmd.env("HOME", &u.dir).env("USER", &u.name);
    }
    if spec.pty.is_some() && !spec.env.contains_key("TERM") {
        cmd.env("TERM", "xterm-256color");
    }
    cmd.envs(&spec.env);
    let cwd = spec.cwd.as_deref().map(crate::fsops::check_path).transpose()?;
    let (uid, gid) = (spec.uid.or(user.as_ref().map(|u| u.uid)), spec.gid.or(user.as_ref().map(|u| u.gid)));
    let keep_caps = spec.caps.as_deref().map(crate::caps::mask).transpose()?;
    if root.is_some() || keep_caps.is_some() || spec.no_new_privs {
        let cwd = if root.is_some() { Some(cwd.unwrap_or_else(|| "/".into())) } else { cwd };
        own_steps(&mut cmd, OwnSteps { root, cwd, ids: (uid, gid), keep_caps, no_new_privs: spec.no_new_privs });
    } else {
        if let Some(cwd) = cwd {
            cmd.current_dir(cwd);
        }
        if let Some(uid) = uid {
            cmd.uid(uid);
        }
        if let Some(gid) = gid {
            cmd.gid(gid);
        }
    }
    let spawn_err = |e: std::io::Error| match e.kind() {
        ErrorKind::NotFound => AgentError::NotFound { path: prog.clone() },
        _ => AgentError::os(format!("starting {prog}"), &e),
    };
    let (child, master, outs, stdin) = if let Some(size) = spec.pty {
        let (master, slave) = crate::sys::open_pty(size.rows, size.cols).map_err(|e| AgentError::os("openpty", &e))?;
        let dup = |fd: &OwnedFd| fd.try_clone().map(Stdio::from);
        let (i, o, e) = (dup(&slave), dup(&slave), dup(&slave));
        let (i, o, e) = match (i, o, e) {
            (Ok(i), Ok(o), Ok(e)) => (i, o, e),
            _ => {
                return Err(AgentError::Failed {
                    detail: "duplicating the pty slave failed: too many open files?".into(),
                })
            }
        };
        cmd.stdin(i).stdout(o).stderr(e);
        crate::sys::pre_exec_controlling_tty(&mut cmd);
        let child = agent.reaper.spawn(&mut cmd).map_err(spawn_err)?;
        drop(slave);
        let master = Arc::new(File::from(master));
        let reader = master.try_clone().map_err(|e| AgentError::os("dup pty master", &e))?;
        (child, Some(master), vec![(Chan::Stdout, reader)], None)
    } else {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.stdin(if spec.stdin { Stdio::piped() } else { Stdio::null() });
        cmd.process_group(0);
        let mut child = agent.reaper.spawn(&mut cmd).map_err(spawn_err)?;
        let mut outs = Vec::new();
        if let Some(o) = child.stdout.take() {
            outs.push((Chan::Stdout, File::from(OwnedFd::from(o))));
        }
        if let Some(e) = child.stderr.take() {
            outs.push((Chan::Stderr, File::from(OwnedFd::from(e))));
        }
        let stdin = child.stdin.take().map(|s| File::from(OwnedFd::from(s)));
        (child, None, outs, stdin)
    };
    let entry = Arc::new(Entry {
        pid: child.id(),
        argv: spec.argv.clone(),
        tag: spec.tag.clone(),
        stdin: Mutex::new(stdin),
        master,
        exit: Mutex::new(None),
        cv: Condvar::new(),
    });
    agent.procs.insert(entry.clone());
    Ok(Started { agent: agent.clone(), conn: conn.clone(), entry, outs })
}

impl Started {
    pub fn pid(&self) -> u32 {
        self.entry.pid
    }

    /// Starts the supervisor thread. If no thread can be had, supervises on this one.
    pub fn supervise(self) {
        let pid = self.entry.pid;
        let cell = Arc::new(Mutex::new(Some(self)));
        let c2 = cell.clone();
        let spawned = std::thread::Builder::new().name(format!("proc-{pid}")).spawn(move || {
            if let Some(s) = c2.lock().take() {
                s.run();
            }
        });
        if spawned.is_err() {
            if let Some(s) = cell.lock().take() {
                s.run();
            }
        }
    }

    fn run(mut self) {
        let pid = self.entry.pid;
        let mut buf = vec![0u8; 12 + 64 * 1024];
        let mut exit: Option<ExitStatus> = None;
        let mut grace: Option<Instant> = None;
        while !self.outs.is_empty() {
            let wait = match grace {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_millis(200),
            };
            let ready: Vec<bool> = {
                let mut fds: Vec<PollFd> =
                    self.outs.iter().map(|(_, f)| PollFd::new(f.as_fd(), PollFlags::POLLIN)).collect();
                let t = PollTimeout::try_from(wait.as_millis().min(10_000) as i32).unwrap_or(PollTimeout::MAX);
                match poll(&mut fds, t) {
                    Ok(_) => fds.iter().map(|p| p.revents().is_some_and(|r| !r.is_empty())).collect(),
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => vec![true; fds.len()],
                }
            };
            let mut i = 0;
            let mut idx = 0;
            while i < self.outs.len() {
                if !ready[idx] {
                    i += 1;
                    idx += 1;
                    continue;
                }
                idx += 1;
                let (chan, f) = &self.outs[i];
                match (&*f).read(&mut buf[12..]) {
                    Ok(n) if n > 0 => {
                        buf[..12].copy_from_slice(&encode_header(Kind::Data, *chan, 0, pid, n));
                        self.conn.raw(&buf[..12 + n]);
                        i += 1;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::WouldBlock => i += 1,
                    _ => {
                        // EOF, or EIO on a PTY whose slave side is all closed.
                        self.conn.data(*chan, pid, &[], FLAG_END);
                        self.outs.remove(i);
                    }
                }
            }
            if exit.is_none() {
                exit = self.agent.reaper.wait(pid, Some(Duration::ZERO));
                if exit.is_some() {
                    grace = Some(Instant::now() + OUTPUT_GRACE);
                }
            }
            if grace.is_some_and(|d| Instant::now() >= d) {
                break;
            }
        }
        let status = match exit {
            Some(s) => s,
            None => self.agent.reaper.wait(pid, None).unwrap_or(ExitStatus { code: None, signal: None }),
        };
        *self.entry.stdin.lock() = None;
        *self.entry.exit.lock() = Some(status);
        self.entry.cv.notify_all();
        self.conn.event(pid, &Event::Exit { pid, status });
    }
}
