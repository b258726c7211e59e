//! The sandbox operations as one library: what `clade run|fork|exec|mark|retake|suspend|resume|kill|ls|marks`
//! do, callable from the CLI (embedded), from `clade serve` (the HTTP API) and from the E2B surface, so the three
//! faces cannot drift apart. Each answer is a JSON value with one shape for all of them; errors carry an
//! [`ErrorKind`] (see `error`) that the CLI turns into exit codes and the API into HTTP statuses.
//!
//! Running sandboxes live in their supervisor processes (see `supervisor/`); this module starts them, finds them
//! through the ledger and talks to them over their control sockets. It holds no sandbox itself, so a daemon that
//! restarts loses nothing.

use std::time::{Duration, Instant};

use anyhow::anyhow;
use base64::Engine as _;
use clade_core::backend::BackendKind;
use clade_core::engine::{from_ledger, Engine};
use clade_core::{CladeHome, ErrorKind};
use clade_ledger::{Branch, SandboxId, SandboxState};

pub use crate::api::*;
use crate::error::check_id;
use crate::error::{conflict, kinded, not_found};
use crate::supervisor::client;
use crate::supervisor::client::supervisor_alive;
use crate::supervisor::protocol::Request;
use crate::supervisor::start::{fork_mark, spawn_supervisor, wait_ready, READY_TIMEOUT};

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

    /// The admission policy for `count` new sandboxes of `mark`; the sandboxes it suspended to make room.
    fn admit(&self, mark: &Mark, count: u32, make_room: bool) -> anyhow::Result<Vec<String>> {
        crate::admit::admit(&self.engine, mark, count, make_room, &|id| self.suspend(id).map(|_| ()))
    }

    /// One request to a sandbox's supervisor, its errors said in the ledger's words ([`Ops::explain`]).
    fn sup_call(&self, sandbox: &str, req: &Request) -> anyhow::Result<serde_json::Value> {
        check_id(sandbox)?;
        client::call(self.home(), sandbox, req).map_err(|e| self.explain(sandbox, e))
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

    /// The mark a reboot resumes from: `head` itself when it is disk-only already, else a new mark on the branch
    /// naming `head`'s manifests and booting cold (a backend's cold boot reads only its disk's roles), so the
    /// sandbox's line shows that it rebooted there.
    fn reboot_mark(
        &self,
        branch: &clade_ledger::BranchId,
        head: &clade_ledger::Mark,
    ) -> anyhow::Result<clade_ledger::Mark> {
        let mut state = self.engine.mark_state(head)?;
        if state.boots_cold() {
            return Ok(head.clone());
        }
        state.manifests.insert(clade_core::backend::ROLE_BOOT.into(), clade_core::backend::BOOT_COLD.into());
        state.pause = Duration::ZERO;
        state.stored_bytes = 0;
        let opts =
            clade_core::backend::MarkOptions { label: Some("reboot".into()), not_clean: !state.clean, disk_only: true };
        Ok(self.engine.record_mark(branch, &state, &opts, false)?)
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
                ),
            ));
        }
        Ok(())
    }

    /// [`Self::resume_with`] once the sandbox is in this host's ledger.
    fn resume_local(
        &self,
        sandbox: &str,
        req: &ResumeRequest,
        pulled: Option<PullOutcome>,
    ) -> anyhow::Result<ResumeOutcome> {
        let engine = &self.engine;
        let id = SandboxId::new(sandbox);
        let rec = engine.ledger().sandbox(&id).map_err(|_| not_found(format!("no sandbox {sandbox}")))?;
        if rec.state != SandboxState::Suspended {
            return Err(conflict(format!("sandbox {sandbox} is {}, not suspended", rec.state.as_str())));
        }
        let head = engine
            .ledger()
            .head(&rec.branch)?
            .ok_or_else(|| not_found(format!("sandbox {sandbox} has no mark to resume from")))?;
        let head = if req.reboot { self.reboot_mark(&rec.branch, &head)? } else { head };
        self.admit(&head, 1, false)?;
        let start = Instant::now();
        let pid = spawn_supervisor(self.home(), &id, &head, 1)?;
        let r = wait_ready(&self.engine, &id, Some(pid), READY_TIMEOUT)?;
        let took = start.elapsed();
        engine.op("resume", Some(&id), Some(&head.id), took, r.error.as_deref(), serde_json::json!({}));
        Ok(ResumeOutcome {
            sandbox: sandbox.to_string(),
            mark: head.id,
            ok: r.ok,
            error: r.error,
            resume_ms: took.as_secs_f64() * 1e3,
            blob_bytes: r.blob_bytes,
            pulled,
        })
    }
}

