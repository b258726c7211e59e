//! Per-sandbox supervisors, as conmon or containerd-shim are for containers: a detached `clade supervise`
//! process owns one running sandbox (its QEMU or restored process tree, its disk export, its agent connection),
//! outlives the CLI that started it, and answers requests on a unix socket next to the sandbox's run dir. The
//! ledger records its pid, so `clade ls` reports a sandbox whose supervisor died instead of losing it.

pub mod client;
pub mod pool;
pub mod procs;
pub mod protocol;
pub mod server;

use std::path::PathBuf;

use clade_core::CladeHome;

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
