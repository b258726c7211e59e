//! Directory trees (a CRIU image directory, an overlay upper dir): every entry with its type, mode, owner,
//! mtime and extended attributes (overlayfs keeps whiteouts as 0/0 character devices and opaque dirs as
//! `trusted.overlay.*` xattrs, so both are kept), each regular file's content as an inline manifest.
//!
//! All files of a tree go through one writer session, so small files share frames and packs, and a tree is
//! one root for gc. Hard links are stored as separate files (restored unlinked).

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::codec::{Dec, DecodeError, Enc};
use crate::error::IoCtx;
use crate::ids::{ManifestId, TreeId};
use crate::manifest::{ImageKind, Manifest};
use crate::store::Store;
use crate::writer::{merge_reports, ImageState, PutReport, Session};
use crate::{fsutil, StoreError};

const MAGIC: &[u8; 8] = b"CLADETR1";
const VERSION: u32 = 1;
const READ_CHUNK: usize = 8 << 20;

/// What an entry is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A directory.
    Dir,
    /// A regular file and its content.
    File(Manifest),
    /// A symbolic link and its target.
    Symlink(Vec<u8>),
    /// A character device, block device or fifo (`mode` says which) and its device number.
    Special(u64),
}

/// One entry of a tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeEntry {
    /// Path relative to the tree root, `/`-separated, parents before children.
    pub path: Vec<u8>,
    /// `st_mode` (type and permission bits).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time (seconds, nanoseconds).
    pub mtime: (i64, u32),
    /// Extended attributes.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Type-specific content.
    pub kind: EntryKind,
}

/// A stored directory tree.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Tree {
    /// Entries, parents before children.
    pub entries: Vec<TreeEntry>,
}

/// What `put_dir` did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TreeReport {
    /// The tree published.
    pub id: TreeId,
    /// Entries by type.
    pub files: u64,
    /// Directories.
    pub dirs: u64,
    /// Symlinks and special files.
    pub others: u64,
    /// Size of the encoded tree.
    pub tree_bytes: u64,
    /// Totals over all files' content.
    pub data: PutReport,
}

impl Tree {
    /// Encoded bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::with_magic(MAGIC, VERSION);
        e.u32(self.entries.len() as u32);
        for t in &self.entries {
            e.blob(&t.path);
            e.u32(t.mode);
            e.u32(t.uid);
            e.u32(t.gid);
            e.i64(t.mtime.0);
            e.u32(t.mtime.1);
            e.u32(t.xattrs.len() as u32);
            for (k, v) in &t.xattrs {
                e.blob(k);
                e.blob(v);
            }
            match &t.kind {
                EntryKind::Dir => e.u8(0),
                EntryKind::File(m) => {
                    e.u8(1);
                    e.blob(&m.encode());
                }
                EntryKind::Symlink(target) => {
                    e.u8(2);
                    e.blob(target);
                }
                EntryKind::Special(rdev) => {
                    e.u8(3);
                    e.u64(*rdev);
                }
            }
        }
        e.buf
    }

    pub(crate) fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Dec::new(buf);
        d.magic(MAGIC, VERSION)?;
        let n = d.count(33, "entry count")?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let path = d.blob("path")?.to_vec();
            if path.is_empty()
                || path.starts_with(b"/")
                || path.split(|c| *c == b'/').any(|c| c == b".." || c.is_empty())
            {
                return Err(DecodeError::Bad(format!("unsafe path {:?}", String::from_utf8_lossy(&path))));
            }
            let mode = d.u32("mode")?;
            let uid = d.u32("uid")?;
            let gid = d.u32("gid")?;
            let mtime = (d.i64("mtime")?, d.u32("mtime ns")?);
            let nx = d.count(8, "xattr count")?;
            let mut xattrs = Vec::with_capacity(nx);
            for _ in 0..nx {
                xattrs.push((d.blob("xattr name")?.to_vec(), d.blob("xattr value")?.to_vec()));
            }
            let kind = match d.u8("entry type")? {
                0 => EntryKind::Dir,
                1 => EntryKind::File(Manifest::decode(d.blob("file manifest")?)?),
                2 => EntryKind::Symlink(d.blob("symlink target")?.to_vec()),
                3 => EntryKind::Special(d.u64("rdev")?),
                t => return Err(DecodeError::Bad(format!("unknown entry type {t}"))),
            };
            entries.push(TreeEntry { path, mode, uid, gid, mtime, xattrs, kind });
        }
        d.end()?;
        Ok(Tree { entries })
    }

    /// Every manifest in the tree.
    pub fn manifests(&self) -> impl Iterator<Item = &Manifest> {
        self.entries.iter().filter_map(|e| match &e.kind {
            EntryKind::File(m) => Some(m),
            _ => None,
        })
    }
}

