//! A fake [`SandboxApi`] in memory, for the router's tests (as clade-e2b's `fake` is for its routers): sandboxes
//! are rows, a command's output is its argv, files live in a map. The tests serve the real router over it on a
//! unix socket and drive it with the real typed client ([`crate::client::Remote`]), so the HTTP face is checked
//! against the library's trait, answer for answer and error kind for error kind, with no sandbox started.

use std::collections::BTreeMap;
use std::io::Read;

use clade_core::backend::{BackendKind, Shape};
use clade_core::ErrorKind;
use clade_host::api::*;
use clade_host::error::{conflict, invalid, kinded, not_found};
use clade_ledger::{BranchId, MarkId};
use parking_lot::Mutex;

#[derive(Default)]
pub struct Fake {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    sandboxes: BTreeMap<String, SandboxRow>,
    marks: Vec<MarkRow>,
    files: BTreeMap<(String, String), Vec<u8>>,
    /// How each file was written (owner, attributes).
    written: BTreeMap<(String, String), WriteOptions>,
    next: u32,
}

impl State {
    fn sandbox(&mut self, id: &str) -> anyhow::Result<&mut SandboxRow> {
        clade_host::error::check_id(id)?;
        self.sandboxes.get_mut(id).ok_or_else(|| not_found(format!("no sandbox {id}")))
    }

    fn running(&mut self, id: &str) -> anyhow::Result<&mut SandboxRow> {
        let row = self.sandbox(id)?;
        if row.state != "running" {
            return Err(conflict(format!("sandbox {id} is {}", row.state)));
        }
        Ok(row)
    }

    fn new_mark(&mut self, sandbox: &str, label: Option<String>) -> MarkRow {
        self.next += 1;
        let m = MarkRow {
            id: MarkId::new(format!("m-{}", self.next)),
            branch: BranchId::new(format!("b-{sandbox}")),
            label,
            parent: None,
            backend: BackendKind::Ct,
            pause_ms: Some(1),
            logical_bytes: 10,
            stored_bytes: 5,
            created_ms: self.next as i64,
            pinned: false,
            clean: true,
            disk_only: false,
        };
        self.marks.push(m.clone());
        m
    }
}

fn record(m: &MarkRow) -> Mark {
    Mark {
        id: m.id.clone(),
        branch: m.branch.clone(),
        label: m.label.clone(),
        parent: m.parent.clone(),
        backend: clade_ledger::Backend::Ct,
        manifests: BTreeMap::new(),
        logical_bytes: m.logical_bytes,
        stored_bytes: m.stored_bytes,
        pause_ms: m.pause_ms,
        timings: serde_json::json!({}),
        created_ms: m.created_ms,
        pinned: m.pinned,
        clean: m.clean,
    }
}

/// `echo A B` prints `A B\n`; `false` exits 1; anything else prints nothing and exits 0.
fn run(argv: &[String]) -> (i32, Vec<u8>) {
    match argv.first().map(String::as_str) {
        Some("echo") => (0, format!("{}\n", argv[1..].join(" ")).into_bytes()),
        Some("false") => (1, vec![]),
        _ => (0, vec![]),
    }
}

impl SandboxApi for Fake {
    fn fork(&self, req: &ForkRequest) -> anyhow::Result<ForkOutcome> {
        req.check()?;
        if req.from == "nosuch" {
            return Err(not_found("no mark, label or template named 'nosuch'"));
        }
        if req.from == "huge" {
            return Err(kinded(ErrorKind::NoCapacity, "memory: needs 1 TiB"));
        }
        let mut st = self.state.lock();
        let mut sandboxes = Vec::new();
        for _ in 0..req.count {
            st.next += 1;
            let id = format!("fk-{}", st.next);
            let at = st.next as i64;
            st.sandboxes.insert(
                id.clone(),
                SandboxRow {
                    id: id.clone(),
                    backend: req.backend.unwrap_or(BackendKind::Ct),
                    state: "running".into(),
                    origin: Some(MarkId::new(req.from.clone())),
                    branch: BranchId::new(format!("b-{id}")),
                    supervisor_pid: Some(1),
                    error: None,
                    created_ms: at,
                    last_active_ms: at,
                },
            );
            sandboxes.push(serde_json::from_value(serde_json::json!({"ok": true, "sandbox": id, "pid": 1}))?);
        }
        Ok(ForkOutcome {
            mark: MarkId::new(req.from.clone()),
            backend: req.backend.unwrap_or(BackendKind::Ct),
            shape: Some(Shape { memory_mib: 512, vcpus: 2, disk_gib: 4 }),
            total_ms: 1.0,
            sandboxes,
            suspended_to_make_room: vec![],
        })
    }

