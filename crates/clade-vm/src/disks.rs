//! The root disks of `vm` sandboxes: one clade-nbd export per sandbox, copy-on-write over a store manifest,
//! served on a unix socket in the sandbox's run dir. All exports of this process share one small tokio runtime
//! and, through the store's cache, every object of a common base.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clade_nbd::{Export, Server};
use clade_store::{ManifestId, Store};

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot start the NBD runtime: {0}")]
    Runtime(std::io::Error),
    #[error("disk manifest {0}: {1}")]
    Store(String, clade_store::StoreError),
    #[error("cannot listen on {0}: {1}")]
    Bind(String, std::io::Error),
    #[error("disk snapshot failed: {0}")]
    Snapshot(String),
}

/// Serves the exports of this process.
pub struct DiskHost {
    rt: tokio::runtime::Runtime,
    store: Store,
}

impl DiskHost {
    pub fn new(store: Store) -> Result<Self, DiskError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("clade-nbd")
            .enable_all()
            .build()
            .map_err(DiskError::Runtime)?;
        Ok(DiskHost { rt, store })
    }

    /// A private, writable export of `manifest` on `socket`.
    pub fn export(&self, manifest: &str, socket: &Path) -> Result<DiskExport, DiskError> {
        let id: ManifestId =
            manifest.parse().map_err(|_| DiskError::Snapshot(format!("'{manifest}' is not a manifest id")))?;
        let export = Arc::new(
            clade_nbd::store_export(&self.store, &id, false).map_err(|e| DiskError::Store(manifest.into(), e))?,
        );
        if !self.store.index_loaded() {
            // The export reads frames through the store's index, loaded on first use: load it now, beside
            // QEMU's start (a pool member: before its claim), not on the guest's first disk read.
            let store = self.store.clone();
            std::thread::spawn(move || {
                if let Err(e) = store.reload_index() {
                    eprintln!("clade-vm: loading the store index: {e}");
                }
            });
        }
        let server = Server::new();
        server.add_export("", export.clone());
        let _guard = self.rt.enter();
        let listener = Server::bind_unix(socket).map_err(|e| DiskError::Bind(socket.display().to_string(), e))?;
        let task = self.rt.spawn(server.serve_unix(listener));
        Ok(DiskExport { export, socket: socket.to_path_buf(), task })
    }
}

/// One sandbox's disk. Dropping it stops serving and removes the socket.
pub struct DiskExport {
    export: Arc<Export>,
    socket: PathBuf,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl DiskExport {
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Turn what the guest wrote into a new complete manifest and go on serving on top of it. Take it while the
    /// guest is paused (QEMU drains and flushes its block layer on `stop`).
    pub fn snapshot(&self) -> Result<String, DiskError> {
        self.export.snapshot().map_err(|e| DiskError::Snapshot(e.to_string()))
    }

    /// Phase one of a two-phase snapshot (clade-nbd's `Export::freeze`): O(1), the guest may write on at once.
    /// Take it while the guest is paused; [`DiskExport::commit`] stores the frozen blocks afterwards.
    pub fn freeze(&self) -> Result<(), DiskError> {
        self.export.freeze().map(|_| ()).map_err(|e| DiskError::Snapshot(e.to_string()))
    }

    /// Phase two: store what [`DiskExport::freeze`] froze as a new complete manifest (the guest runs meanwhile).
    pub fn commit(&self) -> Result<String, DiskError> {
        self.export.commit().map_err(|e| DiskError::Snapshot(e.to_string()))
    }

    /// Bytes written since the last snapshot (dirty 4 KiB blocks).
    pub fn dirty_bytes(&self) -> u64 {
        self.export.stats().dirty_blocks as u64 * clade_nbd::BLOCK as u64
    }
}

impl Drop for DiskExport {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}
