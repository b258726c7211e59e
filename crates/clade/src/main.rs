//! The `clade` binary: the CLI (embedded: store, ledger and backends in this process, or through `clade serve`
//! when `CLADE_HOST` is set) and the daemon (`clade serve`).
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
    /// Bases: a template booted once, provisioned and marked.
    #[command(subcommand)]
    Base(cmd::base::Command),
    /// Warm pools: prepared restores of a mark waiting for a fork.
    #[command(subcommand)]
    Pool(cmd::pool::Command),
    /// E2B compatibility: API keys for `clade serve --e2b-api`.
    #[command(subcommand)]
    E2b(cmd::e2b::Command),
    /// Start one sandbox from a mark, or from a template's base (`--backend vm|ct`).
    #[command(visible_alias = "restore")]
    Run(cmd::sandbox::RunArgs),
    /// Start N sibling sandboxes from one mark (or a template's base).
    Fork(cmd::sandbox::ForkArgs),
    /// Run a command in a sandbox; exits with its status.
    Exec(cmd::sandbox::ExecArgs),
    /// One sandbox: its record and, while it runs, its supervisor's facts (pids, memory, agent, blob reads).
    Info(cmd::sandbox::SbxArgs),
    /// Checkpoint a running sandbox (it keeps running).
    Mark(cmd::sandbox::MarkArgs),
    /// Take a sandbox back to an earlier mark of its branch.
    Retake(cmd::sandbox::RetakeArgs),
    /// Mark a sandbox and release its CPU and memory.
    Suspend(cmd::sandbox::SuspendArgs),
    /// Bring a suspended sandbox back from its last mark.
    Resume(cmd::sandbox::ResumeArgs),
    /// Stop every process of a running sandbox where it stands, memory kept (containerd's pause).
    Freeze(cmd::sandbox::SbxArgs),
    /// Continue a frozen sandbox.
    Thaw(cmd::sandbox::SbxArgs),
    /// Print what happens in a directory of a sandbox as it happens (inotify inside), until interrupted or
    /// `--count` events.
    Watch(cmd::sandbox::WatchArgs),
    /// Move suspended sandboxes between hosts through the shared blob tier (`CLADE_BLOB`).
    #[command(subcommand)]
    Roam(cmd::roam::Command),
    /// The hosts sharing the blob tier: last heartbeat, what each runs and owns, which stopped.
    Hosts(cmd::roam::HostsArgs),
    /// End a sandbox, or (`--all`) every sandbox not dead.
    Kill(cmd::sandbox::KillArgs),
    /// List sandboxes (a sandbox whose supervisor died is reported as lost).
    Ls(cmd::sandbox::ListArgs),
    /// List marks (all, or one sandbox's branch).
    Marks(cmd::sandbox::MarksArgs),
    /// List branches (lines of marks) with their heads; `branches rm BRANCH` deletes one.
    Branches(cmd::house::BranchesArgs),
    /// Collect: retention in the ledger, then the store's unused objects (and vm RAM files).
    Gc(cmd::house::GcArgs),
    /// Check the ledger against this host: lost sandboxes, missing manifests, leaked processes, mounts,
    /// cgroups and run dirs (`--fix` takes leftovers down); with two ct sandboxes, audit them for anything shared.
    Audit(cmd::house::AuditArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(cmd::house::CompletionsArgs),
    /// The HTTP API (axum) over the same operations, on a unix socket under $CLADE_HOME by default.
    Serve(cmd::serve::Args),
    /// The fleet simulator: keep-running vs suspend-idle over a trace, with clade's measured costs.
    #[command(subcommand)]
    Fleet(cmd::fleet::Command),
    /// Run clade's main job on the embedded defaults.
    Demo(cmd::demo::Args),
    /// The per-sandbox supervisor (started by run, fork and resume).
    #[command(hide = true)]
    Supervise(cmd::supervise::Args),
    /// The zygote that forks supervisors (started on first use; docs/scale.md).
    #[command(hide = true)]
    Spawner(cmd::supervise::SpawnerArgs),
}

/// `clade completions bash | head` closes the pipe early; `println!` (or clap's generator) then panics on
/// the broken pipe. End quietly with the shell's SIGPIPE status instead, as Unix tools do; every other panic
/// keeps the default report.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("Broken pipe") || msg.contains("BrokenPipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

fn main() {
    quiet_on_closed_stdout();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor(a) => cmd::doctor::run(a),
        Command::Store(c) => cmd::store::run(c),
        Command::Nbd(c) => cmd::nbd::run(c),
        Command::Template(c) => cmd::template::run(c),
        Command::Base(c) => cmd::base::run(c),
        Command::Pool(c) => cmd::pool::run(c),
        Command::E2b(c) => cmd::e2b::run(c),
        Command::Run(a) => cmd::sandbox::run(a),
        Command::Fork(a) => cmd::sandbox::fork(a),
        Command::Exec(a) => cmd::sandbox::exec(a),
        Command::Mark(a) => cmd::sandbox::mark(a),
        Command::Retake(a) => cmd::sandbox::retake(a),
        Command::Info(a) => cmd::sandbox::info(a),
        Command::Suspend(a) => cmd::sandbox::suspend(a),
        Command::Freeze(a) => cmd::sandbox::freeze(a, true),
        Command::Thaw(a) => cmd::sandbox::freeze(a, false),
        Command::Watch(a) => cmd::sandbox::watch(a),
        Command::Resume(a) => cmd::sandbox::resume(a),
        Command::Roam(c) => cmd::roam::run(c),
        Command::Hosts(a) => cmd::roam::hosts(a),
        Command::Kill(a) => cmd::sandbox::kill(a),
        Command::Ls(a) => cmd::sandbox::ls(a),
        Command::Marks(a) => cmd::sandbox::marks(a),
        Command::Branches(a) => cmd::house::branches(a),
        Command::Gc(a) => cmd::house::gc(a),
        Command::Audit(a) => cmd::house::audit(a),
        Command::Completions(a) => cmd::house::completions::<Cli>(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Fleet(c) => cmd::fleet::run(c),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Supervise(a) => cmd::supervise::run(a),
        Command::Spawner(a) => cmd::supervise::spawner(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("clade: error: {e:#}");
            std::process::exit(cmd::exit_code(&e));
        }
    }
}
