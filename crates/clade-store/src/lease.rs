//! Locks and leases, both on `flock`, so they vanish with the process that held them (kill -9 included).
//!
//! - `lock`: every writer session holds a shared lock for its life; gc takes it exclusively, so gc never
//!   runs while a writer may be about to name a frame that gc would find unreferenced.
//! - leases: a file per lease in `leases/`, naming a manifest or tree, flock-held by its owner. gc treats a
//!   leased id as live even after `delete_manifest`; a lease file whose lock it can take belongs to a dead
//!   process and is removed.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{flock, FlockOperation};

use crate::error::IoCtx;
use crate::ids::{ManifestId, TreeId};
use crate::store::Store;
use crate::{fsutil, StoreError};

/// The store's lock file: created 0600 if missing.
pub(crate) fn lock_options() -> OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = OpenOptions::new();
    o.create(true).append(true).mode(fsutil::FILE_MODE);
    o
}

pub(crate) fn lock_shared(store: &Store) -> Result<File, StoreError> {
    let path = store.inner.dir.join("lock");
    let f = lock_options().open(&path).ctx("open lock", &path)?;
    flock(&f, FlockOperation::LockShared).map_err(|e| StoreError::io("lock (shared)", &path, e.into()))?;
    Ok(f)
}

/// Take the store lock exclusively, waiting up to `wait`.
pub(crate) fn lock_exclusive(store: &Store, wait: Duration) -> Result<File, StoreError> {
    let path = store.inner.dir.join("lock");
    let f = lock_options().open(&path).ctx("open lock", &path)?;
    let start = Instant::now();
    loop {
        match flock(&f, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(f),
            Err(rustix::io::Errno::WOULDBLOCK) if start.elapsed() < wait => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(StoreError::Busy(store.inner.dir.clone(), "writers are in flight".into()))
            }
            Err(e) => return Err(StoreError::io("lock (exclusive)", &path, e.into())),
        }
    }
}

/// What a lease keeps alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Root {
    /// A manifest.
    Manifest(ManifestId),
    /// A directory tree.
    Tree(TreeId),
}

impl From<ManifestId> for Root {
    fn from(m: ManifestId) -> Self {
        Root::Manifest(m)
    }
}

impl From<TreeId> for Root {
    fn from(t: TreeId) -> Self {
        Root::Tree(t)
    }
}

impl Root {
    pub(crate) fn line(&self) -> String {
        match self {
            Root::Manifest(m) => format!("manifest {m}\n"),
            Root::Tree(t) => format!("tree {t}\n"),
        }
    }
    pub(crate) fn parse(s: &str) -> Option<Root> {
        let (k, v) = s.trim().split_once(' ')?;
        match k {
            "manifest" => v.parse().ok().map(Root::Manifest),
            "tree" => v.parse().ok().map(Root::Tree),
            _ => None,
        }
    }
}

/// A lease on a manifest or tree: while it lives (in this or any process), gc keeps what it names.
/// Dropping it ends the lease.
pub struct Lease {
    path: PathBuf,
    _file: File,
    root: Root,
}

impl Lease {
    /// What this lease keeps.
    pub fn root(&self) -> Root {
        self.root
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Store {
    /// Take a lease on a manifest or tree (it must exist).
    pub fn lease(&self, root: impl Into<Root>) -> Result<Lease, StoreError> {
        let root = root.into();
        match root {
            Root::Manifest(m) => {
                self.manifest(&m)?;
            }
            Root::Tree(t) => {
                self.tree(&t)?;
            }
        }
        let path = fsutil::temp_path(&self.inner.leases, "lease").with_extension("lease");
        let mut f = fsutil::new_private().open(&path).ctx("create lease", &path)?;
        flock(&f, FlockOperation::LockShared).map_err(|e| StoreError::io("lock lease", &path, e.into()))?;
        f.write_all(root.line().as_bytes()).ctx("write lease", &path)?;
        Ok(Lease { path, _file: f, root })
    }

    /// Live leases (held by a running process). Stale lease files are removed unless `dry_run`.
    pub(crate) fn live_leases(&self, dry_run: bool) -> Result<(Vec<Root>, usize), StoreError> {
        let mut live = Vec::new();
        let mut stale = 0;
        let dir = &self.inner.leases;
        for e in std::fs::read_dir(dir).ctx("list", dir)? {
            let p = e.ctx("list", dir)?.path();
            if p.extension().and_then(|x| x.to_str()) != Some("lease") {
                continue;
            }
            let Ok(f) = File::open(&p) else { continue };
            if flock(&f, FlockOperation::NonBlockingLockExclusive).is_ok() {
                stale += 1;
                if !dry_run {
                    let _ = std::fs::remove_file(&p);
                }
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            match Root::parse(&text) {
                Some(r) => live.push(r),
                None => {
                    // Being written right now (created, locked, not yet filled): treat conservatively.
                    if text.is_empty() {
                        continue;
                    }
                }
            }
        }
        Ok((live, stale))
    }

    /// Unpublish a manifest: it is no longer a gc root, in either tier (with a blob tier, its copy there is
    /// deleted too, even if only the blob tier had it). It stays readable here (from `trash/`) until the next
    /// gc, and after it for as long as a lease names it; gc frees the data nothing else uses. Returns false
    /// if it was not published.
    pub fn delete_manifest(&self, id: &ManifestId) -> Result<bool, StoreError> {
        let path = self.manifest_path(id);
        let trash = self.inner.trash.join(format!("{id}.manifest"));
        let found = self.unpublish(&path, &trash)?;
        self.inner.manifest_cache.lock().unwrap_or_else(|p| p.into_inner()).pop(id);
        Ok(found)
    }

    /// Unpublish a tree (as [`Store::delete_manifest`]).
    pub fn delete_tree(&self, id: &TreeId) -> Result<bool, StoreError> {
        let path = self.tree_path(id);
        let trash = self.inner.trash.join(format!("{id}.tree"));
        self.inner.tree_cache.lock().unwrap_or_else(|p| p.into_inner()).pop(id);
        self.unpublish(&path, &trash)
    }

    /// Move a published root to the trash (local tier) and delete its blob copy.
    fn unpublish(&self, path: &Path, trash: &Path) -> Result<bool, StoreError> {
        let key = crate::store::blob_key(path, &self.inner.dir);
        if path.exists() {
            std::fs::rename(path, trash).ctx("move to trash", path)?;
            fsutil::sync_dir(&self.inner.trash)?;
        } else {
            let Some(blob) = &self.inner.blob else { return Ok(false) };
            let Some(bytes) = blob.get(&key)? else { return Ok(false) };
            fsutil::write_atomic(&self.inner.tmp, trash, &bytes)?;
        }
        if let Some(blob) = &self.inner.blob {
            blob.delete(&key)?;
        }
        Ok(true)
    }
}

pub(crate) fn is_older_than(path: &Path, age: Duration) -> bool {
    std::fs::metadata(path).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).is_some_and(|e| e >= age)
}
