//! File operations. Paths are checked before any system call: absolute, no NUL, no `..` component
//! (the host names paths inside the sandbox; `..` is never needed and only ever a mistake or an attack).

use crate::conn::Conn;
use clade_agent::wire::{encode_header, Chan, Kind, DATA_CHUNK};
use clade_agent::{AgentError, DirEntry, FileOwner, FileStat, FileType, MountSource, Reply, Response, WriteOptions};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{fchown, lchown, DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

const MAX_LIST: usize = 100_000;

/// A temp file name next to `target`, unique across threads and connections of this agent:
/// `.{name}.clade-tmp.{pid}.{n}`, or `clade-tmpr` when it will replace an existing `target` (a watch reports
/// the write as the target's own: crate::watch).
pub fn tmp_path(target: &Path) -> PathBuf {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = target.parent().unwrap_or(Path::new("/"));
    let tag = if target.symlink_metadata().is_ok() { "clade-tmpr" } else { "clade-tmp" };
    dir.join(format!(".{name}.{tag}.{}.{n}", std::process::id()))
}

/// Accepts an absolute path without NUL or `..`.
pub fn check_path(p: &str) -> Result<PathBuf, AgentError> {
    let bad = |reason: &str| AgentError::BadPath { path: p.escape_default().to_string(), reason: reason.into() };
    if p.contains('\0') {
        return Err(bad("it contains a NUL byte"));
    }
    if !p.starts_with('/') {
        return Err(bad("it must be absolute"));
    }
    if Path::new(p).components().any(|c| c == Component::ParentDir) {
        return Err(bad("it contains a `..` component"));
    }
    Ok(PathBuf::from(p))
}

fn io_err(what: &str, path: &Path, e: &std::io::Error) -> AgentError {
    let p = path.display().to_string();
    match e.kind() {
        ErrorKind::NotFound => AgentError::NotFound { path: p },
        _ if e.raw_os_error() == Some(libc::EISDIR) => AgentError::IsADirectory { path: p },
        _ => AgentError::os(format!("{what} {p}"), e),
    }
}

fn to_stat(path: &Path, m: &fs::Metadata) -> FileStat {
    let ft = m.file_type();
    let file_type = if ft.is_symlink() {
        FileType::Symlink
    } else if ft.is_dir() {
        FileType::Dir
    } else if ft.is_file() {
        FileType::File
    } else {
        FileType::Other
    };
    FileStat {
        file_type,
        size: m.len(),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        mtime_ns: m.mtime().saturating_mul(1_000_000_000).saturating_add(m.mtime_nsec()),
        link_target: if ft.is_symlink() {
            fs::read_link(path).ok().map(|t| t.to_string_lossy().into_owned())
        } else {
            None
        },
        xattrs: if ft.is_file() || ft.is_dir() { user_xattrs(path) } else { BTreeMap::new() },
    }
}

/// Names a write may set: the `user.` namespace only (the others are the kernel's or need privileges a
/// caller of the agent should not borrow), within the kernel's limits.
const XATTR_PREFIX: &str = "user.";
const XATTR_NAME_MAX: usize = 255;
const XATTR_VALUE_MAX: usize = 64 * 1024;
/// At most this many attributes are read back per entry (a listing stays bounded).
const XATTR_READ_MAX: usize = 64;

/// The `user.` extended attributes of a file or directory (none where the filesystem has none).
fn user_xattrs(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(names) = xattr::list(path) else { return out };
    for name in names {
        let Some(n) = name.to_str() else { continue };
        if !n.starts_with(XATTR_PREFIX) {
            continue;
        }
        if out.len() >= XATTR_READ_MAX {
            break;
        }
        if let Ok(Some(v)) = xattr::get(path, n) {
            out.insert(n.to_string(), String::from_utf8_lossy(&v).into_owned());
        }
    }
    out
}

fn check_xattrs(path: &str, xattrs: &BTreeMap<String, String>) -> Result<(), AgentError> {
    for (name, value) in xattrs {
        let reason = if !name.starts_with(XATTR_PREFIX) || name.len() == XATTR_PREFIX.len() {
            format!("extended attribute {name:?} is not in the `user.` namespace")
        } else if name.len() > XATTR_NAME_MAX || name.contains('\0') {
            format!("extended attribute name {name:?} is longer than {XATTR_NAME_MAX} bytes or holds a NUL")
        } else if value.len() > XATTR_VALUE_MAX {
            format!("extended attribute {name:?} is over {XATTR_VALUE_MAX} bytes")
        } else {
            continue;
        };
        return Err(AgentError::BadPath { path: path.into(), reason });
    }
    Ok(())
}

/// `mkdir -p` of `dir`, each directory it creates given `mode` and, when named, `owner`.
fn make_dirs(dir: &Path, mode: u32, owner: Option<FileOwner>) -> Result<(), AgentError> {
    let Some(owner) = owner else {
        return fs::DirBuilder::new().recursive(true).mode(mode).create(dir).map_err(|e| io_err("mkdir -p", dir, &e));
    };
    // The missing ancestors, nearest the root last.
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(d) = cur {
        if fs::symlink_metadata(d).is_ok() {
            break;
        }
        missing.push(d);
        cur = d.parent();
    }
    for d in missing.into_iter().rev() {
        match fs::DirBuilder::new().mode(mode).create(d) {
            Ok(()) => lchown(d, Some(owner.uid), Some(owner.gid)).map_err(|e| io_err("chown", d, &e))?,
            // Made meanwhile by someone else: theirs, left as it is.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err("mkdir", d, &e)),
        }
    }
    if !fs::metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Err(AgentError::BadPath { path: dir.display().to_string(), reason: "not a directory".into() });
    }
    Ok(())
}

