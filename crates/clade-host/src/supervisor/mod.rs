//! Per-sandbox supervisors, as conmon or containerd-shim are for containers: a detached `clade supervise`
//! process owns one running sandbox (its QEMU or restored process tree, its disk export, its agent connection),
//! outlives the CLI that started it, and answers requests on a unix socket next to the sandbox's run dir. The
//! ledger records its pid, so `clade ls` reports a sandbox whose supervisor died instead of losing it.

pub mod client;
pub mod pool;
pub mod procs;
pub mod protocol;
pub mod server;
#[allow(unsafe_code)]
pub mod spawner;
pub mod start;

use std::path::{Path, PathBuf};

use clade_core::engine::{from_ledger, Engine};
use clade_core::CladeHome;
use clade_ledger::{MarkId, SandboxId};

/// The supervisor's own directory: `$CLADE_HOME/run/<sandbox>.sup/` (the backend's run dir is `run/<sandbox>/`).
pub fn sup_dir(home: &CladeHome, sandbox: &str) -> PathBuf {
    home.run_dir().join(format!("{sandbox}.sup"))
}

pub fn ctl_socket(home: &CladeHome, sandbox: &str) -> PathBuf {
    sup_dir(home, sandbox).join("ctl.sock")
}

pub fn ready_file(home: &CladeHome, sandbox: &str) -> PathBuf {
    sup_dir(home, sandbox).join("ready.json")
}

pub fn log_file(home: &CladeHome, sandbox: &str) -> PathBuf {
    sup_dir(home, sandbox).join("supervisor.log")
}

/// A unix socket path holds at most 107 bytes (`sun_path`), and a pool member's socket sits four names deep under
/// `$CLADE_HOME` (a 26-byte home already overflows it). Longer paths are reached through the directory opened
/// here: `/proc/self/fd/N/<name>` is short and resolves to the same place for bind and connect alike.
fn via_short_path<T>(path: &Path, f: impl FnOnce(&Path) -> std::io::Result<T>) -> std::io::Result<T> {
    const SUN_PATH_MAX: usize = 107;
    if path.as_os_str().len() <= SUN_PATH_MAX {
        return f(path);
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return f(path) };
    let dir = std::fs::File::open(dir)?;
    use std::os::fd::AsRawFd;
    let short = Path::new("/proc/self/fd").join(dir.as_raw_fd().to_string()).join(name);
    f(&short)
}

/// `UnixListener::bind` for a path of any length.
pub fn bind_unix(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    via_short_path(path, |p| std::os::unix::net::UnixListener::bind(p))
}

/// `UnixStream::connect` for a path of any length.
pub fn connect_unix(path: &Path) -> std::io::Result<std::os::unix::net::UnixStream> {
    via_short_path(path, |p| std::os::unix::net::UnixStream::connect(p))
}

/// The `clade` binary: what a supervisor process is started as (`clade supervise ARGS...`, a subcommand only
/// that binary carries), and what a bench runs as the CLI or the daemon. A program that links this library
/// without being `clade` (a bench, a test) finds it: `$CLADE_BIN` when set, else the running executable when it
/// is `clade`, else a `clade` beside it or up to two directories above it (cargo puts test binaries under
/// `target/*/deps`).
pub fn clade_exe() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_BIN") {
        return Ok(p.into());
    }
    let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("locate the running executable: {e}"))?;
    if exe.file_name().is_some_and(|n| n == "clade") {
        return Ok(exe);
    }
    exe.ancestors().skip(1).take(3).map(|d| d.join("clade")).find(|p| p.is_file()).ok_or_else(|| {
        anyhow::anyhow!(
            "{} is not clade and no clade binary is beside it: build it (cargo build -p clade) or set CLADE_BIN \
             to its path",
            exe.display()
        )
    })
}

/// The supervisor process itself (`clade supervise`): open the mark's backend, then serve the sandbox until it
/// ends, or (`pool`) prepare a restore of the mark and wait in its warm pool.
pub fn run_process(sandbox: &str, mark: &str, generation: u64, pool: bool) -> anyhow::Result<()> {
    spawner::forget_lean_malloc();
    let home = CladeHome::from_env();
    let engine = Engine::open(&home)?;
    let mark = engine.ledger().mark(&MarkId::new(mark.to_string()))?;
    let backend = crate::backends::open(&engine, from_ledger(mark.backend))?;
    if pool {
        pool::run_member(engine, backend, mark)
    } else {
        server::run(engine, backend, SandboxId::new(sandbox), mark.id, generation)
    }
}

/// Start `clade supervise ARGS...` ([`clade_exe`]) detached: its own process group (it outlives the CLI and the
/// daemon), stdin closed, output to `log`, `CLADE_HOME` passed on. A long-lived parent (the daemon) reaps it
/// when it ends, so none lingers as a zombie; a CLI that exits first hands it to init. Returns its pid.
pub fn spawn_detached(home: &CladeHome, args: &[&str], log: std::fs::File) -> anyhow::Result<u32> {
    use anyhow::Context;
    use std::os::unix::process::CommandExt;
    let exe = clade_exe()?;
    let mut child = spawner::lean_malloc(&mut std::process::Command::new(exe))
        .arg("supervise")
        .args(args)
        .env("CLADE_HOME", home.root())
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("start a supervisor")?;
    let pid = child.id();
    std::thread::Builder::new().name("reap-supervisor".into()).spawn(move || child.wait()).ok();
    Ok(pid)
}
