//! The store adapter: a manifest as an export's base ([`StoreSource`]) and snapshots written as
//! new manifests derived from the base ([`StoreSnapshotter`]).
//!
//! Reads go through the store's shared frame cache, so two exports of one base (or of two
//! manifests sharing frames) decode each frame once; zero ranges of a manifest are filled without
//! any I/O. A snapshot writes only the overlay's blocks into `Store::derive(Some(base))`, so its
//! cost follows the dirty data, not the disk size.

use std::io;
use std::sync::Arc;

use clade_store::{ImageKind, ImageReader, ManifestId, Store, StoreError};

use crate::source::{BlockSource, Changes, Extent, Run, SnapshotError, Snapshotter, BLOCK};

/// A stored image as a block source.
#[derive(Clone)]
pub struct StoreSource {
    reader: ImageReader,
    id: String,
}

impl StoreSource {
    /// Opens manifest `id` of `store`.
    pub fn open(store: &Store, id: &ManifestId) -> Result<Self, StoreError> {
        let reader = store.image(id)?;
        Ok(StoreSource { reader, id: id.to_hex() })
    }

    /// The manifest id.
    pub fn manifest_id(&self) -> &ManifestId {
        self.reader.id()
    }
}

impl BlockSource for StoreSource {
    fn size(&self) -> u64 {
        self.reader.size()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        // The store names the object that failed its hash; keep that in the message for the log.
        self.reader.read_at(offset, buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
    }

    fn extents(&self, offset: u64, len: u64) -> Vec<Extent> {
        let end = offset.saturating_add(len).min(self.size());
        let xs = &self.reader.manifest().extents;
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |offset: u64, len: u64, zero: bool| match out.last_mut() {
            Some(l) if l.zero == zero && l.offset + l.len == offset => l.len += len,
            _ => out.push(Extent { offset, len, zero }),
        };
        let mut pos = offset;
        let first = xs.partition_point(|x| x.end() <= offset);
        for x in &xs[first..] {
            if x.offset >= end {
                break;
            }
            if x.offset > pos {
                push(pos, x.offset - pos, true);
                pos = x.offset;
            }
            let e = x.end().min(end);
            push(pos, e - pos, false);
            pos = e;
        }
        if pos < end {
            push(pos, end - pos, true);
        }
        out
    }

    fn id(&self) -> String {
        self.id.clone()
    }
}

/// An export of manifest `id` whose snapshots go back into `store` (writable unless `read_only`).
pub fn store_export(store: &Store, id: &ManifestId, read_only: bool) -> Result<crate::Export, StoreError> {
    let base = StoreSource::open(store, id)?;
    Ok(crate::Export::new(Arc::new(base), read_only, Some(Arc::new(StoreSnapshotter::new(store.clone())))))
}

/// Writes snapshots into a store as manifests derived from the export's base.
#[derive(Clone)]
pub struct StoreSnapshotter {
    store: Store,
}

impl StoreSnapshotter {
    /// Snapshots into `store`.
    pub fn new(store: Store) -> Self {
        StoreSnapshotter { store }
    }
}

fn store_err(e: StoreError) -> SnapshotError {
    SnapshotError::Store(e.to_string())
}

impl Snapshotter for StoreSnapshotter {
    fn snapshot(
        &self,
        base: &Arc<dyn BlockSource>,
        changes: &Changes<'_>,
    ) -> Result<Arc<dyn BlockSource>, SnapshotError> {
        let base_id: ManifestId = base.id().parse().map_err(|_| {
            SnapshotError::Store(format!("base {} is not a store manifest: serve a manifest to snapshot", base.id()))
        })?;
        let size = base.size();
        let mut b = self.store.derive(Some(&base_id), size).map_err(store_err)?.kind(ImageKind::Disk);
        let mut buf = Vec::with_capacity(256 * BLOCK);
        for run in changes.runs(256) {
            match run {
                Run::Data { offset, blocks } => {
                    buf.clear();
                    for blk in blocks {
                        buf.extend_from_slice(blk);
                    }
                    // The last block of an image whose size is not a multiple of 4 KiB is short.
                    let n = ((size - offset) as usize).min(buf.len());
                    b.write(offset, &buf[..n]).map_err(store_err)?;
                }
                Run::Zero { offset, len } => b.zero(offset, len.min(size - offset)).map_err(store_err)?,
            }
        }
        let report = b.finish().map_err(store_err)?;
        let id = report.id.ok_or_else(|| SnapshotError::Store("the store published no manifest".into()))?;
        Ok(Arc::new(StoreSource::open(&self.store, &id).map_err(store_err)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Export;

    fn store() -> (tempfile::TempDir, Store) {
        let d = tempfile::tempdir().unwrap();
        let s = Store::open(&d.path().join("store"), clade_store::StoreConfig::default()).unwrap();
        (d, s)
    }

    #[test]
    fn snapshot_writes_only_dirty_blocks_and_reads_back() {
        let (_d, s) = store();
        let mut img = vec![0u8; 64 * BLOCK];
        for (i, b) in img.iter_mut().enumerate().take(16 * BLOCK) {
            *b = (i % 251) as u8 + 1;
        }
        let put = s.put_bytes(&img, ImageKind::Disk).unwrap();
        let base = StoreSource::open(&s, &put.id.unwrap()).unwrap();
        assert_eq!(
            base.extents(0, 64 * BLOCK as u64),
            vec![
                Extent { offset: 0, len: 16 * BLOCK as u64, zero: false },
                Extent { offset: 16 * BLOCK as u64, len: 48 * BLOCK as u64, zero: true }
            ]
        );
        let e = Export::new(Arc::new(base), false, Some(Arc::new(StoreSnapshotter::new(s.clone()))));
        e.write(40 * BLOCK as u64 + 7, b"hello").unwrap();
        e.write_zeroes(0, BLOCK as u64).unwrap();
        let id = e.snapshot().unwrap();
        let snap = s.image(&id.parse().unwrap()).unwrap();
        let mut got = vec![0u8; 64 * BLOCK];
        snap.read_at(0, &mut got).unwrap();
        img[..BLOCK].fill(0);
        img[40 * BLOCK + 7..40 * BLOCK + 12].copy_from_slice(b"hello");
        assert!(got == img);
        // Only the one written block is new data.
        assert_eq!(e.stats().dirty_blocks, 0);
        let mut r = vec![0u8; 5];
        e.read(40 * BLOCK as u64 + 7, &mut r).unwrap();
        assert_eq!(&r, b"hello");
    }
}