fn xattrs_of(path: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut names = vec![0u8; 4096];
    let Ok(n) = rustix::fs::llistxattr(path, &mut names) else { return Vec::new() };
    let mut out = Vec::new();
    for name in names[..n].split(|c| *c == 0).filter(|s| !s.is_empty()) {
        let mut val = vec![0u8; 65536];
        if let Ok(v) = rustix::fs::lgetxattr(path, name, &mut val) {
            val.truncate(v);
            out.push((name.to_vec(), val));
        }
    }
    out.sort();
    out
}

fn walk(root: &Path, rel: &Path, out: &mut Vec<(PathBuf, fs::Metadata)>) -> Result<(), StoreError> {
    let dir = root.join(rel);
    let mut names: Vec<_> = fs::read_dir(&dir)
        .ctx("list", &dir)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .ctx("list", &dir)?;
    names.sort();
    for name in names {
        let r = rel.join(&name);
        let p = root.join(&r);
        let md = fs::symlink_metadata(&p).ctx("stat", &p)?;
        let is_dir = md.is_dir();
        out.push((r.clone(), md));
        if is_dir {
            walk(root, &r, out)?;
        }
    }
    Ok(())
}

/// Where copies of trees read from the blob tier are kept for the host's other processes (crate::kept).
pub(crate) const KEPT_TREES: &str = "blob-trees";

impl Store {
    pub(crate) fn tree_path(&self, id: &TreeId) -> PathBuf {
        self.inner.trees.join(id.fanout()).join(id.to_hex())
    }

    /// Whether this tree is published in the local tier.
    pub fn has_tree(&self, id: &TreeId) -> bool {
        self.tree_path(id).exists()
    }

    /// Store a directory tree: every file, directory, symlink and special file under `path`.
    pub fn put_dir(&self, path: &Path) -> Result<TreeReport, StoreError> {
        use std::os::unix::ffi::OsStrExt;
        let mut list = Vec::new();
        walk(path, Path::new(""), &mut list)?;
        let mut session = Session::new(self)?;
        let mut images: Vec<(usize, ImageState)> = Vec::new();
        let mut entries = Vec::with_capacity(list.len());
        let (mut files, mut dirs, mut others) = (0u64, 0u64, 0u64);
        let mut buf = Vec::new();
        for (i, (rel, md)) in list.iter().enumerate() {
            let full = path.join(rel);
            let ft = md.file_type();
            let kind = if ft.is_dir() {
                dirs += 1;
                EntryKind::Dir
            } else if ft.is_file() {
                files += 1;
                let mut img = ImageState::new(&mut session, ImageKind::Other, None, md.len());
                let mut f = fs::File::open(&full).ctx("open", &full)?;
                let mut off = 0u64;
                loop {
                    let n = read_full(&mut f, &mut buf, READ_CHUNK).ctx("read", &full)?;
                    if n == 0 || off + n as u64 > md.len() {
                        break;
                    }
                    img.write(&mut session, off, &buf[..n])?;
                    off += n as u64;
                }
                if off != md.len() {
                    return Err(StoreError::Invalid(format!(
                        "{} changed size while being stored; retry when it is quiet",
                        full.display()
                    )));
                }
                images.push((i, img));
                EntryKind::Dir // replaced after flush
            } else if ft.is_symlink() {
                others += 1;
                EntryKind::Symlink(fs::read_link(&full).ctx("read link", &full)?.as_os_str().as_bytes().to_vec())
            } else {
                others += 1;
                EntryKind::Special(md.rdev())
            };
            entries.push(TreeEntry {
                path: rel.as_os_str().as_bytes().to_vec(),
                mode: md.mode(),
                uid: md.uid(),
                gid: md.gid(),
                mtime: (md.mtime(), md.mtime_nsec() as u32),
                xattrs: xattrs_of(&full),
                kind,
            });
        }
        session.flush()?;
        for (i, mut img) in images {
            entries[i].kind = EntryKind::File(img.build(&session)?);
        }
        let tree = Tree { entries };
        let bytes = tree.encode();
        let id = TreeId::of(&bytes);
        let tpath = self.tree_path(&id);
        if !tpath.exists() {
            fsutil::write_atomic(&self.inner.tmp, &tpath, &bytes)?;
        }
        self.blob_cover(tree.manifests())?;
        self.blob_upload(&tpath)?;
        let mut data = PutReport::default();
        merge_reports(&mut data, &session.stats);
        data.size = tree.manifests().map(|m| m.size).sum();
        Ok(TreeReport { id, files, dirs, others, tree_bytes: bytes.len() as u64, data })
    }

