//! The control plane: the routes of E2B's `openapi.yml` that the SDKs (>= 2.7, < 3) call. Errors are
//! `{"code": <http status>, "message": ...}` with E2B's statuses; every route but none needs `X-API-Key`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::host::{Host, HostError, Started, Status};
use crate::state::{now_ms, rfc3339, Record, SnapshotRecord};
use crate::App;

/// An E2B API error.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, axum::Json(json!({"code": self.0.as_u16(), "message": self.1}))).into_response()
    }
}

impl From<HostError> for ApiError {
    fn from(e: HostError) -> ApiError {
        let status = match &e {
            HostError::NotFound(_) => StatusCode::NOT_FOUND,
            HostError::Invalid(_) => StatusCode::BAD_REQUEST,
            HostError::Conflict(_) => StatusCode::CONFLICT,
            HostError::Permission(_) => StatusCode::FORBIDDEN,
            HostError::NoSpace(_) => StatusCode::INSUFFICIENT_STORAGE,
            HostError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, e.to_string())
    }
}

type R = Result<Response, ApiError>;

pub fn router<H: Host>(app: Arc<App<H>>) -> Router {
    Router::new()
        .route("/sandboxes", post(create::<H>).get(list_v1::<H>))
        .route("/v2/sandboxes", post(create::<H>).get(list_v2::<H>))
        .route("/sandboxes/metrics", get(|| async { axum::Json(json!({"sandboxes": {}})) }))
        .route("/sandboxes/{id}", get(detail::<H>).delete(kill::<H>))
        .route("/sandboxes/{id}/timeout", post(set_timeout::<H>))
        .route("/sandboxes/{id}/refreshes", post(refresh::<H>))
        .route("/sandboxes/{id}/pause", post(pause::<H>))
        .route("/sandboxes/{id}/resume", post(resume::<H>))
        .route("/sandboxes/{id}/connect", post(connect::<H>))
        .route("/v2/sandboxes/{id}/connect", post(connect::<H>))
        .route("/sandboxes/{id}/fork", post(fork::<H>))
        .route("/sandboxes/{id}/snapshots", post(snapshot::<H>))
        .route("/sandboxes/{id}/metrics", get(metrics::<H>))
        .route("/sandboxes/{id}/network", put(update_network::<H>))
        .route("/sandboxes/{id}/logs", get(|| async { axum::Json(json!({"logs": [], "logEntries": []})) }))
        .route("/v2/sandboxes/{id}/logs", get(|| async { axum::Json(json!({"logs": []})) }))
        .route("/snapshots", get(list_snapshots::<H>))
        .route("/templates/{id}", delete(delete_snapshot::<H>))
        .route("/templates/aliases/{alias}", get(template_alias::<H>))
        .fallback(|| async { ApiError(StatusCode::NOT_FOUND, "no such route in clade's E2B API".into()) })
        .layer(middleware::from_fn_with_state(app.clone(), auth::<H>))
        .with_state(app)
}

async fn auth<H: Host>(State(app): State<Arc<App<H>>>, req: Request, next: Next) -> Response {
    let key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()).map(str::to_owned).or_else(|| {
        let a = req.headers().get("authorization")?.to_str().ok()?;
        a.strip_prefix("Bearer ").map(str::to_owned)
    });
    let ok = match key {
        Some(k) => app.blocking(move |h| h.check_key(&k)).await.unwrap_or(false),
        None => false,
    };
    if !ok {
        return ApiError(
            StatusCode::UNAUTHORIZED,
            "Invalid API key: create one with `clade e2b key create` and set E2B_API_KEY".into(),
        )
        .into_response();
    }
    next.run(req).await
}

/// A JSON body (an empty one is `T::default()`); a bad one is a 400 in E2B's shape.
fn body<T: DeserializeOwned + Default>(b: &Bytes) -> Result<T, ApiError> {
    if b.iter().all(|c| c.is_ascii_whitespace()) {
        return Ok(T::default());
    }
    serde_json::from_slice(b).map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("bad request body: {e}")))
}

fn not_found(id: &str) -> ApiError {
    ApiError(StatusCode::NOT_FOUND, format!("sandbox \"{id}\" doesn't exist or you don't have access to it"))
}

fn sandbox_json<H: Host>(app: &App<H>, r: &Record) -> Value {
    let mut v = json!({
        "templateID": r.template_id, "sandboxID": r.id, "clientID": app.cfg.client_id,
        "envdVersion": app.cfg.envd_version, "envdAccessToken": r.token,
    });
    if let Some(a) = &r.alias {
        v["alias"] = json!(a);
    }
    if r.private_traffic {
        v["trafficAccessToken"] = json!(app.state.traffic_token(r));
    }
    v
}

