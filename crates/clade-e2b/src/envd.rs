//! envd, the daemon E2B runs inside each sandbox, answered from outside it: `process.Process` and
//! `filesystem.Filesystem` over Connect (JSON codec), `GET/POST /files`, `GET /health`. Users come from
//! `Authorization: Basic <user:>` as envd reads them (default: the configured user); relative paths resolve
//! against the user's home. Directory watches are the sandbox's own (inotify in its agent); a sandbox whose
//! agent predates them is polled (every 250 ms) and its listings diffed.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use bytes::BytesMut;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::header_str;
use crate::connect::{self, Code, RpcError};
use crate::host::{Change, Entry, Host, HostError, Kind, ProcEvent, ProcSpec, Status, Upload};
use crate::state::{random_hex, rfc3339_ns};
use crate::App;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

pub fn router<H: Host>(app: Arc<App<H>>) -> Router {
    Router::new()
        .route("/health", get(health::<H>))
        .route("/envs", get(envs::<H>))
        .route("/init", post(init::<H>))
        .route("/files", get(download::<H>).post(upload::<H>))
        .route("/process.Process/{method}", post(process::<H>))
        .route("/filesystem.Filesystem/{method}", post(filesystem::<H>))
        .fallback(|| async { plain(StatusCode::NOT_FOUND, "no such envd route".into()) })
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(app.clone(), port_door::<H>))
        .with_state(app)
}

/// envd's own port: a `<port>-<id>.` host naming another port is a request for the sandbox's own server.
const ENVD_PORT: u16 = 49983;

/// `<port>-<id>.<domain>`, as E2B names a sandbox's ports: (the port part, the id).
fn host_parts(host: &str) -> Option<(&str, &str)> {
    host.split('.').next()?.split_once('-').filter(|(_, id)| !id.is_empty())
}

/// `<port>-<id>.<domain>` -> (port, id), for a port other than envd's.
fn port_target(host: &str) -> Option<(u16, String)> {
    let (port, id) = host_parts(host)?;
    let port: u16 = port.parse().ok()?;
    (port != ENVD_PORT).then(|| (port, id.to_string()))
}

/// E2B's sandbox hosts (`sandbox.get_host(port)`): a request whose Host names `<port>-<id>.` goes to that port
/// on the sandbox's own loopback, as plain HTTP/1.1 (ct sandboxes; the listener's doors already let only such
/// names through). A sandbox that is not running answers 502 "was not found", a port where nothing listens 502
/// "port is not open", as E2B's proxy does (the SDKs read both). A sandbox created with
/// `allowPublicTraffic: false` answers 403 unless the request carries its `e2b-traffic-access-token`.
async fn port_door<H: Host>(State(app): State<Arc<App<H>>>, req: Request, next: axum::middleware::Next) -> Response {
    let Some((port, id)) = header_str(req.headers(), "host").and_then(port_target) else {
        return next.run(req).await;
    };
    let gone = || plain(StatusCode::BAD_GATEWAY, format!("The sandbox {id} was not found"));
    let Some(rec) = app.state.get(&id) else { return gone() };
    if rec.private_traffic {
        let want = app.state.traffic_token(&rec);
        let given = header_str(req.headers(), "e2b-traffic-access-token").unwrap_or("");
        if !crate::state::same_secret(given.as_bytes(), want.as_bytes()) {
            return plain(
                StatusCode::FORBIDDEN,
                format!("sandbox {id} allows no public traffic: send its e2b-traffic-access-token"),
            );
        }
    }
    let i = id.clone();
    let stream = match app.blocking(move |h| h.connect_port(&i, port)).await.and_then(|r| r) {
        Ok(s) => s,
        Err(HostError::NotFound(_)) => return gone(),
        Err(HostError::Conflict(m)) => return plain(StatusCode::BAD_GATEWAY, m),
        Err(e) => return plain(host_status(&e), e.to_string()),
    };
    // The token is the door's, not the sandbox server's business.
    let mut req = req;
    req.headers_mut().remove("e2b-traffic-access-token");
    match forward(stream, req).await {
        Ok(r) => r,
        Err(e) => plain(StatusCode::BAD_GATEWAY, format!("sandbox {id} port {port}: {e}")),
    }
}

async fn forward(stream: std::net::TcpStream, req: Request) -> Result<Response, String> {
    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
    let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::from_std(stream).map_err(|e| e.to_string())?);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    Ok(resp.map(Body::new))
}

/// A plain envd HTTP error: `{"code": status, "message": ...}`.
fn plain(status: StatusCode, message: String) -> Response {
    (status, axum::Json(json!({"code": status.as_u16(), "message": message}))).into_response()
}

fn host_status(e: &HostError) -> StatusCode {
    match e {
        HostError::NotFound(_) => StatusCode::NOT_FOUND,
        HostError::Invalid(_) | HostError::Conflict(_) => StatusCode::BAD_REQUEST,
        HostError::Permission(_) => StatusCode::FORBIDDEN,
        HostError::NoSpace(_) => StatusCode::INSUFFICIENT_STORAGE,
        HostError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The sandbox a request names: `E2b-Sandbox-Id`, else a `49983-<id>.<domain>` Host as E2B's own hosts name
/// sandboxes.
fn named_sandbox(h: &HeaderMap) -> Option<String> {
    if let Some(id) = header_str(h, "e2b-sandbox-id") {
        return Some(id.to_string());
    }
    host_parts(header_str(h, "host")?).map(|(_, id)| id.to_string())
}

/// The sandbox a request is for: its id, after checking it exists, runs, and the access token matches.
async fn sandbox_of<H: Host>(app: &Arc<App<H>>, h: &HeaderMap) -> Result<String, Response> {
    let Some(id) = named_sandbox(h) else {
        return Err(plain(
            StatusCode::BAD_REQUEST,
            "no E2b-Sandbox-Id header: say which sandbox this request is for".into(),
        ));
    };
    if app.state.get(&id).is_none() {
        return Err(plain(StatusCode::NOT_FOUND, format!("The sandbox {id} was not found")));
    }
    if !app.state.token_ok(&id, header_str(h, "x-access-token")) {
        return Err(plain(StatusCode::UNAUTHORIZED, format!("wrong or missing X-Access-Token for sandbox {id}")));
    }
    running(app, id).await
}

/// `id` while it runs; the answer E2B's proxy gives otherwise.
async fn running<H: Host>(app: &Arc<App<H>>, id: String) -> Result<String, Response> {
    let gone = || plain(StatusCode::NOT_FOUND, format!("The sandbox {id} was not found"));
    let i = id.clone();
    match app.blocking(move |h| h.status(&i)).await.unwrap_or(Status::Gone) {
        Status::Running => Ok(id),
        Status::Paused => Err(plain(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {id} was not found: it is paused; resume it with Sandbox.connect"),
        )),
        Status::Gone => Err(gone()),
    }
}

/// A user of the sandbox's /etc/passwd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// The sandbox's users and groups (read once per sandbox).
#[derive(Debug, Default)]
pub struct Users {
    users: Vec<User>,
    groups: HashMap<u32, String>,
}

impl Users {
    pub fn parse(passwd: &str, group: &str) -> Users {
        let users = passwd
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                (f.len() >= 6).then(|| User {
                    name: f[0].into(),
                    uid: f[2].parse().unwrap_or(u32::MAX),
                    gid: f[3].parse().unwrap_or(u32::MAX),
                    home: f[5].into(),
                })
            })
            .collect();
        let groups = group
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                Some((f.get(2)?.parse().ok()?, f[0].to_string()))
            })
            .collect();
        Users { users, groups }
    }
    fn by_name(&self, n: &str) -> Option<&User> {
        self.users.iter().find(|u| u.name == n)
    }
    fn owner(&self, uid: u32) -> String {
        self.users.iter().find(|u| u.uid == uid).map(|u| u.name.clone()).unwrap_or_else(|| uid.to_string())
    }
    fn group(&self, gid: u32) -> String {
        self.groups.get(&gid).cloned().unwrap_or_else(|| gid.to_string())
    }
}

