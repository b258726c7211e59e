//! `clade audit SBX_A SBX_B`: the sibling audit of two running `ct` sandboxes (docs/ct.md, "Audit").
//!
//! The checks themselves are `clade_ct::audit` (distinct namespaces, disjoint PIDs, no shared pipe, socket,
//! eventfd, writable regular file or lock); this module finds the sandboxes' processes through their
//! supervisors and provides the control: every sandbox opens the host's `/dev/null` and
//! friends, so shared character devices are judged against a pair of *cold* sandboxes of the same template,
//! started here for the purpose and ended before the answer (or a pair the caller names with `--control`).
//!
//! `vm` sandboxes are refused: their processes are QEMUs in the host's namespaces by design, and what a guest
//! holds is inside its own kernel, out of reach of a host-side audit.

use std::collections::BTreeMap;
use std::time::Duration;

use clade_core::backend::{BackendKind, Sandbox};
use clade_ledger::SandboxId;
use serde::{Deserialize, Serialize};

use clade_core::engine::Engine;
use clade_ledger::{Backend as LBackend, SandboxState};

use crate::error::{check_id, conflict, invalid, not_found};
use crate::supervisor::{client, client::supervisor_alive, protocol::Request};

/// The sibling audit's verdict on two running ct sandboxes (`clade audit A B`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SiblingAudit {
    /// The checks themselves (namespaces, pids, shared objects), as `clade_ct::audit` reports them.
    #[serde(flatten)]
    pub report: BTreeMap<String, serde_json::Value>,
}

/// What the shared character devices are judged against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Two cold sandboxes of the siblings' template, started and ended by the audit.
    Cold,
    /// Two running ct sandboxes the caller names.
    Given(String, String),
    /// None: only the strict rule (nothing shared at all, character devices included) is judged.
    Skip,
}

impl Control {
    /// From the request's words: a control pair, or `no_control`, or neither (a cold pair).
    pub fn parse(control: Option<Vec<String>>, no_control: bool) -> anyhow::Result<Control> {
        match (control, no_control) {
            (Some(_), true) => Err(invalid("give a control pair or no control, not both")),
            (Some(v), false) => match <[String; 2]>::try_from(v) {
                Ok([c, d]) => Ok(Control::Given(c, d)),
                Err(_) => Err(invalid("control: name exactly two sandboxes")),
            },
            (None, true) => Ok(Control::Skip),
            (None, false) => Ok(Control::Cold),
        }
    }
}

#[derive(Debug, Serialize)]
struct ControlInfo {
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    template: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    sandboxes: Vec<String>,
}

/// How long a cold control sandbox may take to reach its template's readiness.
const CONTROL_READY: Duration = Duration::from_secs(120);

/// The host pids of a running ct sandbox, from its supervisor; refused for a vm sandbox or one that does not run.
fn pids_of(engine: &Engine, id: &str) -> anyhow::Result<Vec<u32>> {
    check_id(id)?;
    let rec = engine.ledger().sandbox(&SandboxId::new(id)).map_err(|_| not_found(format!("no sandbox {id}")))?;
    if rec.backend != LBackend::Ct {
        return Err(invalid(format!(
            "{id} is a vm sandbox: the sibling audit reads a ct sandbox's processes; a vm sandbox's processes are a \
             QEMU in the host's namespaces by design, and what its guest holds is out of a host audit's reach"
        )));
    }
    let alive = rec.supervisor_pid.is_some_and(supervisor_alive);
    if rec.state != SandboxState::Running || !alive {
        let state = if alive { rec.state.as_str() } else { "lost" };
        return Err(conflict(format!("{id} is not running ({state}); audit two running sandboxes")));
    }
    let info = client::call(&engine.home, id, &Request::Info)?;
    let pids: Vec<u32> = info["pids"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| p.as_u64().map(|p| p as u32)).collect())
        .unwrap_or_default();
    if pids.is_empty() {
        return Err(conflict(format!("{id}: its supervisor reports no processes (is it ending?)")));
    }
    Ok(pids)
}

/// The template `sandbox` descends from: the base whose mark is on its origin mark's line of parents.
fn template_of(engine: &Engine, sandbox: &str) -> anyhow::Result<(String, String)> {
    let l = engine.ledger();
    let rec = l.sandbox(&SandboxId::new(sandbox))?;
    let bases = l.bases()?;
    let mut at = rec.origin_mark;
    while let Some(m) = at {
        if let Some(b) = bases.iter().find(|b| b.mark == m) {
            let name = l.template(&b.template).map(|t| t.name).unwrap_or_default();
            return Ok((b.template.to_string(), name));
        }
        // A parent is always an older mark, so the walk ends at a root.
        at = l.mark(&m).ok().and_then(|m| m.parent);
    }
    Err(not_found(format!(
        "{sandbox} descends from no template's base, so there is no cold pair to compare with: name two running ct \
         sandboxes with `--control A B`, or `--no-control` for the literal check only"
    )))
}

