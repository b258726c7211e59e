//! The native API's routes: thin handlers over [`clade_host::ops::Ops`], so HTTP and the CLI share every semantic.
//! Blocking work (supervisor calls, restores, marks) runs on tokio's blocking pool.
//!
//! [`ROUTES`] lists every route once; the router is built from the same handlers and a test checks the list
//! against `docs/openapi.json`, so the document cannot fall behind the code.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clade_core::backend::BackendKind;
use serde::Deserialize;

use crate::error::{ApiError, Body};
use crate::server::App;
use clade_host::ops::ExecRequest;

/// Every route of the native API: (method, path in OpenAPI's `{param}` form).
#[cfg_attr(not(test), allow(dead_code))]
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/openapi.json"),
    ("get", "/metrics"),
    ("get", "/v1/health"),
    ("get", "/v1/sandboxes"),
    ("post", "/v1/sandboxes"),
    ("get", "/v1/sandboxes/{id}"),
    ("delete", "/v1/sandboxes/{id}"),
    ("post", "/v1/sandboxes/{id}/exec"),
    ("get", "/v1/sandboxes/{id}/files"),
    ("put", "/v1/sandboxes/{id}/files"),
    ("get", "/v1/sandboxes/{id}/marks"),
    ("post", "/v1/sandboxes/{id}/marks"),
    ("post", "/v1/sandboxes/{id}/retake"),
    ("post", "/v1/sandboxes/{id}/suspend"),
    ("post", "/v1/sandboxes/{id}/resume"),
    ("post", "/v1/sandboxes/{id}/timeout"),
    ("get", "/v1/marks"),
    ("get", "/v1/marks/{id}"),
    ("post", "/v1/marks/{id}/fork"),
    ("get", "/v1/branches"),
    ("delete", "/v1/branches/{id}"),
    ("post", "/v1/gc"),
    ("post", "/v1/audit"),
    ("post", "/v1/sandboxes/{id}/push"),
    ("post", "/v1/sandboxes/{id}/pull"),
    ("get", "/v1/roam"),
];

pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/v1/health", get(health))
        .route("/v1/sandboxes", get(list).post(create))
        .route("/v1/sandboxes/{id}", get(sandbox).delete(kill))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/files", get(read_file).put(write_file))
        .route("/v1/sandboxes/{id}/marks", get(sandbox_marks).post(mark))
        .route("/v1/sandboxes/{id}/retake", post(retake))
        .route("/v1/sandboxes/{id}/suspend", post(suspend))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/sandboxes/{id}/timeout", post(set_timeout))
        .route("/v1/marks", get(marks))
        .route("/v1/marks/{id}", get(mark_info))
        .route("/v1/marks/{id}/fork", post(fork_mark))
        .route("/v1/branches", get(branches))
        .route("/v1/branches/{id}", axum::routing::delete(delete_branch))
        .route("/v1/gc", post(gc))
        .route("/v1/audit", post(audit))
        .route("/v1/sandboxes/{id}/push", post(push))
        .route("/v1/sandboxes/{id}/pull", post(pull))
        .route("/v1/roam", get(roam_list))
        .with_state(app)
}

type Reply = Result<Response, ApiError>;

/// Runs a blocking operation, timing it into the metrics under `op`.
async fn blocking<T: Send + 'static>(
    app: &Arc<App>,
    op: &'static str,
    f: impl FnOnce(&App) -> anyhow::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    let a = app.clone();
    let start = Instant::now();
    let r = tokio::task::spawn_blocking(move || f(&a)).await?;
    app.metrics.op(op, r.is_ok(), start.elapsed());
    Ok(r?)
}