fn state_str(s: Status) -> &'static str {
    if s == Status::Paused {
        "paused"
    } else {
        "running"
    }
}

fn detail_json<H: Host>(app: &App<H>, r: &Record, s: Status) -> Value {
    let mut v = sandbox_json(app, r);
    let extra = json!({
        "startedAt": rfc3339(r.started_ms), "endAt": rfc3339(r.end_ms), "cpuCount": r.cpu_count,
        "memoryMB": r.memory_mb, "diskSizeMB": r.disk_mb, "state": state_str(s), "metadata": r.metadata,
        "lifecycle": {"autoResume": false, "onTimeout": if r.auto_pause { "pause" } else { "kill" }},
    });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    v
}

/// A sandbox's record and its host status; a record whose sandbox is gone is dropped.
async fn live<H: Host>(app: &Arc<App<H>>, id: &str) -> Result<(Record, Status), ApiError> {
    let Some(rec) = app.state.get(id) else { return Err(not_found(id)) };
    let i = id.to_string();
    let s = app.blocking(move |h| h.status(&i)).await?;
    if s == Status::Gone {
        app.state.remove(id);
        return Err(not_found(id));
    }
    Ok((rec, s))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct Lifecycle {
    on_timeout: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    auto_pause: Option<bool>,
    /// False: the timeout's auto-pause keeps the filesystem alone (a resume boots cold).
    auto_pause_memory: Option<bool>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    lifecycle: Option<Lifecycle>,
    /// E2B's API spells this one in snake case.
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<NetworkOpts>,
}

/// E2B's network settings (create's `network`, and `update_network`'s body with `allowInternetAccess`).
#[derive(Deserialize, Default, Debug)]
#[serde(rename_all = "camelCase", default)]
struct NetworkOpts {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    allow_public_traffic: Option<bool>,
    mask_request_host: Option<String>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
    dns_servers: Option<Vec<String>>,
}

/// (allow, deny) of E2B's settings: `allowInternetAccess: false` denies everything (what `allowOut` names
/// still passes), `denyOut`/`allowOut` as given. What clade cannot enforce is a 400 that says so.
fn egress_of(allow_internet: Option<bool>, n: &NetworkOpts) -> Result<(Vec<String>, Vec<String>), ApiError> {
    let unsupported = [
        ("maskRequestHost", n.mask_request_host.is_some()),
        ("rules", n.rules.as_ref().is_some_and(|r| !r.is_null() && r != &json!({}))),
        ("egressProxy", n.egress_proxy.as_ref().is_some_and(|p| !p.is_null())),
        ("dnsServers", n.dns_servers.as_ref().is_some_and(|d| !d.is_empty())),
    ];
    if let Some((name, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("network.{name} is not supported by clade (allowOut, denyOut and allowInternetAccess are)"),
        ));
    }
    let allow = n.allow_out.clone().unwrap_or_default();
    let mut deny = n.deny_out.clone().unwrap_or_default();
    if allow_internet.or(n.allow_internet_access) == Some(false) && !deny.iter().any(|d| d == "0.0.0.0/0") {
        deny.push("0.0.0.0/0".into());
    }
    Ok((allow, deny))
}

/// Set a sandbox's egress rules on the host.
async fn set_egress<H: Host>(app: &Arc<App<H>>, id: &str, allow: &[String], deny: &[String]) -> Result<(), ApiError> {
    let (i, a, d) = (id.to_string(), allow.to_vec(), deny.to_vec());
    Ok(app.blocking(move |h| h.set_egress(&i, &a, &d)).await??)
}

/// Set a sandbox's egress rules and keep them in its record for the next resume.
async fn apply_egress<H: Host>(
    app: &Arc<App<H>>,
    id: &str,
    allow: Vec<String>,
    deny: Vec<String>,
) -> Result<(), ApiError> {
    set_egress(app, id, &allow, &deny).await?;
    app.state.update(id, |r| {
        r.egress_allow = allow;
        r.egress_deny = deny;
    });
    Ok(())
}