pub fn stat(path: &str) -> Result<FileStat, AgentError> {
    let p = check_path(path)?;
    let m = fs::symlink_metadata(&p).map_err(|e| io_err("stat", &p, &e))?;
    Ok(to_stat(&p, &m))
}

/// Streams a file as `Data` frames; the caller sends the final reply.
pub fn read_file(conn: &Conn, id: u32, path: &str) -> Response {
    let p = check_path(path)?;
    let mut f = File::open(&p).map_err(|e| io_err("opening", &p, &e))?;
    let m = f.metadata().map_err(|e| io_err("stat", &p, &e))?;
    if m.is_dir() {
        return Err(AgentError::IsADirectory { path: path.into() });
    }
    if !m.is_file() {
        return Err(AgentError::BadPath { path: path.into(), reason: "not a regular file".into() });
    }
    // The size known now goes by sendfile in whole chunks; anything the file grew by since goes by
    // plain reads after, so /proc files (size 0) and growing logs still read to their end.
    let mut total = 0u64;
    let mut chunk = vec![0u8; 64 * 1024];
    while total < m.len() {
        let n = (m.len() - total).min(DATA_CHUNK as u64) as usize;
        let real = conn.file_chunk(id, &f, total, n, &mut chunk).map_err(|e| AgentError::os("sending the file", &e))?;
        total += real as u64;
        if real < n {
            return Err(AgentError::Failed {
                detail: format!("{path} shrank while being read: the last chunk is padded, discard the data"),
            });
        }
    }
    f.seek(SeekFrom::Start(total)).map_err(|e| io_err("seeking", &p, &e))?;
    let mut buf = vec![0u8; 12 + 64 * 1024];
    loop {
        let n = match f.read(&mut buf[12..]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("reading", &p, &e)),
        };
        buf[..12].copy_from_slice(&encode_header(Kind::Data, Chan::File, 0, id, n));
        conn.raw(&buf[..12 + n]);
        total += n as u64;
    }
    Ok(Reply::Bytes { n: total })
}

/// A file being written from `Data` frames: a temp file next to the target, renamed over it at the end.
pub struct PendingWrite {
    tmp: PathBuf,
    target: PathBuf,
    file: File,
    mode: u32,
    owner: Option<FileOwner>,
    xattrs: BTreeMap<String, String>,
    n: u64,
}

impl PendingWrite {
    pub fn open(path: &str, opts: WriteOptions, mkdirs: bool) -> Result<PendingWrite, AgentError> {
        let WriteOptions { mode, owner, xattrs } = opts;
        let target = check_path(path)?;
        check_xattrs(path, &xattrs)?;
        if fs::metadata(&target).is_ok_and(|m| m.is_dir()) {
            return Err(AgentError::IsADirectory { path: path.into() });
        }
        let (Some(dir), Some(_)) = (target.parent(), target.file_name()) else {
            return Err(AgentError::BadPath { path: path.into(), reason: "it names no file".into() });
        };
        if mkdirs {
            make_dirs(dir, 0o755, owner)?;
        }
        let tmp = tmp_path(&target);
        let mode = mode.unwrap_or(0o644) & 0o7777;
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
            .map_err(|e| io_err("creating", &tmp, &e))?;
        Ok(PendingWrite { tmp, target, file, mode, owner, xattrs, n: 0 })
    }

    pub fn write(&mut self, data: &[u8]) -> Result<(), AgentError> {
        self.file.write_all(data).map_err(|e| io_err("writing", &self.tmp, &e))?;
        self.n += data.len() as u64;
        Ok(())
    }

    pub fn finish(self) -> Response {
        // Owner first (a chown clears set-id bits), then the mode, the attributes, and only then the name.
        let owned = match self.owner {
            Some(o) => fchown(&self.file, Some(o.uid), Some(o.gid)),
            None => Ok(()),
        };
        let res = owned
            .and_then(|_| fs::set_permissions(&self.tmp, fs::Permissions::from_mode(self.mode)))
            .and_then(|_| {
                self.xattrs.iter().try_for_each(|(k, v)| xattr::FileExt::set_xattr(&self.file, k, v.as_bytes()))
            })
            .and_then(|_| fs::rename(&self.tmp, &self.target));
        if let Err(e) = res {
            let _ = fs::remove_file(&self.tmp);
            return Err(io_err("renaming into place", &self.target, &e));
        }
        Ok(Reply::Bytes { n: self.n })
    }