fn json(v: impl serde::Serialize) -> Response {
    Json(v).into_response()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Reply {
    let text = blocking(&app, "metrics", |a| Ok(a.metrics.render(&a.ops))).await?;
    Ok(([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response())
}

async fn health(State(app): State<Arc<App>>) -> Response {
    json(serde_json::json!({"ok": true, "version": env!("CARGO_PKG_VERSION"), "home": app.ops.home().root()}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateReq {
    /// A mark id or label, or a template name (its base on `backend`).
    from: String,
    #[serde(default)]
    backend: Option<BackendKind>,
    #[serde(default = "one")]
    count: u32,
    /// Suspend after this many seconds without exec, file or API activity (0: never).
    #[serde(default)]
    idle_timeout_s: Option<u64>,
    /// When the host lacks memory or CPU, suspend the idlest sandboxes to make room (else: 429).
    #[serde(default)]
    make_room: bool,
}

fn one() -> u32 {
    1
}

async fn create(State(app): State<Arc<App>>, Body(req): Body<CreateReq>) -> Reply {
    let idle = req.idle_timeout_s;
    let out =
        blocking(&app, "fork", move |a| a.ops.fork_with(&req.from, req.backend, req.count, req.make_room)).await?;
    if let Some(secs) = idle {
        for s in out["sandboxes"].as_array().into_iter().flatten() {
            if let Some(id) = s["sandbox"].as_str() {
                app.idle.set_timeout(id, secs);
            }
        }
    }
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ForkReq {
    #[serde(default = "one")]
    count: u32,
    #[serde(default)]
    make_room: bool,
}

async fn fork_mark(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<ForkReq>) -> Reply {
    let out = blocking(&app, "fork", move |a| a.ops.fork_with(&id, None, req.count, req.make_room)).await?;
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

async fn list(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "list", |a| a.ops.list()).await?))
}

async fn sandbox(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "get", move |a| a.ops.get(&id)).await?))
}

async fn kill(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    app.idle.forget(&id);
    Ok(json(blocking(&app, "kill", move |a| a.ops.kill(&id)).await?))
}

/// Resume a suspended sandbox before a request that needs it running (idle suspend is invisible to callers).
fn wake(a: &App, id: &str) -> anyhow::Result<()> {
    if a.idle.was_idle_suspended(id) {
        let rec = a.ops.engine.ledger().sandbox(&clade_ledger::SandboxId::new(id));
        if rec.is_ok_and(|r| r.state == clade_ledger::SandboxState::Suspended) {
            let r = a.ops.resume(id)?;
            if !r["ok"].as_bool().unwrap_or(false) {
                return Err(anyhow::anyhow!("resuming idle sandbox {id}: {}", r["error"]));
            }
        }
    }
    a.idle.touch(id);
    Ok(())
}

async fn exec(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<ExecRequest>) -> Reply {
    if req.stream {
        return exec_stream(app, id, req).await;
    }
    let limit = crate::exec::limit_for(&req, app.exec_limit);
    let out = blocking(&app, "exec", move |a| {
        wake(a, &id)?;
        crate::exec::exec_within(&a.ops, &id, req, limit)
    })
    .await?;
    Ok(json(out))
}

/// NDJSON lines as the command runs: `{"pid"}`, `{"stdout"}`/`{"stderr"}` chunks, `{"exit"}` (or `{"error"}`).
/// A client that hangs up detaches; the command keeps running.
async fn exec_stream(app: Arc<App>, id: String, req: ExecRequest) -> Reply {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let events = blocking(&app, "exec_start", move |a| {
        wake(a, &id)?;
        a.ops.exec_stream(&id, req)
    })
    .await?;
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
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
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
        a.ops.open_file(&id, &q.path)
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
            app.ops.write_file_from(&id, &q.path, mode, &mut src)
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

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct MarkReq {
    #[serde(default)]
    label: Option<String>,
    #[serde(default)]
    keep: bool,
    #[serde(default)]
    not_clean: bool,
}

async fn mark(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<MarkReq>) -> Reply {
    let out = blocking(&app, "mark", move |a| {
        wake(a, &id)?;
        a.ops.mark(&id, req.label, req.keep, req.not_clean)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

async fn sandbox_marks(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "marks", move |a| a.ops.marks(Some(&id))).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RetakeReq {
    to: String,
}

async fn retake(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<RetakeReq>) -> Reply {
    let out = blocking(&app, "retake", move |a| {
        wake(a, &id)?;
        a.ops.retake(&id, &req.to)
    })
    .await?;
    Ok(json(out))
}

async fn suspend(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "suspend", move |a| a.ops.suspend(&id)).await?))
}

async fn resume(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    let out = blocking(&app, "resume", move |a| {
        let r = a.ops.resume(&id);
        a.idle.touch(&id);
        r
    })
    .await?;
    Ok(json(out))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TimeoutReq {
    idle_timeout_s: u64,
}

async fn set_timeout(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<TimeoutReq>) -> Reply {
    let id2 = id.clone();
    blocking(&app, "get", move |a| a.ops.get(&id2)).await?;
    app.idle.set_timeout(&id, req.idle_timeout_s);
    Ok(json(serde_json::json!({"sandbox": id, "idle_timeout_s": req.idle_timeout_s})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MarkQuery {
    #[serde(default)]
    backend: Option<BackendKind>,
}

async fn marks(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "marks", |a| a.ops.marks(None)).await?))
}

async fn mark_info(State(app): State<Arc<App>>, Path(id): Path<String>, Query(q): Query<MarkQuery>) -> Reply {
    Ok(json(blocking(&app, "marks", move |a| a.ops.mark_info(&id, q.backend)).await?))
}

async fn branches(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "branches", |a| a.ops.branches()).await?))
}

async fn delete_branch(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "delete_branch", move |a| a.ops.delete_branch(&id)).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GcReq {
    #[serde(default)]
    dry_run: bool,
}

async fn gc(State(app): State<Arc<App>>, Body(req): Body<GcReq>) -> Reply {
    Ok(json(blocking(&app, "gc", move |a| a.ops.gc(req.dry_run)).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditReq {
    #[serde(default)]
    fix: bool,
    /// Two running ct sandboxes: the sibling audit instead of the house audit.
    #[serde(default)]
    siblings: Option<Vec<String>>,
    /// The sibling audit's control pair (default: two cold sandboxes of the siblings' template).
    #[serde(default)]
    control: Option<Vec<String>>,
    #[serde(default)]
    no_control: bool,
}

async fn audit(State(app): State<Arc<App>>, Body(req): Body<AuditReq>) -> Reply {
    let Some(sibs) = req.siblings else {
        return Ok(json(blocking(&app, "audit", move |a| a.ops.audit(req.fix)).await?));
    };
    let control = clade_host::siblings::Control::parse(req.control, req.no_control)?;
    let [x, y] =
        <[String; 2]>::try_from(sibs).map_err(|_| clade_host::error::invalid("siblings: name exactly two sandboxes"))?;
    Ok(json(blocking(&app, "audit", move |a| a.ops.audit_siblings(&x, &y, control)).await?))
}

async fn push(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "push", move |a| a.ops.push(&id, &mut |_| {})).await?))
}

async fn pull(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "pull", move |a| a.ops.pull(&id, &mut |_| {})).await?))
}

