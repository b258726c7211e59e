//! What an export reads from and snapshots into, as two small traits.
//!
//! The server does not depend on how images are stored: a [`BlockSource`] is an immutable image
//! (a store manifest, a raw file, a buffer in memory) and a [`Snapshotter`] turns a base plus the
//! blocks an export changed into a new immutable image. The store adapter lives in `store.rs`;
//! [`MemSource`], [`FileSource`] and [`MemSnapshotter`] serve tests, benches and raw-file exports.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Granularity of dirty tracking and of snapshots.
pub const BLOCK: usize = 4096;
/// [`BLOCK`] as a u64, for offset arithmetic.
pub const BLOCK_U64: u64 = BLOCK as u64;

/// A run of an image that is either all data or known to read as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub zero: bool,
}

/// An immutable image an export reads unwritten blocks from.
pub trait BlockSource: Send + Sync + 'static {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; the range is within `size()`. An error means EIO for that read.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Extents covering `[offset, offset + len)`, in order. The default reports all data.
    fn extents(&self, offset: u64, len: u64) -> Vec<Extent> {
        vec![Extent { offset, len, zero: false }]
    }
    /// A stable name for this image (a manifest id), shown to control clients and in logs.
    fn id(&self) -> String;
}

/// What an export changed since its base, one entry per 4 KiB block.
#[derive(Debug, Clone, Copy)]
pub enum Change<'a> {
    /// The block's new contents.
    Data(&'a [u8; BLOCK]),
    /// The block now reads as zeros (WRITE_ZEROES or TRIM over the whole block).
    Zero,
}

/// The changed blocks of an export, sorted by block index.
pub struct Changes<'a> {
    pub blocks: Vec<(u64, Change<'a>)>,
}

/// A contiguous run of changed blocks, as a [`Snapshotter`] would like to write it.
#[derive(Debug)]
pub enum Run<'a> {
    /// Data blocks starting at `offset`, in order.
    Data { offset: u64, blocks: Vec<&'a [u8; BLOCK]> },
    /// `len` bytes of zeros at `offset`.
    Zero { offset: u64, len: u64 },
}

impl<'a> Changes<'a> {
    /// Number of changed blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    /// True when nothing changed.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
    /// Coalesces adjacent blocks of the same kind into runs of at most `max_blocks` data blocks.
    pub fn runs(&self, max_blocks: usize) -> Vec<Run<'a>> {
        let mut out: Vec<Run<'a>> = Vec::new();
        let mut next_idx = u64::MAX;
        for &(idx, change) in &self.blocks {
            let contiguous = idx == next_idx;
            next_idx = idx + 1;
            match (change, out.last_mut()) {
                (Change::Data(d), Some(Run::Data { blocks, .. })) if contiguous && blocks.len() < max_blocks.max(1) => {
                    blocks.push(d)
                }
                (Change::Zero, Some(Run::Zero { len, .. })) if contiguous => *len += BLOCK_U64,
                (Change::Data(d), _) => out.push(Run::Data { offset: idx * BLOCK_U64, blocks: vec![d] }),
                (Change::Zero, _) => out.push(Run::Zero { offset: idx * BLOCK_U64, len: BLOCK_U64 }),
            }
        }
        out
    }
}

/// Why a snapshot failed; the export keeps its overlay and can try again.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("reading the base image failed while snapshotting: {0}")]
    Io(#[from] io::Error),
    #[error("the store refused the snapshot: {0}")]
    Store(String),
}

/// Turns a base and an export's changes into a new complete image.
pub trait Snapshotter: Send + Sync + 'static {
    /// Writes only the changed blocks as new data; everything else is shared with `base`.
    fn snapshot(
        &self,
        base: &Arc<dyn BlockSource>,
        changes: &Changes<'_>,
    ) -> Result<Arc<dyn BlockSource>, SnapshotError>;
}

/// An image held in memory, for tests.
pub struct MemSource {
    id: String,
    data: Vec<u8>,
}

impl MemSource {
    /// Wraps `data` (its length is the image size) under the name `id`.
    pub fn new(id: impl Into<String>, data: Vec<u8>) -> Self {
        MemSource { id: id.into(), data }
    }
    /// The image's bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
}