/// Ends the control sandboxes however the audit leaves.
struct ColdPair(Vec<Box<dyn Sandbox>>);

impl Drop for ColdPair {
    fn drop(&mut self) {
        for s in self.0.drain(..) {
            if let Err(e) = s.kill() {
                eprintln!("clade: ending a control sandbox of the audit: {e}");
            }
        }
    }
}

/// Starts two cold sandboxes of the template `sandbox` descends from and waits for its readiness, so their
/// services hold what they hold at rest (a control counted while a service starts would share less).
fn cold_pair(engine: &Engine, sandbox: &str) -> anyhow::Result<(ColdPair, String)> {
    let (hash, name) = template_of(engine, sandbox)?;
    let home = &engine.home;
    let record = crate::base::template_record(home, &hash, BackendKind::Ct)
        .or_else(|_| crate::base::template_record(home, &name, BackendKind::Ct))
        .map_err(|e| {
            not_found(format!(
                "template {name} ({hash}) of {sandbox} is not built on this host ({e:#}); name a control pair with \
                 `--control A B`, or `--no-control`"
            ))
        })?;
    let image = crate::base::image_of(&record);
    let be = crate::backends::open(engine, BackendKind::Ct)?;
    let stop = crate::supervisor::server::stop_flag()?;
    let mut pair = ColdPair(Vec::new());
    for i in 0..2 {
        // A name of its own (`sb-control0-<hex>`): its hostname is the hex, its run dir says what it is.
        let fresh = SandboxId::generate();
        let id = clade_core::hygiene::new_identity(&format!("sb-control{i}-{}", &fresh.as_str()[3..15]), 0);
        let s = be.cold_start(&image, &id).map_err(|e| anyhow::anyhow!("cold start of a control sandbox: {e}"))?;
        pair.0.push(s);
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(anyhow::anyhow!("interrupted; the control sandboxes were ended"));
        }
    }
    if let Some(target) = crate::base::ready_target(&record) {
        for s in &pair.0 {
            s.agent()
                .wait_ready(target.clone(), CONTROL_READY)
                .map_err(|e| anyhow::anyhow!("a control sandbox of {name} never became ready: {e}"))?;
        }
    }
    Ok((pair, record.name))
}

/// The audit of running ct sandboxes `a` and `b`, judged against `control`. `pass` is the control rule with a
/// control (shared character devices pass only if the control pair shares them too), the strict rule (nothing
/// shared at all) without one.
pub fn audit_siblings(engine: &Engine, a: &str, b: &str, control: Control) -> anyhow::Result<SiblingAudit> {
    if a == b {
        return Err(invalid(format!("audit two different sandboxes (both are {a})")));
    }
    let (pa, pb) = (pids_of(engine, a)?, pids_of(engine, b)?);
    let (report, info) = match control {
        Control::Skip => (clade_ct::audit(&pa, &pb), ControlInfo { kind: "none", template: None, sandboxes: vec![] }),
        Control::Given(c, d) => {
            if [a, b].contains(&c.as_str()) || [a, b].contains(&d.as_str()) || c == d {
                return Err(invalid("the control pair must be two other sandboxes than the audited ones"));
            }
            let (pc, pd) = (pids_of(engine, &c)?, pids_of(engine, &d)?);
            let r = clade_ct::audit_with_control(&pa, &pb, &pc, &pd);
            (r, ControlInfo { kind: "given", template: None, sandboxes: vec![c, d] })
        }
        Control::Cold => {
            let (pair, template) = cold_pair(engine, a)?;
            let (pc, pd) = (pair.0[0].pids(), pair.0[1].pids());
            // The siblings are read again after the control is up: a sibling that ended meanwhile is an error,
            // not an empty side that shares nothing.
            let (pa, pb) = (pids_of(engine, a)?, pids_of(engine, b)?);
            let r = clade_ct::audit_with_control(&pa, &pb, &pc, &pd);
            drop(pair);
            (r, ControlInfo { kind: "cold pair", template: Some(template), sandboxes: vec![] })
        }
    };
    let pass = report.pass_control_rule.unwrap_or(report.pass_literal);
    let mut out = serde_json::to_value(&report)?;
    out["sandboxes"] = serde_json::json!([a, b]);
    out["control"] = serde_json::to_value(&info)?;
    out["shared_besides_char_devices"] = serde_json::json!(report.shared_writable());
    out["pass"] = serde_json::json!(pass);
    out["rule"] = serde_json::json!(if report.pass_control_rule.is_some() {
        "with control: nothing shared but character devices, and only those the control pair shares too"
    } else {
        "literal: nothing shared at all"
    });
    Ok(serde_json::from_value(out)?)
}
