//! `$CLADE_HOME` (default `/var/lib/clade`): where setup caches the guest kernel and CRIU, and where the
//! store, the ledger and the run directories of sandboxes live. One place names every path, so no layer
//! invents its own.
//!
//! Every sandbox is a security boundary, and so is this host's user list: guest RAM, packs, the ledger, run
//! sockets, console logs and E2B tokens are readable by nobody but clade's own user. [`CladeHome::ensure_private`]
//! makes the root directories (the home, `store/`, `run/`, `tmp/`, `cache/`, `e2b/`, and `CLADE_SHM` with its
//! `ram/`, `run/`, `lazy/`) mode 0700: a 0700 directory protects everything beneath it, whatever mode a file
//! deeper down was created with. Sensitive files are also created 0600 themselves ([`PRIVATE_FILE_MODE`]), so a
//! copy moved elsewhere stays private. Sandbox processes never walk these paths: overlayfs and CRIU reach the
//! ct backend's lower layers and caches as root, QEMU opens RAM files and disks as root.

use std::path::{Path, PathBuf};

/// The mode of clade's root directories: owner only.
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// The mode of clade's sensitive files (keys, tokens, the ledger, packs, RAM files): owner read/write only.
pub const PRIVATE_FILE_MODE: u32 = 0o600;

/// A private directory that could not be made or tightened.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {source} (clade keeps its state in directories only its own user may read; check the owner and \
         permissions of this path, or point CLADE_HOME / CLADE_SHM somewhere this user owns)", path.display())]
pub struct PrivateDirError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Create `dir` (and missing parents, each 0700) or tighten an existing one to 0700. A directory another user
/// owns is left as it is when this process may not change it (its owner's clade tightens it): only a failure
/// on a directory this user owns is an error.
pub fn private_dir(dir: &Path) -> Result<(), PrivateDirError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let err = |what, source| PrivateDirError { what, path: dir.to_path_buf(), source };
    std::fs::DirBuilder::new().recursive(true).mode(PRIVATE_DIR_MODE).create(dir).map_err(|e| err("create", e))?;
    let md = std::fs::metadata(dir).map_err(|e| err("stat", e))?;
    if md.mode() & 0o077 == 0 {
        return Ok(());
    }
    match std::fs::set_permissions(dir, std::fs::Permissions::from_mode(PRIVATE_DIR_MODE)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied && md.uid() != nix::unistd::geteuid().as_raw() => {
            Ok(())
        }
        Err(e) => Err(err("chmod 0700", e)),
    }
}

/// Tighten an existing file to 0600 (a missing one is fine): for files made before clade set modes itself.
pub fn private_file(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(path) {
        Ok(md) if md.permissions().mode() & 0o077 != 0 => {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(PRIVATE_FILE_MODE))
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Write `data` to a new file `tmp` (refused if it exists), 0600 from its creation, and fsync it: the first
/// half of publishing a secret by rename or link.
pub fn write_new_private(tmp: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(PRIVATE_FILE_MODE).open(tmp)?;
    f.write_all(data)?;
    f.sync_all()
}

/// The root of clade's state on this host.
#[derive(Debug, Clone)]
pub struct CladeHome {
    root: PathBuf,
    /// Set by [`CladeHome::with_shm`]; otherwise `CLADE_SHM` decides.
    shm: Option<PathBuf>,
}

impl CladeHome {
    /// `$CLADE_HOME`, or `/var/lib/clade`.
    pub fn from_env() -> Self {
        let root = std::env::var_os("CLADE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/lib/clade"));
        Self { root, shm: None }
    }

    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into(), shm: None }
    }

    /// The same home with its RAM files under `shm` instead of `CLADE_SHM` (tests: no process-wide variable).
    pub fn with_shm(mut self, shm: impl Into<PathBuf>) -> Self {
        self.shm = Some(shm.into());
        self
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
    /// The E2B face's API keys and records (`clade serve --e2b-api`).
    pub fn e2b_dir(&self) -> PathBuf {
        self.root.join("e2b")
    }
    /// Held (flock) by the one `clade serve` answering for this home.
    pub fn serve_lock(&self) -> PathBuf {
        self.root.join("serve.lock")
    }

    /// Make the home's root directories and the tmpfs directory of RAM files 0700 (creating them if needed);
    /// see the module doc. Cheap enough for every open: a few `stat`s when all is in order.
    pub fn ensure_private(&self) -> Result<(), PrivateDirError> {
        for d in [self.root.clone(), self.store_dir(), self.run_dir(), self.tmp_dir(), self.cache_dir(), self.e2b_dir()]
        {
            private_dir(&d)?;
        }
        let shm = self.shm_dir();
        // Only where tmpfs is: a host without /dev/shm fails later, in the vm backend that needs it, not here.
        if !shm.parent().is_some_and(Path::is_dir) {
            return Ok(());
        }
        private_dir(&shm)?;
        // Made by the backends when they first need them; tightened here when an older clade left them open.
        for sub in ["ram", "run", "lazy"] {
            let d = shm.join(sub);
            if d.is_dir() {
                private_dir(&d)?;
            }
        }
        Ok(())
    }

    /// Where this host keeps guest RAM files on tmpfs (`ram/` roots, `run/` cold sandboxes, `lazy/` mounts):
    /// `CLADE_SHM`, else `/dev/shm/clade`. Homes on one machine share it unless told otherwise (RAM roots are
    /// named by content, so sharing is safe); a test or bench standing in for a second host gives it its own.
    pub fn shm_dir(&self) -> PathBuf {
        if let Some(s) = &self.shm {
            return s.clone();
        }
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
mod private_tests {
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &std::path::Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    // Under the usual umask (022) a directory made without an explicit mode is 0755 and an existing 0755 one
    // stays so: both fail here unless ensure_private sets and tightens modes itself.
    #[test]
    fn home_dirs_are_0700_made_or_tightened() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("home");
        let shm = d.path().join("shm");
        std::fs::create_dir_all(shm.join("ram")).unwrap();
        std::fs::set_permissions(shm.join("ram"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir_all(root.join("store")).unwrap();
        std::fs::set_permissions(root.join("store"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let home = super::CladeHome::at(&root).with_shm(&shm);
        home.ensure_private().unwrap();
        for p in [root.clone(), home.store_dir(), home.run_dir(), home.tmp_dir(), home.cache_dir(), home.e2b_dir()] {
            assert_eq!(mode(&p), 0o700, "{}", p.display());
        }
        assert_eq!(mode(&shm), 0o700);
        assert_eq!(mode(&shm.join("ram")), 0o700);
    }

    #[test]
    fn files_are_tightened_to_0600() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        super::private_file(&f).unwrap();
        assert_eq!(mode(&f), 0o600);
        super::private_file(&d.path().join("missing")).unwrap();
    }
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
