//! Blocking entry points for the CLI: run a server on a unix socket (plus its control socket)
//! until SIGINT or SIGTERM, and set up logging to stderr.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::control::{control_path, serve_control};
use crate::server::Server;

/// Why a server could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot listen on {path} (is the directory there and writable, and no other server on it?)")]
    Bind { path: PathBuf, source: std::io::Error },
    #[error("accepting connections on {path} failed")]
    Accept { path: PathBuf, source: std::io::Error },
    #[error("cannot install signal handlers: {0}")]
    Signal(std::io::Error),
}

/// Logs to stderr at `RUST_LOG` (default `info`). Safe to call twice.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).try_init();
}

/// Serves `server` on the unix socket `socket` and its control socket `<socket>.ctl` until SIGINT
/// or SIGTERM; removes both socket files on the way out. `ready` runs once both are listening.
pub fn serve_unix_blocking(server: Arc<Server>, socket: &Path, ready: impl FnOnce()) -> Result<(), RunError> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(RunError::Runtime)?;
    let ctl = control_path(socket);
    // Socket files are removed on the way out only once this process has bound them: a failed
    // start must not delete a running server's socket.
    let mut bound: Vec<PathBuf> = Vec::new();
    let result = rt.block_on(async {
        let listener = Server::bind_unix(socket).map_err(|source| RunError::Bind { path: socket.to_owned(), source })?;
        bound.push(socket.to_owned());
        let ctl_listener = Server::bind_unix(&ctl).map_err(|source| RunError::Bind { path: ctl.clone(), source })?;
        bound.push(ctl.clone());
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).map_err(RunError::Signal)?;
        let mut int = signal(SignalKind::interrupt()).map_err(RunError::Signal)?;
        ready();
        tokio::select! {
            r = server.clone().serve_unix(listener) => r.map_err(|source| RunError::Accept { path: socket.to_owned(), source }),
            r = serve_control(server.clone(), ctl_listener) => r.map_err(|source| RunError::Accept { path: ctl.clone(), source }),
            _ = term.recv() => Ok(()),
            _ = int.recv() => Ok(()),
        }
    });
    for p in &bound {
        let _ = std::fs::remove_file(p);
    }
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    result
}
