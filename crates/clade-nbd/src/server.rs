//! The server: a set of named exports and the accept loop that gives each connection its own
//! handshake and transmission tasks.
//!
//! A connection's failure (bad framing, a client that vanishes) is logged and ends that connection
//! only; the listener and every other connection keep going.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, PoisonError, RwLock};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{UnixListener, UnixStream};

use crate::export::Export;
use crate::handshake::{negotiate, HandshakeError};
use crate::transmission::serve;

fn log_handshake(e: HandshakeError) {
    match e {
        HandshakeError::Aborted => {}
        HandshakeError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        e => tracing::warn!("handshake failed: {e}"),
    }
}

/// Named exports; the empty name resolves to the default export.
#[derive(Default)]
pub struct Exports {
    map: RwLock<BTreeMap<String, Arc<Export>>>,
    default: RwLock<Option<String>>,
}

impl Exports {
    /// Looks up an export by its wire name ("" is the default export).
    pub fn get(&self, name: &[u8]) -> Option<Arc<Export>> {
        let name = std::str::from_utf8(name).ok()?;
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        if name.is_empty() {
            let def = self.default.read().unwrap_or_else(PoisonError::into_inner);
            return def.as_ref().and_then(|d| map.get(d)).cloned();
        }
        map.get(name).cloned()
    }

    /// Names for `NBD_OPT_LIST`.
    pub fn names(&self) -> Vec<String> {
        self.map.read().unwrap_or_else(PoisonError::into_inner).keys().cloned().collect()
    }
}

/// An NBD server over a set of exports.
#[derive(Default)]
pub struct Server {
    exports: Exports,
}

impl Server {
    /// A server with no exports yet.
    pub fn new() -> Arc<Self> {
        Arc::new(Server::default())
    }

    /// Adds (or replaces) the export called `name`; the first one added becomes the default.
    pub fn add_export(&self, name: &str, export: Arc<Export>) {
        self.exports.map.write().unwrap_or_else(PoisonError::into_inner).insert(name.to_owned(), export);
        let mut def = self.exports.default.write().unwrap_or_else(PoisonError::into_inner);
        if def.is_none() {
            *def = Some(name.to_owned());
        }
    }

    /// Makes `name` the export that the empty export name serves.
    pub fn set_default(&self, name: &str) {
        *self.exports.default.write().unwrap_or_else(PoisonError::into_inner) = Some(name.to_owned());
    }

    /// The export called `name` ("" for the default).
    pub fn export(&self, name: &str) -> Option<Arc<Export>> {
        self.exports.get(name.as_bytes())
    }

    /// Runs one connection to its end, logging why it ended if that was not a clean disconnect.
    pub async fn handle<S>(self: Arc<Self>, mut io: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let neg = match negotiate(&mut io, &self.exports).await {
            Ok(n) => n,
            Err(e) => return log_handshake(e),
        };
        let (r, w) = tokio::io::split(io);
        if let Err(e) = serve(r, w, neg).await {
            tracing::warn!("connection ended: {e}");
        }
    }

    /// Like [`Server::handle`] for a unix socket, with lock-free owned halves.
    pub async fn handle_unix(self: Arc<Self>, mut io: UnixStream) {
        let neg = match negotiate(&mut io, &self.exports).await {
            Ok(n) => n,
            Err(e) => return log_handshake(e),
        };
        let (r, w) = io.into_split();
        if let Err(e) = serve(r, w, neg).await {
            tracing::warn!("connection ended: {e}");
        }
    }

    /// Accepts connections on `listener` forever, each in its own task.
    pub async fn serve_unix(self: Arc<Self>, listener: UnixListener) -> std::io::Result<()> {
        loop {
            let (stream, _) = listener.accept().await?;
            tokio::spawn(self.clone().handle_unix(stream));
        }
    }

    /// Binds `path`, first removing a stale socket file there; a socket that still answers is
    /// another live server's and is left alone (`AddrInUse`).
    pub fn bind_unix(path: &Path) -> std::io::Result<UnixListener> {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("{} is in use by a running server; stop it or pick another path", path.display()),
            ));
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        UnixListener::bind(path)
    }
}
