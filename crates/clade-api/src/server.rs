//! The daemon (`clade serve`): the HTTP API over the same operations as the CLI ([`clade_host::ops`]), on a unix
//! socket under `$CLADE_HOME` by default, or on TCP. Sandboxes are not held by the daemon: each lives in its supervisor
//! process, so a daemon restart finds every one again through the ledger, and an in-flight request fails
//! cleanly (its connection closes) while the sandbox carries on.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clade_core::CladeHome;

use clade_host::Ops;

use crate::app::{idle_loop, App};
use crate::{doors, e2b, idle, lock, metrics, routes};

/// How the daemon listens and what it allows (the `clade serve` flags).
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen: `unix:PATH` or `HOST:PORT`. Empty: unix:$CLADE_HOME/api.sock.
    pub listen: Vec<String>,
    /// Also answer E2B's control plane and its in-sandbox API (envd) on these addresses.
    pub e2b: Option<(SocketAddr, SocketAddr)>,
    /// Largest file upload accepted, MiB (larger: 413).
    pub max_upload_mib: u64,
    /// A non-streamed exec is killed after this many seconds (504); a request's timeout_ms may only lower it.
    pub exec_timeout: u64,
    /// Suspend sandboxes idle for this many seconds unless a create says otherwise (0: only those that ask).
    pub idle_timeout: u64,
    /// How often the idle loop looks, in seconds.
    pub idle_tick: u64,
}

enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

fn parse_listen(s: &str) -> anyhow::Result<Listen> {
    if let Some(p) = s.strip_prefix("unix:") {
        return Ok(Listen::Unix(PathBuf::from(p)));
    }
    s.parse::<SocketAddr>().map(Listen::Tcp).map_err(|e| {
        anyhow::anyhow!(clade_core::OpError::new(
            clade_core::ErrorKind::Invalid,
            format!("--listen {s:?}: {e}; use unix:PATH or HOST:PORT such as 127.0.0.1:8080")
        ))
    })
}

fn tcp_hosts(addr: SocketAddr) -> Vec<String> {
    clade_http::doors::tcp_hosts(addr)
}

/// With a blob tier: this host's heartbeat and lease records there, every `CLADE_HEARTBEAT_S` (docs/roam.md,
/// "Hosts and heartbeats"), on a thread of its own (the store's API blocks). It ends with the process; the
/// lease then expires after three missed beats.
fn heartbeat_loop(ops: &Ops) {
    let me = match clade_host::roam::host_id(&ops.engine) {
        Ok(h) => h,
        Err(e) => return eprintln!("clade serve: no heartbeat: this home's host id: {e:#}"),
    };
    let mut failing = false;
    loop {
        match clade_host::roam::beat(&ops.engine, &me, &[]) {
            Ok(_) if failing => {
                eprintln!("clade serve: heartbeat to the blob tier works again");
                failing = false;
            }
            Ok(_) => {}
            Err(e) if !failing => {
                eprintln!("clade serve: heartbeat to the blob tier failed (retrying every beat): {e:#}");
                failing = true;
            }
            Err(_) => {}
        }
        std::thread::sleep(clade_host::roam::beat_every());
    }
}

/// Serve until SIGINT or SIGTERM.
pub fn run(a: Config) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let _lock = lock::take(&home)?;
    let ops = Arc::new(Ops::open(&home)?);
    let store = Some(ops.engine.store.clone());
    if ops.engine.store.blob_tier().is_some() {
        let ops = ops.clone();
        std::thread::Builder::new().name("clade-heartbeat".into()).spawn(move || heartbeat_loop(&ops))?;
    }
    let key = doors::load_or_create_key(&home)?;
    let app = Arc::new(App {
        api: ops,
        store,
        home: home.root().to_path_buf(),
        metrics: metrics::Metrics::new(),
        idle: idle::Idle::load(&home, a.idle_timeout),
        max_upload: a.max_upload_mib << 20,
        exec_limit: Duration::from_secs(a.exec_timeout.max(1)),
    });
    let listens: Vec<Listen> = if a.listen.is_empty() {
        vec![Listen::Unix(home.root().join("api.sock"))]
    } else {
        a.listen.iter().map(|s| parse_listen(s)).collect::<anyhow::Result<_>>()?
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let out = rt.block_on(async move {
        let mut tasks = Vec::new();
        for l in listens {
            match l {
                Listen::Unix(path) => {
                    let _ = std::fs::remove_file(&path);
                    if let Some(d) = path.parent() {
                        std::fs::create_dir_all(d)?;
                    }
                    let lis = tokio::net::UnixListener::bind(&path)
                        .with_context(|| format!("listen on {}", path.display()))?;
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
                    eprintln!("clade serve: listening on unix:{}", path.display());
                    let r = routes::app_router(app.clone(), key.clone(), vec!["localhost".into()]);
                    tasks.push(tokio::spawn(clade_http::serve(lis, r, clade_http::Limits::default())));
                }
                Listen::Tcp(addr) => {
                    let lis = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("listen on {addr}"))?;
                    let addr = lis.local_addr()?;
                    eprintln!("clade serve: listening on http://{addr}");
                    let r = routes::app_router(app.clone(), key.clone(), tcp_hosts(addr));
                    tasks.push(tokio::spawn(clade_http::serve(lis, r, clade_http::Limits::default())));
                }
            }
        }
        if let Some((api, sbx)) = a.e2b {
            e2b::spawn(app.api.clone(), api, sbx, home.clone()).await?;
        }
        tokio::spawn(idle_loop(app.clone(), Duration::from_secs(a.idle_tick.max(1))));
        eprintln!("clade serve: ready (key in {})", home.root().join("api.key").display());
        let started = Instant::now();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        eprintln!("clade serve: stopping after {:.0} s; sandboxes keep running", started.elapsed().as_secs_f64());
        for t in tasks {
            t.abort();
        }
        anyhow::Ok(0)
    });
    // Operations in flight get a moment to finish (their clients' connections are closed either way); one
    // that waits on a long command must not hold the daemon: the command runs on under its supervisor.
    rt.shutdown_timeout(Duration::from_secs(5));
    out
}
