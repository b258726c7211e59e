//! Store content as files that are fetched as they are read, through FUSE.
//!
//! Why: a sandbox resumed on a host whose caches are cold (suspended on host A, resumed on host B: docs/roam.md)
//! should fetch what its working set touches, not its whole state. Two shapes:
//! - [`LazyFile`]: one image as one read-only file. The `vm` backend maps a mark's root RAM `MAP_PRIVATE`
//!   from it: every page the guest touches first is a page-cache miss that the kernel turns into a FUSE read,
//!   answered from the store (local tier, then the blob tier by frame, through the store's verified LRU frame
//!   cache). Clean pages stay in this file's page cache; written pages become the process's own copies, exactly
//!   as with a tmpfs file, so the backend's marks (pagemap: present and not file-backed = diverged) work
//!   unchanged.
//! - [`LazyTree`]: a stored directory tree as a read-only file system (modes, owners, times, symlinks, special
//!   files, xattrs). The `ct` backend uses it as an overlay lower layer that came from another host (a
//!   template's root file system): only the files the sandbox opens are fetched.
//!
//! A mount lives as long as its handle; dropping it unmounts (lazily: a process still using it keeps what it
//! has). The store and its blob tier know nothing of FUSE: this crate only reads through
//! [`clade_store::ImageReader`].

#![forbid(unsafe_code)]

mod file;
mod tree;

pub use file::LazyFile;
pub use tree::LazyTree;

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;

/// What can go wrong making a lazy file or tree.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("open {what} in the store: {source}")]
    Store { what: String, source: clade_store::StoreError },
    #[error("mount a FUSE file system at {dir}: {source} (is /dev/fuse there? `modprobe fuse`; clade needs root)")]
    Mount { dir: PathBuf, source: std::io::Error },
    #[error("make the mount point {dir}: {source}")]
    Dir { dir: PathBuf, source: std::io::Error },
}

/// Counters of one mount (shared with its FUSE thread).
#[derive(Debug, Default)]
pub struct Counters {
    /// FUSE reads answered, and the bytes they returned.
    pub reads: AtomicU64,
    pub bytes: AtomicU64,
    /// Reads that failed (the reader got EIO).
    pub errors: AtomicU64,
}

/// Unmount (detached) and remove the mount point.
fn unmount(dir: &std::path::Path, session: Option<fuser::BackgroundSession>) {
    // Detach first: a process still using the mount keeps what it has, and the session thread's own unmount
    // then finds nothing to wait for.
    let _ = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH);
    drop(session);
    let _ = std::fs::remove_dir(dir);
}
