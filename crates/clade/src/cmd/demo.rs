//! `clade demo`: clade's main job on the embedded defaults. Until the backends land it runs the doctor.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<i32> {
    println!("clade demo: the backends are not built yet; here is what this host can run.\n");
    super::doctor::run(super::doctor::Args::default())
}
