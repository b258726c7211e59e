//! A stored directory tree as a read-only file system, each file fetched as it is read (see the crate docs).
//!
//! Inode 1 is the tree's root; entry `i` of the tree (parents before children) is inode `i + 2`. Attributes
//! (mode, owner, times, size) come from the tree, and the kernel checks permissions against them
//! (`default_permissions`), so a sandbox's unprivileged users see what they would on disk. A file's reader is
//! made on its first open and kept (its manifest is inline in the tree).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clade_store::{EntryKind, ImageReader, Store, Tree, TreeId};
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, MountOption, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry,
    ReplyOpen, ReplyXattr, Request,
};

use crate::{Counters, LazyError};

/// A mounted lazy tree; unmounted on drop.
pub struct LazyTree {
    dir: PathBuf,
    counters: Arc<Counters>,
    session: Option<fuser::BackgroundSession>,
}

impl LazyTree {
    /// Mount the tree `id` of `store` at the directory `dir` (made if missing), read-only.
    pub fn mount(store: &Store, id: &TreeId, dir: &Path) -> Result<LazyTree, LazyError> {
        Self::mount_shifted(store, id, dir, 0)
    }

    /// The same, with every owner shown as `id_shift` + the stored uid (gid): the tree seen by a user
    /// namespace whose root is host uid `id_shift` (FUSE mounts cannot be idmapped here).
    pub fn mount_shifted(store: &Store, id: &TreeId, dir: &Path, id_shift: u32) -> Result<LazyTree, LazyError> {
        let tree = store.tree(id).map_err(|source| LazyError::Store { what: format!("tree {id}"), source })?;
        std::fs::create_dir_all(dir).map_err(|source| LazyError::Dir { dir: dir.to_path_buf(), source })?;
        let counters = Arc::new(Counters::default());
        let mut fs = TreeFs::new(store.clone(), tree, counters.clone());
        fs.id_shift = id_shift;
        let opts = [
            MountOption::FSName(format!("clade-lazy:{id}")),
            MountOption::Subtype("clade-lazy".into()),
            MountOption::RO,
            MountOption::AllowOther,
            MountOption::DefaultPermissions,
            MountOption::Dev,
            MountOption::Suid,
        ];
        let session = fuser::spawn_mount2(fs, dir, &opts)
            .map_err(|source| LazyError::Mount { dir: dir.to_path_buf(), source })?;
        Ok(LazyTree { dir: dir.to_path_buf(), counters, session: Some(session) })
    }

    /// The mount point (the tree's root).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }
}

impl std::fmt::Debug for LazyTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyTree").field("dir", &self.dir).finish_non_exhaustive()
    }
}

impl Drop for LazyTree {
    fn drop(&mut self) {
        crate::unmount(&self.dir, self.session.take());
    }
}

const ROOT: u64 = fuser::FUSE_ROOT_ID;
/// Nothing in a stored tree ever changes.
const TTL: Duration = Duration::from_secs(3600);

struct Node {
    /// Index into the tree's entries; `None` for the root.
    entry: Option<usize>,
    parent: u64,
    /// Children by name (directories only).
    children: BTreeMap<Vec<u8>, u64>,
}

struct TreeFs {
    store: Store,
    tree: Tree,
    nodes: Vec<Node>,
    readers: HashMap<u64, ImageReader>,
    counters: Arc<Counters>,
    mounted: SystemTime,
    /// Added to every uid and gid shown (LazyTree::mount_shifted).
    id_shift: u32,
    pool: ReadPool,
}

/// A few threads that answer reads (rayon's pool: FUSE replies may be sent from any thread, so the request loop
/// hands each read over and goes on). `None` where the threads cannot be made: reads are answered in the loop.
struct ReadPool(Option<rayon::ThreadPool>);

impl ReadPool {
    const THREADS: usize = 4;