async fn users_of<H: Host>(app: &Arc<App<H>>, id: &str) -> Arc<Users> {
    if let Some(u) = app.users.lock().get(id) {
        return u.clone();
    }
    let i = id.to_string();
    let read = move |h: &H, p: &str| -> String {
        let mut s = String::new();
        if let Ok((_, mut r)) = h.read_file(&i, p) {
            let _ = r.read_to_string(&mut s);
        }
        s
    };
    let (pw, gr) = app.blocking(move |h| (read(h, "/etc/passwd"), read(h, "/etc/group"))).await.unwrap_or_default();
    let u = Arc::new(Users::parse(&pw, &gr));
    if !u.users.is_empty() {
        app.users.lock().insert(id.to_string(), u.clone());
    }
    u
}

/// The user named by `Authorization: Basic` (or `username`), else the default.
async fn user_of<H: Host>(app: &Arc<App<H>>, id: &str, h: &HeaderMap, named: Option<&str>) -> Result<User, String> {
    let from_header = header_str(h, "authorization").and_then(|a| a.strip_prefix("Basic ")).and_then(|b| {
        let raw = B64.decode(b.trim()).ok()?;
        let s = String::from_utf8(raw).ok()?;
        Some(s.split(':').next().unwrap_or("").to_string())
    });
    let named = named.map(str::to_owned).or(from_header).filter(|n| !n.is_empty());
    let users = users_of(app, id).await;
    choose_user(&users, named, &app.cfg.default_user)
}

/// The user a request runs as: the one it names, else the default (E2B's `user`) where the sandbox's
/// /etc/passwd has it, else root (a template without E2B's user, such as clade's `minimal`). A named user the
/// sandbox lacks is an error, as in envd.
fn choose_user(users: &Users, named: Option<String>, default: &str) -> Result<User, String> {
    let root = || User { name: "root".into(), uid: 0, gid: 0, home: "/root".into() };
    let name = match named {
        Some(n) => n,
        None => return Ok(users.by_name(default).or_else(|| users.by_name("root")).cloned().unwrap_or_else(root)),
    };
    if let Some(u) = users.by_name(&name) {
        return Ok(u.clone());
    }
    if users.users.is_empty() && name == "root" {
        return Ok(root());
    }
    Err(format!("error looking up user '{name}': unknown user {name} in the sandbox's /etc/passwd"))
}

/// An absolute path: relative ones (and `~/...`) are under the user's home.
fn resolve(user: &User, p: &str) -> String {
    let p = p.trim();
    let home = user.home.trim_end_matches('/');
    if p.is_empty() || p == "~" {
        return user.home.clone();
    }
    if let Some(rest) = p.strip_prefix("~/") {
        return format!("{home}/{rest}");
    }
    if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{home}/{p}")
    }
}

/// 204 while the named sandbox runs; otherwise 502 "was not found", as E2B's proxy answers (the SDKs read that
/// as "not running").
async fn health<H: Host>(State(app): State<Arc<App<H>>>, h: HeaderMap) -> Response {
    let Some(id) = header_str(&h, "e2b-sandbox-id").map(str::to_owned) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    let known = app.state.get(&id).is_some();
    let i = id.clone();
    let s = app.blocking(move |h| h.status(&i)).await.unwrap_or(Status::Gone);
    if known && s == Status::Running {
        StatusCode::NO_CONTENT.into_response()
    } else {
        plain(StatusCode::BAD_GATEWAY, format!("The sandbox {id} was not found"))
    }
}

async fn envs<H: Host>(State(app): State<Arc<App<H>>>, h: HeaderMap) -> Response {
    match sandbox_of(&app, &h).await {
        Ok(_) => axum::Json(json!({})).into_response(),
        Err(r) => r,
    }
}

async fn init<H: Host>(State(app): State<Arc<App<H>>>, h: HeaderMap) -> Response {
    match sandbox_of(&app, &h).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => r,
    }
}

// ---- /files -----------------------------------------------------------------------------------------------

#[derive(Deserialize, Default)]
#[serde(default)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
    /// A signed URL's `v1_<base64 sha256>` (E2B's `download_url` / `upload_url`).
    signature: Option<String>,
    signature_expiration: Option<i64>,
}

