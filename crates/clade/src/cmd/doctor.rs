//! `clade doctor`: what this host can run.

#[derive(clap::Args, Default)]
pub struct Args {
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_args: Args) -> anyhow::Result<i32> {
    Ok(0)
}
