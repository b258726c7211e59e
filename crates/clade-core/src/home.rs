//! `$CLADE_HOME` (default `/var/lib/clade`): where setup caches the guest kernel and CRIU, and where the
//! store, the ledger and the run directories of sandboxes live. One place names every path, so no layer
//! invents its own.

use std::path::{Path, PathBuf};

/// The root of clade's state on this host.
#[derive(Debug, Clone)]
pub struct CladeHome {
    root: PathBuf,
}

impl CladeHome {
    /// `$CLADE_HOME`, or `/var/lib/clade`.
    pub fn from_env() -> Self {
        let root = std::env::var_os("CLADE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/lib/clade"));
        Self { root }
    }

    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    /// The extracted guest kernel: `vmlinuz`, `vmlinux` (uncompressed ELF), `modules/`, `release`, `config`.
    pub fn kernel_dir(&self) -> PathBuf {
        self.root.join("kernel/current")
    }
    /// The wrapper that runs sid's CRIU through sid's loader.
    pub fn criu_bin(&self) -> PathBuf {
        self.root.join("criu/bin/criu")
    }
    /// The chunk store's local tier.
    pub fn store_dir(&self) -> PathBuf {
        self.root.join("store")
    }
    /// The ledger's SQLite file.
    pub fn ledger_path(&self) -> PathBuf {
        self.root.join("ledger.db")
    }
    /// Per-host caches that are derived and may be deleted (e.g. the KVM probe result per boot id).
    pub fn cache_dir(&self) -> PathBuf {
        self.root.join("cache")
    }
    /// Run directories of live sandboxes (sockets, pid files, console logs).
    pub fn run_dir(&self) -> PathBuf {
        self.root.join("run")
    }
    /// Scratch space on the same filesystem, for temp-then-rename.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }
}
