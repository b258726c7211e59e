//! The sandbox operations as one library: what `clade run|fork|exec|mark|retake|suspend|resume|kill|ls|marks`
//! do, callable from the CLI (embedded), from `clade serve` (the HTTP API) and from the E2B surface, so the three
//! faces cannot drift apart. Each answer is a JSON value with one shape for all of them; errors carry an
//! [`ErrorKind`] (see `error`) that the CLI turns into exit codes and the API into HTTP statuses.
//!
//! Running sandboxes live in their supervisor processes (see `supervisor/`); this module starts them, finds them
//! through the ledger and talks to them over their control sockets. It holds no sandbox itself, so a daemon that
//! restarts loses nothing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use base64::Engine as _;
use clade_core::backend::BackendKind;
use clade_core::engine::{from_ledger, Engine};
use clade_core::{CladeHome, ErrorKind};
use clade_ledger::{Mark, SandboxId, SandboxState};
use serde::{Deserialize, Serialize};

pub use crate::error::check_id;
use crate::error::{conflict, invalid, kinded, not_found};
use crate::supervisor::client;
use crate::supervisor::protocol::Request;
use crate::supervisor::start::{fork_mark, spawn_supervisor, supervisor_alive, wait_ready, READY_TIMEOUT};

/// A command to run in a sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Bytes for stdin (closed after), as UTF-8 text.
    #[serde(default)]
    pub stdin: Option<String>,
    /// The HTTP API streams output as it comes (NDJSON lines) instead of answering once at the end.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// The HTTP API kills a non-streamed command past this many milliseconds (at most the daemon's
    /// `--exec-timeout`, which applies when this is absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl ExecRequest {
    /// What the agent could not start is refused here, naming the field: an empty command, NUL bytes (a C string
    /// cannot carry them), an environment name that is empty or holds `=`.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.argv.first().is_none_or(|a| a.is_empty()) {
            return Err(invalid("argv: exec needs a command (a non-empty argv[0])"));
        }
        if let Some(i) = self.argv.iter().position(|a| a.contains('\0')) {
            return Err(invalid(format!("argv[{i}]: contains a NUL byte")));
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(invalid(format!("env: the name {k:?} must be non-empty, without '=' or NUL")));
            }
            if v.contains('\0') {
                return Err(invalid(format!("env[{k:?}]: contains a NUL byte")));
            }
        }
        if self.cwd.as_deref().is_some_and(|c| c.contains('\0') || !c.starts_with('/')) {
            return Err(invalid("cwd: must be an absolute path without NUL bytes"));
        }
        Ok(())
    }
}

/// How a command ended, with all its output.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecOutput {
    /// The exit code, or 128 + the signal that ended it.
    pub code: i32,
    pub signal: Option<i32>,
    #[serde(with = "lossy")]
    pub stdout: Vec<u8>,
    #[serde(with = "lossy")]
    pub stderr: Vec<u8>,
}

/// One thing a streamed command produced.
#[derive(Debug, Clone)]
pub enum ExecEvent {
    Pid(u32),
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit { code: i32, signal: Option<i32> },
}

impl ExecEvent {
    /// One NDJSON line of the HTTP API's streamed exec.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            ExecEvent::Pid(p) => serde_json::json!({"pid": p}),
            ExecEvent::Stdout(d) => serde_json::json!({"stdout": String::from_utf8_lossy(d)}),
            ExecEvent::Stderr(d) => serde_json::json!({"stderr": String::from_utf8_lossy(d)}),
            ExecEvent::Exit { code, signal } => serde_json::json!({"exit": {"code": code, "signal": signal}}),
        }
    }
}

/// Output bytes shown as text (invalid UTF-8 replaced) in JSON; scripts wanting bytes use the files routes.
mod lossy {
    pub fn serialize<S: serde::Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&String::from_utf8_lossy(b))
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s: String = serde::Deserialize::deserialize(d)?;
        Ok(s.into_bytes())
    }
}

/// The sandbox operations over one `$CLADE_HOME`. Cheap to share between threads.
pub struct Ops {
    pub engine: Engine,
}

impl Ops {
    pub fn open(home: &CladeHome) -> anyhow::Result<Ops> {
        Ok(Ops { engine: Engine::open(home)? })
    }

    pub fn home(&self) -> &CladeHome {
        &self.engine.home
    }

    /// Start `count` siblings from a mark spec (a mark id or label, or a template name with `backend`).
    pub fn fork(&self, from: &str, backend: Option<BackendKind>, count: u32) -> anyhow::Result<serde_json::Value> {
        self.fork_with(from, backend, count, false)
    }

