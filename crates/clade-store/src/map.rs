//! Read-only memory maps of published packs, so a restore verifies and writes frames straight from the page
//! cache instead of copying them into a buffer first (`get_file`: one copy of the data less).
//!
//! This is the crate's only `unsafe`. It is confined to packs because they are immutable once published:
//! written to `tmp/`, fsynced, renamed into place, and never modified in place afterwards (gc removes a pack
//! by unlinking it, which leaves existing maps valid). A map is only made of a local pack file, its length
//! is checked against the frame being read, and every block is still verified against its object id before
//! it is used. Input files given to `put` are *not* mapped: another process may truncate or rewrite them
//! while they are stored (a truncated map faults with SIGBUS), so they are read with `read(2)` into private
//! buffers and hashed there.

use std::path::Path;

use crate::error::IoCtx;
use crate::StoreError;

/// A read-only map of a whole pack file (`None` for an empty file: nothing to map, every read is short).
pub(crate) struct PackMap {
    map: Option<memmap2::Mmap>,
}

impl PackMap {
    /// Map `path` (a published pack), or `None` if it is not in the local tier.
    pub fn open(path: &Path) -> Result<Option<PackMap>, StoreError> {
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::io("open pack", path, e)),
        };
        let len = f.metadata().ctx("stat pack", path)?.len();
        if len == 0 {
            return Ok(Some(PackMap { map: None }));
        }
        let len = usize::try_from(len).map_err(|_| StoreError::Invalid(format!("{} is too large", path.display())))?;
        // SAFETY: the file is a published pack, which nothing in clade modifies or truncates (see the module
        // docs); its length was read just now and every access is bounds-checked by `get`.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(&f) }.ctx("map pack", path)?;
        Ok(Some(PackMap { map: Some(map) }))
    }

    /// The stored bytes at `offset..offset + len`, or `None` if the pack is shorter (truncated).
    pub fn get(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let start = usize::try_from(offset).ok()?;
        self.map.as_ref()?.get(start..start.checked_add(len)?)
    }
}