fn slice_range(size: u64, offset: u64, len: usize) -> io::Result<(usize, usize)> {
    let end = offset.checked_add(len as u64).filter(|&e| e <= size);
    match end {
        Some(end) => Ok((offset as usize, end as usize)),
        None => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end of the image")),
    }
}

impl BlockSource for MemSource {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let (a, b) = slice_range(self.size(), offset, buf.len())?;
        buf.copy_from_slice(&self.data[a..b]);
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        let end = offset.saturating_add(len).min(self.size());
        let mut at = offset;
        while at < end {
            let next = ((at / BLOCK_U64 + 1) * BLOCK_U64).min(end);
            let zero = self.data[at as usize..next as usize].iter().all(|&b| b == 0);
            match out.last_mut() {
                Some(e) if e.zero == zero => e.len += next - at,
                _ => out.push(Extent { offset: at, len: next - at, zero }),
            }
            at = next;
        }
        out
    }
    fn id(&self) -> String {
        self.id.clone()
    }
}

/// A raw image file, read with `pread`; for benches and for serving a file without a store.
pub struct FileSource {
    id: String,
    file: File,
    size: u64,
}

impl FileSource {
    /// Opens `path` read-only; the export never writes to it.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        let size = file.metadata()?.len();
        Ok(FileSource { id: path.display().to_string(), file, size })
    }
}

impl BlockSource for FileSource {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        slice_range(self.size, offset, buf.len())?;
        self.file.read_exact_at(buf, offset)
    }
    fn id(&self) -> String {
        self.id.clone()
    }
}

/// Snapshots into new [`MemSource`]s named `mem-1`, `mem-2`, ...: a full copy, for tests only.
#[derive(Default)]
pub struct MemSnapshotter {
    counter: AtomicU64,
}

impl Snapshotter for MemSnapshotter {
    fn snapshot(
        &self,
        base: &Arc<dyn BlockSource>,
        changes: &Changes<'_>,
    ) -> Result<Arc<dyn BlockSource>, SnapshotError> {
        let size = base.size();
        let mut data = vec![0u8; size as usize];
        base.read_at(0, &mut data)?;
        for &(idx, change) in &changes.blocks {
            let at = (idx * BLOCK_U64) as usize;
            let end = (at + BLOCK).min(data.len());
            match change {
                Change::Data(d) => data[at..end].copy_from_slice(&d[..end - at]),
                Change::Zero => data[at..end].fill(0),
            }
        }
        let n = self.counter.fetch_add(1, Ordering::Relaxed) + 1;
        Ok(Arc::new(MemSource::new(format!("mem-{n}"), data)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_coalesce_adjacent_blocks() {
        let a = [1u8; BLOCK];
        let b = [2u8; BLOCK];
        let c = Changes {
            blocks: vec![
                (0, Change::Data(&a)),
                (1, Change::Data(&b)),
                (2, Change::Zero),
                (3, Change::Zero),
                (7, Change::Data(&a)),
            ],
        };
        let runs = c.runs(16);
        assert_eq!(runs.len(), 3);
        assert!(matches!(&runs[0], Run::Data { offset: 0, blocks } if blocks.len() == 2));
        assert!(matches!(&runs[1], Run::Zero { offset: 8192, len: 8192 }));
        assert!(matches!(&runs[2], Run::Data { offset: 28672, blocks } if blocks.len() == 1));
        assert_eq!(c.runs(1).len(), 4);
    }

    #[test]
    fn mem_extents_find_zero_blocks() {
        let mut d = vec![0u8; 4 * BLOCK];
        d[BLOCK + 5] = 1;
        let m = MemSource::new("m", d);
        let e = m.extents(0, 4 * BLOCK_U64);
        assert_eq!(
            e,
            vec![
                Extent { offset: 0, len: BLOCK_U64, zero: true },
                Extent { offset: BLOCK_U64, len: BLOCK_U64, zero: false },
                Extent { offset: 2 * BLOCK_U64, len: 2 * BLOCK_U64, zero: true },
            ]
        );
        let mut buf = [9u8; 4];
        assert!(m.read_at(4 * BLOCK_U64 - 2, &mut buf).is_err());
    }
}