async fn roam_list(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "roam_list", |a| a.ops.roaming().map(serde_json::Value::from)).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;
    use tower::ServiceExt;

    fn app(dir: &std::path::Path) -> (Arc<App>, axum::Router) {
        let home = clade_core::CladeHome::at(dir);
        let app = Arc::new(App {
            ops: Arc::new(clade_host::ops::Ops::open(&home).unwrap()),
            metrics: crate::metrics::Metrics::new(),
            idle: crate::idle::Idle::load(&home, 0),
            max_upload: 1 << 20,
            exec_limit: std::time::Duration::from_secs(60),
        });
        let r = crate::server::app_router(app.clone(), "k3y".into(), vec!["localhost".into()]);
        (app, r)
    }

    fn req(method: &str, path: &str) -> axum::http::request::Builder {
        Request::builder().method(method).uri(path).header("host", "localhost").header("authorization", "Bearer k3y")
    }

    async fn send(r: &axum::Router, rq: Request<axum::body::Body>) -> (u16, serde_json::Value) {
        let resp = r.clone().oneshot(rq).await.unwrap();
        let status = resp.status().as_u16();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null))
    }

    #[test]
    fn openapi_document_lists_exactly_the_routes() {
        let doc: serde_json::Value = serde_json::from_str(OPENAPI).expect("docs/openapi.json parses");
        let mut documented = std::collections::BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for m in ["get", "post", "put", "delete", "patch"] {
                if item.get(m).is_some() {
                    documented.insert((m.to_string(), path.clone()));
                }
            }
        }
        let routed: std::collections::BTreeSet<_> =
            ROUTES.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
        assert_eq!(documented, routed, "docs/openapi.json and ROUTES differ");
    }

    #[tokio::test]
    async fn every_listed_route_reaches_a_handler() {
        let dir = tempfile::tempdir().unwrap();
        let (_app, r) = app(dir.path());
        for (m, p) in ROUTES {
            let path = p.replace("{id}", "nosuch") + if p.ends_with("/files") { "?path=/etc/x" } else { "" };
            let mut rq = req(&m.to_uppercase(), &path);
            let body = if *m == "post" {
                rq = rq.header("content-type", "application/json");
                axum::body::Body::from("{}")
            } else {
                axum::body::Body::empty()
            };
            let resp = r.clone().oneshot(rq.body(body).unwrap()).await.unwrap();
            let status = resp.status().as_u16();
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
            // axum's own "no such route" answers are empty; every handler's answer has a body.
            assert!(status != 405 && !(status == 404 && bytes.is_empty()), "{m} {p}: not routed ({status})");
            assert!(status < 500, "{m} {p}: {status} {}", String::from_utf8_lossy(&bytes));
        }
    }

    #[tokio::test]
    async fn the_doors_refuse_what_they_must() {
        let dir = tempfile::tempdir().unwrap();
        let (_app, r) = app(dir.path());
        let b = || axum::body::Body::empty();
        let no_key = Request::builder().uri("/v1/sandboxes").header("host", "localhost").body(b()).unwrap();
        assert_eq!(send(&r, no_key).await.0, 401);
        let wrong =
            Request::builder().uri("/v1/sandboxes").header("host", "localhost").header("authorization", "Bearer nope");
        assert_eq!(send(&r, wrong.body(b()).unwrap()).await.0, 401);
        let origin = req("GET", "/v1/sandboxes").header("origin", "http://evil.example");
        let (s, v) = send(&r, origin.body(b()).unwrap()).await;
        assert_eq!((s, v["error"]["code"].as_str()), (403, Some("origin")));
        let host = Request::builder()
            .uri("/v1/sandboxes")
            .header("host", "evil.example")
            .header("authorization", "Bearer k3y")
            .body(b())
            .unwrap();
        assert_eq!(send(&r, host).await.0, 403);
        let text = req("POST", "/v1/sandboxes").header("content-type", "text/plain").body("from=x".into()).unwrap();
        let (s, v) = send(&r, text).await;
        assert_eq!((s, v["error"]["code"].as_str()), (403, Some("content_type")));
        let ok = req("GET", "/v1/sandboxes").body(b()).unwrap();
        assert_eq!(send(&r, ok).await, (200, serde_json::json!([])));
    }

    #[tokio::test]
    async fn bad_input_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let (_app, r) = app(dir.path());
        let json = |m: &str, p: &str, body: &'static str| {
            req(m, p).header("content-type", "application/json").body(axum::body::Body::from(body)).unwrap()
        };
        let (s, v) = send(&r, json("POST", "/v1/sandboxes", r#"{"backend":"vm"}"#)).await;
        assert_eq!(s, 400);
        assert!(v["error"]["message"].as_str().unwrap().contains("from"), "{v}");
        let (s, v) = send(&r, json("POST", "/v1/sandboxes", r#"{"from":"x","colour":1}"#)).await;
        assert_eq!(s, 400);
        assert!(v["error"]["message"].as_str().unwrap().contains("colour"), "{v}");
        let (s, _) = send(&r, json("POST", "/v1/sandboxes", "{not json")).await;
        assert_eq!(s, 400);
        let (s, v) = send(&r, json("POST", "/v1/sandboxes", r#"{"from":"nosuchmark"}"#)).await;
        assert_eq!(s, 404, "{v}");
        let (s, v) = send(&r, req("GET", "/v1/sandboxes/sbx-missing").body(axum::body::Body::empty()).unwrap()).await;
        assert_eq!(s, 404);
        assert!(v["error"]["message"].as_str().unwrap().contains("sbx-missing"));
        let (s, _) = send(&r, req("GET", "/v1/sandboxes/..%2Fetc").body(axum::body::Body::empty()).unwrap()).await;
        assert_eq!(s, 400);
        let (s, _) = send(&r, json("POST", "/v1/sandboxes/x/exec", r#"{"argv":[]}"#)).await;
        assert_eq!(s, 400);
        let huge = format!(r#"{{"from":"{}"}}"#, "x".repeat(3 << 20));
        let huge = req("POST", "/v1/sandboxes").header("content-type", "application/json").body(huge.into()).unwrap();
        let (s, v) = send(&r, huge).await;
        assert_eq!((s, v["error"]["code"].as_str()), (413, Some("too_large")), "{v}");
        let big = req("PUT", "/v1/sandboxes/x/files?path=/tmp/f").body(vec![0u8; (1 << 20) + 1].into()).unwrap();
        assert_eq!(send(&r, big).await.0, 413);
        let (s, _) = send(&r, req("GET", "/metrics").body(axum::body::Body::empty()).unwrap()).await;
        assert_eq!(s, 200);
    }
}
