//! The native API's routes for what runs inside a sandbox: commands (`exec`, whole or streamed), processes
//! started through its supervisor (start, list, attach, stdin, signals, PTY size), and its filesystem (read,
//! write, stat, list, mkdir, rename, remove). Every handler is one [`SandboxApi`] operation; output streams are
//! NDJSON lines (`{"pid"}`, `{"stdout"}`/`{"stderr"}` chunks, then `{"exit"}` or `{"error"}`).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use base64::Engine as _;
use clade_host::api::{ExecEvents, ExecRequest, ProcSpec};
use serde::Deserialize;

use crate::app::{blocking, json, wake, App, Reply};
use crate::error::{ApiError, Body};

async fn exec(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<ExecRequest>) -> Reply {
    if req.stream {
        return exec_stream(app, id, req).await;
    }
    let limit = crate::exec::limit_for(&req, app.exec_limit);
    let out = blocking(&app, "exec", move |a| {
        wake(a, &id)?;
        crate::exec::exec_within(a.api.as_ref(), &id, req, limit)
    })
    .await?;
    Ok(json(out))
}

/// NDJSON lines as the command runs: `{"pid"}`, `{"stdout"}`/`{"stderr"}` chunks, `{"exit"}` (or `{"error"}`).
/// A client that hangs up detaches; the command keeps running.
async fn exec_stream(app: Arc<App>, id: String, req: ExecRequest) -> Reply {
    let events = blocking(&app, "exec_start", move |a| {
        wake(a, &id)?;
        a.api.exec_stream(&id, req)
    })
    .await?;
    Ok(ndjson(events))
}

/// A stream of events as an NDJSON answer; a client that hangs up detaches (the process keeps running).
fn ndjson(events: ExecEvents) -> axum::response::Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::task::spawn_blocking(move || {
        for ev in events {
            let line = match ev {
                Ok(ev) => ev.to_json(),
                Err(e) => {
                    let err: ApiError = e.into();
                    serde_json::json!({"error": {"code": err.code, "message": err.message}})
                }
            };
            let mut b = serde_json::to_vec(&line).unwrap_or_default();
            b.push(b'\n');
            if tx.blocking_send(Ok(Bytes::from(b))).is_err() {
                return; // the client went away: detach
            }
        }
    });
    let body = axum::body::Body::from_stream(tokio_stream_of(rx));
    ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}

fn tokio_stream_of<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: String,
    #[serde(default)]
    mode: Option<String>,
    /// Owner of the file written (and of parents created for it): both or neither.
    #[serde(default)]
    uid: Option<u32>,
    #[serde(default)]
    gid: Option<u32>,
    /// Extended attributes of the file written: a JSON object of `user.` names to string values.
    #[serde(default)]
    xattrs: Option<String>,
}

/// `uid` and `gid`, both or neither.
fn owner_of(uid: Option<u32>, gid: Option<u32>) -> Result<Option<clade_host::api::FileOwner>, ApiError> {
    match (uid, gid) {
        (Some(uid), Some(gid)) => Ok(Some(clade_host::api::FileOwner { uid, gid })),
        (None, None) => Ok(None),
        _ => Err(ApiError::bad_request("uid and gid: give both or neither")),
    }
}

fn check_path(p: &str) -> Result<(), ApiError> {
    if !p.starts_with('/') || p.contains('\0') {
        return Err(ApiError::bad_request(format!("path: {p:?} must be absolute and contain no NUL")));
    }
    Ok(())
}