/// A new sandbox's record (not yet kept: the caller puts it once it is complete).
fn record_of<H: Host>(
    app: &App<H>,
    s: &Started,
    timeout_s: u64,
    auto_pause: bool,
    meta: BTreeMap<String, String>,
) -> Record {
    let now = now_ms();
    let (salt, token) = app.state.issue_token(&s.id);
    Record {
        id: s.id.clone(),
        template_id: s.template_id.clone(),
        alias: None,
        metadata: meta,
        started_ms: now,
        end_ms: now + timeout_s * 1000,
        auto_pause,
        auto_pause_disk_only: false,
        token,
        salt,
        cpu_count: s.cpu_count,
        egress_allow: vec![],
        egress_deny: vec![],
        private_traffic: false,
        memory_mb: s.memory_mb,
        disk_mb: s.disk_mb,
    }
}

async fn create<H: Host>(State(app): State<Arc<App<H>>>, b: Bytes) -> R {
    let req: NewSandbox = body(&b)?;
    let template = req.template_id.unwrap_or_else(|| "base".into());
    if template.trim().is_empty() {
        return Err(ApiError(StatusCode::BAD_REQUEST, "templateID is empty".into()));
    }
    let (allow, deny) = egress_of(req.allow_internet_access, req.network.as_ref().unwrap_or(&NetworkOpts::default()))?;
    let envs = req.env_vars.unwrap_or_default();
    let t = template.clone();
    let started = app.blocking(move |h| h.create(&t, &envs)).await?.map_err(|e| match e {
        HostError::NotFound(m) => ApiError(StatusCode::NOT_FOUND, m),
        other => other.into(),
    })?;
    let auto_pause =
        req.auto_pause.unwrap_or(false) || req.lifecycle.and_then(|l| l.on_timeout).is_some_and(|o| o == "pause");
    let timeout = req.timeout.unwrap_or(app.cfg.default_timeout_s);
    if !(allow.is_empty() && deny.is_empty()) {
        if let Err(e) = set_egress(&app, &started.id, &allow, &deny).await {
            // A sandbox that cannot have the rules it was asked for does not run without them.
            let i = started.id.clone();
            let _ = app.blocking(move |h| h.kill(&i)).await;
            return Err(e);
        }
    }
    let rec = Record {
        egress_allow: allow,
        egress_deny: deny,
        private_traffic: req.network.as_ref().and_then(|n| n.allow_public_traffic) == Some(false),
        auto_pause_disk_only: auto_pause && req.auto_pause_memory == Some(false),
        ..record_of(&app, &started, timeout, auto_pause, req.metadata.unwrap_or_default())
    };
    app.state.put(rec.clone());
    Ok((StatusCode::CREATED, axum::Json(sandbox_json(&app, &rec))).into_response())
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
    /// `asc` (oldest first) or `desc` (newest first, the default).
    order: Option<String>,
    /// RFC 3339: only sandboxes started at or after it.
    started_after: Option<String>,
    /// Only sandboxes of this template.
    template: Option<String>,
}

/// What a list keeps besides state and metadata: (oldest first, started at or after ms, template).
fn list_filters(q: &ListQuery) -> Result<(bool, u64, Option<String>), ApiError> {
    let asc = match q.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(o) => return Err(ApiError(StatusCode::BAD_REQUEST, format!("unknown order {o:?}: asc or desc"))),
    };
    let after = match q.started_after.as_deref() {
        None => 0,
        Some(t) => chrono::DateTime::parse_from_rfc3339(t)
            .map(|d| d.timestamp_millis().max(0) as u64)
            .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("startedAfter {t:?}: an RFC 3339 time ({e})")))?,
    };
    Ok((asc, after, q.template.clone().filter(|t| !t.is_empty())))
}

/// `metadata` is a query string of its own (`k=v&k2=v2`, each part percent-encoded once more).
fn metadata_filter(q: &Option<String>) -> BTreeMap<String, String> {
    let Some(q) = q else { return BTreeMap::new() };
    form_urlencoded::parse(q.as_bytes())
        .map(|(k, v)| {
            let dec = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
            (dec(&k), dec(&v))
        })
        .collect()
}

