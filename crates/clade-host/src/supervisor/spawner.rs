//! Supervisors forked from a per-host zygote (docs/scale.md).
//!
//! A supervisor started with `exec` pays for itself twice: the dynamic loader relocates the `clade` binary's
//! pointer tables (`.data.rel.ro`, ~470 KiB of pages that become private the moment they are written), and the
//! process starts from nothing. A thousand idle siblings paid ~1 MiB PSS each for their supervisors, ten to
//! twenty-five times what an idle `minimal` sandbox costs. Android's zygote answers the same problem: one
//! process loads and relocates the binary once and forks a child per start, and every child shares those pages
//! copy-on-write with it (and with each other) for as long as none writes them.
//!
//! The zygote (`clade spawner`) is started on first use, one per `$CLADE_HOME`, binary and namespaces (the
//! socket's name hashes them, so a rebuilt binary or a caller in another mount namespace gets its own and never
//! a stale one). It lives while a supervisor it forked lives, and ends [`GRACE`] after the last one, or when its
//! socket is removed: killing every sandbox leaves no clade process behind. It is single-threaded
//! (the one condition under which `fork` without `exec` is sound) and only forks: each request carries the
//! supervisor's arguments, the caller's environment and working directory, and the log file as a descriptor.
//! The child takes its own session, its own stdio and environment, rewrites its command line to
//! `clade supervise ARGS...` (what the audit, `ps` and the liveness check of a supervisor pid look for) and then
//! runs exactly what `clade supervise` runs. Every supervisor is still its own process, so a crash of one
//! sandbox's handling touches no other.
//!
//! Anything that goes wrong on this path falls back to [`super::spawn_detached`] (`exec`), which is also what
//! `CLADE_SPAWNER=0` selects.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clade_core::CladeHome;
use serde::{Deserialize, Serialize};

/// How long a zygote that has forked nothing yet waits for its first request.
pub const IDLE: Duration = Duration::from_secs(30);
/// How long a zygote whose supervisors have all ended waits for another request before it ends.
pub const GRACE: Duration = Duration::from_millis(200);

#[derive(Serialize, Deserialize)]
struct Request {
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
}

#[derive(Serialize, Deserialize)]
struct Reply {
    pid: Option<u32>,
    error: Option<String>,
}

/// Start `clade supervise ARGS...` with its output to `log`: forked by the zygote, or (if that path is off or
/// fails) executed as [`super::spawn_detached`] does. Returns its pid.
pub fn spawn(home: &CladeHome, args: &[&str], log: std::fs::File) -> anyhow::Result<u32> {
    if std::env::var("CLADE_SPAWNER").is_ok_and(|v| v == "0") {
        return super::spawn_detached(home, args, log);
    }
    match via_zygote(home, args, &log) {
        Ok(pid) => Ok(pid),
        Err(e) => {
            let _ = writeln!(&log, "clade: the supervisor zygote was not usable ({e:#}); starting it with exec");
            super::spawn_detached(home, args, log)
        }
    }
}

/// The zygote's socket for this home, binary and set of namespaces.
pub fn socket_path(home: &CladeHome) -> anyhow::Result<PathBuf> {
    let exe = super::clade_exe()?;
    let m = std::fs::metadata(&exe).with_context(|| format!("stat {}", exe.display()))?;
    let mut key = format!("{}:{}:{}:{}", m.dev(), m.ino(), m.mtime(), m.mtime_nsec());
    for ns in ["mnt", "pid", "net", "user", "ipc", "uts", "cgroup"] {
        let ino = std::fs::metadata(format!("/proc/self/ns/{ns}")).map(|m| m.ino()).unwrap_or(0);
        key.push_str(&format!(":{ino}"));
    }
    let hash = blake3::hash(key.as_bytes()).to_hex();
    Ok(home.run_dir().join(format!("spawner-{}.sock", &hash[..16])))
}

fn via_zygote(home: &CladeHome, args: &[&str], log: &std::fs::File) -> anyhow::Result<u32> {
    let sock = socket_path(home)?;
    let conn = match super::connect_unix(&sock) {
        Ok(c) => c,
        Err(_) => start_zygote(home, &sock)?,
    };
    let req = Request {
        args: args.iter().map(|s| s.to_string()).collect(),
        env: std::env::vars().collect(),
        cwd: std::env::current_dir().unwrap_or_else(|_| "/".into()),
    };
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    send_fd(&conn, log.as_raw_fd())?;
    let mut line = serde_json::to_vec(&req)?;
    line.push(b'\n');
    (&conn).write_all(&line)?;
    let mut answer = String::new();
    BufReader::new(&conn).read_line(&mut answer).context("read the zygote's answer")?;
    let reply: Reply = serde_json::from_str(&answer).with_context(|| format!("the zygote answered {answer:?}"))?;
    match (reply.pid, reply.error) {
        (Some(pid), _) => Ok(pid),
        (None, e) => Err(anyhow!("the zygote refused: {}", e.unwrap_or_default())),
    }
}