    fn new() -> ReadPool {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(Self::THREADS)
            .thread_name(|i| format!("lazyfs-read-{i}"))
            // A read that panics answers nothing (its reply, dropped, answers EIO): the mount and its process go
            // on, where rayon would otherwise abort the process.
            .panic_handler(|_| {})
            .build();
        ReadPool(pool.ok())
    }

    fn run(&self, job: impl FnOnce() + Send + 'static) {
        match &self.0 {
            Some(pool) => pool.spawn(job),
            None => job(),
        }
    }
}

impl TreeFs {
    fn new(store: Store, tree: Tree, counters: Arc<Counters>) -> TreeFs {
        let mut nodes = vec![Node { entry: None, parent: ROOT, children: BTreeMap::new() }];
        let mut by_path: HashMap<Vec<u8>, u64> = HashMap::new();
        by_path.insert(Vec::new(), ROOT);
        for (i, e) in tree.entries.iter().enumerate() {
            let ino = i as u64 + 2;
            let (parent_path, name) = match e.path.iter().rposition(|&b| b == b'/') {
                Some(k) => (e.path[..k].to_vec(), e.path[k + 1..].to_vec()),
                None => (Vec::new(), e.path.clone()),
            };
            // Parents come before children; an orphan (a corrupt tree) hangs off the root.
            let parent = by_path.get(&parent_path).copied().unwrap_or(ROOT);
            nodes.push(Node { entry: Some(i), parent, children: BTreeMap::new() });
            if let Some(p) = nodes.get_mut((parent - 1) as usize) {
                p.children.insert(name, ino);
            }
            if matches!(e.kind, EntryKind::Dir) {
                by_path.insert(e.path.clone(), ino);
            }
        }
        TreeFs {
            store,
            tree,
            nodes,
            readers: HashMap::new(),
            counters,
            mounted: SystemTime::now(),
            id_shift: 0,
            pool: ReadPool::new(),
        }
    }

    fn node(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(ino.checked_sub(1)? as usize)
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let n = self.node(ino)?;
        let Some(i) = n.entry else {
            return Some(FileAttr {
                ino,
                size: 0,
                blocks: 0,
                atime: self.mounted,
                mtime: self.mounted,
                ctime: self.mounted,
                crtime: self.mounted,
                kind: FileType::Directory,
                perm: 0o755,
                nlink: 2,
                uid: self.id_shift,
                gid: self.id_shift,
                rdev: 0,
                blksize: 4096,
                flags: 0,
            });
        };
        let e = &self.tree.entries[i];
        let (kind, size, rdev) = match &e.kind {
            EntryKind::Dir => (FileType::Directory, 0, 0),
            EntryKind::File(m) => (FileType::RegularFile, m.size, 0),
            EntryKind::Symlink(t) => (FileType::Symlink, t.len() as u64, 0),
            EntryKind::Special(r) => {
                let k = match e.mode & libc::S_IFMT {
                    libc::S_IFCHR => FileType::CharDevice,
                    libc::S_IFBLK => FileType::BlockDevice,
                    libc::S_IFSOCK => FileType::Socket,
                    _ => FileType::NamedPipe,
                };
                (k, 0, *r as u32)
            }
        };
        let t = UNIX_EPOCH + Duration::new(e.mtime.0.max(0) as u64, e.mtime.1);
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind,
            perm: (e.mode & 0o7777) as u16,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: e.uid.saturating_add(self.id_shift),
            gid: e.gid.saturating_add(self.id_shift),
            rdev,
            blksize: 4096,
            flags: 0,
        })
    }

    fn xattrs(&self, ino: u64) -> &[(Vec<u8>, Vec<u8>)] {
        match self.node(ino).and_then(|n| n.entry) {
            Some(i) => &self.tree.entries[i].xattrs,
            None => &[],
        }
    }
}

