//! Content-addressed chunk store: every mark clade takes (guest memory, disks, CRIU image directories) lives
//! here, and every restore reads from here. It knows nothing of QEMU or CRIU.
//!
//! Images are cut into 4 KiB blocks, the unit of change of both guest memory and disks. Each non-zero block
//! is an object named by the BLAKE3 of its bytes and stored once, whatever image it came from. New blocks are
//! packed in image order into frames of up to 1 MiB (the unit of compression and of reading), frames into
//! packs of ~32 MiB (the unit of files). A manifest maps an image's byte ranges to frames, collapsing runs
//! into extents, so it is complete (no parent chain) yet small. See `docs/store.md` for the design and the
//! measurements behind it.
//!
//! The API is synchronous. From async code call it through `spawn_blocking`: on a runtime worker thread it
//! blocks that worker (the blob tier's calls then wait on a plain thread of their own, docs/store.md).

// `unsafe` only in map.rs (read-only maps of immutable packs), documented there.
#![deny(unsafe_code)]

mod blob;
mod blobcheck;
mod blobgc;
mod codec;
mod error;
mod fileput;
mod fsutil;
mod hash;
mod hostlease;
mod ids;
mod index;
mod kept;
mod lease;
mod maint;
mod manifest;
#[allow(unsafe_code)]
mod map;
mod pack;
mod prefetch;
mod push;
mod reader;
mod statcache;
mod store;
pub mod testkit;
mod tree;
#[allow(unsafe_code)]
mod trim;
mod writer;

pub use blob::BlobConfig;
pub use blobcheck::BlobCheckReport;
pub use blobgc::BlobGcReport;
pub use error::StoreError;
pub use hostlease::HostLease;
pub use ids::{FrameId, ManifestId, ObjectId, PackId, TreeId};
pub use lease::{Lease, Root};
pub use maint::{FsckReport, GcReport, StoreStats};
pub use manifest::{Extent, ImageKind, Manifest};
pub use push::{PackedPush, PushReport};
pub use reader::{ImageExtent, ImageReader};
pub use store::{Store, StoreConfig};
pub use tree::{EntryKind, Tree, TreeEntry, TreeReport};
pub use writer::{ManifestBuilder, PutReport};

use std::path::Path;

/// The block size: unit of dedup, of change tracking and of manifest addressing.
pub const BLOCK: usize = 4096;

/// Bytes per `ManifestBuilder::write` when storing a buffer.
const PUT_CHUNK: usize = 8 << 20;

impl Store {
    /// Store a file as an image of `kind`; returns the published manifest and what was new.
    ///
    /// Like git and restic, a file stored before whose path, device, inode, size, mtime and ctime are all
    /// unchanged is not read again (its manifest is reused). A file written through a shared `mmap` on
    /// tmpfs may not get a new mtime: store such files with [`Store::put_file_rehash`].
    pub fn put_file(&self, path: &Path, kind: ImageKind) -> Result<PutReport, StoreError> {
        if let Some(r) = statcache::lookup(self, path, kind)? {
            return Ok(r);
        }
        self.put_file_rehash(path, kind)
    }

    /// Store a file, always reading and hashing all of it (its holes excepted: they are zeros).
    pub fn put_file_rehash(&self, path: &Path, kind: ImageKind) -> Result<PutReport, StoreError> {
        use error::IoCtx;
        let start = std::time::SystemTime::now();
        let f = std::fs::File::open(path).ctx("open", path)?;
        let md = f.metadata().ctx("stat", path)?;
        let r = fileput::put(self, &f, path, md.len(), kind)?;
        if let Some(id) = &r.id {
            statcache::record(self, path, kind, &md, start, id);
        }
        Ok(r)
    }

    /// Store bytes as an image of `kind`.
    pub fn put_bytes(&self, data: &[u8], kind: ImageKind) -> Result<PutReport, StoreError> {
        let mut b = self.derive(None, data.len() as u64)?.kind(kind);
        for (i, chunk) in data.chunks(PUT_CHUNK).enumerate() {
            b.write((i * PUT_CHUNK) as u64, chunk)?;
        }
        b.finish()
    }

    /// Start a new complete manifest of `size` bytes: `base`'s content (or zeros), then the blocks you
    /// write or zero over it. For an NBD snapshot or a VM's diverged pages: write only what changed.
    pub fn derive(&self, base: Option<&ManifestId>, size: u64) -> Result<ManifestBuilder, StoreError> {
        ManifestBuilder::new(self, base, size)
    }
}
