//! `clade base build|ls`: a template booted cold once, provisioned (its `/etc/clade/provision.sh`, with the exit
//! status and log kept), waited for (`ready`), and marked. Cached by template hash and backend: a second build
//! returns the recorded base at once. No sandbox ever cold-boots after its base exists.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_agent::proto::{ExecSpec, ReadyTarget};
use clade_core::backend::{BackendKind, Sandbox, Shape, TemplateImage};
use clade_core::engine::{from_ledger, to_ledger, Engine, EngineError};
use clade_core::{CladeHome, ExitCoded};
use clade_ledger::TemplateId;
use clade_template::TemplateRecord;
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
            let out = build_with(&home, &template, backend, rebuild, &steps, &|line| steps.line(&line));
            steps.finish();
            let out = out?;
            if json {
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!(
                    "base {} of {} on {}{}",
                    out["mark"].as_str().unwrap_or("?"),
                    out["template"].as_str().unwrap_or("?"),
                    backend.as_str(),
                    if out["cached"] == true { " (cached)" } else { "" }
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

/// Find or build the template `key` names (a name, a hash, or a spec path).
pub fn template_record(home: &CladeHome, key: &str, backend: BackendKind) -> anyhow::Result<TemplateRecord> {
    template_record_with(home, key, backend, &super::progress::Steps::plain())
}

/// [`template_record`], a build's step lines going to `steps`.
fn template_record_with(
    home: &CladeHome,
    key: &str,
    backend: BackendKind,
    steps: &super::progress::Steps,
) -> anyhow::Result<TemplateRecord> {
    let path = std::path::Path::new(key);
    let spec_path = if path.is_dir() { path.join("template.toml") } else { path.to_path_buf() };
    if spec_path.is_file() {
        let spec =
            clade_template::TemplateSpec::load(&spec_path).map_err(|e| anyhow!(ExitCoded::new(2, e.to_string())))?;
        let agent = crate::cmd::agent_binary();
        let backends = match backend {
            BackendKind::Vm => clade_template::Backends::VM,
            BackendKind::Ct => clade_template::Backends::CT,
        };
        let steps = steps.clone();
        let sink = move |p: &clade_template::Progress| {
            steps.line(&format!("  [{:>6.1} s] template {}: {}", p.elapsed.as_secs_f64(), p.step, p.detail))
        };
        let report =
            clade_template::Builder::new(home.clone()).agent(agent).on_progress(sink).build(&spec, backends)?;
        return Ok(report.record);
    }
    clade_template::find(home, key).map_err(|e| anyhow!(ExitCoded::new(3, e.to_string())))
}

pub fn image_of(r: &TemplateRecord) -> TemplateImage {
    TemplateImage {
        name: r.name.clone(),
        hash: r.hash.clone(),
        rootfs: r.rootfs.clone(),
        disk_manifest: r.disk.as_ref().and_then(|d| d.manifest.clone()),
        shape: Shape { memory_mib: r.memory_mib, vcpus: r.vcpus, disk_gib: r.disk_gib },
        egress: r.egress,
    }
}

pub fn ready_target(r: &TemplateRecord) -> Option<ReadyTarget> {
    r.ready.as_ref().map(|r| r.to_agent())
}

/// Build or return the cached base; `say` gets progress lines.
pub fn build(
    home: &CladeHome,
    key: &str,
    backend: BackendKind,
    rebuild: bool,
    say: &dyn Fn(String),
) -> anyhow::Result<serde_json::Value> {
    build_with(home, key, backend, rebuild, &super::progress::Steps::plain(), say)
}

/// [`build`], the template's own build (if it is built first) reporting to `steps`.
fn build_with(
    home: &CladeHome,
    key: &str,
    backend: BackendKind,
    rebuild: bool,
    steps: &super::progress::Steps,
    say: &dyn Fn(String),
) -> anyhow::Result<serde_json::Value> {
    let t0 = Instant::now();
    let record = template_record_with(home, key, backend, steps)?;
    let engine = Engine::open(home)?;
    let tid = TemplateId::new(record.hash.clone());
    if engine.ledger().template(&tid).is_err() {
        engine.ledger().put_template(&tid, &record.name, &record.identity.to_json())?;
    }
    if !rebuild {
        let base = engine.ledger().base_for(&tid, to_ledger(backend))?;
        if let Some(b) = base {
            let found = engine.ledger().mark(&b.mark);
            if let Ok(m) = found {
                return Ok(
                    serde_json::json!({"template": record.name, "hash": record.hash, "backend": backend, "mark": m.id, "cached": true, "elapsed_ms": t0.elapsed().as_secs_f64() * 1e3}),
                );
            }
        }
    }
    let image = image_of(&record);
    if backend == BackendKind::Vm && image.disk_manifest.is_none() {
        return Err(anyhow!(ExitCoded::new(
            4,
            format!("template {} has no vm disk: build it with --backend vm", record.name)
        )));
    }
    let be = crate::backends::open(&engine, backend)?;
    say(format!(
        "  [{:>6.1} s] base: booting {} cold on {}",
        t0.elapsed().as_secs_f64(),
        record.name,
        backend.as_str()
    ));
    let ready = ready_target(&record);
    let provision_log = std::sync::Mutex::new(String::new());
    let provision = |s: &dyn Sandbox| -> Result<(), EngineError> {
        say(format!("  [{:>6.1} s] base: agent up; provisioning", t0.elapsed().as_secs_f64()));
        if record.provision {
            let out = s
                .agent()
                .run(ExecSpec { argv: vec!["/bin/sh".into(), "/etc/clade/provision.sh".into()], ..Default::default() })
                .map_err(|e| EngineError::Invalid(format!("provision: {e}")))?;
            let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            *provision_log.lock().unwrap_or_else(|p| p.into_inner()) = log.clone();
            if out.status.code != Some(0) {
                return Err(EngineError::Invalid(format!(
                    "provision script of {} exited with {:?}; its output:\n{}",
                    record.name,
                    out.status.code,
                    log.trim_end()
                )));
            }
        }
        if let Some(t) = &ready {
            say(format!("  [{:>6.1} s] base: waiting for ready ({t:?})", t0.elapsed().as_secs_f64()));
            s.agent()
                .wait_ready(t.clone(), Duration::from_secs(600))
                .map_err(|e| EngineError::Invalid(format!("ready: {e}")))?;
        }
        say(format!("  [{:>6.1} s] base: marking", t0.elapsed().as_secs_f64()));
        Ok(())
    };
    let (mark, boot) = engine.build_base(be.as_ref(), &tid, &image, &provision).context("base build")?;
    say(format!(
        "  [{:>6.1} s] base: {} marked (cold boot {:.1} s, pause {} ms)",
        t0.elapsed().as_secs_f64(),
        mark.id,
        boot.as_secs_f64(),
        mark.pause_ms.unwrap_or(0)
    ));
    Ok(serde_json::json!({
        "template": record.name, "hash": record.hash, "backend": backend, "mark": mark.id, "cached": false,
        "cold_boot_ms": boot.as_secs_f64() * 1e3, "elapsed_ms": t0.elapsed().as_secs_f64() * 1e3,
        "provision_log": provision_log.into_inner().unwrap_or_default(),
    }))
}