/// Answer an xattr request: the size when `size` is 0, else the bytes (ERANGE when they do not fit).
fn reply_xattr(reply: ReplyXattr, size: u32, bytes: &[u8]) {
    if size == 0 {
        reply.size(bytes.len() as u32);
    } else if bytes.len() > size as usize {
        reply.error(libc::ERANGE);
    } else {
        reply.data(bytes);
    }
}

impl Filesystem for TreeFs {
    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), libc::c_int> {
        let _ = config.set_max_readahead(1 << 20);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let found = self.node(parent).and_then(|n| n.children.get(name.as_bytes()).copied());
        match found.and_then(|ino| self.attr(ino)) {
            Some(a) => reply.entry(&TTL, &a, 0),
            None => reply.error(libc::ENOENT),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(libc::ENOENT),
        }
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        match self.node(ino).and_then(|n| n.entry).map(|i| &self.tree.entries[i].kind) {
            Some(EntryKind::Symlink(t)) => reply.data(t),
            _ => reply.error(libc::EINVAL),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(libc::EROFS);
        }
        let Some(i) = self.node(ino).and_then(|n| n.entry) else { return reply.error(libc::EISDIR) };
        match &self.tree.entries[i].kind {
            EntryKind::File(m) => {
                if !self.readers.contains_key(&ino) {
                    self.readers.insert(ino, self.store.image_of(m.clone()));
                }
                reply.opened(0, fuser::consts::FOPEN_KEEP_CACHE);
            }
            EntryKind::Dir => reply.error(libc::EISDIR),
            _ => reply.opened(0, 0),
        }
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
        let Some(r) = self.readers.get(&ino) else { return reply.error(libc::EBADF) };
        let total = r.size();
        let off = u64::try_from(offset).unwrap_or(u64::MAX);
        if off >= total {
            return reply.data(&[]);
        }
        let (r, counters) = (r.clone(), self.counters.clone());
        let len = u64::from(size).min(total - off) as usize;
        // Off the FUSE loop: one read waiting on the blob tier (a page fault of a file not fetched yet) would
        // otherwise hold up every other request to this mount, the agent's own included.
        self.pool.run(move || {
            let mut buf = vec![0u8; len];
            match r.read_at(off, &mut buf) {
                Ok(()) => {
                    counters.reads.fetch_add(1, Ordering::Relaxed);
                    counters.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    reply.data(&buf)
                }
                Err(_) => {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    reply.error(libc::EIO)
                }
            }
        });
    }

    fn readdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, offset: i64, mut reply: ReplyDirectory) {
        let Some(n) = self.node(ino) else { return reply.error(libc::ENOENT) };
        if n.entry.is_some_and(|i| !matches!(self.tree.entries[i].kind, EntryKind::Dir)) {
            return reply.error(libc::ENOTDIR);
        }
        let mut all: Vec<(u64, FileType, &[u8])> =
            vec![(ino, FileType::Directory, b"."), (n.parent, FileType::Directory, b"..")];
        for (name, child) in &n.children {
            let kind = self.attr(*child).map(|a| a.kind).unwrap_or(FileType::RegularFile);
            all.push((*child, kind, name));
        }
        for (i, (child, kind, name)) in all.iter().enumerate().skip(usize::try_from(offset).unwrap_or(0)) {
            if reply.add(*child, (i + 1) as i64, *kind, OsStr::from_bytes(name)) {
                break;
            }
        }
        reply.ok();
    }

    fn getxattr(&mut self, _req: &Request<'_>, ino: u64, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.xattrs(ino).iter().find(|(k, _)| k.as_slice() == name.as_bytes()) {
            Some((_, v)) => reply_xattr(reply, size, v),
            None => reply.error(libc::ENODATA),
        }
    }

    fn listxattr(&mut self, _req: &Request<'_>, ino: u64, size: u32, reply: ReplyXattr) {
        let mut names = Vec::new();
        for (k, _) in self.xattrs(ino) {
            names.extend_from_slice(k);
            names.push(0);
        }
        reply_xattr(reply, size, &names);
    }
}
