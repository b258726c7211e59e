//! The E2B-compatible control plane and envd endpoint (`clade serve --e2b-api --e2b-sandbox`): clade_e2b's
//! routers over [`CladeHost`], which maps E2B onto clade: create is a fork of a template's base or of a mark
//! (a snapshot), pause is suspend, connect/resume is resume, fork is a mark then a fork of it, snapshot is a
//! kept mark; envd's process and filesystem calls go to the sandbox's supervisor (streams over its socket).
//!
//! Template names: `base` is `$CLADE_E2B_TEMPLATE` (default `minimal`); `NAME:ct` / `NAME:vm` pick the backend,
//! otherwise `$CLADE_E2B_BACKEND` (default `ct`); a mark id or label (what a snapshot returned) works as is.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use clade_agent::proto::{DirEntry, FileStat, FileType};
use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use clade_e2b::{
    Entry, Host, HostError, HostResult, Kind, ProcEvent, ProcInfo, ProcSpec, ProcStream, Snapshot, Started, Status,
};
use clade_ledger::{SandboxId, SandboxState};

use clade_host::ops::Ops;
use clade_host::supervisor::client;
use clade_host::supervisor::protocol::{self, Request, StreamEvent};

/// Bind both E2B listeners and serve them as tokio tasks; returns once both listen.
pub async fn spawn(ops: Arc<Ops>, api: SocketAddr, sandbox: SocketAddr, home: CladeHome) -> anyhow::Result<()> {
    let host = Arc::new(CladeHost::new(ops, home.clone()));
    crate::e2b_keys::hash_plaintext_keys(&home)?;
    let cfg = clade_e2b::Config { state_file: Some(e2b_dir(&home).join("sandboxes.json")), ..Default::default() };
    let app = clade_e2b::App::new(host, cfg)?;
    let (a, s) = clade_e2b::spawn(app, api, sandbox)
        .await
        .map_err(|e| anyhow::anyhow!("e2b listeners on {api} and {sandbox}: {e} (is the port taken?)"))?;
    eprintln!("clade serve: E2B API on http://{a}, envd on http://{s} (keys: `clade e2b key create`)");
    Ok(())
}

/// `$CLADE_HOME/e2b/` (0700): API key hashes, E2B's own records and the token key (see clade_e2b::state).
pub fn e2b_dir(home: &CladeHome) -> std::path::PathBuf {
    home.e2b_dir()
}

pub use crate::e2b_keys::{check_key, create_key, keys_file};

/// Clade as an E2B host.
pub struct CladeHost {
    ops: Arc<Ops>,
    home: CladeHome,
    default_template: String,
    default_backend: BackendKind,
    /// E2B `envVars` of each sandbox, given to every process it starts.
    envs: Mutex<HashMap<String, BTreeMap<String, String>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A clade error as the E2B layer sorts them, by its kind.
fn host_err(e: anyhow::Error) -> HostError {
    use clade_core::ErrorKind as K;
    let msg = format!("{e:#}");
    match clade_host::error::kind(&e) {
        K::Invalid => HostError::Invalid(msg),
        K::NotFound => HostError::NotFound(msg),
        K::Conflict => HostError::Conflict(msg),
        K::NoCapacity | K::NoSpace => HostError::NoSpace(msg),
        K::Permission => HostError::Permission(msg),
        K::Timeout | K::Unavailable | K::Internal => HostError::Internal(msg),
    }
}

fn kind_of(t: FileType) -> Kind {
    match t {
        FileType::File => Kind::File,
        FileType::Dir => Kind::Dir,
        FileType::Symlink => Kind::Symlink,
        FileType::Other => Kind::Other,
    }
}

fn entry_of(path: &str, st: FileStat) -> Entry {
    Entry {
        path: path.to_string(),
        kind: kind_of(st.file_type),
        size: st.size,
        mode: st.mode,
        uid: st.uid,
        gid: st.gid,
        mtime_ns: st.mtime_ns,
        link_target: st.link_target,
    }
}

impl CladeHost {
    pub fn new(ops: Arc<Ops>, home: CladeHome) -> CladeHost {
        let default_backend = match std::env::var("CLADE_E2B_BACKEND").as_deref() {
            Ok("vm") => BackendKind::Vm,
            _ => BackendKind::Ct,
        };
        CladeHost {
            ops,
            home,
            default_template: std::env::var("CLADE_E2B_TEMPLATE").unwrap_or_else(|_| "minimal".into()),
            default_backend,
            envs: Mutex::new(HashMap::new()),
        }
    }

    fn call(&self, id: &str, req: &Request) -> HostResult<serde_json::Value> {
        clade_host::error::check_id(id).map_err(host_err)?;
        client::call(&self.home, id, req).map_err(host_err)
    }

