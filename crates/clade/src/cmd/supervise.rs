//! `clade supervise` (hidden): the per-sandbox supervisor process that `run`, `fork`, `resume` and `retake`
//! start detached, or (`--pool`) a warm-pool member of a mark. See `clade_host::supervisor`.

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
    clade_host::supervisor::run_process(&a.sandbox, &a.mark, a.generation, a.pool)?;
    Ok(0)
}