/// Start a zygote for `sock` and connect to it (a racing starter's zygote does as well: only one holds the lock).
fn start_zygote(home: &CladeHome, sock: &Path) -> anyhow::Result<UnixStream> {
    use std::os::unix::process::CommandExt;
    let log = std::fs::File::create(sock.with_extension("log"))?;
    let mut child = lean_malloc(&mut std::process::Command::new(super::clade_exe()?))
        .arg("spawner")
        .arg("--socket")
        .arg(sock)
        .env("CLADE_HOME", home.root())
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("start the supervisor zygote")?;
    let t0 = Instant::now();
    loop {
        if let Ok(c) = super::connect_unix(sock) {
            std::thread::Builder::new().name("reap-spawner".into()).spawn(move || child.wait()).ok();
            return Ok(c);
        }
        if let Ok(Some(status)) = child.try_wait() {
            // It lost the race to another zygote (which listens soon), or could not serve (its log says why).
            if let Ok(c) = super::connect_unix(sock) {
                return Ok(c);
            }
            let why = std::fs::read_to_string(sock.with_extension("log")).unwrap_or_default();
            bail!("the zygote ended ({status}): {}", why.trim());
        }
        if t0.elapsed() > Duration::from_secs(3) {
            bail!("the zygote did not listen on {} within 3 s", sock.display());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn send_fd(conn: &UnixStream, fd: RawFd) -> anyhow::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd];
    let iov = [std::io::IoSlice::new(b"F")];
    sendmsg::<()>(conn.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .context("pass the log descriptor to the zygote")?;
    Ok(())
}

fn recv_fd(conn: &UnixStream) -> anyhow::Result<OwnedFd> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(conn.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(&fd) = fds.first() {
                // SAFETY: the kernel just installed this descriptor in our table for us alone; nothing else owns it.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    bail!("the request carried no log descriptor")
}

/// The zygote itself (`clade spawner --socket PATH`): serve fork requests until idle. `supervise` runs in each
/// child with the request's arguments and returns its exit code; it is what `clade supervise` runs.
pub fn serve(sock: &Path, supervise: fn(&[String]) -> i32) -> anyhow::Result<()> {
    let lock =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(sock.with_extension("lock"))?;
    let Ok(lock) = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) else {
        return Ok(()); // another zygote serves this socket
    };
    // A child whose command line cannot be set would be invisible to the audit: refuse to serve at all.
    let own: Vec<String> = std::env::args().collect();
    set_cmdline(&own)?;
    let _ = std::fs::remove_file(sock);
    let listener = super::bind_unix(sock).with_context(|| format!("bind {}", sock.display()))?;
    let ours = std::fs::metadata(sock)?.ino();
    let mut last = Instant::now();
    let mut served = false;
    let mut children: Vec<u32> = Vec::new();
    loop {
        let still_ours = std::fs::metadata(sock).is_ok_and(|m| m.ino() == ours);
        // Reap the supervisors that ended (each exit is seen once, whatever the number of children).
        while let Ok(nix::sys::wait::WaitStatus::Exited(pid, _) | nix::sys::wait::WaitStatus::Signaled(pid, _, _)) =
            nix::sys::wait::waitpid(None, Some(nix::sys::wait::WaitPidFlag::WNOHANG))
        {
            children.retain(|&c| c != pid.as_raw() as u32);
        }
        // It lives while a supervisor it forked lives (and a moment after its last request); an unused one
        // ends after IDLE. So killing every sandbox leaves no clade process behind.
        let done = if children.is_empty() && served {
            last.elapsed() > GRACE
        } else {
            children.is_empty() && last.elapsed() > IDLE
        };
        if !still_ours || done {
            if still_ours {
                let _ = std::fs::remove_file(sock);
            }
            // A caller may have connected just before the unlink: answer what is queued, then end.
            listener.set_nonblocking(true)?;
            while let Ok((conn, _)) = listener.accept() {
                let _ = conn.set_nonblocking(false);
                if let Err(e) = answer(&conn, listener.as_raw_fd(), lock.as_raw_fd(), supervise) {
                    let reply = Reply { pid: None, error: Some(format!("{e:#}")) };
                    let _ = (&conn).write_all(format!("{}\n", serde_json::to_string(&reply)?).as_bytes());
                }
            }
            return Ok(());
        }
        let mut fds = [nix::poll::PollFd::new(std::os::fd::AsFd::as_fd(&listener), nix::poll::PollFlags::POLLIN)];
        if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(250u16)).unwrap_or(0) == 0 {
            continue;
        }
        let Ok((conn, _)) = listener.accept() else { continue };
        last = Instant::now();
        served = true;
        match answer(&conn, listener.as_raw_fd(), lock.as_raw_fd(), supervise) {
            Ok(pid) => children.push(pid),
            Err(e) => {
                eprintln!("clade spawner: {e:#}");
                let reply = Reply { pid: None, error: Some(format!("{e:#}")) };
                let _ = (&conn).write_all(format!("{}\n", serde_json::to_string(&reply)?).as_bytes());
            }
        }
    }
}

fn answer(conn: &UnixStream, listener: RawFd, lock: RawFd, supervise: fn(&[String]) -> i32) -> anyhow::Result<u32> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let log = recv_fd(conn)?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line)?;
    let req: Request = serde_json::from_str(&line).context("parse the request")?;
    let threads = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Threads:").map(|n| n.trim().to_string())));
    if threads.as_deref() != Some("1") {
        bail!("the zygote has {threads:?} threads; it forks only while it has one");
    }
    // SAFETY: this process is single-threaded (checked just above, and the zygote never starts a thread), so
    // the child's copy of the heap, the allocator and every lock is consistent; the child goes on to run the
    // supervisor as a process of its own and never returns into this loop.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Parent { child } => {
            let reply = Reply { pid: Some(child.as_raw() as u32), error: None };
            (&*conn).write_all(format!("{}\n", serde_json::to_string(&reply)?).as_bytes())?;
            Ok(child.as_raw() as u32)
        }
        nix::unistd::ForkResult::Child => {
            // The child closed the zygote's descriptors by number, and their numbers are soon reused (the
            // ledger's, a sandbox's): it must never unwind back into the zygote's frames, whose owners would
            // close them again. So a panic stops here and the process ends.
            let run = std::panic::AssertUnwindSafe(|| {
                match become_supervisor(&req, &log, [listener, lock, conn.as_raw_fd()]) {
                    Ok(()) => supervise(&req.args),
                    Err(e) => {
                        eprintln!("clade spawner: prepare the supervisor: {e:#}");
                        1
                    }
                }
            });
            let code = std::panic::catch_unwind(run).unwrap_or(101);
            std::process::exit(code)
        }
    }
}