/// E2B's v1 file URL signature: `v1_` and the unpadded base64 of
/// `sha256("<path>:<read|write>:<username>:<access token>[:<expiration>]")`.
pub(crate) fn file_signature(path: &str, op: &str, user: &str, token: &str, expiration: Option<i64>) -> String {
    use sha2::Digest;
    let raw = match expiration {
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let b64 = base64::engine::general_purpose::STANDARD_NO_PAD;
    format!("v1_{}", b64.encode(sha2::Sha256::digest(raw.as_bytes())))
}

/// The sandbox of a `/files` request: by its access token as any envd request, or by a signed URL's signature.
/// A signed URL need not name its sandbox (behind one `E2B_SANDBOX_URL` it cannot): the signature is checked
/// against the sandbox named, else against each known sandbox's token, and names the one it was made with.
async fn files_sandbox<H: Host>(app: &Arc<App<H>>, h: &HeaderMap, q: &FileQuery, op: &str) -> Result<String, Response> {
    let Some(sig) = q.signature.as_deref() else { return sandbox_of(app, h).await };
    if let Some(exp) = q.signature_expiration {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        if exp < now {
            return Err(plain(StatusCode::UNAUTHORIZED, "signature is already expired".into()));
        }
    }
    let path = q.path.as_deref().unwrap_or("");
    let user = q.username.as_deref().unwrap_or("");
    let signs = |r: &crate::state::Record| {
        let want = file_signature(path, op, user, &r.token, q.signature_expiration);
        crate::state::same_secret(want.as_bytes(), sig.as_bytes())
    };
    let found = match named_sandbox(h) {
        Some(id) => app.state.get(&id).filter(|r| signs(r)),
        None => app.state.all().into_iter().find(|r| signs(r)),
    };
    match found {
        Some(r) => running(app, r.id).await,
        None => Err(plain(StatusCode::UNAUTHORIZED, "invalid signature".into())),
    }
}

async fn download<H: Host>(State(app): State<Arc<App<H>>>, h: HeaderMap, Query(q): Query<FileQuery>) -> Response {
    let id = match files_sandbox(&app, &h, &q, "read").await {
        Ok(id) => id,
        Err(r) => return r,
    };
    let user = match user_of(&app, &id, &h, q.username.as_deref()).await {
        Ok(u) => u,
        Err(m) => return plain(StatusCode::UNAUTHORIZED, m),
    };
    let Some(p) = q.path.as_deref() else { return plain(StatusCode::BAD_REQUEST, "path is required".into()) };
    let path = resolve(&user, p);
    let (i, pp) = (id.clone(), path.clone());
    let opened = app.blocking(move |h| h.read_file(&i, &pp)).await.and_then(|r| r);
    let (size, mut reader) = match opened {
        Ok(x) => x,
        Err(HostError::NotFound(_)) => return plain(StatusCode::NOT_FOUND, format!("path '{path}' does not exist")),
        Err(e) => return plain(host_status(&e), e.to_string()),
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if tx.blocking_send(Ok(Bytes::copy_from_slice(&buf[..n]))).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    let name = path.rsplit('/').next().unwrap_or("file").replace('"', "");
    let body = Body::from_stream(tokio_stream(rx));
    let mut r = Response::new(body);
    let hs = r.headers_mut();
    hs.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/octet-stream"));
    // A file the kernel makes as it is read (/proc, /sys) has size 0 yet holds bytes: its length is left to
    // the end of the (chunked) body.
    if size > 0 {
        if let Ok(v) = header::HeaderValue::from_str(&size.to_string()) {
            hs.insert(header::CONTENT_LENGTH, v);
        }
    }
    if let Ok(v) = header::HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        hs.insert(header::CONTENT_DISPOSITION, v);
    }
    r
}

fn tokio_stream<T: Send + 'static>(rx: mpsc::Receiver<T>) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) })
}

/// A blocking reader over chunks fed from async code.
struct ChanReader {
    rx: mpsc::Receiver<Bytes>,
    cur: Bytes,
}

impl Read for ChanReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(b) => self.cur = b,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur = self.cur.slice(n..);
        Ok(n)
    }
}

/// Feed `chunks` into `host.write_file` as they arrive; the bytes written.
async fn write_from<H: Host, S>(
    app: &Arc<App<H>>,
    id: &str,
    path: &str,
    up: Upload,
    gzip: bool,
    mut chunks: S,
) -> Result<u64, HostError>
where
    S: futures_util::Stream<Item = Result<Bytes, String>> + Unpin,
{
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let (i, p) = (id.to_string(), path.to_string());
    let writer = app.blocking(move |h| {
        let r = ChanReader { rx, cur: Bytes::new() };
        if gzip {
            h.write_file(&i, &p, &up, &mut flate2::read::MultiGzDecoder::new(r))
        } else {
            let mut r = r;
            h.write_file(&i, &p, &up, &mut r)
        }
    });
    let feed = async move {
        while let Some(c) = chunks.next().await {
            let c = c.map_err(|e| HostError::Invalid(format!("reading the upload: {e}")))?;
            if tx.send(c).await.is_err() {
                break; // the writer stopped early: its answer says why
            }
        }
        Ok::<(), HostError>(())
    };
    let (w, f) = tokio::join!(writer, feed);
    let n = w.and_then(|r| r)?;
    f?;
    Ok(n)
}

fn written(paths: &[String], metadata: &BTreeMap<String, String>) -> Response {
    let v: Vec<Value> = paths
        .iter()
        .map(|p| {
            let mut v = json!({"path": p, "name": p.rsplit('/').next().unwrap_or(""), "type": "file"});
            if !metadata.is_empty() {
                v["metadata"] = json!(metadata);
            }
            v
        })
        .collect();
    axum::Json(v).into_response()
}

/// E2B's file metadata lives in extended attributes under this prefix (envd >= 0.6.2).
const METADATA_XATTR: &str = "user.e2b.";
const METADATA_HEADER: &str = "x-metadata-";

/// The `X-Metadata-<key>: value` headers of an upload, keys lowercased, as envd reads them: a key is an HTTP
/// token, a value printable US-ASCII.
fn metadata_of(h: &HeaderMap) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else { continue };
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| format!("metadata value of {key:?} must be printable US-ASCII"))?;
        if key.is_empty() || METADATA_XATTR.len() + key.len() > 255 {
            return Err(format!("metadata key {key:?} must be 1 to {} characters", 255 - METADATA_XATTR.len()));
        }
        out.insert(key.to_ascii_lowercase(), value.to_string());
    }
    Ok(out)
}

/// What an upload by `user` with `metadata` asks of the host: the user owns the file and the parents made
/// for it, as envd writes them as the user.
fn upload_of(user: &User, metadata: &BTreeMap<String, String>) -> Upload {
    Upload {
        owner: Some((user.uid, user.gid)),
        xattrs: metadata.iter().map(|(k, v)| (format!("{METADATA_XATTR}{k}"), v.clone())).collect(),
    }
}

