//! `clade base build|ls`: a template booted cold once, provisioned and marked (see `clade_host::base`).

use clade_core::backend::BackendKind;
use clade_core::engine::{from_ledger, Engine};
use clade_core::CladeHome;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Command {
    /// Build (or return the cached) base of a template on a backend.
    Build {
        /// A built template's name or hash, or a spec file (template.toml) to build first.
        template: String,
        #[arg(long)]
        backend: BackendKind,
        /// Build again even when a base is recorded.
        #[arg(long)]
        rebuild: bool,
        #[arg(long)]
        json: bool,
    },
    /// List bases.
    Ls {
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    match cmd {
        Command::Build { template, backend, rebuild, json } => {
            let steps = super::progress::Steps::new(&format!("base of {template} on {}", backend.as_str()));
            let out = clade_host::base::build(&home, &template, backend, rebuild, &|line| steps.line(&line));
            steps.finish();
            let out = out?;
            if json {
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!(
                    "base {} of {} on {}{}",
                    out.mark,
                    out.template,
                    backend.as_str(),
                    if out.cached { " (cached)" } else { "" }
                );
            }
            Ok(0)
        }
        Command::Ls { json } => {
            let engine = Engine::open(&home)?;
            let l = engine.ledger();
            let mut rows = Vec::new();
            for b in l.bases()? {
                let name = l.template(&b.template).map(|t| t.name).unwrap_or_default();
                rows.push(serde_json::json!({"template": name, "hash": b.template, "backend": from_ledger(b.backend), "mark": b.mark}));
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                for r in rows {
                    println!(
                        "{:<16} {:<3} {}",
                        r["template"].as_str().unwrap_or(""),
                        r["backend"].as_str().unwrap_or(""),
                        r["mark"].as_str().unwrap_or("")
                    );
                }
            }
            Ok(0)
        }
    }
}