async fn read_file(State(app): State<Arc<App>>, Path(id): Path<String>, Query(q): Query<FileQuery>) -> Reply {
    check_path(&q.path)?;
    let (size, mut reader) = blocking(&app, "read_file", move |a| {
        wake(a, &id)?;
        a.api.open_file(&id, &q.path)
    })
    .await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut left = size;
        while left > 0 {
            let mut buf = vec![0u8; (256 * 1024).min(left as usize)];
            match reader.read(&mut buf) {
                Ok(0) => {
                    let _ = tx.blocking_send(Err(std::io::Error::other("the file ended early")));
                    return;
                }
                Ok(n) => {
                    buf.truncate(n);
                    left -= n as u64;
                    if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    let body = axum::body::Body::from_stream(tokio_stream_of(rx));
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream".to_string()), (header::CONTENT_LENGTH, size.to_string())],
        body,
    )
        .into_response())
}

async fn write_file(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Reply {
    check_path(&q.path)?;
    let mode = match q.mode.as_deref().map(|m| u32::from_str_radix(m.trim_start_matches("0o"), 8)) {
        None => None,
        Some(Ok(m)) if m <= 0o7777 => Some(m),
        Some(_) => return Err(ApiError::bad_request("mode: an octal permission such as 644")),
    };
    let xattrs = match q.xattrs.as_deref().map(serde_json::from_str::<BTreeMap<String, String>>) {
        None => BTreeMap::new(),
        Some(Ok(x)) => x,
        Some(Err(e)) => return Err(ApiError::bad_request(format!("xattrs: a JSON object of names to strings: {e}"))),
    };
    let opts = clade_host::api::WriteOptions { mode, owner: owner_of(q.uid, q.gid)?, xattrs };
    use futures_util::StreamExt;
    let limit = app.max_upload;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("upload larger than the limit of {} MiB (clade serve --max-upload-mib)", limit >> 20),
        )
    };
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    // The bytes go to the sandbox as they arrive: async body -> channel -> a blocking reader for the supervisor.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Bytes, String>>(8);
    let writer = {
        let app = app.clone();
        tokio::task::spawn_blocking(move || {
            let mut src = ChannelReader { rx, cur: Bytes::new() };
            wake(&app, &id)?;
            app.api.write_file_from(&id, &q.path, &opts, &mut src)
        })
    };
    let mut stream = body.into_data_stream();
    let mut seen = 0u64;
    let mut refused = None;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                refused = Some(ApiError::bad_request(format!("upload: {e}")));
                break;
            }
        };
        seen += chunk.len() as u64;
        if seen > limit {
            refused = Some(too_large());
            break;
        }
        let tx2 = tx.clone();
        if tokio::task::spawn_blocking(move || tx2.send(Ok(chunk))).await.ok().and_then(|r| r.ok()).is_none() {
            break; // the writer stopped early: its answer says why
        }
    }
    if let Some(e) = &refused {
        let _ = tx.send(Err(e.message.clone()));
    }
    drop(tx);
    let out = writer.await?;
    if let Some(e) = refused {
        return Err(e);
    }
    Ok(json(serde_json::json!({"bytes": out?})))
}

