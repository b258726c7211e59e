//! The supervisor process: restore one sandbox, then serve its requests until it is killed or suspended (or
//! the supervisor gets SIGTERM/SIGINT, which ends the sandbox cleanly).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use std::time::Instant;

use base64::Engine as _;
use clade_agent::client::{AgentClient, ClientError};
use clade_agent::proto::{AgentError, ExecSpec, FileType, WriteOptions};
use clade_core::backend::{Backend, BackendError, EgressRules, MarkOptions, Sandbox};
use clade_core::engine::{Engine, EngineError};
use clade_core::time::now_ms;
use clade_core::{CladeHome, ErrorKind};
use clade_ledger::{MarkId, SandboxId, SandboxState};

use super::procs::Procs;
use super::protocol::{Ready, Request, Response, StreamEvent};

fn write_ready(path: &std::path::Path, r: &Ready) {
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, serde_json::to_vec(r).unwrap_or_default()).is_ok() {
        let _ = std::fs::rename(tmp, path);
    }
}

/// Restore `mark` as sandbox `id` and serve it. Returns when the sandbox ends.
pub fn run(
    engine: Engine,
    backend: Arc<dyn Backend>,
    id: SandboxId,
    mark: MarkId,
    generation: u64,
) -> anyhow::Result<()> {
    let home = engine.home.clone();
    let dir = super::sup_dir(&home, id.as_str());
    std::fs::create_dir_all(&dir)?;
    let ready = super::ready_file(&home, id.as_str());
    let _ = std::fs::remove_file(&ready);
    let stop = stop_flag()?;
    let fail = |engine: &Engine, e: &dyn std::fmt::Display| {
        let _ = engine.ledger().set_sandbox_state(&id, SandboxState::Failed, Some(&e.to_string()));
        write_ready(&ready, &Ready { ok: false, sandbox: id.to_string(), error: Some(e.to_string()), ..empty(&id) });
    };
    // Bind the ledger's answer first: a guard held through the match would deadlock `fail`.
    let found = engine.ledger().mark(&mark);
    let m = match found {
        Ok(m) => m,
        Err(e) => {
            fail(&engine, &e);
            return Err(e.into());
        }
    };
    let _ = engine.ledger().set_supervisor(&id, Some(std::process::id()), None);
    let restored = match engine.restore_into(backend.as_ref(), &id, &m, generation) {
        Ok(r) => r,
        Err(e) => {
            fail(&engine, &e);
            return Err(e.into());
        }
    };
    // A template's base: ready means the template's own readiness (a browser's new clean context loaded after
    // hygiene), not only the agent's hello. A sandbox that does not get there is still served (and says so
    // in the supervisor's log): it runs, and the user can look at it.
    if let Some((target, timeout)) = crate::base::base_readiness(&engine, &m) {
        if let Err(e) = restored.sandbox.agent().wait_ready(target, timeout) {
            eprintln!("clade supervisor: {id}: the template's readiness was not reached: {e}");
        }
    }
    serve_restored(engine, backend, id, restored, generation, &stop)
}

/// Serve a restored sandbox: bind its control socket, publish `ready.json`, answer requests until it ends.
pub fn serve_restored(
    engine: Engine,
    backend: Arc<dyn Backend>,
    id: SandboxId,
    restored: clade_core::engine::Restored,
    generation: u64,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    serve_restored_then(engine, backend, id, restored, generation, stop, || {})
}

/// As [`serve_restored`], calling `ready` once the control socket listens (a pool member answers its claimer).
pub fn serve_restored_then(
    engine: Engine,
    backend: Arc<dyn Backend>,
    id: SandboxId,
    restored: clade_core::engine::Restored,
    generation: u64,
    stop: &AtomicBool,
    ready_hook: impl FnOnce(),
) -> anyhow::Result<()> {
    let home = engine.home.clone();
    let dir = super::sup_dir(&home, id.as_str());
    std::fs::create_dir_all(&dir)?;
    let ready = super::ready_file(&home, id.as_str());
    let _ = engine.ledger().set_supervisor(&id, Some(std::process::id()), None);
    let listener = super::bind_unix(&super::ctl_socket(&home, id.as_str()))?;
    let r = ready_of(&id, &restored);
    write_ready(&ready, &r);
    ready_hook();
    // The restore's buffers are free now: hand their pages back, as an idle supervisor keeps little.
    engine.ledger().close_idle();
    super::spawner::trim_heap();
    let sup = Arc::new(Supervisor::new(engine, backend, id, restored.sandbox, generation, &home));
    if sup.engine.store.index_loaded() {
        // The restore read the store (a mark not laid out on this host yet): give the index back once idle.
        sup.shed_store_later();
    }
    let end = serve(&sup, &listener, stop);
    sup.finish(&end);
    Ok(())
}

