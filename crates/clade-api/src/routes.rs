//! The native API's routes: thin handlers over [`clade_host::ops::Ops`], so HTTP and the CLI share every semantic.
//! Blocking work (supervisor calls, restores, marks) runs on tokio's blocking pool.
//!
//! [`ROUTES`] lists every route once; the router is built from the same handlers and a test checks the list
//! against `docs/openapi.json`, so the document cannot fall behind the code.

use std::sync::Arc;

use axum::extract::{MatchedPath, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clade_core::backend::BackendKind;
use serde::Deserialize;

use crate::app::{blocking, json, wake, App, Reply};
use crate::doors;
use crate::error::{ApiError, Body};
use clade_host::api::{ForkRequest, MarkRequest};

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
    ("delete", "/v1/sandboxes/{id}/files"),
    ("get", "/v1/sandboxes/{id}/fs/stat"),
    ("get", "/v1/sandboxes/{id}/fs/list"),
    ("post", "/v1/sandboxes/{id}/fs/mkdir"),
    ("post", "/v1/sandboxes/{id}/fs/rename"),
    ("put", "/v1/sandboxes/{id}/egress"),
    ("get", "/v1/sandboxes/{id}/processes"),
    ("post", "/v1/sandboxes/{id}/processes"),
    ("get", "/v1/sandboxes/{id}/processes/{pid}/events"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/input"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/close_stdin"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/signal"),
    ("post", "/v1/sandboxes/{id}/processes/{pid}/resize"),
    ("post", "/v1/sandboxes/{id}/watches"),
    ("get", "/v1/sandboxes/{id}/watches/{watch}"),
    ("delete", "/v1/sandboxes/{id}/watches/{watch}"),
    ("get", "/v1/sandboxes/{id}/marks"),
    ("post", "/v1/sandboxes/{id}/marks"),
    ("post", "/v1/sandboxes/{id}/retake"),
    ("post", "/v1/sandboxes/{id}/suspend"),
    ("post", "/v1/sandboxes/{id}/resume"),
    ("post", "/v1/sandboxes/{id}/freeze"),
    ("post", "/v1/sandboxes/{id}/thaw"),
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
    ("get", "/v1/hosts"),
];

pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");

async fn count_requests(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_string()).unwrap_or_else(|| "-".into());
    let method = req.method().to_string();
    let resp = next.run(req).await;
    app.metrics.request(&method, &route, resp.status().as_u16());
    resp
}

/// The native API's router for one listener (its doors know that listener's names).
pub fn app_router(app: Arc<App>, key: String, hosts: Vec<String>) -> axum::Router {
    let doors = Arc::new(doors::Doors { key, hosts });
    router(app.clone())
        .route_layer(axum::middleware::from_fn_with_state(app, count_requests))
        .layer(axum::middleware::from_fn_with_state(doors, doors::check))
}

pub fn router(app: Arc<App>) -> Router {
    let r = Router::new()
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/v1/health", get(health))
        .route("/v1/sandboxes", get(list).post(create))
        .route("/v1/sandboxes/{id}", get(sandbox).delete(kill))
        .route("/v1/sandboxes/{id}/marks", get(sandbox_marks).post(mark))
        .route("/v1/sandboxes/{id}/retake", post(retake))
        .route("/v1/sandboxes/{id}/suspend", post(suspend))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/sandboxes/{id}/freeze", post(freeze))
        .route("/v1/sandboxes/{id}/thaw", post(thaw))
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
        .route("/v1/hosts", get(hosts_list));
    crate::watches::routes(crate::inside::routes(r)).with_state(app)
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Reply {
    let text = blocking(&app, "metrics", |a| Ok(a.metrics.render(a.api.as_ref(), a.store.as_ref()))).await?;
    Ok(([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response())
}

async fn health(State(app): State<Arc<App>>) -> Response {
    json(serde_json::json!({"ok": true, "version": env!("CARGO_PKG_VERSION"), "home": app.home}))
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
    let fork = ForkRequest { from: req.from, backend: req.backend, count: req.count, make_room: req.make_room };
    let out = blocking(&app, "fork", move |a| a.api.fork(&fork)).await?;
    if let Some(secs) = idle {
        for s in &out.sandboxes {
            app.idle.set_timeout(&s.sandbox, secs);
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
    let fork = ForkRequest { from: id, backend: None, count: req.count, make_room: req.make_room };
    let out = blocking(&app, "fork", move |a| a.api.fork(&fork)).await?;
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

async fn list(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "list", |a| a.api.list()).await?))
}

async fn sandbox(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "get", move |a| a.api.get(&id)).await?))
}

