//! E2B's two faces over any sandbox host: the control plane (E2B's `openapi.yml`: create, list, get, kill,
//! timeout, pause, resume/connect, fork, snapshots) and envd (the in-sandbox daemon's Connect-RPC
//! `process.Process` and `filesystem.Filesystem` services, `/files` and `/health`). Both are axum routers over
//! an [`App`], which is generic over [`Host`]: the official E2B SDKs, pointed here with `E2B_API_URL` and
//! `E2B_SANDBOX_URL`, drive whatever implements it.
//!
//! envd requests name their sandbox with the `E2b-Sandbox-Id` header (or a `49983-<id>.<domain>` host) and
//! carry the `X-Access-Token` the create call returned.

pub mod api;
pub mod connect;
pub mod envd;
pub mod host;
pub mod state;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub use host::{
    Change, Changed, Entry, Host, HostError, HostResult, Kind, ProcEvent, ProcInfo, ProcSpec, ProcStream, Snapshot,
    Started, Status, Upload, Usage,
};

/// Settings of the E2B layer.
#[derive(Debug, Clone)]
pub struct Config {
    /// The envd version reported to SDKs: it selects their code paths. 0.6.4: default user, stdin,
    /// octet-stream uploads, file metadata (0.6.2), entry info in watch events (0.6.3), watches that allow
    /// network mounts (0.6.4: inotify in the sandbox's agent sees what the sandbox's own kernel sees of a mount).
    pub envd_version: String,
    /// The user processes and files run as when a request names none, where the sandbox has it (E2B's `user`,
    /// home /home/user); a sandbox without it runs such requests as root.
    pub default_user: String,
    /// Seconds a sandbox lives when create names no timeout.
    pub default_timeout_s: u64,
    /// Where E2B's own records are kept across restarts (None: memory only).
    pub state_file: Option<PathBuf>,
    /// `clientID` in answers.
    pub client_id: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            envd_version: "0.6.4".into(),
            default_user: "user".into(),
            default_timeout_s: 300,
            state_file: None,
            client_id: "clade".into(),
        }
    }
}

/// The shared state of both routers.
pub struct App<H: Host> {
    pub host: Arc<H>,
    pub state: state::State,
    pub cfg: Config,
    users: Mutex<HashMap<String, Arc<envd::Users>>>,
    watchers: Mutex<HashMap<String, envd::Watcher>>,
    /// Processes started with a PTY, by (sandbox, pid): a `Connect` to one streams `pty` data, as its start did.
    ptys: Mutex<std::collections::HashSet<(String, u32)>>,
}

impl<H: Host> App<H> {
    /// The app over `host`, its records loaded from `cfg.state_file` (the token key beside them made if missing).
    pub fn new(host: Arc<H>, cfg: Config) -> Result<Arc<App<H>>, state::StateError> {
        let state = state::State::open(cfg.state_file.clone())?;
        Ok(Arc::new(App {
            host,
            state,
            cfg,
            users: Mutex::new(HashMap::new()),
            watchers: Mutex::new(HashMap::new()),
            ptys: Mutex::new(Default::default()),
        }))
    }

    /// Run `f` on the host from tokio's blocking pool.
    pub async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&H) -> T + Send + 'static,
    ) -> Result<T, HostError> {
        let host = self.host.clone();
        tokio::task::spawn_blocking(move || f(&host))
            .await
            .map_err(|e| HostError::Internal(format!("a host call failed: {e}")))
    }
}

/// Ends sandboxes whose timeout passed (pausing those created with auto-pause), every `every`.
pub fn spawn_reaper<H: Host>(app: Arc<App<H>>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            api::reap(&app).await;
        }
    })
}

/// `router` behind the doors the native API has too (clade_http::doors): no `Origin`, a `Host` naming the
/// listener (`hosts`). A refusal is a 403 in E2B's error shape, naming the door.
pub fn with_doors(router: axum::Router, hosts: Vec<String>) -> axum::Router {
    router.layer(axum::middleware::from_fn_with_state(Arc::new(hosts), doors))
}

async fn doors(
    axum::extract::State(hosts): axum::extract::State<Arc<Vec<String>>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match clade_http::doors::check(&hosts, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(r) => api::ApiError(axum::http::StatusCode::FORBIDDEN, r.message()).into_response(),
    }
}

/// Bind both listeners, then serve them (and the reaper) as tokio tasks. Returns once both are bound.
pub async fn spawn<H: Host>(
    app: Arc<App<H>>,
    api_addr: std::net::SocketAddr,
    envd_addr: std::net::SocketAddr,
) -> std::io::Result<(std::net::SocketAddr, std::net::SocketAddr)> {
    let api_l = tokio::net::TcpListener::bind(api_addr).await?;
    let envd_l = tokio::net::TcpListener::bind(envd_addr).await?;
    let (a, e) = (api_l.local_addr()?, envd_l.local_addr()?);
    let api_r = with_doors(api::router(app.clone()), clade_http::doors::tcp_hosts(a));
    let envd_r = with_doors(envd::router(app.clone()), clade_http::doors::tcp_hosts(e));
    let limits = clade_http::Limits::default();
    tokio::spawn(clade_http::serve(api_l, api_r, limits));
    tokio::spawn(clade_http::serve(envd_l, envd_r, limits));
    spawn_reaper(app, Duration::from_secs(1));
    Ok((a, e))
}

#[cfg(test)]
mod fake;
