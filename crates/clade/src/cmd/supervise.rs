//! `clade supervise` (hidden): the per-sandbox supervisor process that `run`, `fork`, `resume` and `retake`
//! start detached, or (`--pool`) a warm-pool member of a mark. See `supervisor/`.

use clade_core::engine::{from_ledger, Engine};
use clade_core::CladeHome;
use clade_ledger::{MarkId, SandboxId};

#[derive(clap::Args)]
pub struct Args {
    /// The sandbox (`-` with --pool: the member names itself).
    #[arg(long)]
    pub sandbox: String,
    #[arg(long)]
    pub mark: String,
    #[arg(long, default_value_t = 1)]
    pub generation: u64,
    /// Prepare a restore of the mark and wait in its warm pool.
    #[arg(long)]
    pub pool: bool,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let engine = Engine::open(&home)?;
    let found = engine.ledger().mark(&MarkId::new(a.mark.clone()));
    let mark = found?;
    let backend = crate::backends::open(&engine, from_ledger(mark.backend))?;
    if backend.kind() == clade_core::backend::BackendKind::Vm {
        // A vm sandbox's disk server reads through the store's index (loaded on first use): load it beside
        // QEMU's start (a pool member: before its claim) instead of on the guest's first disk read.
        let store = engine.store.clone();
        std::thread::spawn(move || {
            if let Err(e) = store.reload_index() {
                eprintln!("clade supervisor: loading the store index: {e}");
            }
        });
    }
    if a.pool {
        crate::supervisor::pool::run_member(engine, backend, mark)?;
    } else {
        crate::supervisor::server::run(engine, backend, SandboxId::new(a.sandbox), mark.id, a.generation)?;
    }
    Ok(0)
}
