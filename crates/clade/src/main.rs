//! The `clade` binary: the CLI (embedded: store, ledger and backends in this process) and, later, the daemon.
//! Each subcommand group lives in its own file under `cmd/`; this file only parses and dispatches.

#![forbid(unsafe_code)]

mod cmd;

use clap::{Parser, Subcommand};

/// clade: agent sandboxes that boot once, then mark, restore and fork in milliseconds.
#[derive(Parser)]
#[command(name = "clade", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check this host: kernel, cgroups, QEMU, KVM (by a real guest boot), CRIU, userfaultfd, overlayfs, KSM.
    Doctor(cmd::doctor::Args),
    /// The chunk store: put, get, fsck, gc, stats.
    #[command(subcommand)]
    Store(cmd::store::Command),
    /// clade's NBD server over store manifests.
    #[command(subcommand)]
    Nbd(cmd::nbd::Command),
    /// Templates: build a root filesystem and disk image from a spec; list; remove.
    #[command(subcommand)]
    Template(cmd::template::Command),
    /// Run clade's main job on the embedded defaults.
    Demo(cmd::demo::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor(a) => cmd::doctor::run(a),
        Command::Store(c) => cmd::store::run(c),
        Command::Nbd(c) => cmd::nbd::run(c),
        Command::Template(c) => cmd::template::run(c),
        Command::Demo(a) => cmd::demo::run(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("clade: error: {e:#}");
            std::process::exit(cmd::exit_code(&e));
        }
    }
}
