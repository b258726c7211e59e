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

#[derive(clap::Args)]
pub struct SpawnerArgs {
    /// The socket to serve (`clade_host::supervisor::spawner::socket_path`).
    #[arg(long)]
    pub socket: std::path::PathBuf,
}

/// `clade spawner` (hidden): the zygote that forks supervisors. Each child runs `clade supervise ARGS` as parsed
/// here, so a forked supervisor and an executed one take the same arguments the same way.
pub fn spawner(a: SpawnerArgs) -> anyhow::Result<i32> {
    fn supervise(args: &[String]) -> i32 {
        #[derive(clap::Parser)]
        struct Supervise {
            #[command(flatten)]
            args: Args,
        }
        let argv = std::iter::once("clade-supervise".to_string()).chain(args.iter().cloned());
        let parsed = match <Supervise as clap::Parser>::try_parse_from(argv) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("clade supervise: {e}");
                return 2;
            }
        };
        match run(parsed.args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("clade: error: {e:#}");
                super::exit_code(&e)
            }
        }
    }
    clade_host::supervisor::spawner::serve(&a.socket, supervise)?;
    Ok(0)
}