async fn listed<H: Host>(
    app: &Arc<App<H>>,
    q: &ListQuery,
    states: &[Status],
) -> Result<Vec<(Record, Status)>, ApiError> {
    let want = metadata_filter(&q.metadata);
    let (asc, after, template) = list_filters(q)?;
    let recs = app.state.all();
    let ids: Vec<String> = recs.iter().map(|r| r.id.clone()).collect();
    let statuses = app.blocking(move |h| ids.iter().map(|i| h.status(i)).collect::<Vec<_>>()).await.unwrap_or_default();
    let mut out = Vec::new();
    for (r, s) in recs.into_iter().zip(statuses) {
        if s == Status::Gone {
            app.state.remove(&r.id);
            continue;
        }
        if states.contains(&s)
            && want.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
            && r.started_ms >= after
            && template.as_ref().is_none_or(|t| &r.template_id == t)
        {
            out.push((r, s));
        }
    }
    // Newest first, as E2B lists, unless asked otherwise.
    out.sort_by(|a, b| b.0.started_ms.cmp(&a.0.started_ms).then(b.0.id.cmp(&a.0.id)));
    if asc {
        out.reverse();
    }
    Ok(out)
}

fn listed_json<H: Host>(app: &App<H>, r: &Record, s: Status) -> Value {
    let mut v = detail_json(app, r, s);
    if let Some(o) = v.as_object_mut() {
        o.remove("envdAccessToken");
        o.remove("lifecycle");
    }
    v
}

async fn list_v1<H: Host>(State(app): State<Arc<App<H>>>, Query(q): Query<ListQuery>) -> R {
    let all = listed(&app, &q, &[Status::Running]).await?;
    Ok(axum::Json(all.iter().map(|(r, s)| listed_json(&app, r, *s)).collect::<Vec<_>>()).into_response())
}

async fn list_v2<H: Host>(State(app): State<Arc<App<H>>>, Query(q): Query<ListQuery>) -> R {
    let mut states = Vec::new();
    for s in q.state.as_deref().unwrap_or("running,paused").split(',').filter(|s| !s.is_empty()) {
        match s {
            "running" => states.push(Status::Running),
            "paused" => states.push(Status::Paused),
            other => {
                return Err(ApiError(StatusCode::BAD_REQUEST, format!("unknown state {other:?}: running or paused")))
            }
        }
    }
    let all = listed(&app, &q, &states).await?;
    let start = match &q.next_token {
        Some(t) => all.iter().position(|(r, _)| &r.id == t).map(|i| i + 1).unwrap_or(all.len()),
        None => 0,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let page: Vec<_> = all.iter().skip(start).take(limit).collect();
    let mut resp = axum::Json(page.iter().map(|(r, s)| listed_json(&app, r, *s)).collect::<Vec<_>>()).into_response();
    if start + page.len() < all.len() {
        if let Some((last, _)) = page.last() {
            if let Ok(v) = HeaderValue::from_str(&last.id) {
                resp.headers_mut().insert("x-next-token", v);
            }
        }
    }
    Ok(resp)
}

async fn detail<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>) -> R {
    let (rec, s) = live(&app, &id).await?;
    Ok(axum::Json(detail_json(&app, &rec, s)).into_response())
}

/// `update_network`: replace the sandbox's egress rules (`allowOut`, `denyOut`, `allowInternetAccess`).
async fn update_network<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let n: NetworkOpts = body(&b)?;
    live(&app, &id).await?;
    let (allow, deny) = egress_of(None, &n)?;
    apply_egress(&app, &id, allow, deny).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// E2B's alias check (`Template.exists`): 200 with the template when `create` accepts the name, else 404.
