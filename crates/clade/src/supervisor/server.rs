//! The supervisor process: restore one sandbox, then serve its requests until it is killed or suspended (or
//! the supervisor gets SIGTERM/SIGINT, which ends the sandbox cleanly).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, MarkOptions, Sandbox};
use clade_core::engine::{Engine, EngineError};
use clade_ledger::{MarkId, SandboxId, SandboxState};

use super::protocol::{Ready, Request, Response};

/// Everything one supervisor holds.
pub struct Supervisor {
    pub engine: Engine,
    pub backend: Arc<dyn Backend>,
    pub id: SandboxId,
    pub sandbox: Option<Box<dyn Sandbox>>,
    pub generation: u64,
}

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
    let listener = UnixListener::bind(super::ctl_socket(&home, id.as_str()))?;
    let r = ready_of(&id, &restored);
    write_ready(&ready, &r);
    ready_hook();
    let mut sup = Supervisor { engine, backend, id, sandbox: Some(restored.sandbox), generation };
    let end = serve(&mut sup, &listener, stop);
    let state = match end {
        End::Suspended => SandboxState::Suspended,
        End::Killed | End::Signal => SandboxState::Dead,
    };
    if let Some(s) = sup.sandbox.take() {
        let _ = s.kill();
    }
    let _ = sup.engine.ledger().set_supervisor(&sup.id, None, None);
    let _ = sup.engine.ledger().set_sandbox_state(&sup.id, state, None);
    let _ = std::fs::remove_dir_all(&dir);
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
    }
}

pub fn stop_flag() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    Ok(stop)
}

fn empty(id: &SandboxId) -> Ready {
    Ready {
        ok: false,
        sandbox: id.to_string(),
        error: None,
        pid: std::process::id(),
        restore_ms: 0.0,
        ready_ms: 0.0,
        hygiene: serde_json::Value::Null,
    }
}

enum End {
    Killed,
    Suspended,
    Signal,
}

fn serve(sup: &mut Supervisor, listener: &UnixListener, stop: &AtomicBool) -> End {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    loop {
        if stop.load(Ordering::Relaxed) {
            return End::Signal;
        }
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(200u16)) {
            Ok(0) | Err(_) => continue,
            Ok(_) => {}
        }
        let Ok((stream, _)) = listener.accept() else { continue };
        let _ = sup.engine.ledger().touch_sandbox(&sup.id);
        match handle(sup, stream) {
            Some(end) => return end,
            None => continue,
        }
    }
}

fn handle(sup: &mut Supervisor, stream: UnixStream) -> Option<End> {
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return None,
    });
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return None;
    }
    let (resp, end) = match serde_json::from_str::<Request>(&line) {
        Err(e) => (Response::err(2, format!("bad request: {e}")), None),
        Ok(req) => dispatch(sup, req),
    };
    let mut out = serde_json::to_vec(&resp).unwrap_or_default();
    out.push(b'\n');
    let mut s = stream;
    let _ = s.write_all(&out);
    end
}

fn engine_err(e: EngineError) -> Response {
    Response::err(e.exit_code(), e.to_string())
}

