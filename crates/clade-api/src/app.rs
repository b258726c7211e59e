//! What every handler of the native API shares: the daemon's state ([`App`]), the way a handler runs a blocking
//! operation (timed into the metrics), the idle wake-up before a request that needs a running sandbox, and the
//! idle-suspend loop. The routes (`routes`, `inside`) and the daemon (`server`) build on this module; it knows
//! none of them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use axum::Json;
use clade_host::SandboxApi;

use crate::error::ApiError;
use crate::{idle, metrics};

/// What every handler shares.
pub struct App {
    /// The operations (the library's in a daemon; a fake in the router's tests).
    pub api: Arc<dyn SandboxApi>,
    /// The store, for the metrics' gauges (none in tests).
    pub store: Option<clade_store::Store>,
    /// The daemon's `$CLADE_HOME`, as `/v1/health` shows it.
    pub home: PathBuf,
    pub(crate) metrics: metrics::Metrics,
    pub(crate) idle: idle::Idle,
    pub(crate) max_upload: u64,
    pub(crate) exec_limit: Duration,
}

pub(crate) type Reply = Result<Response, ApiError>;

/// Runs a blocking operation, timing it into the metrics under `op`.
pub(crate) async fn blocking<T: Send + 'static>(
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

pub(crate) fn json(v: impl serde::Serialize) -> Response {
    Json(v).into_response()
}

/// Resume a suspended sandbox before a request that needs it running (idle suspend is invisible to callers).
pub(crate) fn wake(a: &App, id: &str) -> anyhow::Result<()> {
    if a.idle.was_idle_suspended(id) && a.api.state(id).is_ok_and(|r| r.state == "suspended") {
        let r = a.api.resume(id)?;
        if !r.ok {
            return Err(anyhow::anyhow!("resuming idle sandbox {id}: {}", r.error.unwrap_or_default()));
        }
    }
    a.idle.touch(id);
    Ok(())
}

/// The idle loop: every `tick`, suspend what is due (one at a time: a suspend is a mark, which takes the disk).
pub async fn idle_loop(app: Arc<App>, tick: Duration) {
    loop {
        tokio::time::sleep(tick).await;
        let a = app.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for id in a.idle.due(a.api.as_ref()) {
                match a.api.suspend(&id) {
                    Ok(_) => {
                        a.idle.mark_suspended(&id);
                        a.metrics.idle_suspended();
                        eprintln!("clade serve: suspended idle sandbox {id}");
                    }
                    Err(e) => eprintln!("clade serve: could not suspend idle sandbox {id}: {e:#}"),
                }
            }
        })
        .await;
    }
}