    /// Read a tree, verified against its id.
    pub fn tree(&self, id: &TreeId) -> Result<Tree, StoreError> {
        let path = self.tree_path(id);
        let mut from_blob = false;
        let (bytes, location) = match fsutil::read_opt(&path)? {
            Some(b) => (b, path.display().to_string()),
            None => {
                let trash = self.inner.trash.join(format!("{id}.tree"));
                match fsutil::read_opt(&trash)? {
                    Some(b) => (b, trash.display().to_string()),
                    None => {
                        if let Some(t) = self.inner.tree_cache.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
                            return Ok(Tree::clone(t));
                        }
                        from_blob = true;
                        let hex = id.to_hex();
                        match self.kept(KEPT_TREES, &hex, |b| TreeId::of(b) == *id) {
                            Some(b) => (b, format!("{}/blob-trees/{hex}", self.inner.dir.display())),
                            None => {
                                let got = self.blob_get_root(&path, "tree", &hex)?;
                                if TreeId::of(&got.0) == *id {
                                    self.keep(KEPT_TREES, &hex, &got.0);
                                }
                                got
                            }
                        }
                    }
                }
            }
        };
        if TreeId::of(&bytes) != *id {
            return Err(StoreError::Corrupt {
                kind: "tree",
                id: id.to_hex(),
                location,
                detail: "bytes do not hash to the tree id".into(),
            });
        }
        let tree =
            Tree::decode(&bytes).map_err(|e| crate::store::corrupt("tree", id.to_hex(), Path::new(&location), e))?;
        if from_blob {
            // Verified above; a tree is named by its content, so the copy never goes stale.
            self.inner.tree_cache.lock().unwrap_or_else(|p| p.into_inner()).put(*id, Arc::new(tree.clone()));
        }
        Ok(tree)
    }

    /// Restore a tree into `dest` (which must not exist): built in a temp directory beside it, then renamed.
    pub fn get_dir(&self, id: &TreeId, dest: &Path) -> Result<(), StoreError> {
        self.get_dir_except(id, dest, |_| false)
    }

    /// [`Store::get_dir`] without the entries `leave_out` picks (nothing of them is read or written; a left-out
    /// directory's entries must be left out too).
    pub fn get_dir_except(
        &self,
        id: &TreeId,
        dest: &Path,
        leave_out: impl Fn(&TreeEntry) -> bool,
    ) -> Result<(), StoreError> {
        use std::os::unix::ffi::OsStrExt;
        let mut tree = self.tree(id)?;
        tree.entries.retain(|e| !leave_out(e));
        if dest.exists() {
            return Err(StoreError::Invalid(format!("{} exists; restore a tree into a new path", dest.display())));
        }
        self.prefetch(tree.manifests())?;
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let tmp = fsutil::temp_path(parent, ".clade-get-dir");
        fs::create_dir(&tmp).ctx("create", &tmp)?;
        let res = (|| {
            let mut dirs = Vec::new();
            for e in &tree.entries {
                let p = tmp.join(std::ffi::OsStr::from_bytes(&e.path));
                match &e.kind {
                    EntryKind::Dir => {
                        fs::create_dir(&p).ctx("create directory", &p)?;
                        dirs.push((p.clone(), e));
                    }
                    EntryKind::File(m) => {
                        let f = fs::File::create(&p).ctx("create", &p)?;
                        f.set_len(m.size).ctx("set length", &p)?;
                        drop(f);
                        self.write_manifest_into(m, &p)?;
                    }
                    EntryKind::Symlink(t) => {
                        std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(t), &p).ctx("symlink", &p)?
                    }
                    EntryKind::Special(rdev) => {
                        let ft = rustix::fs::FileType::from_raw_mode(e.mode);
                        rustix::fs::mknodat(
                            rustix::fs::CWD,
                            &p,
                            ft,
                            rustix::fs::Mode::from_raw_mode(e.mode & 0o7777),
                            *rdev,
                        )
                        .map_err(|er| StoreError::io("mknod", &p, er.into()))?;
                    }
                }
                if !matches!(e.kind, EntryKind::Dir) {
                    apply_meta(&p, e)?;
                }
            }
            // Directories last, deepest first, so their mtimes stick.
            for (p, e) in dirs.iter().rev() {
                apply_meta(p, e)?;
            }
            fs::rename(&tmp, dest).ctx("rename into place", dest)
        })();
        if res.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        res
    }

    /// Whether every frame of `m` is in a pack file of this host (read without the blob tier). A frame this
    /// process has not seen in any index counts as elsewhere; nothing is fetched or listed.
    pub fn held_here(&self, m: &Manifest) -> bool {
        let idx = self.read_index();
        let mut seen = std::collections::HashSet::new();
        m.frames.iter().all(|f| match idx.frames.get(f) {
            Some(loc) => !seen.insert(loc.pack) || crate::pack::pack_path(&self.inner.packs, &loc.pack).exists(),
            None => false,
        })
    }

    /// The id a manifest would have (files inside trees are not published on their own).
    pub fn manifest_id(m: &Manifest) -> ManifestId {
        m.id()
    }
}