pub fn ready_of(id: &SandboxId, r: &clade_core::engine::Restored) -> Ready {
    Ready {
        ok: true,
        sandbox: id.to_string(),
        error: None,
        pid: std::process::id(),
        restore_ms: r.restore.as_secs_f64() * 1e3,
        ready_ms: r.total.as_secs_f64() * 1e3,
        hygiene: serde_json::to_value(&r.hygiene).unwrap_or_default(),
        blob_bytes: clade_store::Store::blob_fetched().0,
    }
}

pub fn stop_flag() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    Ok(stop)
}

fn empty(id: &SandboxId) -> Ready {
    Ready { ok: false, sandbox: id.to_string(), error: None, pid: std::process::id(), ..Ready::default() }
}

/// Everything one supervisor holds, shared by the threads serving its connections.
pub struct Supervisor {
    pub engine: Engine,
    pub backend: Arc<dyn Backend>,
    pub id: SandboxId,
    sandbox: Mutex<Option<Box<dyn Sandbox>>>,
    generation: AtomicU64,
    /// Short ops hold it shared for their duration; mark, retake, suspend and kill hold it alone.
    gate: RwLock<()>,
    procs: Arc<Procs>,
    last_activity_ms: AtomicU64,
    /// When to give the store's index back (ms since the epoch; 0: nothing to give), see [`shed_store_memory`].
    shed_store_at_ms: AtomicU64,
    end: Mutex<Option<End>>,
    /// Set once the end is recorded ([`Supervisor::finish`]).
    finished: std::sync::atomic::AtomicBool,
    /// Wakes the accept loop when the end is set (a byte written to one side, polled on the other).
    wake: (UnixStream, UnixStream),
    /// This supervisor's directory (`sup_dir`: control socket, ready file, log).
    dir: PathBuf,
    /// The last measure of the sandbox's CPU use ([`Supervisor::cpu_busy`]).
    cpu_seen: Mutex<Option<CpuSample>>,
    /// The egress rules set on this sandbox, applied again after a retake (its restore gets a fresh network).
    egress: Mutex<EgressRules>,
    /// Frozen by a `Freeze` request: until a `Thaw`, only what needs no answer from inside is served (see
    /// `handle`).
    frozen: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct CpuSample {
    at: Instant,
    used_s: f64,
    busy: f64,
}

/// Measures closer together than this return the last one (a short interval is all noise).
const CPU_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug, Clone)]
enum End {
    Killed,
    Suspended,
    Signal,
    /// The sandbox ended on its own (its QEMU died): why, in the backend's and QEMU's words.
    Failed(String),
}