    fn started(&self, forked: &serde_json::Value, template: &str) -> HostResult<Vec<Started>> {
        let mut out = Vec::new();
        for r in forked["sandboxes"].as_array().into_iter().flatten() {
            let id = r["sandbox"].as_str().unwrap_or_default().to_string();
            if r["ok"].as_bool() != Some(true) {
                return Err(HostError::Internal(format!(
                    "sandbox {id} did not start: {}",
                    r["error"].as_str().unwrap_or("no reason given")
                )));
            }
            out.push(Started { id, template_id: template.to_string(), cpu_count: 1, memory_mb: 256, disk_mb: 2048 });
        }
        Ok(out)
    }

    fn events(stream: client::EventStream) -> ProcStream {
        let b64 = base64::engine::general_purpose::STANDARD;
        Box::new(stream.map(move |ev| match ev {
            Ok(StreamEvent::Stdout { data_b64 }) => ProcEvent::Stdout(b64.decode(data_b64).unwrap_or_default()),
            Ok(StreamEvent::Stderr { data_b64 }) => ProcEvent::Stderr(b64.decode(data_b64).unwrap_or_default()),
            Ok(StreamEvent::Exit { code, signal }) => ProcEvent::Exit { code, signal },
            Ok(StreamEvent::Error { message, .. }) => ProcEvent::Error(message),
            Ok(StreamEvent::Start { pid }) => ProcEvent::Error(format!("a second start ({pid}) in one stream")),
            Err(e) => ProcEvent::Error(format!("{e:#}")),
        }))
    }
}

impl Host for CladeHost {
    fn check_key(&self, key: &str) -> bool {
        check_key(&self.home, key)
    }

    fn create(&self, template: &str, envs: &BTreeMap<String, String>) -> HostResult<Started> {
        let name = if template == "base" { self.default_template.as_str() } else { template };
        let (name, backend) = match name.rsplit_once(':') {
            Some((n, "ct")) => (n, BackendKind::Ct),
            Some((n, "vm")) => (n, BackendKind::Vm),
            _ => (name, self.default_backend),
        };
        let forked = self.ops.fork(name, Some(backend), 1).map_err(|e| match host_err(e) {
            HostError::NotFound(m) | HostError::Invalid(m) => {
                HostError::NotFound(format!("template '{template}' not found ({m})"))
            }
            other => other,
        })?;
        let s = self
            .started(&forked, template)?
            .into_iter()
            .next()
            .ok_or_else(|| HostError::Internal("fork started nothing".into()))?;
        if !envs.is_empty() {
            lock(&self.envs).insert(s.id.clone(), envs.clone());
        }
        Ok(s)
    }

    fn status(&self, id: &str) -> Status {
        if clade_host::error::check_id(id).is_err() {
            return Status::Gone;
        }
        match self.ops.engine.ledger().sandbox(&SandboxId::new(id)) {
            // No pid yet: its supervisor is starting.
            Ok(r) if r.state == SandboxState::Running && r.supervisor_pid.is_none_or(clade_host::supervisor::start::supervisor_alive) => {
                Status::Running
            }
            Ok(r) if r.state == SandboxState::Suspended => Status::Paused,
            _ => Status::Gone,
        }
    }

    fn kill(&self, id: &str) -> HostResult<()> {
        lock(&self.envs).remove(id);
        self.ops.kill(id).map(|_| ()).map_err(host_err)
    }