async fn kill(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    app.idle.forget(&id);
    Ok(json(blocking(&app, "kill", move |a| a.api.kill(&id)).await?))
}

async fn mark(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<MarkRequest>) -> Reply {
    let out = blocking(&app, "mark", move |a| {
        wake(a, &id)?;
        a.api.mark(&id, &req)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

async fn sandbox_marks(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "marks", move |a| a.api.marks(Some(&id))).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RetakeReq {
    to: String,
}

async fn retake(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<RetakeReq>) -> Reply {
    let out = blocking(&app, "retake", move |a| {
        wake(a, &id)?;
        a.api.retake(&id, &req.to)
    })
    .await?;
    Ok(json(out))
}

/// The body is optional (`{"disk_only": true}` for a disk-only suspend); none at all is the default.
async fn suspend(State(app): State<Arc<App>>, Path(id): Path<String>, body: axum::body::Bytes) -> Reply {
    let req: clade_host::api::SuspendRequest = optional_body(&body)?;
    Ok(json(blocking(&app, "suspend", move |a| a.api.suspend_with(&id, &req)).await?))
}

/// A JSON body that may be left out (then every field takes its default), for routes that took none before.
fn optional_body<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("request body: {e}")))
}

async fn freeze(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    blocking(&app, "freeze", move |a| a.api.freeze(&id)).await?;
    Ok(json(serde_json::json!({"frozen": true})))
}

async fn thaw(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    blocking(&app, "thaw", move |a| a.api.thaw(&id)).await?;
    Ok(json(serde_json::json!({"frozen": false})))
}

/// The body is optional (`{"reboot": true}` boots the disk cold); none at all is the default.
async fn resume(State(app): State<Arc<App>>, Path(id): Path<String>, body: axum::body::Bytes) -> Reply {
    let req: clade_host::api::ResumeRequest = optional_body(&body)?;
    let out = blocking(&app, "resume", move |a| {
        let r = a.api.resume_with(&id, &req);
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
    blocking(&app, "get", move |a| a.api.get(&id2)).await?;
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
    Ok(json(blocking(&app, "marks", |a| a.api.marks(None)).await?))
}

async fn mark_info(State(app): State<Arc<App>>, Path(id): Path<String>, Query(q): Query<MarkQuery>) -> Reply {
    Ok(json(blocking(&app, "marks", move |a| a.api.mark_info(&id, q.backend)).await?))
}

async fn branches(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "branches", |a| a.api.branches()).await?))
}

async fn delete_branch(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "delete_branch", move |a| a.api.delete_branch(&id)).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GcReq {
    #[serde(default)]
    dry_run: bool,
}

async fn gc(State(app): State<Arc<App>>, Body(req): Body<GcReq>) -> Reply {
    Ok(json(blocking(&app, "gc", move |a| a.api.gc(req.dry_run)).await?))
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
        return Ok(json(blocking(&app, "audit", move |a| a.api.audit(req.fix)).await?));
    };
    let control = clade_host::siblings::Control::parse(req.control, req.no_control)?;
    let [x, y] = <[String; 2]>::try_from(sibs)
        .map_err(|_| clade_host::error::invalid("siblings: name exactly two sandboxes"))?;
    Ok(json(blocking(&app, "audit", move |a| a.api.audit_siblings(&x, &y, control)).await?))
}

async fn push(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "push", move |a| a.api.push(&id, &mut |_| {})).await?))
}

async fn pull(State(app): State<Arc<App>>, Path(id): Path<String>) -> Reply {
    Ok(json(blocking(&app, "pull", move |a| a.api.pull(&id, &mut |_| {})).await?))
}

async fn roam_list(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "roam_list", |a| a.api.roaming()).await?))
}

async fn hosts_list(State(app): State<Arc<App>>) -> Reply {
    Ok(json(blocking(&app, "hosts_list", |a| a.api.hosts()).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;
    use tower::ServiceExt;

    fn app(dir: &std::path::Path) -> (Arc<App>, axum::Router) {
        let home = clade_core::CladeHome::at(dir);
        let app = Arc::new(App {
            api: Arc::new(clade_host::ops::Ops::open(&home).unwrap()),
            store: None,
            home: dir.to_path_buf(),
            metrics: crate::metrics::Metrics::new(),
            idle: crate::idle::Idle::load(&home, 0),
            max_upload: 1 << 20,
            exec_limit: std::time::Duration::from_secs(60),
        });
        let r = crate::routes::app_router(app.clone(), "k3y".into(), vec!["localhost".into()]);
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
            let query = if p.ends_with("/files") || p.contains("/fs/") { "?path=/etc/x" } else { "" };
            let path = p.replace("{id}", "nosuch").replace("{pid}", "1") + query;
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