    fn get(&self, sandbox: &str) -> anyhow::Result<SandboxInfo> {
        let row = self.state.lock().sandbox(sandbox)?.clone();
        let live = (row.state == "running").then(|| LiveFacts { pids: vec![1], pss: 1 << 20, ..Default::default() });
        Ok(SandboxInfo { row, live })
    }

    fn list(&self) -> anyhow::Result<Vec<SandboxRow>> {
        Ok(self.state.lock().sandboxes.values().cloned().collect())
    }

    fn exec(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecOutput> {
        req.check()?;
        self.state.lock().running(sandbox)?;
        let (code, stdout) = run(&req.argv);
        Ok(ExecOutput { code, signal: None, stdout, stderr: vec![] })
    }

    fn exec_stream(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecEvents> {
        let out = self.exec(sandbox, req)?;
        let events = vec![
            Ok(ExecEvent::Pid(2)),
            Ok(ExecEvent::Stdout(out.stdout)),
            Ok(ExecEvent::Exit { code: out.code, signal: None }),
        ];
        Ok(Box::new(events.into_iter()))
    }

    fn open_file(&self, sandbox: &str, path: &str) -> anyhow::Result<(u64, Box<dyn Read + Send>)> {
        let mut st = self.state.lock();
        st.running(sandbox)?;
        let data = st.files.get(&(sandbox.to_string(), path.to_string())).cloned();
        let data = data.ok_or_else(|| not_found(format!("read {path}: no such file")))?;
        Ok((data.len() as u64, Box::new(std::io::Cursor::new(data))))
    }

    fn write_file_from(
        &self,
        sandbox: &str,
        path: &str,
        opts: &WriteOptions,
        src: &mut dyn Read,
    ) -> anyhow::Result<u64> {
        let mut data = Vec::new();
        src.read_to_end(&mut data)?;
        let mut st = self.state.lock();
        st.running(sandbox)?;
        let n = data.len() as u64;
        st.written.insert((sandbox.to_string(), path.to_string()), opts.clone());
        st.files.insert((sandbox.to_string(), path.to_string()), data);
        Ok(n)
    }

    fn mark(&self, sandbox: &str, req: &MarkRequest) -> anyhow::Result<Mark> {
        let mut st = self.state.lock();
        st.running(sandbox)?;
        Ok(record(&st.new_mark(sandbox, req.label.clone())))
    }

    fn retake(&self, sandbox: &str, to: &str) -> anyhow::Result<RetakeOutcome> {
        let mut st = self.state.lock();
        st.running(sandbox)?;
        let m = st.marks.iter().find(|m| m.id.as_str() == to).ok_or_else(|| not_found(format!("no mark {to}")))?;
        Ok(RetakeOutcome { mark: m.id.clone(), retake_ms: 2.0 })
    }

    fn freeze(&self, sandbox: &str) -> anyhow::Result<()> {
        self.state.lock().running(sandbox).map(|_| ())
    }

    fn thaw(&self, sandbox: &str) -> anyhow::Result<()> {
        self.state.lock().running(sandbox).map(|_| ())
    }

    fn suspend_with(&self, sandbox: &str, _req: &SuspendRequest) -> anyhow::Result<Mark> {
        let mut st = self.state.lock();
        st.running(sandbox)?.state = "suspended".into();
        Ok(record(&st.new_mark(sandbox, Some("suspend".into()))))
    }

    fn resume_with(&self, sandbox: &str, _req: &ResumeRequest) -> anyhow::Result<ResumeOutcome> {
        let mut st = self.state.lock();
        let row = st.sandbox(sandbox)?;
        if row.state != "suspended" {
            return Err(conflict(format!("sandbox {sandbox} is {}, not suspended", row.state)));
        }
        row.state = "running".into();
        let mark = st.marks.last().map(|m| m.id.clone()).unwrap_or_else(|| MarkId::new("m-0"));
        Ok(ResumeOutcome {
            sandbox: sandbox.into(),
            mark,
            ok: true,
            error: None,
            resume_ms: 3.0,
            blob_bytes: 0,
            pulled: None,
        })
    }

    fn kill(&self, sandbox: &str) -> anyhow::Result<KillOutcome> {
        let mut st = self.state.lock();
        st.sandbox(sandbox)?;
        st.sandboxes.remove(sandbox);
        Ok(KillOutcome { killed: sandbox.into(), reaped: None, taken_down: None })
    }

    fn marks(&self, sandbox: Option<&str>) -> anyhow::Result<Vec<MarkRow>> {
        let mut st = self.state.lock();
        let branch = match sandbox {
            Some(s) => Some(BranchId::new(format!("b-{}", st.sandbox(s)?.id))),
            None => None,
        };
        Ok(st.marks.iter().filter(|m| branch.as_ref().is_none_or(|b| &m.branch == b)).cloned().collect())
    }

    fn mark_info(&self, spec: &str, _backend: Option<BackendKind>) -> anyhow::Result<MarkRow> {
        let st = self.state.lock();
        st.marks.iter().find(|m| m.id.as_str() == spec).cloned().ok_or_else(|| not_found(format!("no mark {spec}")))
    }

    fn branches(&self) -> anyhow::Result<Vec<BranchRow>> {
        Ok(vec![])
    }

    fn delete_branch(&self, branch: &str) -> anyhow::Result<Deleted> {
        Err(not_found(format!("no branch {branch}")))
    }

    fn gc(&self, _dry_run: bool) -> anyhow::Result<GcOutcome> {
        Err(invalid("the fake keeps no store"))
    }

    fn audit(&self, _fix: bool) -> anyhow::Result<AuditReport> {
        Ok(AuditReport { sandboxes: self.state.lock().sandboxes.len(), ok: true, ..Default::default() })
    }

    fn audit_siblings(&self, a: &str, _b: &str, _control: Control) -> anyhow::Result<SiblingAudit> {
        Err(conflict(format!("{a} is not running (fake)")))
    }

    fn push(&self, _sandbox: &str, _progress: &mut dyn FnMut(&str)) -> anyhow::Result<PushOutcome> {
        Err(kinded(ErrorKind::NoSpace, "the blob tier is full"))
    }

    fn pull(&self, sandbox: &str, _progress: &mut dyn FnMut(&str)) -> anyhow::Result<PullOutcome> {
        Err(not_found(format!("{sandbox} was never pushed")))
    }

    fn roaming(&self) -> anyhow::Result<Vec<RoamRow>> {
        Ok(vec![])
    }

    fn hosts(&self) -> anyhow::Result<Vec<HostRow>> {
        Ok(vec![])
    }

    fn proc_start(&self, sandbox: &str, spec: ProcSpec) -> anyhow::Result<(u32, ExecEvents)> {
        self.state.lock().running(sandbox)?;
        let (code, out) = run(&spec.argv);
        Ok((7, Box::new(vec![Ok(ExecEvent::Stdout(out)), Ok(ExecEvent::Exit { code, signal: None })].into_iter())))
    }

    fn proc_connect(&self, sandbox: &str, pid: u32) -> anyhow::Result<ExecEvents> {
        self.state.lock().running(sandbox)?;
        Err(not_found(format!("no running process {pid}")))
    }

    fn proc_list(&self, sandbox: &str) -> anyhow::Result<Vec<ProcListing>> {
        self.state.lock().running(sandbox)?;
        Ok(serde_json::from_value(serde_json::json!([{"pid": 7, "argv": ["sleep", "9"], "pty": false}]))?)
    }

    fn proc_input(&self, sandbox: &str, _pid: u32, _data: &[u8]) -> anyhow::Result<()> {
        self.state.lock().running(sandbox).map(|_| ())
    }

    fn proc_close_stdin(&self, sandbox: &str, _pid: u32) -> anyhow::Result<()> {
        self.state.lock().running(sandbox).map(|_| ())
    }

    fn proc_signal(&self, sandbox: &str, pid: u32, signal: i32) -> anyhow::Result<()> {
        self.state.lock().running(sandbox)?;
        if signal > 64 {
            return Err(invalid(format!("signal {signal} to {pid}: no such signal")));
        }
        Ok(())
    }

    fn proc_resize(&self, sandbox: &str, _pid: u32, _rows: u16, _cols: u16) -> anyhow::Result<()> {
        self.state.lock().running(sandbox).map(|_| ())
    }

    /// The fake's watches see nothing happen (its files change only through the API).
    fn watch_start(&self, sandbox: &str, _path: &str, _recursive: bool) -> anyhow::Result<u64> {
        self.state.lock().running(sandbox).map(|_| 1)
    }

    fn watch_events(&self, sandbox: &str, watch: u64, _wait_ms: u64) -> anyhow::Result<WatchBatch> {
        self.state.lock().running(sandbox)?;
        if watch != 1 {
            return Err(not_found(format!("no watch {watch}")));
        }
        Ok(WatchBatch::default())
    }

    fn watch_stop(&self, sandbox: &str, _watch: u64) -> anyhow::Result<()> {
        self.state.lock().running(sandbox).map(|_| ())
    }

    fn stat(&self, sandbox: &str, path: &str) -> anyhow::Result<FileStat> {
        let mut st = self.state.lock();
        st.running(sandbox)?;
        let data = st.files.get(&(sandbox.to_string(), path.to_string()));
        let size = data.ok_or_else(|| not_found(format!("stat {path}: no such file")))?.len() as u64;
        let how = st.written.get(&(sandbox.to_string(), path.to_string())).cloned().unwrap_or_default();
        let owner = how.owner.unwrap_or(FileOwner { uid: 0, gid: 0 });
        Ok(FileStat {
            file_type: FileType::File,
            size,
            mode: how.mode.unwrap_or(0o644),
            uid: owner.uid,
            gid: owner.gid,
            mtime_ns: 0,
            link_target: None,
            xattrs: how.xattrs,
        })
    }

    fn list_dir(&self, sandbox: &str, path: &str, _depth: u32) -> anyhow::Result<Vec<DirEntry>> {
        let prefix = format!("{}/", path.trim_end_matches('/'));
        let names: Vec<String> = {
            let mut st = self.state.lock();
            st.running(sandbox)?;
            st.files.keys().filter(|(s, p)| s == sandbox && p.starts_with(&prefix)).map(|(_, p)| p.clone()).collect()
        };
        names.into_iter().map(|p| Ok(DirEntry { stat: self.stat(sandbox, &p)?, path: p, depth: 1 })).collect()
    }

    fn set_egress(&self, sandbox: &str, rules: &EgressRules) -> anyhow::Result<()> {
        rules.check().map_err(clade_host::error::invalid)?;
        self.state.lock().running(sandbox).map(|_| ())
    }

    fn make_dir(&self, sandbox: &str, _path: &str, _owner: Option<FileOwner>) -> anyhow::Result<bool> {
        self.state.lock().running(sandbox).map(|_| true)
    }

    fn rename(&self, sandbox: &str, from: &str, to: &str) -> anyhow::Result<()> {
        let mut st = self.state.lock();
        st.running(sandbox)?;
        let data = st.files.remove(&(sandbox.to_string(), from.to_string()));
        let data = data.ok_or_else(|| not_found(format!("move {from}: no such file")))?;
        st.files.insert((sandbox.to_string(), to.to_string()), data);
        Ok(())
    }

    fn remove(&self, sandbox: &str, path: &str) -> anyhow::Result<()> {
        let mut st = self.state.lock();
        st.running(sandbox)?;
        st.files.remove(&(sandbox.to_string(), path.to_string()));
        Ok(())
    }
}