async fn template_alias<H: Host>(State(app): State<Arc<App<H>>>, Path(alias): Path<String>) -> R {
    let a = alias.clone();
    if app.blocking(move |h| h.template_exists(&a)).await? {
        Ok(axum::Json(json!({"templateID": alias, "public": true})).into_response())
    } else {
        Err(ApiError(StatusCode::NOT_FOUND, format!("template alias '{alias}' not found")))
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct MetricsQuery {
    /// Unix seconds.
    start: Option<i64>,
    end: Option<i64>,
}

/// E2B's metrics of a running sandbox: clade keeps no history, so the answer is one entry measured now
/// (CPU from the host's accounting of the sandbox's processes, memory as their PSS, disk as `df /` inside),
/// or none when now is outside `start..=end`.
async fn metrics<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, Query(q): Query<MetricsQuery>) -> R {
    let (rec, s) = live(&app, &id).await?;
    let now_ms = crate::state::now_ms();
    let now = (now_ms / 1000) as i64;
    // Second-precision bounds: the end is inclusive of its whole second.
    if s != Status::Running || q.start.is_some_and(|t| now < t) || q.end.is_some_and(|t| now > t) {
        return Ok(axum::Json(json!([])).into_response());
    }
    let i = id.clone();
    let u = app.blocking(move |h| h.usage(&i)).await??;
    let cpus = rec.cpu_count.max(1);
    let (disk_used, disk_total) = u.disk.unwrap_or((0, u64::from(rec.disk_mb) << 20));
    Ok(axum::Json(json!([{
        "timestamp": crate::state::rfc3339(now_ms), "timestampUnix": now,
        "cpuCount": cpus, "cpuUsedPct": (u.cpu_busy * 100.0 / f64::from(cpus)).clamp(0.0, 100.0),
        "memUsed": u.mem_used, "memTotal": u64::from(rec.memory_mb) << 20, "memCache": 0,
        "diskUsed": disk_used, "diskTotal": disk_total,
    }]))
    .into_response())
}

async fn kill<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>) -> R {
    live(&app, &id).await?;
    let i = id.clone();
    app.blocking(move |h| h.kill(&i)).await??;
    app.state.remove(&id);
    app.ptys.lock().retain(|(s, _)| s != &id);
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Timeout {
    timeout: Option<u64>,
    duration: Option<u64>,
    #[serde(rename = "autoPause")]
    auto_pause: Option<bool>,
    count: Option<u32>,
    name: Option<String>,
    /// Pause and snapshot: false keeps the filesystem alone (a resume, or a sandbox made from the snapshot,
    /// boots cold). Connect and resume: false boots the filesystem cold even where the pause kept memory.
    memory: Option<bool>,
}

async fn set_timeout<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let t: Timeout = body(&b)?;
    live(&app, &id).await?;
    let secs = t.timeout.ok_or_else(|| ApiError(StatusCode::BAD_REQUEST, "timeout (seconds) is required".into()))?;
    app.state.update(&id, |r| r.end_ms = now_ms() + secs * 1000);
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn refresh<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let t: Timeout = body(&b)?;
    live(&app, &id).await?;
    let secs = t.duration.unwrap_or(app.cfg.default_timeout_s);
    app.state.update(&id, |r| r.end_ms = r.end_ms.max(now_ms() + secs * 1000));
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn pause<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let t: Timeout = body(&b)?;
    let (_, s) = live(&app, &id).await?;
    if s == Status::Paused {
        return Err(ApiError(StatusCode::CONFLICT, format!("sandbox {id} is already paused")));
    }
    pause_now(&app, &id, t.memory == Some(false)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Pause (`disk_only`: the filesystem alone; its resume boots cold).
async fn pause_now<H: Host>(app: &Arc<App<H>>, id: &str, disk_only: bool) -> Result<(), ApiError> {
    let i = id.to_string();
    app.blocking(move |h| h.pause(&i, disk_only)).await??;
    Ok(())
}

async fn bring_back<H: Host>(app: &Arc<App<H>>, id: &str, t: &Timeout) -> Result<Record, ApiError> {
    let i = id.to_string();
    let reboot = t.memory == Some(false);
    app.blocking(move |h| h.resume(&i, reboot)).await??;
    // A resumed sandbox has a fresh network: its rules go back on before anyone can use it.
    if let Some(r) = app.state.get(id).filter(|r| !(r.egress_allow.is_empty() && r.egress_deny.is_empty())) {
        set_egress(app, id, &r.egress_allow, &r.egress_deny).await?;
    }
    let secs = t.timeout.unwrap_or(app.cfg.default_timeout_s);
    let ap = t.auto_pause;
    app.state
        .update(id, |r| {
            r.end_ms = now_ms() + secs * 1000;
            if let Some(a) = ap {
                r.auto_pause = a;
            }
        })
        .ok_or_else(|| not_found(id))
}

async fn resume<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let t: Timeout = body(&b)?;
    let (_, s) = live(&app, &id).await?;
    if s == Status::Running {
        return Err(ApiError(StatusCode::CONFLICT, format!("sandbox {id} is already running")));
    }
    let rec = bring_back(&app, &id, &t).await?;
    Ok((StatusCode::CREATED, axum::Json(sandbox_json(&app, &rec))).into_response())
}

async fn connect<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let t: Timeout = body(&b)?;
    let (rec, s) = live(&app, &id).await?;
    if s == Status::Running {
        // A connect only ever lengthens a running sandbox's life.
        let rec = match t.timeout {
            Some(secs) => app.state.update(&id, |r| r.end_ms = r.end_ms.max(now_ms() + secs * 1000)).unwrap_or(rec),
            None => rec,
        };
        return Ok(axum::Json(sandbox_json(&app, &rec)).into_response());
    }
    let rec = bring_back(&app, &id, &t).await?;
    Ok((StatusCode::CREATED, axum::Json(sandbox_json(&app, &rec))).into_response())
}