async fn upload<H: Host>(State(app): State<Arc<App<H>>>, Query(q): Query<FileQuery>, req: Request) -> Response {
    let h = req.headers().clone();
    let id = match files_sandbox(&app, &h, &q, "write").await {
        Ok(id) => id,
        Err(r) => return r,
    };
    let user = match user_of(&app, &id, &h, q.username.as_deref()).await {
        Ok(u) => u,
        Err(m) => return plain(StatusCode::UNAUTHORIZED, m),
    };
    let metadata = match metadata_of(&h) {
        Ok(m) => m,
        Err(m) => return plain(StatusCode::BAD_REQUEST, m),
    };
    let ctype = header_str(&h, "content-type").unwrap_or("").to_ascii_lowercase();
    let gzip = header_str(&h, "content-encoding").is_some_and(|e| e.eq_ignore_ascii_case("gzip"));
    if ctype.starts_with("multipart/form-data") {
        let mut mp = match Multipart::from_request(req, &()).await {
            Ok(m) => m,
            Err(e) => return plain(StatusCode::BAD_REQUEST, format!("bad multipart body: {e}")),
        };
        let mut done = Vec::new();
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return plain(StatusCode::BAD_REQUEST, format!("bad multipart body: {e}")),
            };
            let name = field.file_name().map(str::to_owned);
            let target = match (&q.path, name) {
                (Some(p), _) if done.is_empty() => p.clone(),
                (_, Some(n)) if !n.is_empty() => n,
                _ => return plain(StatusCode::BAD_REQUEST, "a file part needs a filename (its path) or ?path=".into()),
            };
            let path = resolve(&user, &target);
            let stream = field.map(|r| r.map_err(|e| e.to_string()));
            match write_from(&app, &id, &path, upload_of(&user, &metadata), false, Box::pin(stream)).await {
                Ok(_) => done.push(path),
                Err(e) => return plain(host_status(&e), e.to_string()),
            }
        }
        if done.is_empty() {
            return plain(StatusCode::BAD_REQUEST, "the multipart body has no file part".into());
        }
        return written(&done, &metadata);
    }
    let Some(p) = q.path.as_deref() else {
        return plain(StatusCode::BAD_REQUEST, "path is required for an application/octet-stream upload".into());
    };
    let path = resolve(&user, p);
    let stream = req.into_body().into_data_stream().map(|r| r.map_err(|e| e.to_string()));
    match write_from(&app, &id, &path, upload_of(&user, &metadata), gzip, Box::pin(stream)).await {
        Ok(_) => written(&[path], &metadata),
        Err(e) => plain(host_status(&e), e.to_string()),
    }
}

// ---- Connect services ----------------------------------------------------------------------------------------

/// A process selector: `{"pid": n}` or `{"tag": "..."}`.
#[derive(Deserialize, Default, Debug)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize, Default, Debug)]
#[serde(default)]
struct Size {
    cols: u16,
    rows: u16,
}

#[derive(Deserialize, Default, Debug)]
#[serde(default)]
struct Pty {
    size: Option<Size>,
}

#[derive(Deserialize, Default, Debug)]
#[serde(default)]
struct ProcessConfig {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize, Default, Debug)]
#[serde(default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Deserialize, Default, Debug)]
#[serde(default, rename_all = "camelCase")]
struct ProcReq {
    process: Option<Value>,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
    input: Option<Input>,
    signal: Option<Value>,
}

#[derive(Deserialize, Default, Debug)]
#[serde(default, rename_all = "camelCase")]
struct FsReq {
    path: String,
    depth: Option<u32>,
    source: String,
    destination: String,
    recursive: bool,
    #[serde(alias = "include_entry")]
    include_entry: bool,
    #[serde(alias = "watcher_id")]
    watcher_id: String,
}

fn rpc<T>(r: Result<T, HostError>) -> Result<T, RpcError> {
    r.map_err(RpcError::from)
}

async fn call<H: Host, T: Send + 'static>(
    app: &Arc<App<H>>,
    f: impl FnOnce(&H) -> Result<T, HostError> + Send + 'static,
) -> Result<T, RpcError> {
    rpc(app.blocking(f).await.and_then(|r| r))
}

fn rpc_user_err(m: String) -> RpcError {
    RpcError::new(Code::Unauthenticated, m)
}

/// A process selector's pid.
async fn pid_of<H: Host>(app: &Arc<App<H>>, id: &str, sel: Option<&Value>) -> Result<u32, RpcError> {
    let sel: Selector = sel
        .cloned()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("bad process selector: {e}")))?
        .unwrap_or_default();
    if let Some(pid) = sel.pid {
        return Ok(pid);
    }
    let Some(tag) = sel.tag else { return Err(RpcError::new(Code::InvalidArgument, "select a process by pid or tag")) };
    let i = id.to_string();
    let procs = call(app, move |h| h.proc_list(&i)).await?;
    procs
        .into_iter()
        .find(|p| p.tag.as_deref() == Some(tag.as_str()))
        .map(|p| p.pid)
        .ok_or_else(|| RpcError::new(Code::NotFound, format!("process with tag {tag} not found")))
}

fn signal_of(v: Option<&Value>) -> Result<i32, RpcError> {
    match v {
        Some(Value::Number(n)) => {
            n.as_i64().map(|n| n as i32).ok_or_else(|| RpcError::new(Code::InvalidArgument, "bad signal"))
        }
        Some(Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" => Ok(9),
            "SIGNAL_SIGTERM" => Ok(15),
            other => Err(RpcError::new(Code::InvalidArgument, format!("unsupported signal {other}"))),
        },
        _ => Err(RpcError::new(Code::InvalidArgument, "a signal is required (SIGNAL_SIGTERM or SIGNAL_SIGKILL)")),
    }
}

