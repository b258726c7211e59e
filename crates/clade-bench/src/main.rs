//! `clade-bench`: the product's figures, each measured side by side with its peer in one run and printed as
//! JSON lines (`./x bench` runs them and gathers `bench/out` into a report). The layers' own benches are the
//! other binaries of this crate (`store-bench`, `nbd-bench`, `agent-bench`, `template-bench`, `ct-bench`,
//! `clade-ledger-bench`). Sandboxes are started through `clade-host`, whose supervisors are the `clade` binary
//! beside this one (or `$CLADE_BIN`).

#![forbid(unsafe_code)]

mod api;
mod browser;
mod e2b;
mod figure;
mod html;
mod k8s;
mod report;
mod roam;
mod scale;
mod vm;

pub use figure::{median, percentile, slope, Figure};

use clap::{Parser, Subcommand};

/// clade's benchmarks (run them with `./x bench`).
#[derive(Parser)]
#[command(name = "clade-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The vm backend's figures (`./x bench vm`).
    Vm(vm::Args),
    /// The headline figures with the browser template on one backend (`./x bench browser`).
    Browser(browser::Args),
    /// E2B SDK vs library: create to first command (`./x bench e2b`).
    E2b(e2b::Args),
    /// containerd's CRI: a pod to its first ready probe, clade vs runc, and over `clade fork` (`./x bench k8s`).
    K8s(k8s::Args),
    /// Roaming through a blob tier: bytes fetched vs the working set, resume elsewhere vs here (`./x bench roam`).
    Roam(roam::Args),
    /// The daemon's figures: HTTP overhead, concurrent clients on ct, a restart under load (`./x bench api`).
    Api(api::Args),
    /// Many siblings on one host: bulk fork, host memory per idle sibling, a thousand idle, kill all
    /// (`./x bench scale`).
    Scale(scale::Args),
    /// Gather bench/out into report.json and a self-contained report.html (run by `./x bench`).
    Report(report::Args),
}

fn main() {
    let cli = Cli::parse();
    let out = match cli.command {
        Command::Vm(a) => vm::run(a),
        Command::Browser(a) => browser::run(a),
        Command::E2b(a) => e2b::run(a),
        Command::K8s(a) => k8s::run(a),
        Command::Roam(a) => roam::run(a),
        Command::Api(a) => api::run(a),
        Command::Scale(a) => scale::run(a),
        Command::Report(a) => report::run(a),
    };
    match out {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("clade-bench: {e:#}");
            std::process::exit(1);
        }
    }
}