fn apply_meta(p: &Path, e: &TreeEntry) -> Result<(), StoreError> {
    let is_link = matches!(e.kind, EntryKind::Symlink(_));
    // Ownership first (chown clears setuid bits), then mode, xattrs, mtime.
    let _ = std::os::unix::fs::lchown(p, Some(e.uid), Some(e.gid));
    if !is_link {
        fs::set_permissions(p, fs::Permissions::from_mode(e.mode & 0o7777)).ctx("chmod", p)?;
    }
    for (k, v) in &e.xattrs {
        let _ = rustix::fs::lsetxattr(p, k.as_slice(), v, rustix::fs::XattrFlags::empty());
    }
    let ts = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec { tv_sec: e.mtime.0, tv_nsec: e.mtime.1 as _ },
        last_modification: rustix::fs::Timespec { tv_sec: e.mtime.0, tv_nsec: e.mtime.1 as _ },
    };
    let _ = rustix::fs::utimensat(rustix::fs::CWD, p, &ts, rustix::fs::AtFlags::SYMLINK_NOFOLLOW);
    Ok(())
}

/// Read until `buf` holds `want` bytes or the file ends.
pub(crate) fn read_full(f: &mut fs::File, buf: &mut Vec<u8>, want: usize) -> std::io::Result<usize> {
    use std::io::Read;
    buf.resize(want, 0);
    let mut got = 0;
    while got < want {
        match f.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
