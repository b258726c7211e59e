//! Bases: a template booted cold once, provisioned (its `/etc/clade/provision.sh`, with the exit status and log
//! kept), waited for (`ready`), and marked. Cached by template hash and backend: a second build returns the
//! recorded base at once, so no sandbox ever cold-boots after its base exists. Also how a template name becomes
//! the image a backend starts.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_agent::proto::{ExecSpec, ReadyTarget};
use clade_core::backend::{BackendKind, Sandbox, Shape, TemplateImage};
use clade_core::engine::{to_ledger, Engine, EngineError};
use clade_core::CladeHome;
use clade_ledger::TemplateId;
use clade_template::TemplateRecord;
use serde::{Deserialize, Serialize};

use crate::error::{conflict, invalid, not_found};

/// The spec of a template shipped with clade (`templates/NAME/template.toml`): under `$CLADE_TEMPLATES_DIR`, else
/// `templates/` in the working directory or beside the running binary and up to four directories above it (a
/// cargo build's `target/*/deps`).
pub fn shipped_template(name: &str) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut roots: Vec<PathBuf> = std::env::var_os("CLADE_TEMPLATES_DIR").map(PathBuf::from).into_iter().collect();
    roots.push(PathBuf::from("templates"));
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).take(5).map(|a| a.join("templates")));
    }
    roots.into_iter().map(|r| r.join(name).join("template.toml")).find(|p| p.is_file())
}

/// Find or build the template `key` names (a name, a hash, or a spec path).
pub fn template_record(home: &CladeHome, key: &str, backend: BackendKind) -> anyhow::Result<TemplateRecord> {
    template_record_with(home, key, backend, &|_| {})
}

/// [`template_record`], a build's step lines going to `say`.
pub fn template_record_with(
    home: &CladeHome,
    key: &str,
    backend: BackendKind,
    say: &dyn Fn(String),
) -> anyhow::Result<TemplateRecord> {
    let path = std::path::Path::new(key);
    let spec_path = if path.is_dir() { path.join("template.toml") } else { path.to_path_buf() };
    if spec_path.is_file() {
        let spec = clade_template::TemplateSpec::load(&spec_path).map_err(|e| invalid(e.to_string()))?;
        let agent = clade_core::host::agent_binary();
        let backends = match backend {
            BackendKind::Vm => clade_template::Backends::VM,
            BackendKind::Ct => clade_template::Backends::CT,
        };
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let sink = move |p: &clade_template::Progress| {
            let _ = tx.send(format!("  [{:>6.1} s] template {}: {}", p.elapsed.as_secs_f64(), p.step, p.detail));
        };
        // The builder wants a `Send + 'static` sink: its lines come back here and go to `say` in order.
        let report = std::thread::scope(|s| {
            let build = s.spawn(|| {
                clade_template::Builder::new(home.clone()).agent(agent).on_progress(sink).build(&spec, backends)
            });
            for line in rx {
                say(line);
            }
            build.join()
        });
        let report = report.map_err(|_| anyhow!("the template build's thread panicked"))??;
        return Ok(report.record);
    }
    clade_template::find(home, key).map_err(|e| not_found(e.to_string()))
}

pub fn image_of(r: &TemplateRecord) -> TemplateImage {
    TemplateImage {
        name: r.name.clone(),
        hash: r.hash.clone(),
        rootfs: r.rootfs.clone(),
        disk_manifest: r.disk.as_ref().and_then(|d| d.manifest.clone()),
        shape: Shape { memory_mib: r.memory_mib, vcpus: r.vcpus, disk_gib: r.disk_gib },
        egress: r.egress,
        no_new_privs: r.no_new_privs,
    }
}

pub fn ready_target(r: &TemplateRecord) -> Option<ReadyTarget> {
    r.ready.as_ref().map(|r| r.to_agent())
}

/// A base: a template's cold boot, provisioned and marked, recorded in the ledger.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BaseOutcome {
    pub template: String,
    pub hash: String,
    pub backend: BackendKind,
    pub mark: String,
    /// Recorded before: nothing was booted.
    pub cached: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_boot_ms: Option<f64>,
    pub elapsed_ms: f64,
    /// The output of the template's provision script (a fresh build only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provision_log: Option<String>,
}

/// Build or return the cached base of the template `key` names; `say` gets progress lines (the template's own
/// build first, when `key` is a spec that is not built yet).
pub fn build(
    home: &CladeHome,
    key: &str,
    backend: BackendKind,
    rebuild: bool,
    say: &dyn Fn(String),
) -> anyhow::Result<BaseOutcome> {
    let t0 = Instant::now();
    let record = template_record_with(home, key, backend, say)?;
    let engine = Engine::open(home)?;
    let tid = TemplateId::new(record.hash.clone());
    if engine.ledger().template(&tid).is_err() {
        engine.ledger().put_template(&tid, &record.name, &record.identity.to_json())?;
    }
    if !rebuild {
        let base = engine.ledger().base_for(&tid, to_ledger(backend))?;
        if let Some(b) = base {
            let found = engine.ledger().mark(&b.mark);
            // A base marked with another network than its template's now (a template whose `egress` changed,
            // which does not change its rootfs or hash) is built again: its sandboxes would not have it.
            let egress_of = |m: &clade_ledger::Mark| m.manifests.get("network").map(|v| v.as_str()) == Some("egress");
            if let Some(m) = found.ok().filter(|m| egress_of(m) == record.egress) {
                return Ok(BaseOutcome {
                    template: record.name,
                    hash: record.hash,
                    backend,
                    mark: m.id.to_string(),
                    cached: true,
                    cold_boot_ms: None,
                    elapsed_ms: t0.elapsed().as_secs_f64() * 1e3,
                    provision_log: None,
                });
            }
        }
    }
    let image = image_of(&record);
    if backend == BackendKind::Vm && image.disk_manifest.is_none() {
        return Err(conflict(format!("template {} has no vm disk: build it with --backend vm", record.name)));
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
    Ok(BaseOutcome {
        template: record.name.clone(),
        hash: record.hash.clone(),
        backend,
        mark: mark.id.to_string(),
        cached: false,
        cold_boot_ms: Some(boot.as_secs_f64() * 1e3),
        elapsed_ms: t0.elapsed().as_secs_f64() * 1e3,
        provision_log: Some(provision_log.into_inner().unwrap_or_default()),
    })
}

/// When the mark is a template's base, that template's readiness check (a browser's page loaded after its
/// hygiene), waited for before a member pauses and before a restored sandbox is announced ready; other marks
/// have none recorded.
pub fn base_readiness(engine: &Engine, mark: &clade_ledger::Mark) -> Option<(clade_agent::ReadyTarget, Duration)> {
    let base = engine.ledger().bases().ok()?.into_iter().find(|b| b.mark == mark.id)?;
    let record = clade_template::find(&engine.home, base.template.as_str()).ok()?;
    ready_target(&record).map(|t| (t, Duration::from_secs(120)))
}
