//! `clade roam ls|push|pull`: sandboxes moving between hosts through the shared blob tier (docs/roam.md).
//! `clade resume SBX` pulls by itself when the sandbox is not on this host but was pushed.

use super::sandbox::{face, print, Face};
use clade_api::client::encode;

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
            let rows = match face()? {
                Face::Local(ops) => serde_json::to_value(ops.roaming()?)?,
                Face::Remote(r) => r.call("GET", "/v1/roam", None)?,
            };
            print(json, &rows, |rows| {
                let mut s = format!("{:<40} {:<8} host", "SANDBOX", "STATE");
                for r in rows.as_array().into_iter().flatten() {
                    s.push_str(&format!(
                        "\n{:<40} {:<8} {}",
                        r["sandbox"].as_str().unwrap_or(""),
                        r["owner"]["state"].as_str().unwrap_or("?"),
                        r["owner"]["host"].as_str().unwrap_or("?")
                    ));
                }
                s
            })
        }
        Command::Push { sandbox, json } => {
            let body = match face()? {
                Face::Local(ops) => ops.push(&sandbox, &mut progress)?,
                Face::Remote(r) => r.call("POST", &format!("/v1/sandboxes/{}/push", encode(&sandbox)), None)?,
            };
            print(json, &body, |b| {
                format!(
                    "{sandbox} pushed to {} ({} of {} bytes uploaded) in {:.0} ms",
                    b["blob"].as_str().unwrap_or("?"),
                    b["bytes_uploaded"],
                    b["full_bytes"],
                    b["push_ms"].as_f64().unwrap_or(0.0)
                )
            })
        }
        Command::Pull { sandbox, json } => {
            let body = match face()? {
                Face::Local(ops) => ops.pull(&sandbox, &mut progress)?,
                Face::Remote(r) => r.call("POST", &format!("/v1/sandboxes/{}/pull", encode(&sandbox)), None)?,
            };
            print(json, &body, |b| {
                format!(
                    "{sandbox} pulled from {}; `clade resume {sandbox}` starts it here",
                    b["from"].as_str().unwrap_or("?")
                )
            })
        }
    }
}
