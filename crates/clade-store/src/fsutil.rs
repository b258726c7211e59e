//! Durable file publication: write to a temp file in the same directory tree, fsync, rename, fsync the
//! directory. A reader therefore sees either nothing or the whole file, even across kill -9 or power loss.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::IoCtx;
use crate::StoreError;

/// A unique temp path under `tmp_dir` (pid + counter + random), for a file about to be published.
pub(crate) fn temp_path(tmp_dir: &Path, what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let r: u32 = rand::random();
    tmp_dir.join(format!("{what}.{}.{n}.{r:08x}.tmp", std::process::id()))
}

/// fsync a directory so a rename into it is durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).ctx("fsync directory", dir)
}

/// The mode of every directory the store makes: owner only (packs hold guest memory and disks).
pub(crate) const DIR_MODE: u32 = 0o700;
/// The mode of every file the store makes (packs, indexes, manifests, leases, images it restores).
pub(crate) const FILE_MODE: u32 = 0o600;

/// Create `dir` (and parents, each 0700) if needed.
pub(crate) fn ensure_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir).ctx("create directory", dir)
}

/// Options for a new private file (0600 whatever the umask): write, create_new.
pub(crate) fn new_private() -> OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = OpenOptions::new();
    o.write(true).create_new(true).mode(FILE_MODE);
    o
}

/// Rename a fully written and fsynced temp file to `dest`, creating the fan-out directory, and fsync it.
pub(crate) fn publish(tmp: &Path, dest: &Path) -> Result<(), StoreError> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    ensure_dir(parent)?;
    fs::rename(tmp, dest).ctx("rename into place", dest)?;
    sync_dir(parent)
}

/// Write `data` durably to `dest` through a temp file in `tmp_dir`.
pub(crate) fn write_atomic(tmp_dir: &Path, dest: &Path, data: &[u8]) -> Result<(), StoreError> {
    let tmp = temp_path(tmp_dir, "file");
    let res = (|| {
        let mut f = new_private().open(&tmp).ctx("create temp file", &tmp)?;
        f.write_all(data).ctx("write", &tmp)?;
        f.sync_all().ctx("fsync", &tmp)?;
        drop(f);
        publish(&tmp, dest)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

/// Read a whole file; `Ok(None)` if it does not exist.
pub(crate) fn read_opt(path: &Path) -> Result<Option<Vec<u8>>, StoreError> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::io("read", path, e)),
    }
}

/// Every file under `dir` (one fan-out level deep, as the store lays them out) whose name ends in `suffix`.
pub(crate) fn list_fanout(dir: &Path, suffix: &str) -> Result<Vec<PathBuf>, StoreError> {
    let mut out = Vec::new();
    let top = match fs::read_dir(dir) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(StoreError::io("list", dir, e)),
    };
    for sub in top {
        let sub = sub.ctx("list", dir)?.path();
        if !sub.is_dir() {
            continue;
        }
        for f in fs::read_dir(&sub).ctx("list", &sub)? {
            let p = f.ctx("list", &sub)?.path();
            if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(suffix)) {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The id part of a store file name (`<hex>.<ext>` or `<hex>`).
pub(crate) fn stem(path: &Path) -> &str {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.split('.').next().unwrap_or("")
}
