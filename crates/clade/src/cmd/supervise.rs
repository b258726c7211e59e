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
    if a.pool {
        crate::supervisor::pool::run_member(engine, backend, mark)?;
    } else {
        crate::supervisor::server::run(engine, backend, SandboxId::new(a.sandbox), mark.id, a.generation)?;
    }
    Ok(0)
}