impl SandboxApi for Ops {
    /// Start `req.count` siblings from a mark spec (a mark id or label, or a template name with `backend`),
    /// admitted first ([`crate::admit`]): refused naming the resource when the host lacks it, or, with
    /// `make_room`, admitted after suspending the idlest sandboxes.
    fn fork(&self, req: &ForkRequest) -> anyhow::Result<ForkOutcome> {
        req.check()?;
        let mark = self.engine.resolve_mark(&req.from, req.backend)?;
        // Waiting pool members already run (and hold their memory): only the siblings started cold are admitted.
        let pooled = crate::supervisor::pool::members(&self.engine.home, mark.id.as_str()).0.len() as u32;
        let suspended = self.admit(&mark, req.count.saturating_sub(pooled), req.make_room)?;
        let (ready, took) = fork_mark(&self.engine, &mark, req.count)?;
        Ok(ForkOutcome {
            backend: from_ledger(mark.backend),
            shape: serde_json::from_value(mark.timings["shape"].clone()).ok(),
            mark: mark.id,
            total_ms: took.as_secs_f64() * 1e3,
            sandboxes: ready,
            suspended_to_make_room: suspended,
        })
    }

    /// A sandbox's record, with its live supervisor's facts (pids, memory, agent hello) when it runs.
    fn get(&self, sandbox: &str) -> anyhow::Result<SandboxInfo> {
        check_id(sandbox)?;
        let id = SandboxId::new(sandbox);
        let rec = self.engine.ledger().sandbox(&id).map_err(|_| not_found(format!("no sandbox {sandbox}")))?;
        let live = if rec.state == SandboxState::Running && rec.supervisor_pid.is_some_and(supervisor_alive) {
            client::call(self.home(), sandbox, &Request::Info).ok().and_then(|info| serde_json::from_value(info).ok())
        } else {
            None
        };
        Ok(SandboxInfo { row: row_of(&rec), live })
    }

    /// Every sandbox not dead (a running one whose supervisor died is reported as lost).
    fn list(&self) -> anyhow::Result<Vec<SandboxRow>> {
        let all = self.engine.ledger().sandboxes(None)?;
        Ok(all.iter().filter(|s| s.state != SandboxState::Dead).map(row_of).collect())
    }