/// In the forked child: shed the zygote's descriptors, take a session, stdio and the caller's environment and
/// working directory, and the command line the supervisor would have had if it had been executed.
fn become_supervisor(req: &Request, log: &OwnedFd, zygote_fds: [RawFd; 3]) -> anyhow::Result<()> {
    for fd in zygote_fds {
        let _ = nix::unistd::close(fd);
    }
    nix::unistd::setsid()?;
    let null = std::fs::File::open("/dev/null")?;
    nix::unistd::dup2(null.as_raw_fd(), 0)?;
    nix::unistd::dup2(log.as_raw_fd(), 1)?;
    nix::unistd::dup2(log.as_raw_fd(), 2)?;
    for (k, _) in std::env::vars_os() {
        std::env::remove_var(k);
    }
    for (k, v) in &req.env {
        if !k.is_empty() && !k.contains('=') && !k.contains('\0') && !v.contains('\0') {
            std::env::set_var(k, v);
        }
    }
    let _ = std::env::set_current_dir(&req.cwd);
    // One malloc arena: a supervisor's few threads seldom allocate at once, and each extra arena keeps its own
    // dirty pages for the life of the process.
    // SAFETY: mallopt takes two integers; this process is single-threaded here.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    let mut argv = vec![super::clade_exe()?.to_string_lossy().into_owned(), "supervise".to_string()];
    argv.extend(req.args.iter().cloned());
    set_cmdline(&argv)
}

/// `struct prctl_mm_map` (linux/prctl.h).
#[repr(C)]
struct PrctlMmMap {
    start_code: u64,
    end_code: u64,
    start_data: u64,
    end_data: u64,
    start_brk: u64,
    brk: u64,
    start_stack: u64,
    arg_start: u64,
    arg_end: u64,
    env_start: u64,
    env_end: u64,
    auxv: *mut u64,
    auxv_size: u32,
    exe_fd: u32,
}

const PR_SET_MM: libc::c_int = 35;
const PR_SET_MM_MAP: libc::c_ulong = 14;

