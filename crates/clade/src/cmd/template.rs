//! `clade template ...`: filled in by the templates issue.

use clap::Subcommand;

#[derive(Subcommand)]
pub enum Command {}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    match cmd {}
}