    pub fn abandon(self) {
        let _ = fs::remove_file(&self.tmp);
    }
}

pub fn list_dir(path: &str, depth: u32) -> Response {
    let p = check_path(path)?;
    let m = fs::metadata(&p).map_err(|e| io_err("stat", &p, &e))?;
    if !m.is_dir() {
        return Err(AgentError::BadPath { path: path.into(), reason: "not a directory".into() });
    }
    let mut entries = Vec::new();
    walk(&p, 1, depth.max(1), &mut entries)?;
    Ok(Reply::Dir { entries })
}

fn walk(dir: &Path, level: u32, max: u32, out: &mut Vec<DirEntry>) -> Result<(), AgentError> {
    let rd = fs::read_dir(dir).map_err(|e| io_err("listing", dir, &e))?;
    let mut names: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    names.sort();
    for path in names {
        let Ok(m) = fs::symlink_metadata(&path) else { continue };
        if out.len() >= MAX_LIST {
            return Err(AgentError::Failed {
                detail: format!("more than {MAX_LIST} entries: list with a smaller depth"),
            });
        }
        out.push(DirEntry { path: path.to_string_lossy().into_owned(), depth: level, stat: to_stat(&path, &m) });
        if m.is_dir() && level < max {
            // Unreadable subdirectories are listed but not descended into.
            let _ = walk(&path, level + 1, max, out);
        }
    }
    Ok(())
}

pub fn mkdir_p(path: &str, mode: Option<u32>, owner: Option<FileOwner>) -> Response {
    let p = check_path(path)?;
    make_dirs(&p, mode.unwrap_or(0o755), owner)?;
    Ok(Reply::Done)
}

pub fn remove(path: &str, recursive: bool) -> Response {
    let p = check_path(path)?;
    if p == Path::new("/") {
        return Err(AgentError::BadPath { path: path.into(), reason: "refusing to remove /".into() });
    }
    let m = fs::symlink_metadata(&p).map_err(|e| io_err("stat", &p, &e))?;
    let res = if m.is_dir() {
        if recursive {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_dir(&p)
        }
    } else {
        fs::remove_file(&p)
    };
    res.map_err(|e| io_err("removing", &p, &e))?;
    Ok(Reply::Done)
}

pub fn rename(from: &str, to: &str) -> Response {
    let (f, t) = (check_path(from)?, check_path(to)?);
    fs::rename(&f, &t).map_err(|e| io_err("renaming", &f, &e))?;
    Ok(Reply::Done)
}

pub fn chmod(path: &str, mode: u32) -> Response {
    let p = check_path(path)?;
    fs::set_permissions(&p, fs::Permissions::from_mode(mode & 0o7777)).map_err(|e| io_err("chmod", &p, &e))?;
    Ok(Reply::Done)
}

pub fn symlink(target: &str, path: &str) -> Response {
    let p = check_path(path)?;
    std::os::unix::fs::symlink(target, &p).map_err(|e| io_err("symlink", &p, &e))?;
    Ok(Reply::Done)
}

/// `Request::Mount`: a tmpfs or a bind at `path`, then (read-only) a remount of that mount alone read-only.
pub fn mount(path: &str, source: &MountSource, readonly: bool) -> Response {
    use nix::mount::{mount, MsFlags};
    let p = check_path(path)?;
    let failed = |what: &str, e: nix::Error| AgentError::os(format!("{what} at {}", p.display()), &e.into());
    let bind = match source {
        MountSource::Tmpfs => {
            let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
            mount(Some("tmpfs"), &p, Some("tmpfs"), flags, Some("mode=0755")).map_err(|e| failed("mount tmpfs", e))?;
            false
        }
        MountSource::Bind { from } => {
            let f = check_path(from)?;
            let flags = MsFlags::MS_BIND | MsFlags::MS_REC;
            mount(Some(&f), &p, None::<&str>, flags, None::<&str>).map_err(|e| failed("bind", e))?;
            true
        }
    };
    if readonly {
        let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if bind {
            flags |= MsFlags::MS_BIND;
        }
        if let Err(e) = mount(None::<&str>, &p, None::<&str>, flags, None::<&str>) {
            // Nothing half-made: what was mounted goes again.
            let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
            return Err(failed("remount read-only", e));
        }
    }
    Ok(Reply::Done)
}

/// `Request::Unmount`: the mount at `path` and those below it, detached.
pub fn unmount(path: &str) -> Response {
    let p = check_path(path)?;
    nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH)
        .map_err(|e| AgentError::os(format!("unmount {}", p.display()), &e.into()))?;
    Ok(Reply::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_checked() {
        assert!(check_path("/etc/hostname").is_ok());
        assert!(matches!(check_path("etc"), Err(AgentError::BadPath { .. })));
        assert!(matches!(check_path("/etc/../root"), Err(AgentError::BadPath { .. })));
        assert!(matches!(check_path("/etc/a\0b"), Err(AgentError::BadPath { .. })));
        assert!(check_path("/a/..b/c").is_ok());
    }
}