async fn process<H: Host>(State(app): State<Arc<App<H>>>, Path(method): Path<String>, req: Request) -> Response {
    let h = req.headers().clone();
    let streaming = connect::is_streaming(h.get(header::CONTENT_TYPE));
    let id = match sandbox_of(&app, &h).await {
        Ok(id) => id,
        Err(r) => return r,
    };
    if method == "StreamInput" {
        return stream_input(app, id, req).await;
    }
    let body = match axum::body::to_bytes(req.into_body(), connect::MAX_MESSAGE).await {
        Ok(b) => b,
        Err(e) => {
            return connect::unary(Err(RpcError::new(Code::InvalidArgument, format!("reading the request: {e}"))))
        }
    };
    let r: ProcReq = match connect::decode_request(streaming, &body) {
        Ok(r) => r,
        Err(e) => return if streaming { connect::stream_error(e) } else { connect::unary(Err(e)) },
    };
    let keepalive = header_str(&h, "keepalive-ping-interval").and_then(|s| s.parse::<u64>().ok()).filter(|s| *s > 0);
    // Connect's deadline for the whole stream (the SDKs' `timeout`): past it the stream ends with
    // deadline_exceeded and the process runs on, as after any detach.
    let deadline = header_str(&h, "connect-timeout-ms")
        .and_then(|s| s.parse::<u64>().ok())
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    match method.as_str() {
        "Start" => {
            let user = match user_of(&app, &id, &h, None).await {
                Ok(u) => u,
                Err(m) => return connect::stream_error(rpc_user_err(m)),
            };
            let cfg: ProcessConfig = match r.process.map(serde_json::from_value).transpose() {
                Ok(c) => c.unwrap_or_default(),
                Err(e) => {
                    return connect::stream_error(RpcError::new(Code::InvalidArgument, format!("bad process: {e}")))
                }
            };
            if cfg.cmd.is_empty() {
                return connect::stream_error(RpcError::new(Code::InvalidArgument, "process.cmd is empty"));
            }
            let pty = r.pty.and_then(|p| p.size).map(|s| (s.rows.max(1), s.cols.max(1)));
            let mut argv = vec![cfg.cmd];
            argv.extend(cfg.args);
            let spec = ProcSpec {
                argv,
                env: cfg.envs,
                cwd: Some(cfg.cwd.filter(|c| !c.is_empty()).map(|c| resolve(&user, &c)).unwrap_or(user.home.clone())),
                user: Some(user.name),
                pty,
                stdin: r.stdin.unwrap_or(true),
                tag: r.tag,
            };
            let i = id.clone();
            match call(&app, move |h| h.proc_start(&i, spec)).await {
                Ok((pid, events)) => {
                    if pty.is_some() {
                        app.ptys.lock().insert((id.clone(), pid));
                    }
                    proc_stream(app.clone(), id.clone(), pid, events, pty.is_some(), keepalive, deadline)
                }
                Err(e) => connect::stream_error(e),
            }
        }
        "Connect" => {
            let pid = match pid_of(&app, &id, r.process.as_ref()).await {
                Ok(p) => p,
                Err(e) => return connect::stream_error(e),
            };
            let i = id.clone();
            match call(&app, move |h| h.proc_connect(&i, pid)).await {
                Ok(events) => {
                    let pty = app.ptys.lock().contains(&(id.clone(), pid));
                    proc_stream(app.clone(), id.clone(), pid, events, pty, keepalive, deadline)
                }
                Err(e) => connect::stream_error(e),
            }
        }
        "List" => {
            let i = id.clone();
            connect::unary(call(&app, move |h| h.proc_list(&i)).await.map(|procs| {
                let v: Vec<Value> = procs
                    .into_iter()
                    .map(|p| {
                        let mut args = p.argv;
                        let cmd = if args.is_empty() { String::new() } else { args.remove(0) };
                        let mut cfg = json!({"cmd": cmd, "args": args, "envs": p.env});
                        if let Some(c) = p.cwd {
                            cfg["cwd"] = json!(c);
                        }
                        let mut o = json!({"config": cfg, "pid": p.pid});
                        if let Some(t) = p.tag {
                            o["tag"] = json!(t);
                        }
                        o
                    })
                    .collect();
                json!({"processes": v})
            }))
        }
        "SendInput" => {
            let res = async {
                let pid = pid_of(&app, &id, r.process.as_ref()).await?;
                let data = input_bytes(r.input.as_ref())?;
                let i = id.clone();
                call(&app, move |h| h.proc_input(&i, pid, &data)).await
            };
            connect::unary(res.await.map(|_| json!({})))
        }
        "CloseStdin" => {
            let res = async {
                let pid = pid_of(&app, &id, r.process.as_ref()).await?;
                let i = id.clone();
                call(&app, move |h| h.proc_close_stdin(&i, pid)).await
            };
            connect::unary(res.await.map(|_| json!({})))
        }
        "SendSignal" => {
            let res = async {
                let pid = pid_of(&app, &id, r.process.as_ref()).await?;
                let sig = signal_of(r.signal.as_ref())?;
                let i = id.clone();
                call(&app, move |h| h.proc_signal(&i, pid, sig)).await
            };
            connect::unary(res.await.map(|_| json!({})))
        }
        "Update" => {
            let res = async {
                let pid = pid_of(&app, &id, r.process.as_ref()).await?;
                let Some(size) = r.pty.and_then(|p| p.size) else { return Ok(()) };
                let i = id.clone();
                call(&app, move |h| h.proc_resize(&i, pid, size.rows.max(1), size.cols.max(1))).await
            };
            connect::unary(res.await.map(|_| json!({})))
        }
        other => {
            let e = RpcError::new(Code::Unimplemented, format!("process.Process/{other} is not implemented"));
            if streaming {
                connect::stream_error(e)
            } else {
                connect::unary(Err(e))
            }
        }
    }
}

fn input_bytes(i: Option<&Input>) -> Result<Vec<u8>, RpcError> {
    let Some(i) = i else { return Ok(Vec::new()) };
    let s = i.stdin.as_deref().or(i.pty.as_deref()).unwrap_or("");
    B64.decode(s).map_err(|e| RpcError::new(Code::InvalidArgument, format!("input is not base64: {e}")))
}

/// The events of a process as a Connect server stream: start, data, end (and keepalives).
fn proc_stream<H: Host>(
    app: Arc<App<H>>,
    id: String,
    pid: u32,
    events: crate::host::ProcStream,
    pty: bool,
    keepalive: Option<u64>,
    deadline: Option<tokio::time::Instant>,
) -> Response {
    let (tx, rx) = mpsc::channel::<ProcEvent>(64);
    tokio::task::spawn_blocking(move || {
        for ev in events {
            if tx.blocking_send(ev).is_err() {
                return; // the client went away: dropping `events` detaches, the process runs on
            }
        }
    });
    let start = json!({"event": {"start": {"pid": pid}}});
    let every = Duration::from_secs(keepalive.unwrap_or(3600));
    let s = futures_util::stream::unfold((Some(start), rx, false), move |(first, mut rx, done)| {
        let (app, id) = (app.clone(), id.clone());
        async move {
            if let Some(f) = first {
                return Some((Ok(f), (None, rx, false)));
            }
            if done {
                return None;
            }
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = tokio::time::sleep(every) => {
                    return Some((Ok(json!({"event": {"keepalive": {}}})), (None, rx, false)));
                }
                _ = async { tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)).await },
                    if deadline.is_some() => {
                    let e = RpcError::new(Code::DeadlineExceeded, "the command's timeout passed (the process runs on)");
                    return Some((Err(e), (None, rx, true)));
                }
            };
            let msg = match ev {
                Some(ProcEvent::Stdout(d)) => {
                    let k = if pty { "pty" } else { "stdout" };
                    json!({"event": {"data": {k: B64.encode(d)}}})
                }
                Some(ProcEvent::Stderr(d)) => json!({"event": {"data": {"stderr": B64.encode(d)}}}),
                Some(ProcEvent::Exit { code, signal }) => {
                    let (exit_code, exited, status) = match (code, signal) {
                        (Some(c), _) => (c, true, format!("exit status {c}")),
                        (None, Some(s)) => (-1, false, format!("signal: {}", signal_name(s))),
                        (None, None) => (-1, false, "unknown".to_string()),
                    };
                    let end = json!({"event": {"end": {"exitCode": exit_code, "exited": exited, "status": status}}});
                    return Some((Ok(end), (None, rx, true)));
                }
                Some(ProcEvent::Error(m)) => {
                    return Some((Err(ended(&app, &id, m).await), (None, rx, true)));
                }
                None => {
                    let e = ended(&app, &id, "the process stream ended without an exit".into()).await;
                    return Some((Err(e), (None, rx, true)));
                }
            };
            Some((Ok(msg), (None, rx, false)))
        }
    });
    connect::server_stream(s)
}

