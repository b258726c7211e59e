//! What clade's HTTP faces share (the native API in `clade serve`, E2B's control plane and envd in
//! `clade-e2b`), so that a limit set for one is not forgotten on another:
//!
//! - [`serve`]: the connection loop. `axum::serve` cannot bound how long a client may take to send its request
//!   head, so a connection trickling partial headers held a task and a socket forever; here a connection must
//!   finish its request head (HTTP/1) or its HTTP/2 preface within [`Limits::header_read`], or it is closed.
//! - [`doors`]: refuse a request carrying `Origin` (a browser page) or a `Host` that is not the listener's
//!   (DNS rebinding).

#![forbid(unsafe_code)]

pub mod doors;
mod prefixed;

use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::AsyncReadExt;

/// Limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a client may take, from connecting (or from the end of its previous request), to send a whole
    /// request head; HTTP/2 clients, to send the connection preface.
    pub header_read: Duration,
}

/// The default request-head deadline: generous for any real client on any link, short for a slowloris.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

impl Default for Limits {
    fn default() -> Self {
        Limits { header_read: HEADER_READ_TIMEOUT }
    }
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serve `router` on `listener` until the task is dropped (each connection is a task of its own, with
/// upgrades; HTTP/1.1 and h2c both).
pub async fn serve<L>(mut listener: L, router: axum::Router, limits: Limits)
where
    L: axum::serve::Listener,
{
    loop {
        let (io, _) = listener.accept().await;
        let router = router.clone();
        tokio::spawn(connection(io, router, limits));
    }
}

async fn connection<I>(mut io: I, router: axum::Router, limits: Limits)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    // hyper's auto builder first reads enough to tell HTTP/2's preface from HTTP/1, with no deadline of its
    // own (a client that sends nothing, or half a preface, would be kept forever): read that much here, under
    // the header deadline, and hand the bytes back in front of the stream.
    let mut head = Vec::with_capacity(H2_PREFACE.len());
    let sniff = async {
        while head.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(&head) {
            let mut b = [0u8; 24];
            let want = H2_PREFACE.len() - head.len();
            let n = io.read(&mut b[..want]).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            head.extend_from_slice(&b[..n]);
        }
        Ok::<(), std::io::Error>(())
    };
    match tokio::time::timeout(limits.header_read, sniff).await {
        Ok(Ok(())) => {}
        _ => return, // dropped: the connection closes
    }
    let io = TokioIo::new(prefixed::Prefixed::new(head, io));
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let r = router.clone();
        async move { tower::ServiceExt::oneshot(r, req.map(axum::body::Body::new)).await }
    });
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    b.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read);
    b.http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    // An error here is the client's (it went away, sent garbage, or was too slow): nothing to report.
    let _ = b.serve_connection_with_upgrades(io, service).await;
}

#[cfg(test)]
mod tests;