async fn fork<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let t: Timeout = body(&b)?;
    let (parent, s) = live(&app, &id).await?;
    if s != Status::Running {
        return Err(ApiError(StatusCode::CONFLICT, format!("sandbox {id} is paused: connect to it before forking")));
    }
    let count = t.count.unwrap_or(1);
    if count == 0 || count > 256 {
        return Err(ApiError(StatusCode::BAD_REQUEST, format!("count {count}: fork 1 to 256 sandboxes")));
    }
    let i = id.clone();
    let kids = app.blocking(move |h| h.fork(&i, count)).await??;
    let secs = t.timeout.unwrap_or(app.cfg.default_timeout_s);
    let out: Vec<Value> = kids
        .iter()
        .map(|k| {
            let mut k = k.clone();
            k.template_id = parent.template_id.clone();
            let rec = record_of(&app, &k, secs, parent.auto_pause, parent.metadata.clone());
            app.state.put(rec.clone());
            json!({"sandbox": sandbox_json(&app, &rec)})
        })
        .collect();
    Ok((StatusCode::CREATED, axum::Json(out)).into_response())
}

async fn snapshot<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>, b: Bytes) -> R {
    let t: Timeout = body(&b)?;
    let (_, s) = live(&app, &id).await?;
    if s != Status::Running {
        return Err(ApiError(StatusCode::CONFLICT, format!("sandbox {id} is paused: connect to it first")));
    }
    let (i, name, disk_only) = (id.clone(), t.name.clone(), t.memory == Some(false));
    let snap = app.blocking(move |h| h.snapshot(&i, name.as_deref(), disk_only)).await??;
    let names: Vec<String> = t.name.into_iter().collect();
    app.state.put_snapshot(SnapshotRecord {
        id: snap.id.clone(),
        sandbox: id,
        names: names.clone(),
        created_ms: now_ms(),
    });
    Ok((StatusCode::CREATED, axum::Json(json!({"snapshotID": snap.id, "names": names}))).into_response())
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SnapQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<usize>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

async fn list_snapshots<H: Host>(State(app): State<Arc<App<H>>>, Query(q): Query<SnapQuery>) -> R {
    let all: Vec<_> = app
        .state
        .snapshots()
        .into_iter()
        .filter(|s| q.sandbox_id.as_ref().is_none_or(|w| &s.sandbox == w))
        .filter(|s| q.name.as_ref().is_none_or(|n| s.names.contains(n)))
        .collect();
    let start = match &q.next_token {
        Some(t) => all.iter().position(|s| &s.id == t).map(|i| i + 1).unwrap_or(all.len()),
        None => 0,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let page: Vec<_> = all.iter().skip(start).take(limit).collect();
    let mut resp = axum::Json(page.iter().map(|s| json!({"snapshotID": s.id, "names": s.names})).collect::<Vec<_>>())
        .into_response();
    if start + page.len() < all.len() {
        if let Some(last) = page.last().and_then(|s| HeaderValue::from_str(&s.id).ok()) {
            resp.headers_mut().insert("x-next-token", last);
        }
    }
    Ok(resp)
}

async fn delete_snapshot<H: Host>(State(app): State<Arc<App<H>>>, Path(id): Path<String>) -> R {
    if !app.state.snapshots().iter().any(|s| s.id == id) {
        return Err(ApiError(StatusCode::NOT_FOUND, format!("template or snapshot \"{id}\" not found")));
    }
    let i = id.clone();
    app.blocking(move |h| h.delete_snapshot(&i)).await??;
    app.state.remove_snapshot(&id);
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// One reaper pass: sandboxes past their end are paused (auto-pause) or killed; records of gone ones dropped.
pub async fn reap<H: Host>(app: &Arc<App<H>>) {
    let now = now_ms();
    for r in app.state.all() {
        let id = r.id.clone();
        let s = app.blocking(move |h| h.status(&id)).await.unwrap_or(Status::Running);
        match s {
            Status::Gone => app.state.remove(&r.id),
            Status::Running if r.end_ms <= now => {
                let id = r.id.clone();
                if r.auto_pause {
                    let _ = pause_now(app, &id, r.auto_pause_disk_only).await;
                } else {
                    let _ = app.blocking(move |h| h.kill(&id)).await;
                    app.state.remove(&r.id);
                }
            }
            _ => {}
        }
    }
}

/// Headers helper for tests and the envd side.
pub fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}
