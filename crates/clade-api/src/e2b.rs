//! The E2B-compatible control plane and envd endpoint (`clade serve --e2b-api --e2b-sandbox`): clade_e2b's
//! routers over [`CladeHost`], which maps E2B onto clade: create is a fork of a template's base or of a mark
//! (a snapshot), pause is suspend, connect/resume is resume, fork is a mark then a fork of it, snapshot is a
//! kept mark; envd's process and filesystem calls go to the sandbox's supervisor (streams over its socket).
//!
//! Template names: `base` is `$CLADE_E2B_TEMPLATE` (default `e2b-base`, its base built on first use:
//! [`crate::e2b_base`]); `NAME:ct` / `NAME:vm` pick the backend, otherwise `$CLADE_E2B_BACKEND` (default `ct`); a
//! mark id or label (what a snapshot returned) works as is.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use clade_agent::proto::{FileOwner, FileStat, FileType, WriteOptions};
use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use clade_e2b::{
    Change, Changed, Entry, Host, HostError, HostResult, Kind, ProcEvent, ProcInfo, ProcSpec, ProcStream, Snapshot,
    Started, Status, Upload, Usage,
};
use clade_host::api::{
    ExecEvent, ExecEvents, ExecRequest, ForkOutcome, ForkRequest, MarkRequest, ResumeRequest, SandboxApi,
    SuspendRequest,
};

/// Bind both E2B listeners and serve them as tokio tasks; returns once both listen.
pub async fn spawn(
    api_impl: Arc<dyn SandboxApi>,
    api: SocketAddr,
    sandbox: SocketAddr,
    home: CladeHome,
) -> anyhow::Result<()> {
    let host = Arc::new(CladeHost::new(api_impl, home.clone()));
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

/// Clade as an E2B host: every call is a [`SandboxApi`] operation (the library's, or a remote daemon's).
pub struct CladeHost {
    api: Arc<dyn SandboxApi>,
    home: CladeHome,
    default_template: String,
    default_backend: BackendKind,
    /// E2B `envVars` of each sandbox, given to every process it starts.
    envs: Mutex<HashMap<String, BTreeMap<String, String>>>,
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

/// Whether a clade error is of kind `not_found` (a template with no base yet, an unknown name).
fn host_err_kind_not_found(e: &anyhow::Error) -> bool {
    clade_host::error::kind(e) == clade_core::ErrorKind::NotFound
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
        xattrs: st.xattrs,
    }
}

impl CladeHost {
    pub fn new(api: Arc<dyn SandboxApi>, home: CladeHome) -> CladeHost {
        let default_backend = match std::env::var("CLADE_E2B_BACKEND").as_deref() {
            Ok("vm") => BackendKind::Vm,
            _ => BackendKind::Ct,
        };
        CladeHost {
            api,
            home,
            default_template: std::env::var("CLADE_E2B_TEMPLATE")
                .unwrap_or_else(|_| crate::e2b_base::DEFAULT_TEMPLATE.into()),
            default_backend,
            envs: Mutex::new(HashMap::new()),
        }
    }

    /// The sandboxes a fork started, each with the mark's shape; any that did not start fails the whole.
    fn started(&self, forked: &ForkOutcome, template: &str) -> HostResult<Vec<Started>> {
        let shape =
            forked.shape.clone().unwrap_or(clade_core::backend::Shape { memory_mib: 256, vcpus: 1, disk_gib: 2 });
        let mut out = Vec::new();
        for r in &forked.sandboxes {
            if !r.ok {
                return Err(HostError::Internal(format!(
                    "sandbox {} did not start: {}",
                    r.sandbox,
                    r.error.as_deref().unwrap_or("no reason given")
                )));
            }
            out.push(Started {
                id: r.sandbox.clone(),
                template_id: template.to_string(),
                cpu_count: shape.vcpus,
                memory_mb: shape.memory_mib,
                disk_mb: shape.disk_gib * 1024,
            });
        }
        Ok(out)
    }

    fn events(events: ExecEvents) -> ProcStream {
        Box::new(events.map(move |ev| match ev {
            Ok(ExecEvent::Stdout(d)) => ProcEvent::Stdout(d),
            Ok(ExecEvent::Stderr(d)) => ProcEvent::Stderr(d),
            // A process ended by a signal has no exit code.
            Ok(ExecEvent::Exit { code, signal }) => ProcEvent::Exit { code: signal.is_none().then_some(code), signal },
            Ok(ExecEvent::Pid(pid)) => ProcEvent::Error(format!("a second start ({pid}) in one stream")),
            Err(e) => ProcEvent::Error(format!("{e:#}")),
        }))
    }

    /// `NAME:ct` / `NAME:vm` pick the backend; a bare name gets the default one.
    fn backend_of<'a>(&self, name: &'a str) -> (&'a str, BackendKind) {
        match name.rsplit_once(':') {
            Some((n, "ct")) => (n, BackendKind::Ct),
            Some((n, "vm")) => (n, BackendKind::Vm),
            _ => (name, self.default_backend),
        }
    }

    fn envs(&self) -> parking_lot::MutexGuard<'_, HashMap<String, BTreeMap<String, String>>> {
        self.envs.lock()
    }
}

