//! `clade template ...`: build a template from a spec (root filesystem, and for vm a disk image in the
//! store), list the built ones, remove one. The work is `clade_template`'s; this file parses, prints
//! progress lines to stderr and results to stdout (one JSON document with `--json`).

use std::path::PathBuf;

use clade_core::{CladeHome, ErrorKind, OpError};
use clade_template::{Backends, Builder, TemplateError, TemplateSpec};
use clap::{Subcommand, ValueEnum};

#[derive(Subcommand)]
pub enum Command {
    /// Build a template: cached rootfs, then per backend (vm: ext4 image in the store; ct: the rootfs).
    Build {
        /// The spec file (template.toml), or the directory holding it.
        spec: PathBuf,
        /// Print the record as JSON on stdout.
        #[arg(long)]
        json: bool,
        /// Which backends to prepare.
        #[arg(long, value_enum, default_value_t = BackendArg::All)]
        backend: BackendArg,
        /// The clade-agent binary to install (default: `clade-agent` next to this executable, if any).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// Install no agent even if one is found.
        #[arg(long, conflicts_with = "agent")]
        no_agent: bool,
        /// Keep the ext4 image file next to the rootfs as well as in the store.
        #[arg(long)]
        keep_image: bool,
    },
    /// List built templates.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Remove a template (by name or hash prefix); refused while a base needs it.
    Rm {
        /// Template name or at least 8 digits of its hash.
        template: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BackendArg {
    Vm,
    Ct,
    All,
}

/// Maps library errors to the CLI's exit codes (2 usage, 3 not found, 4 conflict).
fn coded(e: TemplateError) -> anyhow::Error {
    let code = match &e {
        TemplateError::Parse { .. }
        | TemplateError::Invalid { .. }
        | TemplateError::MissingFile { .. }
        | TemplateError::ReadSpec { .. }
        | TemplateError::Ambiguous(_) => ErrorKind::Invalid,
        TemplateError::NotFound(_) => ErrorKind::NotFound,
        TemplateError::InUse(_) => ErrorKind::Conflict,
        _ => ErrorKind::Internal,
    };
    anyhow::Error::new(OpError::new(code, e.to_string()))
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    match cmd {
        Command::Build { spec, json, backend, agent, no_agent, keep_image } => {
            let spec = if spec.is_dir() { spec.join("template.toml") } else { spec };
            let spec = TemplateSpec::load(&spec).map_err(coded)?;
            let agent = if no_agent { None } else { agent.or_else(clade_core::host::agent_binary) };
            let backends = match backend {
                BackendArg::Vm => Backends::VM,
                BackendArg::Ct => Backends::CT,
                BackendArg::All => Backends::ALL,
            };
            let steps = super::progress::Steps::new(&format!("template {}", spec.name));
            let sink = steps.clone();
            let builder = Builder::new(home).agent(agent).keep_image(keep_image).on_progress(move |p| {
                sink.line(&format!("[{:>7.2}s] {:<11} {}", p.elapsed.as_secs_f64(), p.step, p.detail));
            });
            let report = builder.build(&spec, backends).map_err(coded);
            steps.finish();
            let report = report?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                let r = &report.record;
                println!("template {} {}", r.name, r.hash);
                println!("  rootfs  {} ({}, {} entries)", r.rootfs.display(), mib(r.rootfs_bytes), r.rootfs_entries);
                if let Some(d) = &r.disk {
                    println!(
                        "  disk    {} GiB, manifest {}, {} allocated, {} in the store",
                        d.disk_gib,
                        d.manifest.as_deref().unwrap_or("-"),
                        mib(d.allocated_bytes),
                        mib(d.stored_bytes)
                    );
                }
            }
            Ok(0)
        }
        Command::Ls { json } => {
            let all = clade_template::list(&home).map_err(coded)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else if all.is_empty() {
                println!("no templates (build one with `clade template build templates/minimal/template.toml`)");
            } else {
                println!("{:<16} {:<18} {:>11} {:>6}  disk manifest", "NAME", "HASH", "ROOTFS", "DISK");
                for r in &all {
                    let disk = r.disk.as_ref().map(|d| format!("{}G", d.disk_gib)).unwrap_or_else(|| "-".into());
                    let m = r.disk.as_ref().and_then(|d| d.manifest.as_deref()).map(|m| &m[..16]).unwrap_or("-");
                    println!("{:<16} {:<18} {:>11} {:>6}  {m}", r.name, &r.hash[..16], mib(r.rootfs_bytes), disk);
                }
            }
            Ok(0)
        }
        Command::Rm { template, json } => {
            let removed = clade_template::remove(&home, &template).map_err(coded)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&removed)?);
            } else {
                println!("removed {} {}", removed.name, removed.hash);
            }
            Ok(0)
        }
    }
}