fn dispatch(sup: &mut Supervisor, req: Request) -> (Response, Option<End>) {
    let b64 = base64::engine::general_purpose::STANDARD;
    let Some(sbx) = sup.sandbox.as_mut() else {
        return (Response::err(1, "the sandbox is not running"), None);
    };
    match req {
        Request::Info => {
            let rec = sup.engine.ledger().sandbox(&sup.id).ok();
            let pids = sbx.pids();
            let mem: Vec<_> = pids.iter().filter_map(|p| clade_core::host::pss_rss(*p)).collect();
            let hello = sbx.agent().hello().ok();
            (
                Response::ok(serde_json::json!({
                    "sandbox": rec, "pids": pids, "generation": sup.generation,
                    "pss": mem.iter().map(|m| m.0).sum::<u64>(), "rss": mem.iter().map(|m| m.1).sum::<u64>(),
                    "hello": hello,
                })),
                None,
            )
        }
        Request::Exec { argv, env, cwd, stdin_b64 } => {
            if argv.is_empty() {
                return (Response::err(2, "exec needs a command"), None);
            }
            let stdin = match stdin_b64.map(|s| b64.decode(s)) {
                Some(Ok(b)) => Some(b),
                Some(Err(e)) => return (Response::err(2, format!("stdin_b64: {e}")), None),
                None => None,
            };
            let start = Instant::now();
            let spec = ExecSpec { argv, env, cwd, stdin: stdin.is_some(), ..Default::default() };
            let result = match stdin {
                None => sbx.agent().run(spec),
                Some(data) => sbx.agent().exec(spec).and_then(|p| {
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
                Ok(out) => (
                    Response::ok(serde_json::json!({
                        "code": out.status.code, "signal": out.status.signal,
                        "stdout_b64": b64.encode(&out.stdout), "stderr_b64": b64.encode(&out.stderr),
                    })),
                    None,
                ),
                Err(e) => (Response::err(1, format!("exec: {e}")), None),
            }
        }
        Request::WriteFile { path, data_b64, mode } => match b64.decode(data_b64) {
            Err(e) => (Response::err(2, format!("data_b64: {e}")), None),
            Ok(data) => match sbx.agent().write_file_bytes(&path, &data, mode) {
                Ok(n) => (Response::ok(serde_json::json!({"bytes": n})), None),
                Err(e) => (Response::err(1, format!("write {path}: {e}")), None),
            },
        },
        Request::ReadFile { path } => match sbx.agent().read_file_vec(&path) {
            Ok(data) => (Response::ok(serde_json::json!({"data_b64": b64.encode(data)})), None),
            Err(e) => (Response::err(3, format!("read {path}: {e}")), None),
        },
        Request::Mark { label, keep, not_clean } => {
            let opts = MarkOptions { label, not_clean };
            match sup.engine.mark_sandbox(sbx.as_mut(), &sup.id, &opts, keep) {
                Ok(m) => (Response::ok(serde_json::to_value(&m).unwrap_or_default()), None),
                Err(e) => (engine_err(e), None),
            }
        }
        Request::Retake { mark } => (retake(sup, &mark), None),
        Request::Suspend => {
            let sbx = sup.sandbox.take().expect("checked above");
            let start = Instant::now();
            let rec = sup.engine.ledger().sandbox(&sup.id);
            let branch = match rec {
                Ok(r) => r.branch,
                Err(e) => return (Response::err(1, e.to_string()), None),
            };
            let opts = MarkOptions { label: Some("suspend".into()), not_clean: false };
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
                Err(e) => (Response::err(1, format!("suspend: {e}")), Some(End::Killed)),
            }
        }
        Request::Kill => (Response::ok(serde_json::json!({"killed": sup.id.as_str()})), Some(End::Killed)),
    }
}

/// The sandbox's world goes back to `mark`: the running sandbox ends and the mark is restored in its place,
/// with the same id, hostname and machine-id, on the same branch (whose head becomes that mark).
fn retake(sup: &mut Supervisor, mark: &str) -> Response {
    let start = Instant::now();
    let target = match sup.engine.resolve_mark(mark, Some(sup.backend.kind())) {
        Ok(m) => m,
        Err(e) => return engine_err(e),
    };
    let rec = sup.engine.ledger().sandbox(&sup.id);
    let branch = match rec {
        Ok(r) => r.branch,
        Err(e) => return Response::err(1, e.to_string()),
    };
    let moved = sup.engine.ledger().set_head(&branch, &target.id);
    if let Err(e) = moved {
        return Response::err(4, format!("cannot retake to {}: {e}", target.id));
    }
    if let Some(old) = sup.sandbox.take() {
        let _ = old.kill();
    }
    sup.generation += 1;
    match sup.engine.restore_into(sup.backend.as_ref(), &sup.id, &target, sup.generation) {
        Ok(r) => {
            sup.sandbox = Some(r.sandbox);
            sup.engine.op("retake", Some(&sup.id), Some(&target.id), start.elapsed(), None, serde_json::json!({}));
            Response::ok(serde_json::json!({"mark": target.id, "retake_ms": start.elapsed().as_secs_f64() * 1e3}))
        }
        Err(e) => engine_err(e),
    }
}