impl Host for CladeHost {
    fn check_key(&self, key: &str) -> bool {
        check_key(&self.home, key)
    }

    fn create(&self, template: &str, envs: &BTreeMap<String, String>) -> HostResult<Started> {
        let name = if template == "base" { self.default_template.as_str() } else { template };
        let (name, backend) = self.backend_of(name);
        let req = ForkRequest::new(name, Some(backend), 1);
        let forked = match self.api.fork(&req) {
            // E2B's base has no base on this backend yet: build it now (first use), then fork.
            Err(e) if template == "base" && host_err_kind_not_found(&e) => {
                crate::e2b_base::ensure_base(&self.home, name, backend)
                    .map_err(|b| HostError::NotFound(format!("template 'base' (clade's {name}): {b:#}")))?;
                self.api.fork(&req)
            }
            r => r,
        };
        let forked = forked.map_err(|e| match host_err(e) {
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
            self.envs().insert(s.id.clone(), envs.clone());
        }
        Ok(s)
    }

    fn template_exists(&self, name: &str) -> bool {
        // `base` is always there: its base is built on the first create.
        if name == "base" {
            return true;
        }
        let (name, backend) = self.backend_of(name);
        self.api.mark_info(name, Some(backend)).is_ok()
    }

    fn status(&self, id: &str) -> Status {
        if clade_host::error::check_id(id).is_err() {
            return Status::Gone;
        }
        match self.api.state(id) {
            Ok(r) if r.state == "running" => Status::Running,
            Ok(r) if r.state == "suspended" => Status::Paused,
            _ => Status::Gone,
        }
    }

    fn kill(&self, id: &str) -> HostResult<()> {
        self.envs().remove(id);
        self.api.kill(id).map(|_| ()).map_err(host_err)
    }

    fn pause(&self, id: &str, disk_only: bool) -> HostResult<()> {
        self.api.suspend_with(id, &SuspendRequest { disk_only }).map_err(host_err)?;
        // The supervisor answers before it records the sandbox as suspended and exits: wait for that, so a
        // status read right after this sees "paused" (not a running sandbox, nor a lost one).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            match self.api.state(id) {
                Ok(r) if r.state == "suspended" => return Ok(()),
                Ok(r) if r.state == "dead" || r.state == "failed" => {
                    return Err(HostError::Internal(format!("sandbox {id} ended instead of pausing")))
                }
                _ => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        Err(HostError::Internal(format!("sandbox {id} did not finish pausing within 30 s")))
    }

    fn resume(&self, id: &str, reboot: bool) -> HostResult<()> {
        let r = self.api.resume_with(id, &ResumeRequest { reboot }).map_err(host_err)?;
        if r.ok {
            Ok(())
        } else {
            Err(HostError::Internal(format!(
                "resume of {id} failed: {}",
                r.error.as_deref().unwrap_or("no reason given")
            )))
        }
    }

    fn fork(&self, id: &str, count: u32) -> HostResult<Vec<Started>> {
        let m = self.api.mark(id, &MarkRequest::default()).map_err(host_err)?;
        let mark = m.id.as_str();
        let forked = self.api.fork(&ForkRequest::new(mark, None, count)).map_err(host_err)?;
        let kids = self.started(&forked, mark)?;
        let mut envs = self.envs();
        if let Some(e) = envs.get(id).cloned() {
            for k in &kids {
                envs.insert(k.id.clone(), e.clone());
            }
        }
        Ok(kids)
    }

    fn snapshot(&self, id: &str, name: Option<&str>, disk_only: bool) -> HostResult<Snapshot> {
        // A name is a mark label; one already taken falls back to an unlabelled mark (the id still names it).
        let pin = |label: Option<&str>| MarkRequest {
            label: label.map(str::to_owned),
            keep: true,
            not_clean: false,
            disk_only,
        };
        let m = match self.api.mark(id, &pin(name)) {
            Ok(m) => m,
            Err(_) if name.is_some() => self.api.mark(id, &pin(None)).map_err(host_err)?,
            Err(e) => return Err(host_err(e)),
        };
        Ok(Snapshot { id: m.id.to_string() })
    }

    fn proc_start(&self, id: &str, spec: ProcSpec) -> HostResult<(u32, ProcStream)> {
        let mut env = self.envs().get(id).cloned().unwrap_or_default();
        env.extend(spec.env);
        let spec = clade_host::api::ProcSpec {
            argv: spec.argv,
            env,
            cwd: spec.cwd,
            user: spec.user,
            pty: spec.pty,
            stdin: spec.stdin,
            tag: spec.tag,
            stream: true,
            ..Default::default()
        };
        let (pid, events) = self.api.proc_start(id, spec).map_err(host_err)?;
        Ok((pid, Self::events(events)))
    }

    fn proc_connect(&self, id: &str, pid: u32) -> HostResult<ProcStream> {
        Ok(Self::events(self.api.proc_connect(id, pid).map_err(host_err)?))
    }

    fn proc_list(&self, id: &str) -> HostResult<Vec<ProcInfo>> {
        let procs = self.api.proc_list(id).map_err(host_err)?;
        // The port relays serving `<port>-<id>` hosts are clade's, not the sandbox user's.
        Ok(procs
            .into_iter()
            .filter(|p| p.tag.as_deref() != Some(crate::port_relay::TAG))
            .map(|p| ProcInfo { pid: p.pid, argv: p.argv, env: p.env, cwd: p.cwd, tag: p.tag })
            .collect())
    }

    fn proc_input(&self, id: &str, pid: u32, data: &[u8]) -> HostResult<()> {
        self.api.proc_input(id, pid, data).map_err(host_err)
    }

    fn proc_close_stdin(&self, id: &str, pid: u32) -> HostResult<()> {
        self.api.proc_close_stdin(id, pid).map_err(host_err)
    }

    fn proc_signal(&self, id: &str, pid: u32, signal: i32) -> HostResult<()> {
        self.api.proc_signal(id, pid, signal).map_err(host_err)
    }

    fn proc_resize(&self, id: &str, pid: u32, rows: u16, cols: u16) -> HostResult<()> {
        self.api.proc_resize(id, pid, rows, cols).map_err(host_err)
    }

    fn set_egress(&self, id: &str, allow: &[String], deny: &[String]) -> HostResult<()> {
        let rules = clade_host::api::EgressRules { allow: allow.to_vec(), deny: deny.to_vec() };
        self.api.set_egress(id, &rules).map_err(host_err)
    }

    /// ct: a socket made in the sandbox's network namespace; vm: a relay process in the guest
    /// (crate::port_relay), since the host has no network path into a guest.
    fn connect_port(&self, id: &str, port: u16) -> HostResult<std::net::TcpStream> {
        let info = self.api.get(id).map_err(host_err)?;
        if info.row.backend == BackendKind::Vm {
            if info.live.is_none() {
                return Err(HostError::NotFound(format!("The sandbox {id} was not found")));
            }
            return crate::port_relay::connect(&self.api, id, port);
        }
        let pid = info.live.and_then(|l| l.pids.first().copied());
        let pid = pid.ok_or_else(|| HostError::NotFound(format!("The sandbox {id} was not found")))?;
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
            .map_err(|e| HostError::NotFound(format!("The sandbox {id} was not found ({e})")))?;
        // A thread of its own joins the sandbox's network namespace, so the socket it makes lives there; the
        // connected socket is then used from any thread.
        std::thread::spawn(move || {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| HostError::Internal(format!("entering the sandbox's network: {e}")))?;
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(5))
                .map_err(|e| HostError::Conflict(format!("port is not open: {port} in sandbox ({e})")))
        })
        .join()
        .map_err(|_| HostError::Internal("the port connector panicked".into()))?
    }

    fn usage(&self, id: &str) -> HostResult<Usage> {
        let info = self.api.get(id).map_err(host_err)?;
        let live = info.live.ok_or_else(|| HostError::NotFound(format!("sandbox {id} is not running")))?;
        // The root filesystem as the sandbox sees it: `df -P /` (1024-byte blocks, in busybox and coreutils).
        let df = ExecRequest { argv: vec!["df".into(), "-P".into(), "/".into()], ..Default::default() };
        let disk = self.api.exec(id, df).ok().filter(|o| o.code == 0).and_then(|o| {
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            let f: Vec<u64> =
                out.lines().nth(1)?.split_whitespace().skip(1).take(2).filter_map(|v| v.parse().ok()).collect();
            (f.len() == 2).then(|| (f[1] * 1024, f[0] * 1024))
        });
        Ok(Usage { cpu_busy: live.cpu_busy, mem_used: live.pss, disk })
    }

    fn watch_start(&self, id: &str, path: &str, recursive: bool) -> HostResult<Option<u64>> {
        match self.api.watch_start(id, path, recursive) {
            Ok(w) => Ok(Some(w)),
            // A sandbox whose agent predates watches: the face polls its listings instead.
            Err(e) if format!("{e:#}").contains("unknown op") => Ok(None),
            Err(e) => Err(host_err(e)),
        }
    }

    fn watch_events(&self, id: &str, watch: u64, wait_ms: u64) -> HostResult<(Vec<Changed>, bool)> {
        use clade_agent::proto::WatchKind as W;
        let b = self.api.watch_events(id, watch, wait_ms).map_err(host_err)?;
        let events = b
            .events
            .into_iter()
            .map(|e| Changed {
                name: e.name,
                change: match e.kind {
                    W::Create => Change::Create,
                    W::Write => Change::Write,
                    W::Chmod => Change::Chmod,
                    W::Remove => Change::Remove,
                    W::Rename => Change::Rename,
                },
            })
            .collect();
        Ok((events, b.lost))
    }

    fn watch_stop(&self, id: &str, watch: u64) -> HostResult<()> {
        self.api.watch_stop(id, watch).map_err(host_err)
    }

    fn stat(&self, id: &str, path: &str) -> HostResult<Entry> {
        Ok(entry_of(path, self.api.stat(id, path).map_err(host_err)?))
    }

    fn list_dir(&self, id: &str, path: &str, depth: u32) -> HostResult<Vec<Entry>> {
        let es = self.api.list_dir(id, path, depth).map_err(host_err)?;
        Ok(es.into_iter().map(|e| entry_of(&e.path, e.stat)).collect())
    }

    fn mkdir(&self, id: &str, path: &str, owner: Option<(u32, u32)>) -> HostResult<bool> {
        let owner = owner.map(|(uid, gid)| FileOwner { uid, gid });
        self.api.make_dir(id, path, owner).map_err(host_err)
    }

    fn rename(&self, id: &str, from: &str, to: &str) -> HostResult<()> {
        self.api.rename(id, from, to).map_err(host_err)
    }

    fn remove(&self, id: &str, path: &str) -> HostResult<()> {
        self.api.remove(id, path).map_err(host_err)
    }

    fn read_file(&self, id: &str, path: &str) -> HostResult<(u64, Box<dyn Read + Send>)> {
        self.api.open_file(id, path).map_err(host_err)
    }

    fn write_file(&self, id: &str, path: &str, up: &Upload, src: &mut dyn Read) -> HostResult<u64> {
        let opts = WriteOptions {
            mode: None,
            owner: up.owner.map(|(uid, gid)| FileOwner { uid, gid }),
            xattrs: up.xattrs.clone(),
        };
        self.api.write_file_from(id, path, &opts, src).map_err(host_err)
    }
}