/// Point this process's `/proc/self/cmdline` at `argv`, as CRIU does on restore: PR_SET_MM_MAP with the
/// process's own layout (from /proc/self/stat) and only the argument range changed. Without a new auxv or exe
/// file the kernel asks for no capability.
fn set_cmdline(argv: &[String]) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    for a in argv {
        buf.extend_from_slice(a.as_bytes());
        buf.push(0);
    }
    let buf: &'static mut [u8] = Vec::leak(buf);
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after = stat.rfind(')').map(|i| &stat[i + 2..]).ok_or_else(|| anyhow!("unreadable /proc/self/stat"))?;
    // `after` starts at field 3 (proc(5) numbers fields from 1).
    let fields: Vec<u64> = after.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    let field = |n: usize| fields.get(n - 3).copied().ok_or_else(|| anyhow!("/proc/self/stat has no field {n}"));
    let mut map = PrctlMmMap {
        start_code: field(26)?,
        end_code: field(27)?,
        start_stack: field(28)?,
        start_data: field(45)?,
        end_data: field(46)?,
        start_brk: field(47)?,
        brk: 0,
        arg_start: buf.as_ptr() as u64,
        arg_end: buf.as_ptr() as u64 + buf.len() as u64,
        env_start: field(50)?,
        env_end: field(51)?,
        auxv: std::ptr::null_mut(),
        auxv_size: 0,
        exe_fd: u32::MAX,
    };
    // SAFETY: brk(0) only reads the current program break; nothing allocates between it and the prctl below,
    // so the break handed back to the kernel is the one in force.
    map.brk = unsafe { libc::syscall(libc::SYS_brk, 0) } as u64;
    // SAFETY: `map` is a valid prctl_mm_map for the size passed; the argument range lies in `buf`, leaked above,
    // so it stays mapped and unchanged for the life of the process (the kernel reads cmdline from it).
    let r = unsafe {
        libc::prctl(
            PR_SET_MM,
            PR_SET_MM_MAP,
            &mut map as *mut PrctlMmMap as libc::c_ulong,
            std::mem::size_of::<PrctlMmMap>() as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error()).context("set the supervisor's command line (PR_SET_MM_MAP)");
    }
    Ok(())
}

/// glibc reads its malloc tunables from this variable, once, when a process starts.
pub const TUNABLES: &str = "GLIBC_TUNABLES";

/// What a supervisor's malloc runs with: no per-thread cache (`tcache`). An idle supervisor's heap holds ~20
/// KiB of live data after a restore that peaked near 400 KiB; the up to 7 freed chunks per size class the
/// cache keeps are never consolidated or trimmed, and they pinned ~70 KiB of heap pages per supervisor
/// (docs/scale.md). A supervisor is no allocation-heavy path: it waits on its sandbox.
const LEAN_MALLOC: &str = "glibc.malloc.tcache_count=0";

/// Start a zygote or an executed supervisor with [`LEAN_MALLOC`] after the caller's own `GLIBC_TUNABLES`,
/// unless `CLADE_LEAN_MALLOC=0` (glibc's defaults, to compare).
pub fn lean_malloc(cmd: &mut std::process::Command) -> &mut std::process::Command {
    if std::env::var_os("CLADE_LEAN_MALLOC").is_some_and(|v| v == "0") {
        return cmd;
    }
    cmd.env(TUNABLES, with_lean(std::env::var(TUNABLES).ok().as_deref()))
}

fn with_lean(own: Option<&str>) -> String {
    match own {
        Some(own) if !own.is_empty() => format!("{own}:{LEAN_MALLOC}"),
        _ => LEAN_MALLOC.to_string(),
    }
}

/// In a supervisor: take [`LEAN_MALLOC`] out of `GLIBC_TUNABLES` again (glibc has read it), so CRIU, QEMU and
/// the rest of what it starts run with the caller's tunables only. Called while the process has one thread.
pub fn forget_lean_malloc() {
    let Ok(all) = std::env::var(TUNABLES) else { return };
    match without_lean(&all) {
        Some(rest) if rest == all => {}
        Some(rest) => std::env::set_var(TUNABLES, rest),
        None => std::env::remove_var(TUNABLES),
    }
}

fn without_lean(all: &str) -> Option<String> {
    let rest: Vec<&str> = all.split(':').filter(|t| *t != LEAN_MALLOC).collect();
    (!rest.is_empty()).then(|| rest.join(":"))
}

/// Give the allocator's free pages back to the kernel (glibc keeps freed heap memory for reuse otherwise): a
/// supervisor calls it once its sandbox is ready, when the restore's buffers are free.
pub fn trim_heap() {
    // SAFETY: malloc_trim takes an integer and only walks the allocator's own free lists, under its own locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::{with_lean, without_lean, LEAN_MALLOC};

    #[test]
    fn the_lean_malloc_tunable_is_added_after_the_callers_and_taken_out_again() {
        assert_eq!(with_lean(None), LEAN_MALLOC);
        assert_eq!(with_lean(Some("")), LEAN_MALLOC);
        let theirs = "glibc.malloc.arena_max=2";
        let both = with_lean(Some(theirs));
        assert_eq!(both, format!("{theirs}:{LEAN_MALLOC}"));
        assert_eq!(without_lean(&both).as_deref(), Some(theirs), "the caller's own stay");
        assert_eq!(without_lean(LEAN_MALLOC), None, "nothing left: the variable goes");
        assert_eq!(without_lean(theirs).as_deref(), Some(theirs), "unchanged when it is not there");
    }
}