    /// [`Ops::fork`], admitted first ([`crate::admit`]): refused naming the resource when the host lacks it, or,
    /// with `make_room`, admitted after suspending the idlest sandboxes.
    pub fn fork_with(
        &self,
        from: &str,
        backend: Option<BackendKind>,
        count: u32,
        make_room: bool,
    ) -> anyhow::Result<serde_json::Value> {
        if count == 0 {
            return Err(invalid("count must be at least 1"));
        }
        if count > 256 {
            return Err(invalid(format!("count {count} is more than 256 sandboxes in one fork")));
        }
        let mark = self.engine.resolve_mark(from, backend)?;
        let suspended = self.admit(&mark, count, make_room)?;
        let (ready, took) = fork_mark(&self.engine, &mark, count)?;
        let mut out = serde_json::json!({
            "mark": mark.id, "backend": from_ledger(mark.backend), "total_ms": took.as_secs_f64() * 1e3,
            "sandboxes": ready,
        });
        if !suspended.is_empty() {
            out["suspended_to_make_room"] = serde_json::json!(suspended);
        }
        Ok(out)
    }

    /// The admission policy for `count` new sandboxes of `mark`; the sandboxes it suspended to make room.
    fn admit(&self, mark: &Mark, count: u32, make_room: bool) -> anyhow::Result<Vec<String>> {
        crate::admit::admit(&self.engine, mark, count, make_room, &|id| self.suspend(id).map(|_| ()))
    }

    /// A sandbox's record, with its live supervisor's facts (pids, memory, agent hello) when it runs.
    pub fn get(&self, sandbox: &str) -> anyhow::Result<serde_json::Value> {
        check_id(sandbox)?;
        let id = SandboxId::new(sandbox);
        let rec = self.engine.ledger().sandbox(&id).map_err(|_| not_found(format!("no sandbox {sandbox}")))?;
        let mut row = row_of(&rec);
        if rec.state == SandboxState::Running && rec.supervisor_pid.is_some_and(supervisor_alive) {
            if let Ok(info) = client::call(self.home(), sandbox, &Request::Info) {
                for k in ["pids", "pss", "rss", "hello", "generation", "last_activity_ms", "blob_fetched"] {
                    if let Some(v) = info.get(k) {
                        row[k] = v.clone();
                    }
                }
            }
        }
        Ok(row)
    }

    /// Every sandbox not dead (a running one whose supervisor died is reported as lost).
    pub fn list(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let all = self.engine.ledger().sandboxes(None)?;
        Ok(all.iter().filter(|s| s.state != SandboxState::Dead).map(row_of).collect())
    }