impl Supervisor {
    fn new(
        engine: Engine,
        backend: Arc<dyn Backend>,
        id: SandboxId,
        sandbox: Box<dyn Sandbox>,
        generation: u64,
        home: &CladeHome,
    ) -> Supervisor {
        let dir = super::sup_dir(home, id.as_str());
        Supervisor {
            engine,
            backend,
            id,
            sandbox: Mutex::new(Some(sandbox)),
            generation: AtomicU64::new(generation),
            gate: RwLock::new(()),
            procs: Arc::new(Procs::default()),
            last_activity_ms: AtomicU64::new(now_ms()),
            shed_store_at_ms: AtomicU64::new(0),
            end: Mutex::new(None),
            finished: std::sync::atomic::AtomicBool::new(false),
            wake: UnixStream::pair().expect("a socketpair for the supervisor's wake-up"),
            dir,
            cpu_seen: Mutex::new(None),
            egress: Mutex::new(EgressRules::default()),
            frozen: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// vCPUs the sandbox's processes kept busy since the last time they were measured (at least [`CPU_INTERVAL`]
    /// ago), or since they started: what admission counts a running sandbox's CPU by (admit.rs).
    fn cpu_busy(&self, pids: &[u32]) -> f64 {
        let now = Instant::now();
        let mut seen = self.cpu_seen.lock();
        if let Some(last) = *seen {
            if now.duration_since(last.at) < CPU_INTERVAL {
                return last.busy;
            }
        }
        let (mut used_s, mut age_s) = (0.0f64, 0.0f64);
        for (used, age) in pids.iter().filter_map(|p| clade_core::host::cpu_seconds(*p)) {
            used_s += used;
            age_s = age_s.max(age);
        }
        let busy = match *seen {
            // Processes that ended take their time with them: never below zero.
            Some(last) => (used_s - last.used_s).max(0.0) / now.duration_since(last.at).as_secs_f64(),
            None if age_s > 0.0 => used_s / age_s,
            None => 0.0,
        };
        *seen = Some(CpuSample { at: now, used_s, busy });
        busy
    }

    /// A handle on the running sandbox's agent (cheap: a shared connection).
    fn agent(&self) -> Result<AgentClient, Response> {
        self.sandbox.lock().as_ref().map(|s| s.agent().clone()).ok_or_else(|| {
            Response::err(
                ErrorKind::Conflict,
                "the sandbox is not running (suspended or ending meanwhile; see `clade ls`)",
            )
        })
    }

    fn ended(&self) -> Option<End> {
        self.end.lock().clone()
    }

    /// Whether the sandbox ended on its own; checked between requests, without waiting for one that holds it.
    fn check_exited(&self) -> Option<String> {
        let mut g = self.sandbox.try_lock()?;
        g.as_mut()?.exited()
    }

    /// Record how the sandbox ends and wake the accept loop.
    fn set_end(&self, e: End) {
        *self.end.lock() = Some(e);
        let _ = (&self.wake.0).write_all(b"x");
    }

    /// Record the sandbox's end, once: its processes forgotten, whatever still runs killed, the ledger told,
    /// this supervisor's directory (control socket included) removed. A request that ends the sandbox
    /// (suspend, kill) does this *before* it answers: a client that hears "suspended" may resume at once, and
    /// a resume starts a new supervisor under the same id, whose directory and ledger row this one must not
    /// touch any more (before 2026-12-03 a resume right after a suspend found the sandbox still "running").
    fn finish(&self, end: &End) {
        if self.finished.swap(true, Ordering::SeqCst) {
            return;
        }
        let (state, error) = match end {
            End::Suspended => (SandboxState::Suspended, None),
            End::Killed | End::Signal => (SandboxState::Dead, None),
            End::Failed(why) => {
                eprintln!("supervisor: sandbox {} ended on its own: {why}", self.id);
                (SandboxState::Failed, Some(why.as_str()))
            }
        };
        self.procs.forget_all("the sandbox ended");
        if let Some(s) = self.sandbox.lock().take() {
            let _ = s.kill();
        }
        let _ = self.engine.ledger().set_supervisor(&self.id, None, None);
        let _ = self.engine.ledger().set_sandbox_state(&self.id, state, error);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How often an idle supervisor looks at its sandbox without being woken. Signals wake it at once: the
/// sandbox's end (SIGCHLD: its init or QEMU is this process's child) and SIGTERM/SIGINT. A thousand idle
/// supervisors waking every 200 ms cost ~5% of a core before (docs/scale.md).
const IDLE_TICK_MS: u16 = 2_000;

fn serve(sup: &Arc<Supervisor>, listener: &UnixListener, stop: &AtomicBool) -> End {
    let _ = sup.wake.1.set_nonblocking(true);
    let mut wakers = Vec::new();
    for sig in [signal_hook::consts::SIGCHLD, signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Ok(w) = sup.wake.0.try_clone() {
            wakers.extend(signal_hook::low_level::pipe::register(sig, w).ok());
        }
    }
    let end = serve_woken(sup, listener, stop);
    for id in wakers {
        signal_hook::low_level::unregister(id);
    }
    end
}

fn serve_woken(sup: &Arc<Supervisor>, listener: &UnixListener, stop: &AtomicBool) -> End {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // True at the start too: the first quiet tick after the restore trims what the start left.
    let mut served = true;
    loop {
        if let Some(e) = sup.ended() {
            return e;
        }
        if stop.load(Ordering::Relaxed) {
            return End::Signal;
        }
        if let Some(why) = sup.check_exited() {
            return End::Failed(why);
        }
        shed_store_memory_when_due(sup);
        let mut fds =
            [PollFd::new(listener.as_fd(), PollFlags::POLLIN), PollFd::new(sup.wake.1.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(IDLE_TICK_MS)) {
            Ok(0) => {
                if std::mem::take(&mut served) {
                    // Quiet for a tick after requests: what they cached goes back (docs/scale.md).
                    sup.engine.ledger().close_idle();
                    super::spawner::trim_heap();
                }
                continue;
            }
            Err(_) => continue,
            Ok(_) => {}
        }
        if fds[1].revents().is_some_and(|r| !r.is_empty()) {
            let mut sink = [0u8; 64];
            while (&sup.wake.1).read(&mut sink).is_ok_and(|n| n > 0) {}
            continue; // an end was set or a signal came: checked at the top
        }
        let Ok((stream, _)) = listener.accept() else { continue };
        served = true;
        if sup.ended().is_some() {
            continue;
        }
        let sup = sup.clone();
        let spawned = std::thread::Builder::new().name("sup-conn".into()).spawn(move || handle(&sup, stream));
        if let Err(e) = spawned {
            eprintln!("supervisor: cannot start a connection thread: {e}");
        }
    }
}

fn send_line(s: &mut UnixStream, v: &impl serde::Serialize) -> std::io::Result<()> {
    let mut out = serde_json::to_vec(v).unwrap_or_default();
    out.push(b'\n');
    s.write_all(&out)
}

fn handle(sup: &Supervisor, stream: UnixStream) {
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return;
    }
    sup.last_activity_ms.store(now_ms(), Ordering::Relaxed);
    let _ = sup.engine.ledger().touch_sandbox(&sup.id);
    let mut out = stream;
    let req = match serde_json::from_str::<Request>(&line) {
        Ok(r) => r,
        Err(e) => {
            let _ = send_line(&mut out, &Response::err(ErrorKind::Invalid, format!("bad request: {e}")));
            return;
        }
    };
    // Frozen: what needs no answer from inside the sandbox is served (attaching to a process's events only
    // waits); a suspend thaws it first; the rest is refused in the form its caller reads.
    let serves_frozen = matches!(
        req,
        Request::Info
            | Request::Freeze
            | Request::Thaw
            | Request::Kill
            | Request::Suspend { .. }
            | Request::ProcConnect { .. }
    );
    if sup.frozen.load(Ordering::SeqCst) && !serves_frozen {
        let message = "the sandbox is frozen (paused): thaw it first (containerd: resume the task)".to_string();
        let _ = match &req {
            Request::ProcStart(spec) if spec.stream => {
                send_line(&mut out, &StreamEvent::Error { kind: ErrorKind::Conflict, message })
            }
            _ => send_line(&mut out, &Response::err(ErrorKind::Conflict, message)),
        };
        return;
    }
    match req {
        Request::ProcStart(spec) if spec.stream => {
            let started = {
                let _g = sup.gate.read();
                sup.agent().and_then(|a| sup.procs.start(&a, spec).map_err(|e| client_err("start", e)))
            };
            match started {
                Ok((pid, Some(rx))) => pipe_events(&mut out, pid, rx),
                Ok((pid, None)) => {
                    let _ = send_line(&mut out, &StreamEvent::Start { pid });
                }
                Err(r) => {
                    let _ = send_line(
                        &mut out,
                        &StreamEvent::Error {
                            kind: r.kind.unwrap_or(ErrorKind::Internal),
                            message: r.error.unwrap_or_default(),
                        },
                    );
                }
            }
        }
        Request::ProcConnect { pid } => match sup.procs.connect(pid) {
            Some(rx) => pipe_events(&mut out, pid, rx),
            None => {
                let msg = format!("no running process {pid} started through this sandbox's supervisor");
                let _ = send_line(&mut out, &StreamEvent::Error { kind: ErrorKind::NotFound, message: msg });
            }
        },
        Request::ReadStream { path } => read_stream(sup, &mut out, &path),
        Request::WriteStream { path, opts } => {
            let resp = write_stream(sup, &mut reader, &path, &opts);
            let _ = send_line(&mut out, &resp);
        }
        Request::Mark { .. }
        | Request::Retake { .. }
        | Request::Suspend { .. }
        | Request::Kill
        | Request::Freeze
        | Request::Thaw
        | Request::AttachRoot { .. }
        | Request::DetachRoot { .. }
        | Request::ProcGroup { .. }
        | Request::Bind { .. }
        | Request::SetEgress { .. } => {
            let (resp, end) = {
                let _g = sup.gate.write();
                let (resp, end) = exclusive(sup, req);
                if let Some(e) = &end {
                    sup.finish(e); // recorded before the answer (see `finish`)
                }
                (resp, end)
            };
            let _ = send_line(&mut out, &resp);
            if let Some(e) = end {
                sup.set_end(e);
            }
        }
        other => {
            let resp = {
                let _g = sup.gate.read();
                match sup.agent() {
                    Ok(agent) => shared(sup, &agent, other),
                    Err(r) => r,
                }
            };
            let _ = send_line(&mut out, &resp);
        }
    }
}

/// Copy a process's events to the connection until it exits; a failed write only detaches this listener.
fn pipe_events(out: &mut UnixStream, pid: u32, rx: std::sync::mpsc::Receiver<StreamEvent>) {
    if send_line(out, &StreamEvent::Start { pid }).is_err() {
        return;
    }
    for ev in rx {
        let last = matches!(ev, StreamEvent::Exit { .. } | StreamEvent::Error { .. });
        if send_line(out, &ev).is_err() || last {
            return;
        }
    }
}

fn read_stream(sup: &Supervisor, out: &mut UnixStream, path: &str) {
    let agent = {
        let _g = sup.gate.read();
        sup.agent()
    };
    let agent = match agent {
        Ok(a) => a,
        Err(r) => {
            let _ = send_line(out, &r);
            return;
        }
    };
    let st = match agent.stat(path) {
        Ok(st) => st,
        Err(e) => {
            let _ = send_line(out, &client_err(&format!("read {path}"), e));
            return;
        }
    };
    if st.file_type == FileType::Dir {
        let _ = send_line(out, &Response::err(ErrorKind::Invalid, format!("{path} is a directory: list it instead")));
        return;
    }
    if send_line(out, &Response::ok(serde_json::json!({"size": st.size}))).is_err() {
        return;
    }
    let mut w = std::io::BufWriter::with_capacity(256 * 1024, &*out);
    if agent.read_file(path, &mut w).is_ok() {
        let _ = w.flush();
    }
}

fn write_stream(sup: &Supervisor, src: &mut impl Read, path: &str, opts: &WriteOptions) -> Response {
    let agent = {
        let _g = sup.gate.read();
        sup.agent()
    };
    let agent = match agent {
        Ok(a) => a,
        Err(r) => return r,
    };
    match agent.write_file_with(path, src, opts, true) {
        Ok(n) => Response::ok(serde_json::json!({"bytes": n})),
        Err(e) => client_err(&format!("write {path}"), e),
    }
}

/// The kind of an agent failure: bad input, not found, or the kind of the OS error it reports.
pub fn agent_kind(e: &ClientError) -> ErrorKind {
    match e {
        ClientError::Agent(a) => match a {
            AgentError::NotFound { .. } | AgentError::NoSuchProcess { .. } | AgentError::NoSuchWatch { .. } => {
                ErrorKind::NotFound
            }
            AgentError::BadPath { .. } | AgentError::BadRequest { .. } | AgentError::IsADirectory { .. } => {
                ErrorKind::Invalid
            }
            AgentError::Os { errno, .. } => ErrorKind::of_errno(*errno),
            _ => ErrorKind::Internal,
        },
        _ => ErrorKind::Internal,
    }
}

fn client_err(what: &str, e: ClientError) -> Response {
    Response::err(agent_kind(&e), format!("{what}: {e}"))
}

/// A command the agent could not start (no such program, not executable, a bad working directory) is the
/// caller's input, not the sandbox's failure.
fn start_err(argv0: &str, e: ClientError) -> Response {
    match (&e, agent_kind(&e)) {
        (_, ErrorKind::Invalid | ErrorKind::NotFound | ErrorKind::Permission)
        | (ClientError::Agent(AgentError::Os { errno: 0, .. }), _) => {
            Response::err(ErrorKind::Invalid, format!("argv: cannot start {argv0:?}: {e}"))
        }
        (_, k) => Response::err(k, format!("exec: {e}")),
    }
}

fn engine_err(e: EngineError) -> Response {
    Response::err(ErrorKind::from(&e), e.to_string())
}

/// Ops that share the sandbox with others.
fn shared(sup: &Supervisor, agent: &AgentClient, req: Request) -> Response {
    let b64 = base64::engine::general_purpose::STANDARD;
    match req {
        Request::Info => {
            let rec = sup.engine.ledger().sandbox(&sup.id).ok();
            let pids = sup.sandbox.lock().as_ref().map(|s| s.pids()).unwrap_or_default();
            let mem: Vec<_> = pids.iter().filter_map(|p| clade_core::host::pss_rss(*p)).collect();
            let cpu_busy = sup.cpu_busy(&pids);
            let tasks: u64 = pids.iter().filter_map(|p| clade_core::host::threads(*p)).sum();
            // A frozen agent would not answer: no hello then, and the answer says why.
            let frozen = sup.frozen.load(Ordering::SeqCst);
            let hello = if frozen { None } else { agent.hello().ok() };
            Response::ok(serde_json::json!({
                "frozen": frozen,
                "sandbox": rec, "pids": pids, "generation": sup.generation.load(Ordering::Relaxed),
                "pss": mem.iter().map(|m| m.0).sum::<u64>(), "rss": mem.iter().map(|m| m.1).sum::<u64>(),
                "cpu_busy": cpu_busy, "tasks": tasks,
                "hello": hello, "last_activity_ms": sup.last_activity_ms.load(Ordering::Relaxed),
                "procs": sup.procs.list().len(),
                "blob_fetched": {"bytes": clade_store::Store::blob_fetched().0, "reads": clade_store::Store::blob_fetched().1},
            }))
        }
        Request::Exec { argv, env, cwd, stdin_b64 } => {
            if argv.is_empty() {
                return Response::err(ErrorKind::Invalid, "exec needs a command");
            }
            let stdin = match stdin_b64.map(|s| b64.decode(s)) {
                Some(Ok(b)) => Some(b),
                Some(Err(e)) => return Response::err(ErrorKind::Invalid, format!("stdin_b64: {e}")),
                None => None,
            };
            let start = Instant::now();
            let argv0 = argv[0].clone();
            let spec = ExecSpec { argv, env, cwd, stdin: stdin.is_some(), ..Default::default() };
            let result = match stdin {
                None => agent.run(spec),
                Some(data) => agent.exec(spec).and_then(|p| {
                    p.write_stdin(&data)?;
                    p.close_stdin()?;
                    p.output()
                }),
            };
            sup.engine.op(
                "exec",
                Some(&sup.id),
                None,
                start.elapsed(),
                result.as_ref().err().map(|e| e.to_string()).as_deref(),
                serde_json::json!({}),
            );
            match result {
                Ok(out) => Response::ok(serde_json::json!({
                    "code": out.status.code, "signal": out.status.signal,
                    "stdout_b64": b64.encode(&out.stdout), "stderr_b64": b64.encode(&out.stderr),
                })),
                Err(e) => start_err(&argv0, e),
            }
        }
        Request::WriteFile { path, data_b64, mode } => match b64.decode(data_b64) {
            Err(e) => Response::err(ErrorKind::Invalid, format!("data_b64: {e}")),
            Ok(data) => match agent.write_file_bytes(&path, &data, mode) {
                Ok(n) => Response::ok(serde_json::json!({"bytes": n})),
                Err(e) => Response::err(ErrorKind::Internal, format!("write {path}: {e}")),
            },
        },
        Request::ReadFile { path } => match agent.read_file_vec(&path) {
            Ok(data) => Response::ok(serde_json::json!({"data_b64": b64.encode(data)})),
            Err(e) => Response::err(ErrorKind::NotFound, format!("read {path}: {e}")),
        },
        Request::ProcStart(spec) => {
            if spec.argv.is_empty() {
                return Response::err(ErrorKind::Invalid, "proc_start needs a command");
            }
            let argv0 = spec.argv[0].clone();
            match sup.procs.start(agent, spec) {
                Ok((pid, _)) => Response::ok(serde_json::json!({"pid": pid})),
                Err(e) => start_err(&argv0, e),
            }
        }
        Request::ProcList => Response::ok(serde_json::json!({"procs": sup.procs.list()})),
        Request::ProcInput { pid, data_b64 } => {
            let data = match b64.decode(data_b64) {
                Ok(d) => d,
                Err(e) => return Response::err(ErrorKind::Invalid, format!("data_b64: {e}")),
            };
            if !sup.procs.contains(pid) {
                return no_proc(pid);
            }
            done(agent.write_stdin(pid, &data), "input")
        }
        Request::ProcCloseStdin { pid } => known(sup, pid, || agent.close_stdin(pid), "close stdin"),
        Request::ProcSignal { pid, signal } => known(sup, pid, || agent.signal(pid, signal), "signal"),
        Request::ProcResize { pid, rows, cols } => known(sup, pid, || agent.resize(pid, rows, cols), "resize"),
        Request::WatchStart { path, recursive } => match agent.watch_start(&path, recursive) {
            Ok(watch) => Response::ok(serde_json::json!({"watch": watch})),
            Err(e) => client_err(&format!("watch {path}"), e),
        },
        Request::WatchEvents { watch, wait_ms } => {
            match agent.watch_events(watch, std::time::Duration::from_millis(wait_ms.min(60_000))) {
                Ok((events, lost)) => Response::ok(serde_json::json!({"events": events, "lost": lost})),
                Err(e) => client_err(&format!("watch {watch}"), e),
            }
        }
        Request::WatchStop { watch } => match agent.watch_stop(watch) {
            Ok(()) => Response::ok(serde_json::json!({"stopped": watch})),
            Err(e) => client_err(&format!("watch {watch}"), e),
        },
        Request::Stat { path } => match agent.stat(&path) {
            Ok(st) => Response::ok(serde_json::to_value(st).unwrap_or_default()),
            Err(e) => client_err(&format!("stat {path}"), e),
        },
        Request::ListDir { path, depth } => match agent.list_dir(&path, depth.max(1)) {
            Ok(entries) => Response::ok(serde_json::json!({"entries": entries})),
            Err(e) => client_err(&format!("list {path}"), e),
        },
        Request::Mkdir { path, owner } => {
            match agent.stat(&path) {
                Ok(st) if st.file_type == FileType::Dir => return Response::ok(serde_json::json!({"created": false})),
                Ok(_) => return Response::err(ErrorKind::Conflict, format!("{path} exists and is not a directory")),
                Err(_) => {}
            }
            match agent.mkdir_p_owned(&path, None, owner) {
                Ok(()) => Response::ok(serde_json::json!({"created": true})),
                Err(e) => client_err(&format!("mkdir {path}"), e),
            }
        }
        Request::Move { from, to } => done(agent.rename(&from, &to), &format!("move {from} to {to}")),
        Request::Remove { path } => done(agent.remove(&path, true), &format!("remove {path}")),
        // Streams and exclusive ops are routed before this.
        _ => Response::err(ErrorKind::Invalid, "this op cannot be served here"),
    }
}

fn no_proc(pid: u32) -> Response {
    Response::err(ErrorKind::NotFound, format!("no running process {pid} started through this sandbox's supervisor"))
}

fn known(sup: &Supervisor, pid: u32, f: impl FnOnce() -> Result<(), ClientError>, what: &str) -> Response {
    if !sup.procs.contains(pid) {
        return no_proc(pid);
    }
    done(f(), what)
}

fn done(r: Result<(), ClientError>, what: &str) -> Response {
    match r {
        Ok(()) => Response::ok(serde_json::json!({})),
        Err(e) => client_err(what, e),
    }
}

/// How long after a mark or a retake the store's index is kept for the next one (an agent marking every few
/// seconds does not reload it each time); after that an idle sandbox gives it back.
const SHED_STORE_AFTER_MS: u64 = 60_000;

impl Supervisor {
    /// Give the store's index back [`SHED_STORE_AFTER_MS`] from now, unless another mark or retake comes first.
    fn shed_store_later(&self) {
        self.shed_store_at_ms.store(now_ms() + SHED_STORE_AFTER_MS, Ordering::Relaxed);
    }
}

/// Sheds the store's index once its time has come and no mark or retake is running (they hold the gate).
fn shed_store_memory_when_due(sup: &Supervisor) {
    let at = sup.shed_store_at_ms.load(Ordering::Relaxed);
    if at == 0 || now_ms() < at {
        return;
    }
    let Some(_alone) = sup.gate.try_write() else { return };
    if sup.shed_store_at_ms.compare_exchange(at, 0, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
        shed_store_memory(sup);
    }
}

/// After a mark or a retake (the ops that write to or read much of the store), once idle: give back the
/// store index this supervisor will not need while the sandbox runs. A ct sandbox reads nothing from the
/// store while it runs, so the whole index goes (~200 MB on a store of a few GB, loaded again by the next
/// mark); a vm sandbox's disk server keeps reading frames, so only the writers' dedup table goes.
fn shed_store_memory(sup: &Supervisor) {
    if crate::backends::footprint(sup.backend.kind()).reads_store_while_running() {
        sup.engine.store.release_dedup();
    } else {
        sup.engine.store.release_index();
    }
}

/// Ops that change the whole sandbox; the caller holds the gate alone.
fn exclusive(sup: &Supervisor, req: Request) -> (Response, Option<End>) {
    let mut slot = sup.sandbox.lock();
    if slot.is_none() {
        return (
            Response::err(
                ErrorKind::Conflict,
                "the sandbox is not running (suspended or ending meanwhile; see `clade ls`)",
            ),
            None,
        );
    }
    match req {
        Request::Mark { label, keep, not_clean, disk_only } => {
            let opts = MarkOptions { label, not_clean, disk_only };
            let sbx = slot.as_mut().expect("checked above");
            let done = match sup.engine.mark_sandbox(sbx.as_mut(), &sup.id, &opts, keep) {
                Ok(m) => (Response::ok(serde_json::to_value(&m).unwrap_or_default()), None),
                Err(e) => (engine_err(e), None),
            };
            sup.shed_store_later();
            done
        }
        Request::Retake { mark } => {
            let done = (retake(sup, &mut slot, &mark), None);
            sup.shed_store_later();
            done
        }
        Request::Suspend { disk_only } => {
            let rec = sup.engine.ledger().sandbox(&sup.id);
            let branch = match rec {
                Ok(r) => r.branch,
                Err(e) => return (Response::err(ErrorKind::Internal, e.to_string()), None),
            };
            let mut sbx = slot.take().expect("checked above");
            if sup.frozen.swap(false, Ordering::SeqCst) {
                // The suspend's dump stops the processes itself; a frozen cgroup would hold its own tools.
                if let Err(e) = sbx.thaw() {
                    *slot = Some(sbx);
                    sup.frozen.store(true, Ordering::SeqCst);
                    return (Response::err(ErrorKind::Internal, format!("thaw before suspend: {e}")), None);
                }
            }
            sup.procs.forget_all("the sandbox was suspended");
            let start = Instant::now();
            let opts = MarkOptions { label: Some("suspend".into()), not_clean: false, disk_only };
            match sbx.suspend(&opts) {
                Ok(state) => match sup.engine.record_mark(&branch, &state, &opts, false) {
                    Ok(m) => {
                        sup.engine.op(
                            "suspend",
                            Some(&sup.id),
                            Some(&m.id),
                            start.elapsed(),
                            None,
                            serde_json::json!({"pause_ms": state.pause.as_secs_f64()*1e3}),
                        );
                        (Response::ok(serde_json::to_value(&m).unwrap_or_default()), Some(End::Suspended))
                    }
                    Err(e) => (engine_err(e), Some(End::Killed)),
                },
                Err(e) => (Response::err(ErrorKind::Internal, format!("suspend: {e}")), Some(End::Killed)),
            }
        }
        Request::Freeze | Request::Thaw => {
            let freeze = matches!(req, Request::Freeze);
            let sbx = slot.as_mut().expect("checked above");
            let done = if freeze { sbx.freeze() } else { sbx.thaw() };
            answer(done, "freeze".into(), |()| {
                sup.frozen.store(freeze, Ordering::SeqCst);
                serde_json::json!({"frozen": freeze})
            })
        }
        Request::AttachRoot { name, host } => {
            let done = slot.as_mut().expect("checked above").attach_root(&name, &host);
            answer(done, format!("attach root {name}"), |path| serde_json::json!({"path": path}))
        }
        Request::DetachRoot { name } => {
            let done = slot.as_mut().expect("checked above").detach_root(&name);
            answer(done, format!("detach root {name}"), |()| serde_json::json!({"detached": name}))
        }
        Request::Bind { host, inside, readonly } => {
            let done = slot.as_mut().expect("checked above").bind(&host, &inside, readonly);
            answer(done, format!("mount {} at {inside}", host.display()), |()| serde_json::json!({"mounted": inside}))
        }
        Request::ProcGroup { leader, group_op: op } => {
            let done = slot.as_mut().expect("checked above").proc_group(leader, op);
            answer(done, format!("{op:?} the group of {leader}"), |n| serde_json::json!({"processes": n}))
        }
        Request::SetEgress { rules } => {
            let done = slot.as_mut().expect("checked above").set_egress_rules(&rules);
            answer(done, "egress rules".into(), |()| {
                *sup.egress.lock() = rules.clone();
                serde_json::to_value(&rules).unwrap_or_default()
            })
        }
        Request::Kill => {
            sup.procs.forget_all("the sandbox was killed");
            (Response::ok(serde_json::json!({"killed": sup.id.as_str()})), Some(End::Killed))
        }
        _ => (Response::err(ErrorKind::Invalid, "this op cannot be served here"), None),
    }
}

/// The answer to a backend operation on the sandbox: `ok`'s body, a refusal the backend explains (`Unsupported`:
/// invalid for this sandbox), or a failure of `what`.
fn answer<T>(
    done: Result<T, BackendError>,
    what: String,
    ok: impl FnOnce(T) -> serde_json::Value,
) -> (Response, Option<End>) {
    match done {
        Ok(v) => (Response::ok(ok(v)), None),
        Err(e @ BackendError::Unsupported(_)) => (Response::err(ErrorKind::Invalid, e.to_string()), None),
        Err(e) => (Response::err(ErrorKind::Internal, format!("{what}: {e}")), None),
    }
}

/// The sandbox's world goes back to `mark`: the running sandbox ends and the mark is restored in its place,
/// with the same id, hostname and machine-id, on the same branch (whose head becomes that mark).
fn retake(sup: &Supervisor, slot: &mut Option<Box<dyn Sandbox>>, mark: &str) -> Response {
    let start = Instant::now();
    let target = match sup.engine.resolve_mark(mark, Some(sup.backend.kind())) {
        Ok(m) => m,
        Err(e) => return engine_err(e),
    };
    let rec = sup.engine.ledger().sandbox(&sup.id);
    let branch = match rec {
        Ok(r) => r.branch,
        Err(e) => return Response::err(ErrorKind::Internal, e.to_string()),
    };
    let moved = sup.engine.ledger().set_head(&branch, &target.id);
    if let Err(e) = moved {
        return Response::err(ErrorKind::Conflict, format!("cannot retake to {}: {e}", target.id));
    }
    sup.procs.forget_all(&format!("the sandbox was retaken to mark {}", target.id));
    if let Some(old) = slot.take() {
        let _ = old.kill();
    }
    let generation = sup.generation.fetch_add(1, Ordering::Relaxed) + 1;
    match sup.engine.restore_into(sup.backend.as_ref(), &sup.id, &target, generation) {
        Ok(mut r) => {
            let rules = sup.egress.lock().clone();
            if !rules.is_empty() {
                if let Err(e) = r.sandbox.set_egress_rules(&rules) {
                    // Never run a retaken sandbox without the rules it was given.
                    let _ = r.sandbox.kill();
                    return Response::err(ErrorKind::Internal, format!("retake: the egress rules again: {e}"));
                }
            }
            *slot = Some(r.sandbox);
            sup.engine.op("retake", Some(&sup.id), Some(&target.id), start.elapsed(), None, serde_json::json!({}));
            Response::ok(serde_json::json!({"mark": target.id, "retake_ms": start.elapsed().as_secs_f64() * 1e3}))
        }
        Err(e) => engine_err(e),
    }
}
