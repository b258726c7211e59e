//! `clade nbd`: serve a store manifest (or a raw file) as a copy-on-write NBD export on a unix
//! socket, and ask a running server to snapshot its export into a new manifest.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum Command {
    /// Serve an image over NBD on a unix socket until SIGINT/SIGTERM (`nbd+unix:///?socket=PATH`).
    Serve(ServeArgs),
    /// Ask a running `clade nbd serve` to snapshot its export; prints the new manifest id.
    Snapshot(SnapshotArgs),
}

#[derive(Args)]
pub struct ServeArgs {
    /// Manifest id of the base image (from `clade store put`).
    #[arg(long, conflicts_with = "raw", required_unless_present = "raw")]
    manifest: Option<String>,
    /// Serve a raw image file as the base instead of a manifest (snapshots need a manifest).
    #[arg(long)]
    raw: Option<PathBuf>,
    /// Store directory (default: $CLADE_HOME/store, CLADE_HOME defaulting to /var/lib/clade).
    #[arg(long)]
    store: Option<PathBuf>,
    /// Unix socket to listen on; the control socket is PATH.ctl.
    #[arg(long)]
    socket: PathBuf,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
}

#[derive(Args)]
pub struct SnapshotArgs {
    /// The NBD socket the server listens on.
    #[arg(long)]
    socket: PathBuf,
    /// Print the whole reply as JSON.
    #[arg(long)]
    json: bool,
}

fn serve(a: ServeArgs) -> anyhow::Result<i32> {
    clade_nbd::run::init_logging();
    let (base, snapshotter): (Arc<dyn clade_nbd::BlockSource>, Option<Arc<dyn clade_nbd::Snapshotter>>) =
        match (&a.raw, &a.manifest) {
            (Some(raw), _) => {
                let src =
                    clade_nbd::FileSource::open(raw).with_context(|| format!("opening raw image {}", raw.display()))?;
                (Arc::new(src), None)
            }
            (None, Some(id)) => {
                let id: clade_store::ManifestId = id.parse().context("--manifest takes a 64-hex-digit manifest id")?;
                let dir = a.store.clone().unwrap_or_else(|| clade_core::CladeHome::from_env().store_dir());
                let store = clade_store::Store::open(&dir, clade_store::StoreConfig::default())
                    .with_context(|| format!("opening the store at {}", dir.display()))?;
                let src =
                    clade_nbd::StoreSource::open(&store, &id).with_context(|| format!("opening manifest {id}"))?;
                (Arc::new(src), Some(Arc::new(clade_nbd::StoreSnapshotter::new(store))))
            }
            (None, None) => anyhow::bail!("give --manifest ID or --raw FILE"),
        };
    let name = base.id();
    let export = Arc::new(clade_nbd::Export::new(base, a.read_only, snapshotter));
    let server = clade_nbd::Server::new();
    server.add_export(&name, export);
    let socket = a.socket.clone();
    clade_nbd::run::serve_unix_blocking(server, &a.socket, || {
        eprintln!("clade nbd: serving {name} on nbd+unix:///?socket={}", socket.display());
    })?;
    Ok(0)
}

fn snapshot(a: SnapshotArgs) -> anyhow::Result<i32> {
    let reply = clade_nbd::control::snapshot(&a.socket)?;
    if a.json {
        println!("{}", serde_json::to_string(&reply)?);
    } else {
        println!("{}", reply.manifest.unwrap_or_default());
    }
    Ok(0)
}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    match cmd {
        Command::Serve(a) => serve(a),
        Command::Snapshot(a) => snapshot(a),
    }
}
