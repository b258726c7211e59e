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

    /// Where this host keeps guest RAM files on tmpfs (`ram/` roots, `run/` cold sandboxes, `lazy/` mounts):
    /// `CLADE_SHM`, else `/dev/shm/clade`. Homes on one machine share it unless told otherwise (RAM roots are
    /// named by content, so sharing is safe); a test or bench standing in for a second host gives it its own.
    pub fn shm_dir(&self) -> PathBuf {
        std::env::var_os("CLADE_SHM")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| "/dev/shm/clade".into())
    }

    /// The blob tier this home shares with other hosts (docs/roam.md), from the environment:
    /// `CLADE_BLOB` = `s3://BUCKET` (with `CLADE_BLOB_ENDPOINT`, `CLADE_BLOB_REGION`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`) or `file:///DIR`. `None` when unset: the store is local only.
    pub fn blob_config(&self) -> Result<Option<clade_store::BlobConfig>, String> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let Some(url) = var("CLADE_BLOB") else { return Ok(None) };
        if let Some(dir) = url.strip_prefix("file://") {
            return Ok(Some(clade_store::BlobConfig::Local { root: PathBuf::from(dir) }));
        }
        let Some(bucket) = url.strip_prefix("s3://").map(|b| b.trim_end_matches('/')).filter(|b| !b.is_empty()) else {
            return Err(format!("CLADE_BLOB={url}: use s3://BUCKET or file:///DIR"));
        };
        let key = |k: &str| var(k).ok_or_else(|| format!("CLADE_BLOB={url} needs {k} in the environment"));
        let endpoint = var("CLADE_BLOB_ENDPOINT");
        Ok(Some(clade_store::BlobConfig::S3 {
            bucket: bucket.to_string(),
            allow_http: endpoint.as_deref().is_some_and(|e| e.starts_with("http://")),
            endpoint,
            region: var("CLADE_BLOB_REGION").unwrap_or_else(|| "us-east-1".into()),
            access_key_id: key("AWS_ACCESS_KEY_ID")?,
            secret_access_key: key("AWS_SECRET_ACCESS_KEY")?,
        }))
    }
}

/// A temp name beside `dest` (`<name>.tmp<pid>-<n>`), unique across the threads of this process as well as
/// across processes: two restores laying out the same cache at once each write their own temp, and the one
/// that loses the rename drops its copy. (A name made of the pid alone let two threads share one temp.)
pub fn temp_beside(dest: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dest.with_file_name(format!("{name}.tmp{}-{n}", std::process::id()))
}

#[cfg(test)]
mod temp_tests {
    #[test]
    fn temp_names_differ_within_a_process() {
        let d = std::path::Path::new("/x/cache/abc");
        let (a, b) = (super::temp_beside(d), super::temp_beside(d));
        assert_ne!(a, b);
        assert!(a.to_string_lossy().starts_with("/x/cache/abc.tmp"), "{a:?}");
    }
}
