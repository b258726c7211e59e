//! The control socket of a running server: one JSON request per line, one JSON reply per line.
//!
//! It lives next to the NBD socket (`<socket>.ctl`) so whoever knows a disk's socket can also
//! snapshot it, and it is a separate socket so NBD clients never see it. Requests:
//! `{"op":"snapshot","export":""}` and `{"op":"stats","export":""}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

use crate::export::ExportStats;
use crate::server::Server;

/// The control socket path for an NBD socket path.
pub fn control_path(nbd_socket: &Path) -> PathBuf {
    let mut s = nbd_socket.as_os_str().to_owned();
    s.push(".ctl");
    PathBuf::from(s)
}

/// A control request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    Snapshot {
        #[serde(default)]
        export: String,
    },
    Stats {
        #[serde(default)]
        export: String,
    },
}

/// A control reply: `ok` with the fields of the operation, or `error`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ControlReply {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_blocks: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub millis: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<ExportStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn fail(msg: impl Into<String>) -> ControlReply {
    ControlReply { ok: false, error: Some(msg.into()), ..Default::default() }
}

async fn answer(server: &Arc<Server>, line: &str) -> ControlReply {
    let req: ControlRequest = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return fail(format!("bad control request ({e}); send {{\"op\":\"snapshot\"}}")),
    };
    let (ControlRequest::Snapshot { export: name } | ControlRequest::Stats { export: name }) = &req;
    let Some(export) = server.export(name) else {
        return fail(format!("no export named {name:?}"));
    };
    match req {
        ControlRequest::Stats { .. } => ControlReply { ok: true, stats: Some(export.stats()), ..Default::default() },
        ControlRequest::Snapshot { .. } => {
            let dirty = export.stats().dirty_blocks;
            let t = Instant::now();
            match tokio::task::spawn_blocking(move || export.snapshot()).await {
                Ok(Ok(id)) => {
                    tracing::info!(manifest = %id, dirty, "snapshot taken");
                    ControlReply {
                        ok: true,
                        manifest: Some(id),
                        dirty_blocks: Some(dirty),
                        millis: Some(t.elapsed().as_secs_f64() * 1e3),
                        ..Default::default()
                    }
                }
                Ok(Err(e)) => fail(e.to_string()),
                Err(e) => fail(format!("snapshot task failed: {e}")),
            }
        }
    }
}

/// Serves control requests on `listener` forever.
pub async fn serve_control(server: Arc<Server>, listener: UnixListener) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let server = server.clone();
        tokio::spawn(async move {
            let (r, mut w) = stream.into_split();
            let mut lines = tokio::io::BufReader::new(r).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = answer(&server, &line).await;
                let mut out = serde_json::to_vec(&reply).unwrap_or_default();
                out.push(b'\n');
                if w.write_all(&out).await.is_err() {
                    break;
                }
            }
        });
    }
}

/// Why a control call failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot reach the control socket {path} (is `clade nbd serve` running on that socket?)")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("control socket I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("control socket sent an unreadable reply: {0}")]
    Reply(#[from] serde_json::Error),
    #[error("the server refused: {0}")]
    Refused(String),
}

/// Sends one request to the control socket of the server on `nbd_socket` and waits for the reply.
pub fn call(nbd_socket: &Path, req: &ControlRequest) -> Result<ControlReply, ControlError> {
    let path = control_path(nbd_socket);
    let mut s = UnixStream::connect(&path).map_err(|source| ControlError::Connect { path, source })?;
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    s.write_all(&line)?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply)?;
    let reply: ControlReply = serde_json::from_str(&reply)?;
    if !reply.ok {
        return Err(ControlError::Refused(reply.error.unwrap_or_default()));
    }
    Ok(reply)
}

/// Asks the server on `nbd_socket` to snapshot its default export; returns the reply with the new
/// manifest id.
pub fn snapshot(nbd_socket: &Path) -> Result<ControlReply, ControlError> {
    call(nbd_socket, &ControlRequest::Snapshot { export: String::new() })
}