/// How a process stream that lost its process ends. When the sandbox went away, its connection is cut, as
/// E2B's proxy cuts it (the SDKs then ask `/health`, which says it is gone); otherwise the stream ends with
/// `unavailable`. A stream cut by a kill ends a moment before the host's records say so: wait (up to 2 s) for
/// them to settle first, so the answer and the health probe after it are the true ones rather than a race.
async fn ended<H: Host>(app: &Arc<App<H>>, id: &str, why: String) -> RpcError {
    for _ in 0..20 {
        let i = id.to_string();
        if app.blocking(move |h| h.status(&i)).await.unwrap_or(Status::Gone) != Status::Running {
            return RpcError::cut(why);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    RpcError::new(Code::Unavailable, why)
}

fn signal_name(s: i32) -> String {
    match s {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        1 => "hangup".into(),
        6 => "aborted".into(),
        11 => "segmentation fault".into(),
        13 => "broken pipe".into(),
        n => format!("signal {n}"),
    }
}

/// `StreamInput`: a client stream of `start{process}`, `data{input}`, `keepalive` envelopes.
async fn stream_input<H: Host>(app: Arc<App<H>>, id: String, req: Request) -> Response {
    let mut body = req.into_body().into_data_stream();
    let mut buf = BytesMut::new();
    let mut pid: Option<u32> = None;
    let result: Result<(), RpcError> = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| RpcError::new(Code::Canceled, format!("the input stream broke: {e}")))?;
            buf.extend_from_slice(&chunk);
            for (flags, msg) in connect::take_envelopes(&mut buf)? {
                if flags & connect::FLAG_END != 0 {
                    continue;
                }
                let v: Value = serde_json::from_slice(&msg)
                    .map_err(|e| RpcError::new(Code::InvalidArgument, format!("bad input message: {e}")))?;
                if let Some(s) = v.get("start") {
                    pid = Some(pid_of(&app, &id, s.get("process")).await?);
                } else if let Some(d) = v.get("data") {
                    let Some(p) = pid else {
                        return Err(RpcError::new(Code::FailedPrecondition, "data before start in StreamInput"));
                    };
                    let input: Input = d
                        .get("input")
                        .cloned()
                        .map(serde_json::from_value)
                        .transpose()
                        .ok()
                        .flatten()
                        .unwrap_or_default();
                    let data = input_bytes(Some(&input))?;
                    let i = id.clone();
                    call(&app, move |h| h.proc_input(&i, p, &data)).await?;
                }
            }
        }
        Ok(())
    }
    .await;
    let msgs = match result {
        Ok(()) => vec![Ok(json!({}))],
        Err(e) => vec![Err(e)],
    };
    connect::server_stream(futures_util::stream::iter(msgs))
}

