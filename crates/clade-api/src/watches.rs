//! The native API's directory watches (`SandboxApi::watch_*`; inotify in the sandbox's agent, docs/agent.md,
//! "Watches"): start one on a directory, take its events (waiting up to `wait_ms` for the first), stop it.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use clade_host::api::WatchRequest;
use serde::Deserialize;

use crate::app::{blocking, json, wake, App, Reply};
use crate::error::{ApiError, Body};

async fn start(State(app): State<Arc<App>>, Path(id): Path<String>, Body(req): Body<WatchRequest>) -> Reply {
    if !req.path.starts_with('/') || req.path.contains('\0') {
        return Err(ApiError::bad_request(format!("path: {:?} must be absolute and contain no NUL", req.path)));
    }
    let watch = blocking(&app, "watch_start", move |a| {
        wake(a, &id)?;
        a.api.watch_start(&id, &req.path, req.recursive)
    })
    .await?;
    Ok((StatusCode::CREATED, axum::Json(serde_json::json!({"watch": watch}))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    /// Milliseconds to wait for an event when none is queued (at most 60 000; default 0).
    #[serde(default)]
    wait_ms: u64,
}

async fn events(
    State(app): State<Arc<App>>,
    Path((id, watch)): Path<(String, u64)>,
    Query(q): Query<EventsQuery>,
) -> Reply {
    if q.wait_ms > 60_000 {
        return Err(ApiError::bad_request("wait_ms: at most 60000"));
    }
    Ok(json(blocking(&app, "watch_events", move |a| a.api.watch_events(&id, watch, q.wait_ms)).await?))
}

async fn stop(State(app): State<Arc<App>>, Path((id, watch)): Path<(String, u64)>) -> Reply {
    blocking(&app, "watch_stop", move |a| a.api.watch_stop(&id, watch)).await?;
    Ok(json(serde_json::json!({"stopped": watch})))
}

/// The watch routes, added to the native router.
pub fn routes(r: axum::Router<Arc<App>>) -> axum::Router<Arc<App>> {
    use axum::routing::{get, post};
    r.route("/v1/sandboxes/{id}/watches", post(start))
        .route("/v1/sandboxes/{id}/watches/{watch}", get(events).delete(stop))
}
