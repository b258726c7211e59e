//! `clade-agent`: the program inside every sandbox.
//!
//! * `clade-agent init [--listen SPEC] [--sysroot DIR] [--no-mounts]`: PID 1 (vm guest after the
//!   initramfs, or the init a ct sandbox execs): mounts, lo, services, reaping, then serves. Never exits.
//! * `clade-agent serve --listen SPEC [--sysroot DIR]`: only the server (tests, or beside another init).
//!
//! SPEC is `unix:PATH` (ct: a socket in the sandbox's own /run, which the host reaches through
//! `/proc/<pid>/root`) or `virtio:PATH` (vm: a virtio-serial port such as `/dev/virtio-ports/clade`;
//! `--port PATH` means the same). `--sysroot` prefixes the files the agent itself maintains
//! (/etc/hostname, /etc/machine-id, /etc/clade/*, /etc/profile.d/clade.sh, /run/clade/*) for tests.

mod caps;
mod conn;
mod fsops;
mod init;
mod netreset;
mod passwd;
mod procs;
mod ready;
mod reaper;
mod relay;
mod sys;
mod watch;

use parking_lot::Mutex;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

/// State shared by every connection.
pub struct Agent {
    pub role: &'static str,
    pub sysroot: PathBuf,
    pub generation: AtomicU64,
    pub services_ready: AtomicBool,
    pub procs: procs::Procs,
    pub reaper: reaper::Reaper,
    pub restore_signals: Mutex<Vec<(u32, i32)>>,
    /// `--shared-kernel`: a ct sandbox, on the host's kernel (its clock and random pool are the host's; the
    /// jail leaves this agent no right to set either).
    pub shared_kernel: bool,
    /// Directory watches (`watch_start`, `watch_events`, `watch_stop`).
    pub watches: watch::Watches,
}

impl Agent {
    /// Where a file the agent maintains lives (`--sysroot` + the in-sandbox path).
    pub fn sys_path(&self, p: &str) -> PathBuf {
        self.sysroot.join(p.trim_start_matches('/'))
    }
}

pub fn log(msg: &str) {
    eprintln!("clade-agent[{}]: {msg}", std::process::id());
}

/// Where the agent serves.
#[derive(Debug, Clone)]
pub enum Listen {
    Unix(PathBuf),
    Virtio(PathBuf),
}

impl Listen {
    pub fn parse(s: &str) -> Result<Listen, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            Ok(Listen::Unix(p.into()))
        } else if let Some(p) = s.strip_prefix("virtio:").or_else(|| s.strip_prefix("port:")) {
            Ok(Listen::Virtio(p.into()))
        } else {
            Err(format!("listen spec {s:?}: use unix:PATH or virtio:PATH"))
        }
    }
}

struct Opts {
    mode: String,
    listen: Option<Listen>,
    sysroot: PathBuf,
    mounts: bool,
    shared_kernel: bool,
}

const USAGE: &str =
    "usage: clade-agent init [--listen unix:PATH|virtio:PATH] [--sysroot DIR] [--no-mounts] [--shared-kernel]
       clade-agent serve (--listen unix:PATH | --port /dev/virtio-ports/NAME) [--sysroot DIR]
       clade-agent relay PORT
       clade-agent version";

fn parse_args() -> Result<Opts, String> {
    let pid1 = std::process::id() == 1;
    let mut args = std::env::args().skip(1).peekable();
    // As the kernel's `init=`, the agent gets no mode (and maybe stray kernel arguments): it is init.
    let mode = match args.peek().map(String::as_str) {
        Some("init" | "serve" | "version" | "--version") => args.next().unwrap_or_default(),
        _ if pid1 => "init".to_string(),
        other => return Err(format!("unknown mode {other:?}")),
    };
    let mut o = Opts { mode, listen: None, sysroot: PathBuf::from("/"), mounts: true, shared_kernel: false };
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--listen" => o.listen = Some(Listen::parse(&value()?)?),
            "--port" => o.listen = Some(Listen::Virtio(value()?.into())),
            "--sysroot" => o.sysroot = value()?.into(),
            "--no-mounts" => o.mounts = false,
            "--shared-kernel" => o.shared_kernel = true,
            _ if pid1 => log(&format!("ignoring argument {a:?}")),
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    Ok(o)
}