    fn pause(&self, id: &str) -> HostResult<()> {
        self.ops.suspend(id).map_err(host_err)?;
        // The supervisor answers before it records the sandbox as suspended and exits: wait for that, so a
        // status read right after this sees "paused" (not a running sandbox, nor a lost one).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            let rec = self.ops.engine.ledger().sandbox(&SandboxId::new(id));
            match rec {
                Ok(r) if r.state == SandboxState::Suspended => return Ok(()),
                Ok(r) if r.state == SandboxState::Dead || r.state == SandboxState::Failed => {
                    return Err(HostError::Internal(format!("sandbox {id} ended instead of pausing")))
                }
                _ => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        Err(HostError::Internal(format!("sandbox {id} did not finish pausing within 30 s")))
    }

    fn resume(&self, id: &str) -> HostResult<()> {
        let r = self.ops.resume(id).map_err(host_err)?;
        if r["ok"].as_bool() == Some(true) {
            Ok(())
        } else {
            Err(HostError::Internal(format!(
                "resume of {id} failed: {}",
                r["error"].as_str().unwrap_or("no reason given")
            )))
        }
    }

    fn fork(&self, id: &str, count: u32) -> HostResult<Vec<Started>> {
        let m = self.ops.mark(id, None, false, false).map_err(host_err)?;
        let mark = m["id"].as_str().ok_or_else(|| HostError::Internal(format!("mark of {id} has no id: {m}")))?;
        let forked = self.ops.fork(mark, None, count).map_err(host_err)?;
        let kids = self.started(&forked, mark)?;
        if let Some(e) = lock(&self.envs).get(id).cloned() {
            let mut envs = lock(&self.envs);
            for k in &kids {
                envs.insert(k.id.clone(), e.clone());
            }
        }
        Ok(kids)
    }

    fn snapshot(&self, id: &str, name: Option<&str>) -> HostResult<Snapshot> {
        // A name is a mark label; one already taken falls back to an unlabelled mark (the id still names it).
        let m = match self.ops.mark(id, name.map(str::to_owned), true, false) {
            Ok(m) => m,
            Err(_) if name.is_some() => self.ops.mark(id, None, true, false).map_err(host_err)?,
            Err(e) => return Err(host_err(e)),
        };
        let mark = m["id"].as_str().ok_or_else(|| HostError::Internal(format!("mark of {id} has no id: {m}")))?;
        Ok(Snapshot { id: mark.to_string() })
    }

    fn proc_start(&self, id: &str, spec: ProcSpec) -> HostResult<(u32, ProcStream)> {
        clade_host::error::check_id(id).map_err(host_err)?;
        let mut env = lock(&self.envs).get(id).cloned().unwrap_or_default();
        env.extend(spec.env);
        let req = Request::ProcStart(protocol::ProcSpec {
            argv: spec.argv,
            env,
            cwd: spec.cwd,
            user: spec.user,
            pty: spec.pty,
            stdin: spec.stdin,
            tag: spec.tag,
            stream: true,
        });
        let (pid, s) = client::open_stream(&self.home, id, &req).map_err(host_err)?;
        Ok((pid, Self::events(s)))
    }

    fn proc_connect(&self, id: &str, pid: u32) -> HostResult<ProcStream> {
        clade_host::error::check_id(id).map_err(host_err)?;
        let (_, s) = client::open_stream(&self.home, id, &Request::ProcConnect { pid }).map_err(host_err)?;
        Ok(Self::events(s))
    }

    fn proc_list(&self, id: &str) -> HostResult<Vec<ProcInfo>> {
        let v = self.call(id, &Request::ProcList)?;
        let procs: Vec<protocol::ProcListing> = serde_json::from_value(v["procs"].clone())
            .map_err(|e| HostError::Internal(format!("the supervisor's process list: {e}")))?;
        Ok(procs
            .into_iter()
            .map(|p| ProcInfo { pid: p.pid, argv: p.argv, env: p.env, cwd: p.cwd, tag: p.tag })
            .collect())
    }

    fn proc_input(&self, id: &str, pid: u32, data: &[u8]) -> HostResult<()> {
        let data_b64 = base64::engine::general_purpose::STANDARD.encode(data);
        self.call(id, &Request::ProcInput { pid, data_b64 }).map(|_| ())
    }

    fn proc_close_stdin(&self, id: &str, pid: u32) -> HostResult<()> {
        self.call(id, &Request::ProcCloseStdin { pid }).map(|_| ())
    }

    fn proc_signal(&self, id: &str, pid: u32, signal: i32) -> HostResult<()> {
        self.call(id, &Request::ProcSignal { pid, signal }).map(|_| ())
    }

    fn proc_resize(&self, id: &str, pid: u32, rows: u16, cols: u16) -> HostResult<()> {
        self.call(id, &Request::ProcResize { pid, rows, cols }).map(|_| ())
    }

    fn stat(&self, id: &str, path: &str) -> HostResult<Entry> {
        let v = self.call(id, &Request::Stat { path: path.into() })?;
        let st: FileStat = serde_json::from_value(v).map_err(|e| HostError::Internal(format!("stat answer: {e}")))?;
        Ok(entry_of(path, st))
    }

    fn list_dir(&self, id: &str, path: &str, depth: u32) -> HostResult<Vec<Entry>> {
        let v = self.call(id, &Request::ListDir { path: path.into(), depth })?;
        let es: Vec<DirEntry> = serde_json::from_value(v["entries"].clone())
            .map_err(|e| HostError::Internal(format!("list answer: {e}")))?;
        Ok(es.into_iter().map(|e| entry_of(&e.path, e.stat)).collect())
    }

    fn mkdir(&self, id: &str, path: &str) -> HostResult<bool> {
        let v = self.call(id, &Request::Mkdir { path: path.into() })?;
        Ok(v["created"].as_bool().unwrap_or(true))
    }

    fn rename(&self, id: &str, from: &str, to: &str) -> HostResult<()> {
        self.call(id, &Request::Move { from: from.into(), to: to.into() }).map(|_| ())
    }

    fn remove(&self, id: &str, path: &str) -> HostResult<()> {
        self.call(id, &Request::Remove { path: path.into() }).map(|_| ())
    }

    fn read_file(&self, id: &str, path: &str) -> HostResult<(u64, Box<dyn Read + Send>)> {
        clade_host::error::check_id(id).map_err(host_err)?;
        let (size, r) = client::read_stream(&self.home, id, path).map_err(host_err)?;
        Ok((size, Box::new(r)))
    }

    fn write_file(&self, id: &str, path: &str, src: &mut dyn Read) -> HostResult<u64> {
        clade_host::error::check_id(id).map_err(host_err)?;
        client::write_stream(&self.home, id, path, None, src).map_err(host_err)
    }
}