/// A blocking `Read` over chunks sent from the async side; an `Err` chunk fails the read (the upload is
/// abandoned and the sandbox's file is left as it was).
struct ChannelReader {
    rx: std::sync::mpsc::Receiver<Result<Bytes, String>>,
    cur: Bytes,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.recv() {
                Ok(Ok(b)) => self.cur = b,
                Ok(Err(why)) => return Err(std::io::Error::other(why)),
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}

async fn remove_file(State(app): State<Arc<App>>, Path(id): Path<String>, Query(q): Query<FileQuery>) -> Reply {
    check_path(&q.path)?;
    blocking(&app, "remove", move |a| {
        wake(a, &id)?;
        a.api.remove(&id, &q.path)
    })
    .await?;
    Ok(json(serde_json::json!({"removed": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    path: String,
    #[serde(default = "one")]
    depth: u32,
}

fn one() -> u32 {
    1
}

async fn stat(State(app): State<Arc<App>>, Path(id): Path<String>, Query(q): Query<FileQuery>) -> Reply {
    check_path(&q.path)?;
    Ok(json(
        blocking(&app, "stat", move |a| {
            wake(a, &id)?;
            a.api.stat(&id, &q.path)
        })
        .await?,
    ))
}

async fn list_dir(State(app): State<Arc<App>>, Path(id): Path<String>, Query(q): Query<ListQuery>) -> Reply {
    check_path(&q.path)?;
    let entries = blocking(&app, "list_dir", move |a| {
        wake(a, &id)?;
        a.api.list_dir(&id, &q.path, q.depth.max(1))
    })
    .await?;
    Ok(json(serde_json::json!({"entries": entries})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MkdirReq {
    path: String,
    #[serde(default)]
    uid: Option<u32>,
    #[serde(default)]
    gid: Option<u32>,
}

async fn make_dir(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<MkdirReq>) -> Reply {
    check_path(&req.path)?;
    let owner = owner_of(req.uid, req.gid)?;
    let created = blocking(&app, "mkdir", move |a| {
        wake(a, &id)?;
        a.api.make_dir(&id, &req.path, owner)
    })
    .await?;
    Ok(json(serde_json::json!({"created": created})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RenameReq {
    from: String,
    to: String,
}

async fn set_egress(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    Body(rules): Body<clade_host::api::EgressRules>,
) -> Reply {
    let answer = serde_json::to_value(&rules).unwrap_or_default();
    blocking(&app, "egress", move |a| {
        wake(a, &id)?;
        a.api.set_egress(&id, &rules)
    })
    .await?;
    Ok(json(answer))
}

async fn rename(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<RenameReq>) -> Reply {
    check_path(&req.from)?;
    check_path(&req.to)?;
    blocking(&app, "rename", move |a| {
        wake(a, &id)?;
        a.api.rename(&id, &req.from, &req.to)
    })
    .await?;
    Ok(json(serde_json::json!({"renamed": true})))
}

/// A process to start: what `ProcSpec` holds, without the supervisor's own `stream` switch (always streamed).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartReq {
    argv: Vec<String>,
    #[serde(default)]
    env: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    user: Option<String>,
    /// Run on a PTY of this size: `[rows, cols]`.
    #[serde(default)]
    pty: Option<(u16, u16)>,
    #[serde(default)]
    stdin: bool,
    #[serde(default)]
    tag: Option<String>,
}

async fn proc_start(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<StartReq>) -> Reply {
    let probe =
        ExecRequest { argv: req.argv.clone(), env: req.env.clone(), cwd: req.cwd.clone(), ..Default::default() };
    probe.check()?;
    let spec = ProcSpec {
        argv: req.argv,
        env: req.env,
        cwd: req.cwd,
        user: req.user,
        pty: req.pty,
        stdin: req.stdin,
        tag: req.tag,
        stream: true,
        ..Default::default()
    };
    let events = blocking(&app, "proc_start", move |a| {
        wake(a, &id)?;
        let (pid, events) = a.api.proc_start(&id, spec)?;
        let first = std::iter::once(Ok(clade_host::api::ExecEvent::Pid(pid)));
        Ok(Box::new(first.chain(events)) as ExecEvents)
    })
    .await?;
    Ok(ndjson(events))
}

async fn proc_list(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    let procs = blocking(&app, "proc_list", move |a| a.api.proc_list(&id)).await?;
    Ok(json(serde_json::json!({"processes": procs})))
}

async fn proc_events(State(app): State<Arc<App>>, Path((id, pid)): Path<(String, u32)>) -> Reply {
    let events = blocking(&app, "proc_connect", move |a| a.api.proc_connect(&id, pid)).await?;
    Ok(ndjson(events))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InputReq {
    data_b64: String,
}

async fn proc_input(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, u32)>,
    Body(req): Body<InputReq>,
) -> Reply {
    let data = base64::engine::general_purpose::STANDARD
        .decode(req.data_b64)
        .map_err(|e| ApiError::bad_request(format!("data_b64: {e}")))?;
    blocking(&app, "proc_input", move |a| a.api.proc_input(&id, pid, &data)).await?;
    Ok(json(serde_json::json!({"pid": pid})))
}

async fn proc_close_stdin(State(app): State<Arc<App>>, Path((id, pid)): Path<(String, u32)>) -> Reply {
    blocking(&app, "proc_close_stdin", move |a| a.api.proc_close_stdin(&id, pid)).await?;
    Ok(json(serde_json::json!({"pid": pid})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalReq {
    signal: i32,
}

async fn proc_signal(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, u32)>,
    Body(req): Body<SignalReq>,
) -> Reply {
    blocking(&app, "proc_signal", move |a| a.api.proc_signal(&id, pid, req.signal)).await?;
    Ok(json(serde_json::json!({"pid": pid})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResizeReq {
    rows: u16,
    cols: u16,
}

async fn proc_resize(
    State(app): State<Arc<App>>,
    Path((id, pid)): Path<(String, u32)>,
    Body(req): Body<ResizeReq>,
) -> Reply {
    blocking(&app, "proc_resize", move |a| a.api.proc_resize(&id, pid, req.rows, req.cols)).await?;
    Ok(json(serde_json::json!({"pid": pid})))
}

/// The inside routes, added to the native router.
pub fn routes(r: axum::Router<Arc<App>>) -> axum::Router<Arc<App>> {
    use axum::routing::{get, post};
    r.route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/files", get(read_file).put(write_file).delete(remove_file))
        .route("/v1/sandboxes/{id}/fs/stat", get(stat))
        .route("/v1/sandboxes/{id}/fs/list", get(list_dir))
        .route("/v1/sandboxes/{id}/fs/mkdir", post(make_dir))
        .route("/v1/sandboxes/{id}/fs/rename", post(rename))
        .route("/v1/sandboxes/{id}/egress", axum::routing::put(set_egress))
        .route("/v1/sandboxes/{id}/processes", get(proc_list).post(proc_start))
        .route("/v1/sandboxes/{id}/processes/{pid}/events", get(proc_events))
        .route("/v1/sandboxes/{id}/processes/{pid}/input", post(proc_input))
        .route("/v1/sandboxes/{id}/processes/{pid}/close_stdin", post(proc_close_stdin))
        .route("/v1/sandboxes/{id}/processes/{pid}/signal", post(proc_signal))
        .route("/v1/sandboxes/{id}/processes/{pid}/resize", post(proc_resize))
}
