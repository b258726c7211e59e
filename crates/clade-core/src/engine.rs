//! The operations both backends share, over the store and the ledger: resolving what a user names (a mark id, or
//! a template's base on a backend), recording sandboxes, branches and marks, restoring with hygiene, building
//! bases, and timing every operation into the ledger. A supervisor process or `clade demo` holds the running
//! sandboxes; the engine holds no sandbox itself.

use std::time::{Duration, Instant};

use clade_ledger::{Backend as LBackend, BranchId, Ledger, Mark, MarkId, NewBranch, NewMark, NewOp, NewSandbox};
use clade_ledger::{RetentionPolicy, SandboxId, SandboxState, TemplateId};
use clade_store::{Store, StoreConfig};
use parking_lot::{ReentrantMutex, ReentrantMutexGuard};

use crate::backend::{Backend, BackendError, BackendKind, MarkOptions, MarkState, Sandbox, Shape, TemplateImage};
use crate::hygiene::{self, HygieneReport};
use crate::CladeHome;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("store: {0}")]
    Store(#[from] clade_store::StoreError),
    #[error("ledger: {0}")]
    Ledger(#[from] clade_ledger::LedgerError),
    #[error(transparent)]
    Private(#[from] crate::home::PrivateDirError),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

pub fn to_ledger(kind: BackendKind) -> LBackend {
    match kind {
        BackendKind::Vm => LBackend::Vm,
        BackendKind::Ct => LBackend::Ct,
    }
}

pub fn from_ledger(b: LBackend) -> BackendKind {
    match b {
        LBackend::Vm => BackendKind::Vm,
        LBackend::Ct => BackendKind::Ct,
    }
}

/// The store and the ledger of one `$CLADE_HOME`.
pub struct Engine {
    pub home: CladeHome,
    pub store: Store,
    /// Reentrant: a guard held through a `match` on a ledger call while an arm calls `ledger()` again is
    /// natural in this code and must not deadlock (every `Ledger` method takes `&self` and is its own
    /// transaction, so re-entering on one thread is safe).
    ledger: ReentrantMutex<Ledger>,
}

/// A restore prepared up to running (a warm-pool member), with the identity it will get.
pub struct PreparedRestore {
    pub prepared: Box<dyn crate::backend::Prepared>,
    pub identity: crate::backend::Identity,
    pub clean: bool,
}

/// A warm-pool member: restored, hygiene done, paused, waiting for a claim.
pub struct Warm {
    pub sandbox: Box<dyn Sandbox>,
    pub hygiene: HygieneReport,
    pub restore: Duration,
    pub warmed: Duration,
    /// When it was paused: its clock stood still since, by exactly this long (what hygiene's clock shift adds).
    pub paused_at: Instant,
}

/// A sandbox restored by [`Engine::restore_into`], with what it cost.
pub struct Restored {
    pub sandbox: Box<dyn Sandbox>,
    pub hygiene: HygieneReport,
    /// Backend restore to agent hello.
    pub restore: Duration,
    /// Restore plus hygiene: ready for the user.
    pub total: Duration,
}

impl Engine {
    /// Open (creating when missing) the store and ledger under `home`.
    pub fn open(home: &CladeHome) -> Result<Engine> {
        // Before anything is written: the home's directories are 0700 (guest RAM, packs, the ledger, tokens).
        home.ensure_private()?;
        // The blob tier other hosts share, when this home names one (`CLADE_BLOB`, docs/roam.md).
        let blob = home.blob_config().map_err(EngineError::Invalid)?;
        let store = Store::open(&home.store_dir(), StoreConfig { blob, ..StoreConfig::default() })?;
        let ledger = Ledger::open(home.ledger_path())?;
        Ok(Engine { home: home.clone(), store, ledger: ReentrantMutex::new(ledger) })
    }

    pub fn ledger(&self) -> ReentrantMutexGuard<'_, Ledger> {
        self.ledger.lock()
    }

    /// What a user names where a mark is expected: a mark id, a mark label, or a template name whose base on
    /// `backend` is meant.
    pub fn resolve_mark(&self, spec: &str, backend: Option<BackendKind>) -> Result<Mark> {
        let l = self.ledger();
        if let Ok(m) = l.mark(&MarkId::new(spec)) {
            return Ok(m);
        }
        if let Some(t) = l.template_by_name(spec)? {
            let kind = backend.ok_or_else(|| {
                EngineError::Invalid(format!("'{spec}' is a template: say which base with --backend vm|ct"))
            })?;
            return match l.base_for(&t.id, to_ledger(kind))? {
                Some(b) => Ok(l.mark(&b.mark)?),
                None => Err(EngineError::NotFound(format!(
                    "template '{spec}' has no {} base yet: run `clade base build {spec} --backend {}`",
                    kind.as_str(),
                    kind.as_str()
                ))),
            };
        }
        for b in l.branches()? {
            if let Some(m) = l.mark_by_label(&b.id, spec)? {
                return Ok(m);
            }
        }
        if l.collecting(spec)?.is_some() {
            return Err(EngineError::Conflict(format!(
                "mark '{spec}' is being collected (`clade gc` let it go and is sweeping its objects); \
                 fork another mark"
            )));
        }
        Err(EngineError::NotFound(format!(
            "no mark, label or template named '{spec}' (see `clade marks`, `clade template ls`)"
        )))
    }

    /// The backend-facing state of a recorded mark.
    pub fn mark_state(&self, m: &Mark) -> Result<MarkState> {
        let t = &m.timings;
        let compat = serde_json::from_value(t["compat"].clone())
            .map_err(|e| EngineError::Invalid(format!("mark {} has no compat record: {e}", m.id)))?;
        let shape: Shape = serde_json::from_value(t["shape"].clone())
            .map_err(|e| EngineError::Invalid(format!("mark {} has no shape record: {e}", m.id)))?;
        Ok(MarkState {
            backend: from_ledger(m.backend),
            manifests: m.manifests.iter().map(|(k, v)| (k.clone(), v.as_str().to_string())).collect(),
            compat,
            shape,
            logical_bytes: m.logical_bytes,
            stored_bytes: m.stored_bytes,
            pause: Duration::from_micros(t["pause_us"].as_u64().unwrap_or(0)),
            clean: m.clean,
        })
    }

    /// Record a mark a backend took, as the new head of `branch`.
    pub fn record_mark(&self, branch: &BranchId, state: &MarkState, opts: &MarkOptions, keep: bool) -> Result<Mark> {
        let mut n = NewMark::on(branch.clone(), to_ledger(state.backend));
        n.label = opts.label.clone();
        n.manifests =
            state.manifests.iter().map(|(k, v)| (k.clone(), clade_ledger::ManifestId::new(v.clone()))).collect();
        n.logical_bytes = state.logical_bytes;
        n.stored_bytes = state.stored_bytes;
        n.pause_ms = Some(state.pause.as_millis() as u64);
        n.timings = serde_json::json!({
            "compat": state.compat,
            "shape": state.shape,
            "pause_us": state.pause.as_micros() as u64,
        });
        n.pinned = keep;
        n.clean = state.clean;
        Ok(self.ledger().add_mark(&n)?)
    }

    /// A new sandbox record on a new branch forked at `origin` (every sandbox owns its branch).
    pub fn new_sandbox(&self, kind: BackendKind, origin: Option<&Mark>) -> Result<clade_ledger::SandboxRecord> {
        self.new_sandbox_with_id(kind, origin, None)
    }

    /// As [`Engine::new_sandbox`], with an id chosen by the caller (a warm-pool member names itself).
    /// Record `ids.len()` sandboxes of `origin` (each on a branch of its own) in one transaction: all or none.
    pub fn new_sandboxes(
        &self,
        kind: BackendKind,
        origin: Option<&Mark>,
        ids: &[Option<SandboxId>],
    ) -> Result<Vec<clade_ledger::SandboxRecord>> {
        let l = self.ledger();
        Ok(l.batch(|l| ids.iter().map(|id| record_sandbox(l, kind, origin, id.clone())).collect())?)
    }

    pub fn new_sandbox_with_id(
        &self,
        kind: BackendKind,
        origin: Option<&Mark>,
        id: Option<SandboxId>,
    ) -> Result<clade_ledger::SandboxRecord> {
        let l = self.ledger();
        Ok(l.batch(|l| record_sandbox(l, kind, origin, id))?)
    }

    /// Restore `mark` as sandbox `sbx` (generation `generation`), apply hygiene when the mark is clean, and
    /// record the operation.
    pub fn restore_into(
        &self,
        backend: &dyn Backend,
        sbx: &SandboxId,
        mark: &Mark,
        generation: u64,
    ) -> Result<Restored> {
        let state = self.mark_state(mark)?;
        let mut id = hygiene::new_identity(sbx.as_str(), generation);
        // A mark of the sandbox's own branch (resume, retake): the same machine going on, not a sibling.
        id.continues = self.ledger().sandbox(sbx).is_ok_and(|r| r.branch == mark.branch);
        let start = Instant::now();
        let result = backend.restore(&state, &id);
        self.finish_restore(result, start, &id, state.clean, sbx, mark)
    }

    /// A warm-pool member: everything of a restore of `mark` as `sbx` except running it. `None` when the
    /// backend cannot split a restore.
    pub fn prepare(
        &self,
        backend: &dyn Backend,
        sbx: &SandboxId,
        mark: &Mark,
        generation: u64,
    ) -> Result<Option<PreparedRestore>> {
        let state = self.mark_state(mark)?;
        let id = hygiene::new_identity(sbx.as_str(), generation);
        Ok(backend.prepare(&state, &id)?.map(|p| PreparedRestore { prepared: p, identity: id, clean: state.clean }))
    }

    /// Run a prepared restore (claimed from the pool) as sandbox `sbx`, with hygiene, recorded like a restore.
    pub fn start_prepared(&self, p: PreparedRestore, sbx: &SandboxId, mark: &Mark) -> Result<Restored> {
        let start = Instant::now();
        let result = p.prepared.start();
        self.finish_restore(result, start, &p.identity, p.clean, sbx, mark)
    }

    /// A warm-pool member made ready to be claimed: restored, hygiene applied (its identity is its own, named
    /// when it was prepared), its template's readiness waited for when `ready` names one (so a claimed browser
    /// has its new, clean context loaded, not pending), then paused. Nothing is recorded yet: the sandbox
    /// exists in the ledger only once claimed.
    pub fn warm(&self, p: PreparedRestore, ready: Option<(clade_agent::ReadyTarget, Duration)>) -> Result<Warm> {
        let start = Instant::now();
        let mut sandbox = p.prepared.start()?;
        let restore = start.elapsed();
        let hygiene = hygiene::apply(sandbox.agent(), &p.identity, p.clean)?;
        if let Some((target, timeout)) = ready {
            sandbox
                .agent()
                .wait_ready(target, timeout)
                .map_err(|e| BackendError::Failed(format!("pool member: the template's readiness: {e}")))?;
        }
        sandbox.pause()?;
        Ok(Warm { sandbox, hygiene, restore, warmed: start.elapsed(), paused_at: Instant::now() })
    }

    /// Claim a warm member as sandbox `sbx` (its record already created): continue it, step its clock (it
    /// stopped while paused), record the restore.
    pub fn claim_warm(&self, w: Warm, sbx: &SandboxId, mark: &Mark) -> Result<Restored> {
        let start = Instant::now();
        let mut sandbox = w.sandbox;
        sandbox.resume()?;
        let clock =
            sandbox.agent().sync_clock(0).map_err(|e| BackendError::Failed(format!("clock step after claim: {e}")))?;
        let mut hygiene = w.hygiene;
        hygiene.clock_error_ns = clock.error_ns;
        hygiene.clock_steps += clock.steps;
        let total = start.elapsed();
        // One commit for the three (a fork claims many members at once, each writing to the one ledger).
        let l = self.ledger();
        l.batch(|l| {
            self.op(
                "restore",
                Some(sbx),
                Some(&mark.id),
                total,
                None,
                serde_json::json!({"pool": true, "claim_ms": total.as_secs_f64() * 1e3, "warm_ms": w.warmed.as_secs_f64() * 1e3, "hygiene": hygiene}),
            );
            l.set_sandbox_origin(sbx, Some(&mark.id))?;
            l.set_sandbox_state(sbx, SandboxState::Running, None)?;
            Ok(())
        })?;
        drop(l);
        Ok(Restored { sandbox, hygiene, restore: w.restore, total })
    }

    fn finish_restore(
        &self,
        result: Result<Box<dyn Sandbox>, BackendError>,
        start: Instant,
        id: &crate::backend::Identity,
        clean: bool,
        sbx: &SandboxId,
        mark: &Mark,
    ) -> Result<Restored> {
        let restore = start.elapsed();
        let sandbox = match result {
            Ok(s) => s,
            Err(e) => {
                self.op("restore", Some(sbx), Some(&mark.id), restore, Some(&e.to_string()), serde_json::json!({}));
                return Err(e.into());
            }
        };
        let hygiene = hygiene::apply(sandbox.agent(), id, clean)?;
        let total = start.elapsed();
        self.op(
            "restore",
            Some(sbx),
            Some(&mark.id),
            total,
            None,
            serde_json::json!({"restore_ms": restore.as_secs_f64() * 1e3, "hygiene": hygiene}),
        );
        {
            let l = self.ledger();
            l.set_sandbox_origin(sbx, Some(&mark.id))?;
            l.set_sandbox_state(sbx, SandboxState::Running, None)?;
        }
        Ok(Restored { sandbox, hygiene, restore, total })
    }

    /// Mark a running sandbox onto its branch.
    pub fn mark_sandbox(
        &self,
        sandbox: &mut dyn Sandbox,
        sbx: &SandboxId,
        opts: &MarkOptions,
        keep: bool,
    ) -> Result<Mark> {
        let start = Instant::now();
        let branch = self.ledger().sandbox(sbx)?.branch;
        let state = sandbox.mark(opts)?;
        let m = self.record_mark(&branch, &state, opts, keep)?;
        self.op(
            "mark",
            Some(sbx),
            Some(&m.id),
            start.elapsed(),
            None,
            serde_json::json!({"pause_ms": state.pause.as_secs_f64() * 1e3, "stored_bytes": state.stored_bytes}),
        );
        Ok(m)
    }

    /// Boot `image` cold once, mark it, end it, and record the mark as the template's base on `backend`.
    /// `provision` runs inside the booted sandbox before the mark (the template's provision step).
    pub fn build_base(
        &self,
        backend: &dyn Backend,
        template: &TemplateId,
        image: &TemplateImage,
        provision: &dyn Fn(&dyn Sandbox) -> Result<()>,
    ) -> Result<(Mark, Duration)> {
        let start = Instant::now();
        let rec = self.new_sandbox(backend.kind(), None)?;
        let id = hygiene::new_identity(rec.id.as_str(), 0);
        let mut sandbox = match backend.cold_start(image, &id) {
            Ok(s) => s,
            Err(e) => {
                self.ledger().set_sandbox_state(&rec.id, SandboxState::Failed, Some(&e.to_string()))?;
                return Err(e.into());
            }
        };
        let boot = start.elapsed();
        let marked = provision(sandbox.as_ref()).and_then(|()| {
            let state = sandbox.mark(&MarkOptions {
                label: Some(format!("base:{}", image.name)),
                not_clean: false,
                disk_only: false,
            })?;
            self.record_mark(
                &rec.branch,
                &state,
                &MarkOptions { label: None, not_clean: false, disk_only: false },
                true,
            )
        });
        let mark = match marked {
            Ok(m) => m,
            Err(e) => {
                // The sandbox ends with the error (dropped); its record says why instead of `starting` forever.
                let _ = sandbox.kill();
                self.ledger().set_sandbox_state(&rec.id, SandboxState::Failed, Some(&e.to_string()))?;
                return Err(e);
            }
        };
        sandbox.kill()?;
        {
            let l = self.ledger();
            l.put_base(template, to_ledger(backend.kind()), &mark.id)?;
            l.set_sandbox_state(&rec.id, SandboxState::Dead, None)?;
        }
        self.op(
            "base_build",
            Some(&rec.id),
            Some(&mark.id),
            start.elapsed(),
            None,
            serde_json::json!({"boot_ms": boot.as_secs_f64() * 1e3}),
        );
        Ok((mark, boot))
    }

    /// Record one operation's timing (failures to record are not the operation's failure).
    pub fn op(
        &self,
        op: &str,
        sbx: Option<&SandboxId>,
        mark: Option<&MarkId>,
        took: Duration,
        error: Option<&str>,
        details: serde_json::Value,
    ) {
        let mut n = NewOp::ok(op, took.as_millis() as u64).details(details);
        n.sandbox = sbx.cloned();
        n.mark = mark.cloned();
        n.error = error.map(String::from);
        let _ = self.ledger().record_op(&n);
    }
}

/// A sandbox of `origin` on a branch of its own (in the caller's transaction when it runs inside a batch).
fn record_sandbox(
    l: &Ledger,
    kind: BackendKind,
    origin: Option<&Mark>,
    id: Option<SandboxId>,
) -> clade_ledger::Result<clade_ledger::SandboxRecord> {
    let branch = l.create_branch(&NewBranch {
        id: None,
        name: None,
        parent_mark: origin.map(|m| m.id.clone()),
        policy: RetentionPolicy::KEEP_ALL,
    })?;
    l.create_sandbox(&NewSandbox {
        id,
        backend: to_ledger(kind),
        branch: branch.id,
        origin_mark: origin.map(|m| m.id.clone()),
        supervisor_pid: None,
        host: None,
    })
}