fn perm_string(kind: Kind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        Kind::Dir => 'd',
        Kind::Symlink => 'L',
        _ => '-',
    });
    for shift in [6u32, 3, 0] {
        let b = (mode >> shift) & 7;
        s.push(if b & 4 != 0 { 'r' } else { '-' });
        s.push(if b & 2 != 0 { 'w' } else { '-' });
        s.push(if b & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// A symlink as envd reports it: the type, size, mode and owner of what it points to, and the absolute path
/// it resolves to as `symlinkTarget` (followed through up to 8 links). A dangling link stays a symlink.
fn followed<H: Host>(h: &H, id: &str, e: Entry) -> Entry {
    if e.kind != Kind::Symlink {
        return e;
    }
    let mut at = e.path.clone();
    let mut cur = e.clone();
    for _ in 0..8 {
        let Some(t) = cur.link_target.as_deref() else { return e };
        let dir = at.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
        at = normalize(&if t.starts_with('/') { t.to_string() } else { format!("{dir}/{t}") });
        match h.stat(id, &at) {
            Ok(next) if next.kind == Kind::Symlink => cur = next,
            Ok(next) => return Entry { path: e.path, link_target: Some(at), ..next },
            Err(_) => return e,
        }
    }
    e
}

/// `/a/./b/../c` -> `/a/c`, lexically.
fn normalize(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

fn entry_json(e: &Entry, users: &Users) -> Value {
    let kind = match e.kind {
        Kind::File => "FILE_TYPE_FILE",
        Kind::Dir => "FILE_TYPE_DIRECTORY",
        Kind::Symlink => "FILE_TYPE_SYMLINK",
        Kind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let name = if e.path == "/" { "/" } else { e.path.trim_end_matches('/').rsplit('/').next().unwrap_or("") };
    let mut v = json!({
        "name": name, "type": kind, "path": e.path, "size": e.size.to_string(), "mode": e.mode,
        "permissions": perm_string(e.kind, e.mode), "owner": users.owner(e.uid), "group": users.group(e.gid),
        "modifiedTime": rfc3339_ns(e.mtime_ns),
    });
    if let Some(t) = &e.link_target {
        v["symlinkTarget"] = json!(t);
    }
    let metadata: BTreeMap<&str, &str> =
        e.xattrs.iter().filter_map(|(k, val)| Some((k.strip_prefix(METADATA_XATTR)?, val.as_str()))).collect();
    if !metadata.is_empty() {
        v["metadata"] = json!(metadata);
    }
    v
}

async fn filesystem<H: Host>(State(app): State<Arc<App<H>>>, Path(method): Path<String>, req: Request) -> Response {
    let h = req.headers().clone();
    let streaming = connect::is_streaming(h.get(header::CONTENT_TYPE));
    let id = match sandbox_of(&app, &h).await {
        Ok(id) => id,
        Err(r) => return r,
    };
    let body = match axum::body::to_bytes(req.into_body(), connect::MAX_MESSAGE).await {
        Ok(b) => b,
        Err(e) => {
            return connect::unary(Err(RpcError::new(Code::InvalidArgument, format!("reading the request: {e}"))))
        }
    };
    let r: FsReq = match connect::decode_request(streaming, &body) {
        Ok(r) => r,
        Err(e) => return if streaming { connect::stream_error(e) } else { connect::unary(Err(e)) },
    };
    let user = match user_of(&app, &id, &h, None).await {
        Ok(u) => u,
        Err(m) => {
            let e = rpc_user_err(m);
            return if streaming { connect::stream_error(e) } else { connect::unary(Err(e)) };
        }
    };
    let users = users_of(&app, &id).await;
    let i = id.clone();
    match method.as_str() {
        "Stat" => {
            let p = resolve(&user, &r.path);
            let res = call(&app, move |h| h.stat(&i, &p).map(|e| followed(h, &i, e))).await;
            connect::unary(res.map(|e| json!({"entry": entry_json(&e, &users)})))
        }
        "ListDir" => {
            let p = resolve(&user, &r.path);
            let depth = r.depth.unwrap_or(1).max(1);
            let res = async {
                let pp = p.clone();
                let st = call(&app, {
                    let i = i.clone();
                    move |h| h.stat(&i, &pp)
                })
                .await?;
                if st.kind != Kind::Dir {
                    return Err(RpcError::new(Code::InvalidArgument, format!("path {p} is not a directory")));
                }
                call(&app, move |h| {
                    h.list_dir(&i, &p, depth).map(|es| es.into_iter().map(|e| followed(h, &i, e)).collect::<Vec<_>>())
                })
                .await
            };
            connect::unary(
                res.await.map(|es| json!({"entries": es.iter().map(|e| entry_json(e, &users)).collect::<Vec<_>>()})),
            )
        }
        "MakeDir" => {
            let p = resolve(&user, &r.path);
            let res = async {
                let pp = p.clone();
                let owner = Some((user.uid, user.gid));
                let created = call(&app, {
                    let i = i.clone();
                    move |h| h.mkdir(&i, &pp, owner)
                })
                .await?;
                if !created {
                    return Err(RpcError::new(Code::AlreadyExists, format!("directory {p} already exists")));
                }
                call(&app, move |h| h.stat(&i, &p)).await
            };
            connect::unary(res.await.map(|e| json!({"entry": entry_json(&e, &users)})))
        }
        "Move" => {
            let (from, to) = (resolve(&user, &r.source), resolve(&user, &r.destination));
            let res = async {
                let (f, t) = (from.clone(), to.clone());
                call(&app, {
                    let i = i.clone();
                    move |h| h.rename(&i, &f, &t)
                })
                .await?;
                call(&app, move |h| h.stat(&i, &to)).await
            };
            connect::unary(res.await.map(|e| json!({"entry": entry_json(&e, &users)})))
        }
        "Remove" => {
            // As envd's `os.RemoveAll`: a path that is not there is already removed, not an error.
            let p = resolve(&user, &r.path);
            let res = match call(&app, move |h| h.remove(&i, &p)).await {
                Err(e) if e.code == Code::NotFound => Ok(()),
                other => other,
            };
            connect::unary(res.map(|_| json!({})))
        }
        "WatchDir" => {
            let p = resolve(&user, &r.path);
            match Watcher::start(&app, &id, &p, r.recursive, r.include_entry).await {
                Ok(w) => watch_stream(app.clone(), w, users),
                Err(e) => connect::stream_error(e),
            }
        }
        "CreateWatcher" => {
            let p = resolve(&user, &r.path);
            connect::unary(match Watcher::start(&app, &id, &p, r.recursive, r.include_entry).await {
                Ok(w) => {
                    let wid = random_hex(8);
                    app.watchers.lock().insert(wid.clone(), w);
                    Ok(json!({"watcherId": wid}))
                }
                Err(e) => Err(e),
            })
        }
        "GetWatcherEvents" => {
            let w = app.watchers.lock().remove(&r.watcher_id);
            let Some(mut w) = w else {
                return connect::unary(Err(RpcError::new(
                    Code::NotFound,
                    format!("watcher {} not found", r.watcher_id),
                )));
            };
            let evs = w.next(&app, 0).await;
            app.watchers.lock().insert(r.watcher_id.clone(), w);
            connect::unary(evs.map(|evs| json!({"events": evs.iter().map(|e| e.json(&users)).collect::<Vec<_>>()})))
        }
        "RemoveWatcher" => {
            app.watchers.lock().remove(&r.watcher_id);
            connect::unary(Ok(json!({})))
        }
        other => {
            let e = RpcError::new(Code::Unimplemented, format!("filesystem.Filesystem/{other} is not implemented"));
            if streaming {
                connect::stream_error(e)
            } else {
                connect::unary(Err(e))
            }
        }
    }
}

/// A directory watch: the sandbox's own (inotify in its agent) where the host offers one, else a polling one
/// (the previous listing, diffed against each new one: a sandbox whose agent predates watches).
pub struct Watcher {
    sandbox: String,
    path: String,
    depth: u32,
    /// Events carry the entry they are about (`include_entry`, envd >= 0.6.3).
    with_entry: bool,
    /// The sandbox's watch, and what ends it when this watcher goes (a stopped stream, `RemoveWatcher`).
    inside: Option<(u64, Option<StopWatch>)>,
    seen: HashMap<String, Entry>,
}

/// Ends a watch inside the sandbox.
type StopWatch = Box<dyn FnOnce() + Send>;

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(stop) = self.inside.as_mut().and_then(|(_, s)| s.take()) {
            // Off the async runtime: the stop is a request to the sandbox.
            std::thread::spawn(stop);
        }
    }
}

struct FsEvent {
    name: String,
    kind: &'static str,
    /// The entry as it is now (not for a removal).
    entry: Option<Entry>,
}

impl FsEvent {
    fn json(&self, u: &Users) -> Value {
        let mut v = json!({"name": self.name, "type": self.kind});
        if let Some(e) = &self.entry {
            v["entry"] = entry_json(e, u);
        }
        v
    }
}

impl Watcher {
    async fn listing<H: Host>(
        app: &Arc<App<H>>,
        sandbox: &str,
        path: &str,
        depth: u32,
    ) -> Result<HashMap<String, Entry>, RpcError> {
        let (i, p) = (sandbox.to_string(), path.to_string());
        let es = call(app, move |h| h.list_dir(&i, &p, depth)).await?;
        Ok(es.into_iter().map(|e| (e.path.clone(), e)).collect())
    }

    async fn start<H: Host>(
        app: &Arc<App<H>>,
        sandbox: &str,
        path: &str,
        recursive: bool,
        with_entry: bool,
    ) -> Result<Watcher, RpcError> {
        let (i, p) = (sandbox.to_string(), path.to_string());
        let st = call(app, move |h| h.stat(&i, &p)).await?;
        if st.kind != Kind::Dir {
            return Err(RpcError::new(Code::InvalidArgument, format!("path {path} is not a directory")));
        }
        let depth = if recursive { 32 } else { 1 };
        let path = path.trim_end_matches('/').to_string();
        let (i, p) = (sandbox.to_string(), path.clone());
        if let Some(watch) = call(app, move |h| h.watch_start(&i, &p, recursive)).await? {
            let (a, i) = (app.clone(), sandbox.to_string());
            let stop: StopWatch = Box::new(move || {
                let _ = a.host.watch_stop(&i, watch);
            });
            let inside = Some((watch, Some(stop)));
            return Ok(Watcher { sandbox: sandbox.into(), path, depth, with_entry, inside, seen: HashMap::new() });
        }
        let seen = Self::listing(app, sandbox, &path, depth).await?;
        Ok(Watcher { sandbox: sandbox.into(), path, depth, with_entry, inside: None, seen })
    }

    /// New events, waiting up to `wait_ms` for one (a watch inside the sandbox; a polling one answers at once).
    async fn next<H: Host>(&mut self, app: &Arc<App<H>>, wait_ms: u64) -> Result<Vec<FsEvent>, RpcError> {
        let Some((watch, _)) = &self.inside else { return self.poll(app).await };
        let (i, w) = (self.sandbox.clone(), *watch);
        let (changes, _lost) = call(app, move |h| h.watch_events(&i, w, wait_ms)).await?;
        let mut out = Vec::with_capacity(changes.len());
        for c in changes {
            let kind = match c.change {
                Change::Create => "EVENT_TYPE_CREATE",
                Change::Write => "EVENT_TYPE_WRITE",
                Change::Chmod => "EVENT_TYPE_CHMOD",
                Change::Remove => "EVENT_TYPE_REMOVE",
                Change::Rename => "EVENT_TYPE_RENAME",
            };
            // The entry as it is now, where there is one (not after a removal or a rename away).
            let entry = if self.with_entry && c.change != Change::Remove {
                let (i, p) = (self.sandbox.clone(), format!("{}/{}", self.path, c.name));
                call(app, move |h| h.stat(&i, &p)).await.ok()
            } else {
                None
            };
            out.push(FsEvent { name: c.name, kind, entry });
        }
        Ok(out)
    }

    async fn poll<H: Host>(&mut self, app: &Arc<App<H>>) -> Result<Vec<FsEvent>, RpcError> {
        let now = Self::listing(app, &self.sandbox, &self.path, self.depth).await?;
        let rel = |p: &str| p.strip_prefix(&format!("{}/", self.path)).unwrap_or(p).to_string();
        let with = |e: &Entry| self.with_entry.then(|| e.clone());
        let mut out = Vec::new();
        for (p, e) in &now {
            match self.seen.get(p) {
                None => {
                    out.push(FsEvent { name: rel(p), kind: "EVENT_TYPE_CREATE", entry: with(e) });
                    // A file that appeared holding bytes was also written since (inotify's IN_MODIFY).
                    if e.kind == Kind::File && e.size > 0 {
                        out.push(FsEvent { name: rel(p), kind: "EVENT_TYPE_WRITE", entry: with(e) });
                    }
                }
                Some(old) => {
                    if old.kind != Kind::Dir && (old.size != e.size || old.mtime_ns != e.mtime_ns) {
                        out.push(FsEvent { name: rel(p), kind: "EVENT_TYPE_WRITE", entry: with(e) });
                    }
                    if old.mode != e.mode || old.uid != e.uid || old.gid != e.gid || old.xattrs != e.xattrs {
                        out.push(FsEvent { name: rel(p), kind: "EVENT_TYPE_CHMOD", entry: with(e) });
                    }
                }
            }
        }
        for p in self.seen.keys() {
            if !now.contains_key(p) {
                out.push(FsEvent { name: rel(p), kind: "EVENT_TYPE_REMOVE", entry: None });
            }
        }
        // By name, each name's events in the order they happened (a stable sort keeps CREATE before WRITE).
        out.sort_by(|a, b| a.name.cmp(&b.name));
        self.seen = now;
        Ok(out)
    }
}

fn watch_stream<H: Host>(app: Arc<App<H>>, w: Watcher, users: Arc<Users>) -> Response {
    let start = json!({"start": {}});
    let s = futures_util::stream::unfold(
        (Some(start), w, std::collections::VecDeque::<Value>::new(), false),
        move |(first, mut w, mut queue, done)| {
            let app = app.clone();
            let users = users.clone();
            async move {
                if let Some(f) = first {
                    return Some((Ok(f), (None, w, queue, false)));
                }
                if done {
                    return None;
                }
                loop {
                    if let Some(v) = queue.pop_front() {
                        return Some((Ok(v), (None, w, queue, false)));
                    }
                    // A watch inside the sandbox waits there for its next event; a polling one every 250 ms.
                    if w.inside.is_none() {
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    match w.next(&app, 1000).await {
                        Ok(evs) => queue.extend(evs.iter().map(|e| json!({"filesystem": e.json(&users)}))),
                        Err(e) => return Some((Err(e), (None, w, queue, true))),
                    }
                }
            }
        },
    );
    connect::server_stream(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_users_permissions() {
        let u = Users::parse("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/sh\n", "root:x:0:\n");
        let user = u.by_name("user").unwrap().clone();
        assert_eq!(resolve(&user, "a.txt"), "/home/user/a.txt");
        assert_eq!(resolve(&user, "~/b"), "/home/user/b");
        assert_eq!(resolve(&user, "/etc/x"), "/etc/x");
        assert_eq!(u.owner(0), "root");
        assert_eq!(u.group(1000), "1000");
        assert_eq!(perm_string(Kind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(normalize("/home/user/d/./../x"), "/home/user/x");
        assert_eq!(normalize("/../a//b/"), "/a/b");
        assert_eq!(port_target("8001-sb-1.localhost:3001"), Some((8001, "sb-1".into())));
        assert_eq!(port_target("49983-sb-1.localhost:3001"), None, "envd's own port");
        assert_eq!(port_target("127.0.0.1:3001"), None);
        assert_eq!(perm_string(Kind::File, 0o640), "-rw-r-----");
        assert_eq!(signal_of(Some(&json!("SIGNAL_SIGKILL"))).unwrap(), 9);
        assert_eq!(signal_of(Some(&json!(15))).unwrap(), 15);
        assert!(signal_of(None).is_err());
    }

    #[test]
    fn file_signatures_are_e2bs_v1() {
        // Vectors from the Python SDK's e2b.sandbox.signature.get_signature.
        assert_eq!(
            file_signature("a.txt", "read", "user", "tok", None),
            "v1_wPjHOh/p+K3FbqiyGd5vwPNc/g4IPd8sigMxb1gqu9I"
        );
        assert_eq!(
            file_signature("a.txt", "write", "", "tok", Some(1_700_000_000)),
            "v1_ynwN4qqj2sEXxAURgzwm1HWNT+RQ03EBkBe4oJxeqs8"
        );
    }

    #[test]
    fn the_default_user_is_e2bs_user_where_the_sandbox_has_it() {
        let e2b = Users::parse("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n", "");
        let minimal = Users::parse("root:x:0:0:root:/root:/bin/bash\n", "");
        let pick = |u: &Users, n: Option<&str>| choose_user(u, n.map(String::from), "user").map(|u| (u.name, u.home));
        assert_eq!(pick(&e2b, None), Ok(("user".into(), "/home/user".into())));
        assert_eq!(pick(&minimal, None), Ok(("root".into(), "/root".into())), "no `user`: root, as before");
        assert_eq!(pick(&Users::parse("", ""), None), Ok(("root".into(), "/root".into())), "no passwd at all");
        assert_eq!(pick(&e2b, Some("root")), Ok(("root".into(), "/root".into())));
        assert!(pick(&minimal, Some("user")).unwrap_err().contains("unknown user user"), "named and missing");
    }
}