    fn exec(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecOutput> {
        check_id(sandbox)?;
        req.check()?;
        let b64 = base64::engine::general_purpose::STANDARD;
        let body = self.sup_call(
            sandbox,
            &Request::Exec {
                argv: req.argv,
                env: req.env,
                cwd: req.cwd,
                stdin_b64: req.stdin.map(|s| b64.encode(s.as_bytes())),
            },
        )?;
        let stdout = b64.decode(body["stdout_b64"].as_str().unwrap_or("")).unwrap_or_default();
        let stderr = b64.decode(body["stderr_b64"].as_str().unwrap_or("")).unwrap_or_default();
        let signal = body["signal"].as_i64().map(|s| s as i32);
        let code = body["code"].as_i64().map(|c| c as i32).unwrap_or_else(|| 128 + signal.unwrap_or(0));
        Ok(ExecOutput { code, signal, stdout, stderr })
    }

    fn mark(&self, sandbox: &str, req: &MarkRequest) -> anyhow::Result<Mark> {
        check_id(sandbox)?;
        self.ensure_room_for_mark(sandbox)?;
        let req = Request::Mark {
            label: req.label.clone(),
            keep: req.keep,
            not_clean: req.not_clean,
            disk_only: req.disk_only,
        };
        answer(self.sup_call(sandbox, &req)?, "mark")
    }

    fn retake(&self, sandbox: &str, to: &str) -> anyhow::Result<RetakeOutcome> {
        answer(self.sup_call(sandbox, &Request::Retake { mark: to.into() })?, "retake")
    }

    fn suspend_with(&self, sandbox: &str, req: &SuspendRequest) -> anyhow::Result<Mark> {
        check_id(sandbox)?;
        self.ensure_room_for_mark(sandbox)?;
        answer(self.sup_call(sandbox, &Request::Suspend { disk_only: req.disk_only })?, "suspend")
    }

    /// Bring a suspended sandbox back from its branch's head, under its own id.
    fn resume_with(&self, sandbox: &str, req: &ResumeRequest) -> anyhow::Result<ResumeOutcome> {
        check_id(sandbox)?;
        let engine = &self.engine;
        let id = SandboxId::new(sandbox);
        // Unknown here but pushed to the shared blob tier by another host: take it, then resume it here.
        let fetched_before = clade_store::Store::blob_fetched().0;
        // While the take runs, the backend fetches what the restore reads first (Backend::fetch_ahead); after a
        // pull, the heartbeat (which leases the mark's roots in the tier) is written while it restores.
        std::thread::scope(|s| {
            let mut ahead = |state: clade_core::backend::MarkState, packs: Vec<clade_store::PackId>| {
                s.spawn(move || {
                    // The indexes of the mark's packs, named by its record (no LIST of the tier), are loaded
                    // while the backend reads the mark's trees: its first frame lookup waits for them.
                    let r = std::thread::scope(|s| {
                        let loaded = s.spawn(|| engine.store.load_blob_packs(&packs));
                        let ahead = crate::backends::open(engine, state.backend)
                            .and_then(|b| b.fetch_ahead(&state).map_err(anyhow::Error::from));
                        let loaded = loaded.join().unwrap_or(Ok(0));
                        ahead.and(loaded.map(drop).map_err(anyhow::Error::from))
                    });
                    if let Err(e) = r {
                        eprintln!("clade: warning: fetching the mark ahead of its restore: {e:#} (the restore reads it itself)");
                    }
                });
            };
            let mut pulled = None;
            if engine.ledger().sandbox(&id).is_err() && engine.store.blob_tier().is_some() {
                pulled = crate::roam::pull_if_pushed(engine, sandbox, &mut |l| eprintln!("clade: {l}"), &mut ahead)?;
            }
            if pulled.is_some() {
                s.spawn(|| {
                    if let Err(e) = crate::roam::beat_here(engine) {
                        eprintln!("clade: warning: heartbeat after the pull: {e:#}");
                    }
                });
            }
            self.resume_local(sandbox, req, pulled)
        })
        .map(|mut out| {
            // What this process read from the tier for the resume: the pull, the fetch-ahead, the heartbeat.
            if let Some(p) = &mut out.pulled {
                p.blob_bytes = clade_store::Store::blob_fetched().0 - fetched_before;
            }
            out
        })
    }

    /// Send a suspended sandbox to the shared blob tier; this host forgets it (see [`crate::roam`]).
    fn push(&self, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<PushOutcome> {
        crate::roam::push(&self.engine, sandbox, progress)
    }

    /// Take a pushed sandbox into this host's ledger, suspended (see [`crate::roam`]).
    fn pull(&self, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<PullOutcome> {
        crate::roam::pull(&self.engine, sandbox, progress)
    }

    /// The sandboxes in the shared blob tier and who has them.
    fn roaming(&self) -> anyhow::Result<Vec<RoamRow>> {
        crate::roam::list(&self.engine)
    }

    /// The hosts sharing the blob tier (see [`crate::roam`]).
    fn hosts(&self) -> anyhow::Result<Vec<HostRow>> {
        crate::roam::hosts(&self.engine)
    }

    /// End a sandbox: through its supervisor, or (suspended, or lost) in the ledger, reaping what a dead
    /// supervisor left behind.
    fn kill(&self, sandbox: &str) -> anyhow::Result<KillOutcome> {
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
                answer(body, "kill")
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
                Ok(KillOutcome { killed: sandbox.to_string(), reaped: Some(reaped), taken_down: Some(left.len()) })
            }
        }
    }

    /// Marks of one sandbox's branch, or of every branch.
    fn marks(&self, sandbox: Option<&str>) -> anyhow::Result<Vec<MarkRow>> {
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
                rows.push(MarkRow::from(&m));
            }
        }
        Ok(rows)
    }

    /// Branches with their heads and mark counts.
    fn branches(&self) -> anyhow::Result<Vec<BranchRow>> {
        let l = self.engine.ledger();
        let mut rows = Vec::new();
        for b in l.branches()? {
            let marks = l.marks(&b.id)?.len();
            let Branch { id, name, parent_mark, head_mark, created_ms, .. } = b;
            rows.push(BranchRow { id, name, parent_mark, head_mark, marks, created_ms });
        }
        Ok(rows)
    }

    /// Delete a branch (refused while a sandbox lives on it): its marks go at the next `gc`, except those
    /// needed elsewhere (a fork point, a base, a live sandbox's origin).
    fn delete_branch(&self, branch: &str) -> anyhow::Result<Deleted> {
        let l = self.engine.ledger();
        let id = clade_ledger::BranchId::new(branch);
        l.branch(&id).map_err(|_| not_found(format!("no branch {branch} (see `clade branches`)")))?;
        l.delete_branch(&id).map_err(|e| match e {
            clade_ledger::LedgerError::Invalid(m) => conflict(m),
            other => other.into(),
        })?;
        Ok(Deleted { deleted: branch.to_string() })
    }

    /// Retention, then the store: see [`crate::gc`].
    fn gc(&self, dry_run: bool) -> anyhow::Result<GcOutcome> {
        crate::gc::gc(&self.engine, dry_run)
    }

    /// Ledger against host: see [`crate::audit`].
    fn audit(&self, fix: bool) -> anyhow::Result<AuditReport> {
        crate::audit::audit(&self.engine, fix)
    }

    /// The sibling audit of two running ct sandboxes: see [`crate::siblings`].
    fn audit_siblings(&self, a: &str, b: &str, control: crate::siblings::Control) -> anyhow::Result<SiblingAudit> {
        crate::siblings::audit_siblings(&self.engine, a, b, control)
    }

    fn exec_stream(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecEvents> {
        check_id(sandbox)?;
        req.check()?;
        let spec =
            ProcSpec { argv: req.argv, env: req.env, cwd: req.cwd, stdin: req.stdin.is_some(), ..Default::default() };
        let (pid, events) = self.proc_start(sandbox, spec)?;
        if let Some(data) = req.stdin {
            self.proc_input(sandbox, pid, data.as_bytes())?;
            self.proc_close_stdin(sandbox, pid)?;
        }
        Ok(Box::new(std::iter::once(Ok(ExecEvent::Pid(pid))).chain(events)))
    }

    fn open_file(&self, sandbox: &str, path: &str) -> anyhow::Result<(u64, Box<dyn std::io::Read + Send>)> {
        check_id(sandbox)?;
        let (size, r) = client::read_stream(self.home(), sandbox, path).map_err(|e| self.explain(sandbox, e))?;
        Ok((size, Box::new(r)))
    }

    fn write_file_from(
        &self,
        sandbox: &str,
        path: &str,
        opts: &WriteOptions,
        src: &mut dyn std::io::Read,
    ) -> anyhow::Result<u64> {
        check_id(sandbox)?;
        client::write_stream(self.home(), sandbox, path, opts, src).map_err(|e| self.explain(sandbox, e))
    }

    fn proc_start(&self, sandbox: &str, spec: ProcSpec) -> anyhow::Result<(u32, ExecEvents)> {
        check_id(sandbox)?;
        let spec = ProcSpec { stream: true, ..spec };
        let (pid, events) = client::open_stream(self.home(), sandbox, &Request::ProcStart(spec))
            .map_err(|e| self.explain(sandbox, e))?;
        Ok((pid, events_of(events)))
    }

    fn proc_connect(&self, sandbox: &str, pid: u32) -> anyhow::Result<ExecEvents> {
        check_id(sandbox)?;
        let (_, events) = client::open_stream(self.home(), sandbox, &Request::ProcConnect { pid })
            .map_err(|e| self.explain(sandbox, e))?;
        Ok(events_of(events))
    }

    fn proc_list(&self, sandbox: &str) -> anyhow::Result<Vec<ProcListing>> {
        let v = self.sup_call(sandbox, &Request::ProcList)?;
        answer(v["procs"].clone(), "proc_list")
    }

    fn proc_input(&self, sandbox: &str, pid: u32, data: &[u8]) -> anyhow::Result<()> {
        let data_b64 = base64::engine::general_purpose::STANDARD.encode(data);
        self.sup_call(sandbox, &Request::ProcInput { pid, data_b64 }).map(|_| ())
    }

    fn proc_close_stdin(&self, sandbox: &str, pid: u32) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::ProcCloseStdin { pid }).map(|_| ())
    }

    fn proc_signal(&self, sandbox: &str, pid: u32, signal: i32) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::ProcSignal { pid, signal }).map(|_| ())
    }

    fn proc_resize(&self, sandbox: &str, pid: u32, rows: u16, cols: u16) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::ProcResize { pid, rows, cols }).map(|_| ())
    }

    fn stat(&self, sandbox: &str, path: &str) -> anyhow::Result<FileStat> {
        answer(self.sup_call(sandbox, &Request::Stat { path: path.into() })?, "stat")
    }

    fn list_dir(&self, sandbox: &str, path: &str, depth: u32) -> anyhow::Result<Vec<DirEntry>> {
        let v = self.sup_call(sandbox, &Request::ListDir { path: path.into(), depth })?;
        answer(v["entries"].clone(), "list_dir")
    }

    fn set_egress(&self, sandbox: &str, rules: &EgressRules) -> anyhow::Result<()> {
        rules.check().map_err(crate::error::invalid)?;
        self.sup_call(sandbox, &Request::SetEgress { rules: rules.clone() }).map(|_| ())
    }

    fn watch_start(&self, sandbox: &str, path: &str, recursive: bool) -> anyhow::Result<u64> {
        let v = self.sup_call(sandbox, &Request::WatchStart { path: path.into(), recursive })?;
        answer(v["watch"].clone(), "watch_start")
    }

    fn watch_events(&self, sandbox: &str, watch: u64, wait_ms: u64) -> anyhow::Result<WatchBatch> {
        answer(self.sup_call(sandbox, &Request::WatchEvents { watch, wait_ms: wait_ms.min(60_000) })?, "watch_events")
    }

    fn watch_stop(&self, sandbox: &str, watch: u64) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::WatchStop { watch }).map(|_| ())
    }

    fn freeze(&self, sandbox: &str) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::Freeze).map(|_| ())
    }

    fn thaw(&self, sandbox: &str) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::Thaw).map(|_| ())
    }

    fn attach_root(&self, sandbox: &str, name: &str, host: &std::path::Path) -> anyhow::Result<String> {
        let v = self.sup_call(sandbox, &Request::AttachRoot { name: name.into(), host: host.into() })?;
        v["path"].as_str().map(str::to_string).ok_or_else(|| anyhow::anyhow!("the supervisor named no path"))
    }

    fn proc_group(&self, sandbox: &str, leader: u32, op: clade_core::backend::GroupOp) -> anyhow::Result<usize> {
        let v = self.sup_call(sandbox, &Request::ProcGroup { leader, group_op: op })?;
        Ok(v["processes"].as_u64().unwrap_or(0) as usize)
    }

    fn bind(&self, sandbox: &str, host: &std::path::Path, inside: &str, readonly: bool) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::Bind { host: host.into(), inside: inside.into(), readonly }).map(|_| ())
    }

    fn detach_root(&self, sandbox: &str, name: &str) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::DetachRoot { name: name.into() }).map(|_| ())
    }

    fn make_dir(&self, sandbox: &str, path: &str, owner: Option<FileOwner>) -> anyhow::Result<bool> {
        let v = self.sup_call(sandbox, &Request::Mkdir { path: path.into(), owner })?;
        Ok(v["created"].as_bool().unwrap_or(true))
    }

    fn rename(&self, sandbox: &str, from: &str, to: &str) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::Move { from: from.into(), to: to.into() }).map(|_| ())
    }

    fn remove(&self, sandbox: &str, path: &str) -> anyhow::Result<()> {
        self.sup_call(sandbox, &Request::Remove { path: path.into() }).map(|_| ())
    }

    fn state(&self, sandbox: &str) -> anyhow::Result<SandboxRow> {
        check_id(sandbox)?;
        let rec = self.engine.ledger().sandbox(&SandboxId::new(sandbox));
        Ok(row_of(&rec.map_err(|_| not_found(format!("no sandbox {sandbox}")))?))
    }

    fn mark_info(&self, spec: &str, backend: Option<BackendKind>) -> anyhow::Result<MarkRow> {
        Ok(MarkRow::from(&self.engine.resolve_mark(spec, backend)?))
    }
}

