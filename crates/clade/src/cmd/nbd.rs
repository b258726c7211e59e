//! `clade nbd`: filled in by the nbd issue.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum Command {}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    match cmd {}
}
