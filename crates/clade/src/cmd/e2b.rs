//! `clade e2b key create|ls`: API keys for the E2B-compatible API of `clade serve --e2b-api` (the official E2B
//! SDKs send them as `E2B_API_KEY`; anything else gets 401). Their BLAKE3 hashes are kept one a line in
//! `$CLADE_HOME/e2b/keys` (0600): a key is printed once, at create, and never stored.

use clade_core::CladeHome;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Command {
    /// Key subcommands.
    #[command(subcommand)]
    Key(KeyCommand),
}

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Make a new key and print it (`e2b_<hex>`): set it as E2B_API_KEY.
    Create,
    /// How many keys exist (keys are not printed again).
    Ls,
}

pub fn run(c: Command) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    match c {
        Command::Key(KeyCommand::Create) => {
            println!("{}", clade_api::e2b::create_key(&home)?);
        }
        Command::Key(KeyCommand::Ls) => {
            let n = std::fs::read_to_string(clade_api::e2b::keys_file(&home))
                .map(|s| s.lines().filter(|l| !l.trim().is_empty()).count())
                .unwrap_or(0);
            println!("{n} E2B API key(s) in {}", clade_api::e2b::keys_file(&home).display());
        }
    }
    Ok(0)
}