    pub fn exec(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecOutput> {
        check_id(sandbox)?;
        req.check()?;
        let b64 = base64::engine::general_purpose::STANDARD;
        let body = client::call(
            self.home(),
            sandbox,
            &Request::Exec {
                argv: req.argv,
                env: req.env,
                cwd: req.cwd,
                stdin_b64: req.stdin.map(|s| b64.encode(s.as_bytes())),
            },
        )
        .map_err(|e| self.explain(sandbox, e))?;
        let stdout = b64.decode(body["stdout_b64"].as_str().unwrap_or("")).unwrap_or_default();
        let stderr = b64.decode(body["stderr_b64"].as_str().unwrap_or("")).unwrap_or_default();
        let signal = body["signal"].as_i64().map(|s| s as i32);
        let code = body["code"].as_i64().map(|c| c as i32).unwrap_or_else(|| 128 + signal.unwrap_or(0));
        Ok(ExecOutput { code, signal, stdout, stderr })
    }

    /// Start a command and stream its events as they come: `Pid`, output chunks, then `Exit`. Dropping the
    /// iterator detaches; the process keeps running.
    pub fn exec_stream(
        &self,
        sandbox: &str,
        req: ExecRequest,
    ) -> anyhow::Result<impl Iterator<Item = anyhow::Result<ExecEvent>> + Send + 'static> {
        use crate::supervisor::protocol::{ProcSpec, StreamEvent};
        check_id(sandbox)?;
        req.check()?;
        let spec = ProcSpec {
            argv: req.argv,
            env: req.env,
            cwd: req.cwd,
            stdin: req.stdin.is_some(),
            stream: true,
            ..Default::default()
        };
        let (pid, events) = client::open_stream(self.home(), sandbox, &Request::ProcStart(spec))
            .map_err(|e| self.explain(sandbox, e))?;
        if let Some(data) = req.stdin {
            let b64 = base64::engine::general_purpose::STANDARD;
            client::call(self.home(), sandbox, &Request::ProcInput { pid, data_b64: b64.encode(data.as_bytes()) })?;
            client::call(self.home(), sandbox, &Request::ProcCloseStdin { pid })?;
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let rest = events.map(move |ev| {
            Ok(match ev? {
                StreamEvent::Start { pid } => ExecEvent::Pid(pid),
                StreamEvent::Stdout { data_b64 } => ExecEvent::Stdout(b64.decode(data_b64).unwrap_or_default()),
                StreamEvent::Stderr { data_b64 } => ExecEvent::Stderr(b64.decode(data_b64).unwrap_or_default()),
                StreamEvent::Exit { code, signal } => {
                    ExecEvent::Exit { code: code.unwrap_or_else(|| 128 + signal.unwrap_or(0)), signal }
                }
                StreamEvent::Error { kind, message } => return Err(kinded(kind, message)),
            })
        });
        Ok(std::iter::once(Ok(ExecEvent::Pid(pid))).chain(rest))
    }

    /// A file of the sandbox as a stream: its size, and a reader of its bytes.
    pub fn open_file(&self, sandbox: &str, path: &str) -> anyhow::Result<(u64, impl std::io::Read + Send + 'static)> {
        check_id(sandbox)?;
        client::read_stream(self.home(), sandbox, path).map_err(|e| self.explain(sandbox, e))
    }

    /// Write a file of the sandbox from a stream (created or replaced whole: a failed upload leaves the old
    /// file); the bytes written.
    pub fn write_file_from(
        &self,
        sandbox: &str,
        path: &str,
        mode: Option<u32>,
        src: &mut dyn std::io::Read,
    ) -> anyhow::Result<u64> {
        check_id(sandbox)?;
        client::write_stream(self.home(), sandbox, path, mode, src).map_err(|e| self.explain(sandbox, e))
    }

    pub fn mark(
        &self,
        sandbox: &str,
        label: Option<String>,
        keep: bool,
        not_clean: bool,
    ) -> anyhow::Result<serde_json::Value> {
        check_id(sandbox)?;
        self.ensure_room_for_mark(sandbox)?;
        client::call(self.home(), sandbox, &Request::Mark { label, keep, not_clean })
            .map_err(|e| self.explain(sandbox, e))
    }

    pub fn retake(&self, sandbox: &str, to: &str) -> anyhow::Result<serde_json::Value> {
        check_id(sandbox)?;
        client::call(self.home(), sandbox, &Request::Retake { mark: to.into() }).map_err(|e| self.explain(sandbox, e))
    }

    pub fn suspend(&self, sandbox: &str) -> anyhow::Result<serde_json::Value> {
        check_id(sandbox)?;
        self.ensure_room_for_mark(sandbox)?;
        client::call(self.home(), sandbox, &Request::Suspend).map_err(|e| self.explain(sandbox, e))
    }

    /// Bring a suspended sandbox back from its branch's head, under its own id.
    pub fn resume(&self, sandbox: &str) -> anyhow::Result<serde_json::Value> {
        check_id(sandbox)?;
        let engine = &self.engine;
        let id = SandboxId::new(sandbox);
        // Unknown here but pushed to the shared blob tier by another host: take it, then resume it here.
        let mut pulled = serde_json::Value::Null;
        if engine.ledger().sandbox(&id).is_err() && engine.store.blob_tier().is_some() {
            if let Some(p) = crate::roam::pull_if_pushed(engine, sandbox, &mut |l| eprintln!("clade: {l}"))? {
                pulled = p;
            }
        }
        let rec = engine.ledger().sandbox(&id).map_err(|_| not_found(format!("no sandbox {sandbox}")))?;
        if rec.state != SandboxState::Suspended {
            return Err(conflict(format!("sandbox {sandbox} is {}, not suspended", rec.state.as_str())));
        }
        let head = engine
            .ledger()
            .head(&rec.branch)?
            .ok_or_else(|| not_found(format!("sandbox {sandbox} has no mark to resume from")))?;
        self.admit(&head, 1, false)?;
        let start = Instant::now();
        let pid = spawn_supervisor(self.home(), &id, &head, 1)?;
        let r = wait_ready(&self.engine, &id, Some(pid), READY_TIMEOUT)?;
        let took = start.elapsed();
        engine.op("resume", Some(&id), Some(&head.id), took, r.error.as_deref(), serde_json::json!({}));
        Ok(serde_json::json!({
            "sandbox": sandbox, "mark": head.id, "ok": r.ok, "error": r.error,
            "resume_ms": took.as_secs_f64() * 1e3, "blob_bytes": r.blob_bytes, "pulled": pulled,
        }))
    }

    /// Send a suspended sandbox to the shared blob tier; this host forgets it (see [`crate::roam`]).
    pub fn push(&self, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<serde_json::Value> {
        crate::roam::push(&self.engine, sandbox, progress)
    }

    /// Take a pushed sandbox into this host's ledger, suspended (see [`crate::roam`]).
    pub fn pull(&self, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<serde_json::Value> {
        crate::roam::pull(&self.engine, sandbox, progress)
    }

    /// The sandboxes in the shared blob tier and who has them.
    pub fn roaming(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        crate::roam::list(&self.engine)
    }

    /// End a sandbox: through its supervisor, or (suspended, or lost) in the ledger, reaping what a dead
    /// supervisor left behind.
    pub fn kill(&self, sandbox: &str) -> anyhow::Result<serde_json::Value> {
        check_id(sandbox)?;
        let home = self.home();
        let sup = self.engine.ledger().sandbox(&SandboxId::new(sandbox)).ok().and_then(|r| r.supervisor_pid);
        match client::call(home, sandbox, &Request::Kill) {
            Ok(body) => {
                // The supervisor answers, then ends the sandbox: return once it has (so a `ls` right after
                // never shows it running), or after 15 s saying so.
                let start = Instant::now();
                while sup.is_some_and(supervisor_alive) {
                    if start.elapsed() > Duration::from_secs(15) {
                        return Err(anyhow!("sandbox {sandbox}'s supervisor did not end within 15 s of a kill"));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(body)
            }
            Err(e) => {
                let id = SandboxId::new(sandbox);
                let rec =
                    self.engine.ledger().sandbox(&id).map_err(|_| not_found(format!("no sandbox {sandbox}: {e}")))?;
                if rec.state == SandboxState::Dead {
                    return Err(not_found(format!("sandbox {sandbox} is already dead")));
                }
                self.engine.ledger().set_sandbox_state(&id, SandboxState::Dead, None)?;
                // What its dead supervisor left: processes naming its run dir (its QEMU, a restored tree's
                // helper) and those in its cgroup (a ct sandbox's), mounts, network, run dirs.
                let left = crate::audit::take_down(home, sandbox);
                let reaped = left.iter().filter(|f| f.kind == "orphan-process").count();
                let not_fixed: Vec<String> =
                    left.iter().filter(|f| !f.fixed).map(|f| format!("{} {}", f.kind, f.detail)).collect();
                if !not_fixed.is_empty() {
                    eprintln!("clade: {sandbox}: could not take down {} (see `clade audit`)", not_fixed.join("; "));
                }
                Ok(serde_json::json!({"killed": sandbox, "reaped": reaped, "taken_down": left.len()}))
            }
        }
    }

    /// A "not found" from a sandbox's supervisor, said in the ledger's words when the sandbox is not running: a
    /// suspended or failed one is a conflict (resume it first), a dead or unknown one is not found.
    fn explain(&self, sandbox: &str, e: anyhow::Error) -> anyhow::Error {
        if crate::error::kind(&e) != ErrorKind::NotFound {
            return e;
        }
        match self.engine.ledger().sandbox(&SandboxId::new(sandbox)) {
            Err(_) => not_found(format!("no sandbox {sandbox}")),
            Ok(r) => match r.state {
                SandboxState::Suspended => {
                    conflict(format!("sandbox {sandbox} is suspended: resume it first (`clade resume {sandbox}`)"))
                }
                SandboxState::Dead => not_found(format!("sandbox {sandbox} is dead (killed)")),
                SandboxState::Failed => conflict(format!(
                    "sandbox {sandbox} failed: {}",
                    r.error.as_deref().unwrap_or("see its supervisor log")
                )),
                _ => e,
            },
        }
    }

    /// Marks of one sandbox's branch, or of every branch.
    pub fn marks(&self, sandbox: Option<&str>) -> anyhow::Result<Vec<serde_json::Value>> {
        let l = self.engine.ledger();
        let branches = match sandbox {
            Some(s) => vec![
                l.sandbox(&SandboxId::new(check_id(s).map(|_| s)?))
                    .map_err(|_| not_found(format!("no sandbox {s}")))?
                    .branch,
            ],
            None => l.branches()?.into_iter().map(|b| b.id).collect(),
        };
        let mut rows = Vec::new();
        for b in branches {
            for m in l.marks(&b)? {
                rows.push(mark_row(&m));
            }
        }
        Ok(rows)
    }

    pub fn mark_info(&self, spec: &str, backend: Option<BackendKind>) -> anyhow::Result<serde_json::Value> {
        Ok(mark_row(&self.engine.resolve_mark(spec, backend)?))
    }

    /// Branches with their heads and mark counts.
    pub fn branches(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let l = self.engine.ledger();
        let mut rows = Vec::new();
        for b in l.branches()? {
            let n = l.marks(&b.id)?.len();
            rows.push(serde_json::json!({
                "id": b.id, "name": b.name, "parent_mark": b.parent_mark, "head_mark": b.head_mark,
                "marks": n, "created_ms": b.created_ms,
            }));
        }
        Ok(rows)
    }

    /// Delete a branch (refused while a sandbox lives on it): its marks go at the next `gc`, except those
    /// needed elsewhere (a fork point, a base, a live sandbox's origin).
    pub fn delete_branch(&self, branch: &str) -> anyhow::Result<serde_json::Value> {
        let l = self.engine.ledger();
        let id = clade_ledger::BranchId::new(branch);
        l.branch(&id).map_err(|_| not_found(format!("no branch {branch} (see `clade branches`)")))?;
        l.delete_branch(&id).map_err(|e| match e {
            clade_ledger::LedgerError::Invalid(m) => conflict(m),
            other => other.into(),
        })?;
        Ok(serde_json::json!({"deleted": branch}))
    }

    /// Retention, then the store: see [`crate::gc`].
    pub fn gc(&self, dry_run: bool) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::to_value(crate::gc::gc(&self.engine, dry_run)?)?)
    }

    /// Ledger against host: see [`crate::audit`].
    pub fn audit(&self, fix: bool) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::to_value(crate::audit::audit(&self.engine, fix)?)?)
    }

    /// The sibling audit of two running ct sandboxes: see [`crate::siblings`].
    pub fn audit_siblings(
        &self,
        a: &str,
        b: &str,
        control: crate::siblings::Control,
    ) -> anyhow::Result<serde_json::Value> {
        crate::siblings::audit_siblings(&self.engine, a, b, control)
    }

    /// Refuse a mark (or suspend) that might not fit: the store's filesystem needs the sandbox's last mark's
    /// growth (at least 1 GiB) plus a reserve of 1 GiB, so nothing is half-written for want of space.
    fn ensure_room_for_mark(&self, sandbox: &str) -> anyhow::Result<()> {
        const GIB: u64 = 1 << 30;
        let last_growth = {
            let l = self.engine.ledger();
            l.sandbox(&SandboxId::new(sandbox))
                .ok()
                .and_then(|r| l.marks(&r.branch).ok())
                .and_then(|ms| ms.last().map(|m| m.stored_bytes))
                .unwrap_or(0)
        };
        let need = last_growth.max(GIB) + reserve_bytes();
        let free = clade_core::host::space(&self.home().store_dir()).map(|s| s.0).unwrap_or(u64::MAX);
        if free < need {
            return Err(kinded(
                ErrorKind::NoSpace,
                format!(
                    "not enough room for a mark of {sandbox}: {} MiB free in the store, {} MiB needed (last \
                     mark's growth or 1 GiB, plus the reserve); free space or set CLADE_RESERVE_MIB",
                    free >> 20,
                    need >> 20
                )
            ));
        }
        Ok(())
    }
}

/// The free space kept aside beyond a mark's expected growth: `CLADE_RESERVE_MIB`, default 1024.
fn reserve_bytes() -> u64 {
    std::env::var("CLADE_RESERVE_MIB").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(1024) << 20
}

pub fn mark_row(m: &Mark) -> serde_json::Value {
    serde_json::json!({
        "id": m.id, "branch": m.branch, "label": m.label, "parent": m.parent, "backend": from_ledger(m.backend),
        "pause_ms": m.pause_ms, "logical_bytes": m.logical_bytes, "stored_bytes": m.stored_bytes,
        "created_ms": m.created_ms, "pinned": m.pinned, "clean": m.clean,
    })
}

fn row_of(s: &clade_ledger::SandboxRecord) -> serde_json::Value {
    let lost = s.state == SandboxState::Running && !s.supervisor_pid.is_some_and(supervisor_alive);
    let state = if lost { "lost".to_string() } else { s.state.as_str().to_string() };
    serde_json::json!({
        "id": s.id, "backend": from_ledger(s.backend), "state": state, "origin": s.origin_mark, "branch": s.branch,
        "supervisor_pid": s.supervisor_pid, "error": s.error, "created_ms": s.created_ms,
        "last_active_ms": s.last_active_ms,
    })
}

