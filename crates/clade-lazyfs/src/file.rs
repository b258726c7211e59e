//! One image as one read-only file (see the crate docs). The file accepts opens for writing (QEMU 7.2 opens its
//! RAM file read-write even for a private mapping) but refuses writes: a private mapping never writes back.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::{Counters, LazyError};
use clade_store::{ImageReader, ManifestId, Store};
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, MountOption, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry,
    ReplyOpen, ReplyWrite, Request,
};

/// A mounted lazy file; unmounted on drop.
pub struct LazyFile {
    dir: PathBuf,
    name: String,
    counters: Arc<Counters>,
    session: Option<fuser::BackgroundSession>,
}

impl LazyFile {
    /// Mount, at the directory `dir` (made if missing), a filesystem whose only file `name` is the image of
    /// `manifest`, read from `store` on demand.
    pub fn mount(store: &Store, manifest: &ManifestId, dir: &Path, name: &str) -> Result<LazyFile, LazyError> {
        let reader =
            store.image(manifest).map_err(|source| LazyError::Store { what: format!("image {manifest}"), source })?;
        std::fs::create_dir_all(dir).map_err(|source| LazyError::Dir { dir: dir.to_path_buf(), source })?;
        let counters = Arc::new(Counters::default());
        let fs = ImageFs { reader, name: name.to_string(), counters: counters.clone(), created: SystemTime::now() };
        let opts = [
            MountOption::FSName(format!("clade-lazy:{manifest}")),
            MountOption::Subtype("clade-lazy".into()),
            MountOption::NoDev,
            MountOption::NoSuid,
            MountOption::NoExec,
            MountOption::AllowOther,
        ];
        let session = fuser::spawn_mount2(fs, dir, &opts)
            .map_err(|source| LazyError::Mount { dir: dir.to_path_buf(), source })?;
        Ok(LazyFile { dir: dir.to_path_buf(), name: name.to_string(), counters, session: Some(session) })
    }

    /// The file's path.
    pub fn path(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }
}

impl std::fmt::Debug for LazyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyFile").field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl Drop for LazyFile {
    fn drop(&mut self) {
        crate::unmount(&self.dir, self.session.take());
    }
}

const ROOT: u64 = fuser::FUSE_ROOT_ID;
const FILE: u64 = 2;
/// Attributes never change: the kernel may cache them for as long as it likes.
const TTL: Duration = Duration::from_secs(3600);

struct ImageFs {
    reader: ImageReader,
    name: String,
    counters: Arc<Counters>,
    created: SystemTime,
}

impl ImageFs {
    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, perm, size, nlink) = match ino {
            ROOT => (FileType::Directory, 0o555, 0, 2),
            _ => (FileType::RegularFile, 0o644, self.reader.size(), 1),
        };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.created,
            mtime: self.created,
            ctime: self.created,
            crtime: self.created,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl Filesystem for ImageFs {
    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), libc::c_int> {
        // Read ahead up to one store frame: a miss costs a frame fetch anyway.
        let _ = config.set_max_readahead(1 << 20);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        if parent == ROOT && name == OsStr::new(&self.name) {
            reply.entry(&TTL, &self.attr(FILE), 0);
        } else {
            reply.error(libc::ENOENT);
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match ino {
            ROOT | FILE => reply.attr(&TTL, &self.attr(ino)),
            _ => reply.error(libc::ENOENT),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(libc::EISDIR);
        }
        // Keep the page cache across opens: the content never changes.
        reply.opened(0, fuser::consts::FOPEN_KEEP_CACHE);
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock: Option<u64>,
        reply: ReplyData,
    ) {
        if ino != FILE {
            return reply.error(libc::EISDIR);
        }
        let total = self.reader.size();
        let off = u64::try_from(offset).unwrap_or(u64::MAX);
        if off >= total {
            return reply.data(&[]);
        }
        let len = (u64::from(size)).min(total - off) as usize;
        let mut buf = vec![0u8; len];
        match self.reader.read_at(off, &mut buf) {
            Ok(()) => {
                self.counters.reads.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes.fetch_add(len as u64, Ordering::Relaxed);
                reply.data(&buf)
            }
            Err(_) => {
                // A frame that fails verification or cannot be fetched: the reader (a guest page fault) gets EIO
                // (QEMU then dies with SIGBUS) rather than wrong bytes.
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                reply.error(libc::EIO)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _fh: u64,
        _offset: i64,
        _data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock: Option<u64>,
        reply: ReplyWrite,
    ) {
        reply.error(libc::EROFS);
    }

    fn readdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, offset: i64, mut reply: ReplyDirectory) {
        if ino != ROOT {
            return reply.error(libc::ENOTDIR);
        }
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (FILE, FileType::RegularFile, self.name.as_str()),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(usize::try_from(offset).unwrap_or(0)) {
            if reply.add(*ino, (i + 1) as i64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}
