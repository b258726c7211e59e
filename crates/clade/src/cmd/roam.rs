//! `clade roam ls|push|pull`: sandboxes moving between hosts through the shared blob tier (docs/roam.md), and
//! `clade hosts`: the hosts sharing it, from their heartbeat records.
//! `clade resume SBX` pulls by itself when the sandbox is not on this host but was pushed.

use super::sandbox::{api, print};

#[derive(clap::Subcommand)]
pub enum Command {
    /// The sandboxes in the blob tier and which host has them.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Send a suspended sandbox to the blob tier; this host forgets it.
    Push {
        sandbox: String,
        #[arg(long)]
        json: bool,
    },
    /// Take a pushed sandbox into this host (suspended; `clade resume` starts it).
    Pull {
        sandbox: String,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(c: Command) -> anyhow::Result<i32> {
    let mut progress = |l: &str| eprintln!("clade: {l}");
    match c {
        Command::Ls { json } => {
            let rows = api()?.roaming()?;
            print(json, &rows, |rows| {
                let mut s = format!("{:<40} {:<8} host", "SANDBOX", "STATE");
                for r in rows {
                    let (state, host) = r.owner.as_ref().map_or(("?", "?"), |o| (o.state.as_str(), o.host.as_str()));
                    s.push_str(&format!("\n{:<40} {state:<8} {host}", r.sandbox));
                }
                s
            })
        }
        Command::Push { sandbox, json } => {
            let out = api()?.push(&sandbox, &mut progress)?;
            print(json, &out, |b| {
                format!(
                    "{sandbox} pushed to {} ({} of {} bytes uploaded) in {:.0} ms",
                    b.blob, b.bytes_uploaded, b.full_bytes, b.push_ms
                )
            })
        }
        Command::Pull { sandbox, json } => {
            let out = api()?.pull(&sandbox, &mut progress)?;
            print(json, &out, |b| format!("{sandbox} pulled from {}; `clade resume {sandbox}` starts it here", b.from))
        }
    }
}

#[derive(clap::Args)]
pub struct HostsArgs {
    #[arg(long)]
    json: bool,
}

pub fn hosts(a: HostsArgs) -> anyhow::Result<i32> {
    let rows = api()?.hosts()?;
    print(a.json, &rows, |rows| {
        let mut s = format!(
            "{:<22} {:<8} {:>8} {:>7} {:>9} {:<6} owns",
            "HOST", "STATE", "BEAT", "RUNNING", "SUSPENDED", "LEASE"
        );
        for r in rows {
            s.push_str(&format!(
                "\n{:<22} {:<8} {:>7.0}s {:>7} {:>9} {:<6} {}",
                r.beat.host,
                r.state,
                r.age_s,
                r.beat.running.len(),
                r.beat.suspended.len(),
                if r.lease_live { "live" } else { "ended" },
                r.owns.join(",")
            ));
        }
        if rows.is_empty() {
            s.push_str(
                "\n(no host has beaten into this blob tier: `clade serve` beats every CLADE_HEARTBEAT_S seconds)",
            );
        }
        s
    })
}