/// The free space kept aside beyond a mark's expected growth: `CLADE_RESERVE_MIB`, default 1024.
fn reserve_bytes() -> u64 {
    std::env::var("CLADE_RESERVE_MIB").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(1024) << 20
}

fn row_of(s: &clade_ledger::SandboxRecord) -> SandboxRow {
    let lost = s.state == SandboxState::Running && !s.supervisor_pid.is_some_and(supervisor_alive);
    let state = if lost { "lost".to_string() } else { s.state.as_str().to_string() };
    SandboxRow {
        id: s.id.to_string(),
        backend: from_ledger(s.backend),
        state,
        origin: s.origin_mark.clone(),
        branch: s.branch.clone(),
        supervisor_pid: s.supervisor_pid,
        error: s.error.clone(),
        created_ms: s.created_ms,
        last_active_ms: s.last_active_ms,
    }
}

/// A supervisor's process stream as decoded events (its start already taken by the caller).
fn events_of(stream: client::EventStream) -> ExecEvents {
    use crate::supervisor::protocol::StreamEvent;
    let b64 = base64::engine::general_purpose::STANDARD;
    Box::new(stream.map(move |ev| {
        Ok(match ev? {
            StreamEvent::Start { pid } => ExecEvent::Pid(pid),
            StreamEvent::Stdout { data_b64 } => ExecEvent::Stdout(b64.decode(data_b64).unwrap_or_default()),
            StreamEvent::Stderr { data_b64 } => ExecEvent::Stderr(b64.decode(data_b64).unwrap_or_default()),
            StreamEvent::Exit { code, signal } => {
                ExecEvent::Exit { code: code.unwrap_or_else(|| 128 + signal.unwrap_or(0)), signal }
            }
            StreamEvent::Error { kind, message } => return Err(kinded(kind, message)),
        })
    }))
}

/// A supervisor's answer body as the operation's answer type.
fn answer<T: serde::de::DeserializeOwned>(body: serde_json::Value, op: &str) -> anyhow::Result<T> {
    serde_json::from_value(body).map_err(|e| anyhow!("{op}: the supervisor's answer has an unexpected shape: {e}"))
}