fn main() {
    // A host that goes away mid-write must cost an EPIPE on that write, never the agent.
    // SAFETY: setting a signal disposition to SIG_IGN installs no handler code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    // A port relay is a short-lived helper process, never the agent itself (crate::relay).
    if std::process::id() != 1 && std::env::args().nth(1).as_deref() == Some("relay") {
        let port = std::env::args().nth(2).unwrap_or_default();
        std::process::exit(relay::run(&port));
    }
    let o = match parse_args() {
        Ok(o) => o,
        // PID 1 must not exit over a bad argument: it serves with the defaults instead.
        Err(e) if std::process::id() == 1 => {
            log(&format!("{e}; starting init with the defaults"));
            Opts { mode: "init".into(), listen: None, sysroot: PathBuf::from("/"), mounts: true, shared_kernel: false }
        }
        Err(e) => {
            eprintln!("clade-agent: {e}\n{USAGE}");
            std::process::exit(2)
        }
    };
    let role = match o.mode.as_str() {
        "init" => "init",
        "serve" => "serve",
        "version" | "--version" => {
            println!("clade-agent {} (wire version {})", env!("CARGO_PKG_VERSION"), clade_agent::WIRE_VERSION);
            return;
        }
        _ => unreachable_mode(),
    };
    let agent = Arc::new(Agent {
        role,
        sysroot: o.sysroot.clone(),
        generation: AtomicU64::new(0),
        services_ready: AtomicBool::new(role == "serve"),
        procs: procs::Procs::default(),
        reaper: reaper::Reaper::default(),
        restore_signals: Mutex::new(Vec::new()),
        shared_kernel: o.shared_kernel,
        watches: watch::Watches::default(),
    });
    let a = agent.clone();
    if std::thread::Builder::new().name("reaper".into()).spawn(move || a.reaper.run()).is_err() {
        // Serve anyway (a PID 1 must not exit); process exits will not be reported.
        log("cannot start the reaper thread: child exits will not be reported");
    }
    let listen = if role == "init" {
        if std::process::id() != 1 {
            // Not PID 1 (a test): still adopt orphans so they are reaped here.
            let _ = nix::sys::prctl::set_child_subreaper(true);
        } else if std::env::var_os("PATH").is_none() {
            std::env::set_var("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        }
        if o.mounts {
            init::mount_system();
        }
        if let Err(e) = init::loopback_up() {
            log(&format!("bringing lo up: {e}"));
        }
        let listen = o
            .listen
            .clone()
            .or_else(|| init::configured_listen(&agent))
            .unwrap_or(Listen::Unix(clade_agent::CT_SOCKET.into()));
        let a = agent.clone();
        let _ = std::thread::Builder::new().name("services".into()).spawn(move || init::start_services(&a));
        listen
    } else {
        match o.listen.clone() {
            Some(l) => l,
            None => {
                eprintln!("clade-agent: serve needs --listen or --port\n{USAGE}");
                std::process::exit(2)
            }
        }
    };
    log(&format!("{role}: serving on {listen:?}"));
    // Never return: as PID 1 an exit would end the sandbox. Errors are logged and retried.
    loop {
        let res = match &listen {
            Listen::Unix(p) => serve_unix(&agent, p),
            Listen::Virtio(p) => serve_virtio(&agent, p),
        };
        if let Err(e) = res {
            log(&format!("serving on {listen:?}: {e}; retrying in 1 s"));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn unreachable_mode() -> ! {
    eprintln!("{USAGE}");
    std::process::exit(2)
}

fn serve_unix(agent: &Arc<Agent>, path: &Path) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let _ = fs::remove_file(path);
    let l = UnixListener::bind(path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    for s in l.incoming() {
        let s = match s {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log(&format!("accept: {e}"));
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::SndBuf, &(4 << 20));
        let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::RcvBuf, &(4 << 20));
        let a = agent.clone();
        let spawned = std::thread::Builder::new().name("conn".into()).spawn(move || {
            let (Ok(r), Ok(fd)) = (s.try_clone(), s.try_clone()) else { return };
            conn::serve(&a, r, Box::new(s), Some(fd.into()));
        });
        if let Err(e) = spawned {
            log(&format!("no thread for a connection: {e}"));
        }
    }
    Ok(())
}

/// A virtio-serial port reads 0 bytes while the host side is not connected (and sometimes early after
/// boot): that is "no data yet", never the end.
struct RetryRead(File);

impl Read for RetryRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.0.read(buf) {
                Ok(0) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => return r,
            }
        }
    }
}

fn serve_virtio(agent: &Arc<Agent>, path: &Path) -> io::Result<()> {
    let f = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOCTTY).open(path)?;
    let w = f.try_clone()?;
    let fd = f.try_clone()?;
    conn::serve(agent, RetryRead(f), Box::new(w), Some(fd.into()));
    Ok(())
}
