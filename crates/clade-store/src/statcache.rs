//! The stat cache: a file stored before and unchanged since (path, device, inode, size, mtime, ctime) is not
//! read again; its manifest is reused. git's index and restic's parent snapshot do the same.
//!
//! Entries live in `statcache/<blake3 of the path>`, one line each. An entry is only recorded when the file's
//! ctime is older than the start of the put that read it (a file changed while it was being read is never
//! trusted), and only used if its manifest is still published. It is a cache: losing it costs one re-read.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::ids::ManifestId;
use crate::manifest::ImageKind;
use crate::store::Store;
use crate::writer::PutReport;
use crate::{fsutil, StoreError};

fn entry_path(store: &Store, path: &Path) -> Option<(PathBuf, String)> {
    let canon = std::fs::canonicalize(path).ok()?;
    let key = blake3::hash(canon.as_os_str().as_encoded_bytes()).to_hex().to_string();
    Some((store.inner.dir.join("statcache").join(&key[..2]).join(&key), canon.display().to_string()))
}

fn stamp(md: &std::fs::Metadata, kind: ImageKind) -> String {
    format!(
        "{} {} {} {}.{} {}.{} {:?}",
        md.dev(),
        md.ino(),
        md.len(),
        md.mtime(),
        md.mtime_nsec(),
        md.ctime(),
        md.ctime_nsec(),
        kind
    )
}

pub(crate) fn lookup(store: &Store, path: &Path, kind: ImageKind) -> Result<Option<PutReport>, StoreError> {
    let Some((entry, _)) = entry_path(store, path) else { return Ok(None) };
    let Some(text) = fsutil::read_opt(&entry)? else { return Ok(None) };
    let text = String::from_utf8_lossy(&text);
    let Some((st, id)) = text.trim().rsplit_once(' ') else { return Ok(None) };
    let Ok(md) = std::fs::metadata(path) else { return Ok(None) };
    if st != stamp(&md, kind) {
        return Ok(None);
    }
    let Ok(id) = id.parse::<ManifestId>() else { return Ok(None) };
    if !store.has_manifest(&id) {
        return Ok(None);
    }
    let m = store.manifest(&id)?;
    Ok(Some(PutReport {
        id: Some(id),
        size: m.size,
        bytes_dedup: m.data_bytes(),
        bytes_zero: m.size - m.data_bytes(),
        manifest_bytes: m.encode().len() as u64,
        unchanged_file: true,
        ..Default::default()
    }))
}

pub(crate) fn record(
    store: &Store,
    path: &Path,
    kind: ImageKind,
    md: &std::fs::Metadata,
    start: SystemTime,
    id: &ManifestId,
) {
    let ctime = SystemTime::UNIX_EPOCH + std::time::Duration::new(md.ctime().max(0) as u64, md.ctime_nsec() as u32);
    let Ok(now) = std::fs::metadata(path) else { return };
    if ctime >= start || stamp(&now, kind) != stamp(md, kind) {
        return;
    }
    let Some((entry, _)) = entry_path(store, path) else { return };
    if let Some(parent) = entry.parent() {
        let _ = fsutil::ensure_dir(parent);
    }
    let tmp = fsutil::temp_path(&store.inner.tmp, "statcache");
    let line = format!("{} {id}\n", stamp(md, kind));
    let written = fsutil::new_private().open(&tmp).and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    if written.is_ok() && std::fs::rename(&tmp, &entry).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
