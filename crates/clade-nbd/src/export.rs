//! An export: an immutable base image plus a private, sparse overlay of written 4 KiB blocks.
//!
//! Why this shape: siblings forked from one mark share the base (and so every cached store
//! object), while each one's writes stay private and cost memory only for the blocks touched. A
//! snapshot hands the base and the overlay's blocks to a [`Snapshotter`], which writes only those
//! blocks as new data; the export then continues on the new image with an empty overlay.
//!
//! Locking: every request holds a shared guard on the (base, overlay) pair for its whole duration
//! and the overlay has its own sharded mutexes, so requests run in parallel; a snapshot takes the
//! exclusive guard, which waits for requests in flight and holds back new ones until it is done.
//! All methods are blocking (the base may read from disk): call them from `spawn_blocking`.
//!
//! Two-phase snapshots: [`Export::freeze`] takes the exclusive guard only to move the overlay aside
//! as a read-only *frozen* layer between the new, empty overlay and the base (O(1): no block is
//! copied), so a paused guest can continue at once; [`Export::commit`] then writes the frozen layer
//! through the snapshotter without holding the guard (requests go on, reading overlay, frozen layer,
//! base) and swaps the new image in as the base. Reads through (frozen, old base) and through the new
//! base are equal, so the swap is invisible to the guest.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use parking_lot::{Mutex, MutexGuard};

use crate::source::{BlockSource, Change, Changes, Extent, SnapshotError, Snapshotter, BLOCK, BLOCK_U64};

const SHARDS: usize = 64;

/// What an export's request failed with; maps to an NBD errno.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("range {offset}+{len} is beyond the export size {size}")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("the export is read-only")]
    ReadOnly,
    #[error("reading the base image {base} at {offset}: {error}")]
    Io { base: String, offset: u64, error: io::Error },
    #[error("this export has no snapshotter: serve it from a store to snapshot")]
    NoSnapshotter,
    #[error("snapshot failed (the overlay is kept, retry is safe): {0}")]
    Snapshot(#[from] SnapshotError),
}

impl ExportError {
    /// The errno the protocol carries for this error; `write` selects ENOSPC for ranges past the end.
    pub fn errno(&self, write: bool) -> u32 {
        use crate::proto::*;
        match self {
            ExportError::OutOfRange { .. } if write => ENOSPC,
            ExportError::OutOfRange { .. } => EINVAL,
            ExportError::ReadOnly => EPERM,
            ExportError::Io { .. } | ExportError::Snapshot(_) => EIO,
            ExportError::NoSnapshotter => ENOTSUP,
        }
    }
}

enum Block {
    Data(Box<[u8; BLOCK]>),
    Zero,
}

/// Changed blocks, sharded by runs of 16 blocks so sequential I/O takes few distinct locks.
struct Overlay {
    shards: Vec<Mutex<HashMap<u64, Block>>>,
    count: AtomicUsize,
}

impl Overlay {
    fn new() -> Self {
        Overlay { shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(), count: AtomicUsize::new(0) }
    }
    fn shard(&self, idx: u64) -> MutexGuard<'_, HashMap<u64, Block>> {
        self.shards[((idx >> 4) as usize) % SHARDS].lock()
    }
    fn set(&self, idx: u64, block: Block) {
        if self.shard(idx).insert(idx, block).is_none() {
            self.count.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn is_empty(&self) -> bool {
        self.count.load(Ordering::Relaxed) == 0
    }
}

struct State {
    base: Arc<dyn BlockSource>,
    /// A frozen overlay waiting for [`Export::commit`]: read-only, between `overlay` and `base`.
    frozen: Option<Arc<Overlay>>,
    overlay: Overlay,
}

impl State {
    /// Copies block `idx`'s bytes `within..within + dst.len()` from the frozen layer when it has the
    /// block; false when it does not.
    fn frozen_read(&self, idx: u64, within: usize, dst: &mut [u8]) -> bool {
        let Some(f) = &self.frozen else { return false };
        let shard = f.shard(idx);
        match shard.get(&idx) {
            Some(Block::Data(d)) => dst.copy_from_slice(&d[within..within + dst.len()]),
            Some(Block::Zero) => dst.fill(0),
            None => return false,
        }
        true
    }

    /// Whether the frozen layer has block `idx`, and whether it is a zero block.
    fn frozen_kind(&self, idx: u64) -> Option<bool> {
        let f = self.frozen.as_ref()?;
        let shard = f.shard(idx);
        shard.get(&idx).map(|b| matches!(b, Block::Zero))
    }

    /// No overlay and no frozen layer: everything reads from the base.
    fn only_base(&self) -> bool {
        self.overlay.is_empty() && self.frozen.as_ref().is_none_or(|f| f.is_empty())
    }
}

/// Counters of one export, for the control socket and logs.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ExportStats {
    pub base: String,
    pub size: u64,
    pub dirty_blocks: usize,
}

/// A copy-on-write block device over an immutable base image.
pub struct Export {
    size: u64,
    read_only: bool,
    state: RwLock<State>,
    snapshotter: Option<Arc<dyn Snapshotter>>,
    /// Held by [`Export::commit`] for its whole run, so two commits never write one layer twice.
    committing: Mutex<()>,
}

impl Export {
    /// An export of `base`, writable unless `read_only`; `snapshotter` enables [`Export::snapshot`].
    pub fn new(base: Arc<dyn BlockSource>, read_only: bool, snapshotter: Option<Arc<dyn Snapshotter>>) -> Self {
        Export {
            size: base.size(),
            read_only,
            state: RwLock::new(State { base, frozen: None, overlay: Overlay::new() }),
            snapshotter,
            committing: Mutex::new(()),
        }
    }

    /// Size in bytes; a snapshot never changes it.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether writes are refused.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    fn state(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The current base image (after a snapshot: the snapshot), e.g. to start a sibling export.
    pub fn base(&self) -> Arc<dyn BlockSource> {
        self.state().base.clone()
    }

    /// The id of the current base image and how many blocks the overlay holds (a frozen layer not
    /// yet committed is not counted).
    pub fn stats(&self) -> ExportStats {
        let st = self.state();
        ExportStats { base: st.base.id(), size: self.size, dirty_blocks: st.overlay.count.load(Ordering::Relaxed) }
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ExportError::OutOfRange { offset, len, size: self.size }),
        }
    }

    fn base_read(base: &Arc<dyn BlockSource>, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        base.read_at(offset, buf).map_err(|error| ExportError::Io { base: base.id(), offset, error })
    }

    /// Reads `buf.len()` bytes at `offset`: overlay blocks first, the rest from the base.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.check(offset, buf.len() as u64)?;
        let st = self.state();
        if st.only_base() {
            return Self::base_read(&st.base, offset, buf);
        }
        // Walk block by block, batching consecutive base blocks into one base read.
        let end = offset + buf.len() as u64;
        let mut at = offset;
        let mut pending: Option<u64> = None; // start of a run to read from the base
        while at < end {
            let idx = at / BLOCK_U64;
            let next = ((idx + 1) * BLOCK_U64).min(end);
            let within = (at - idx * BLOCK_U64) as usize;
            let dst = &mut buf[(at - offset) as usize..(next - offset) as usize];
            let hit = {
                let shard = st.overlay.shard(idx);
                match shard.get(&idx) {
                    Some(Block::Data(d)) => {
                        dst.copy_from_slice(&d[within..within + dst.len()]);
                        true
                    }
                    Some(Block::Zero) => {
                        dst.fill(0);
                        true
                    }
                    None => false,
                }
            } || st.frozen_read(idx, within, dst);
            if hit {
                if let Some(start) = pending.take() {
                    Self::base_read(&st.base, start, &mut buf[(start - offset) as usize..(at - offset) as usize])?;
                }
            } else if pending.is_none() {
                pending = Some(at);
            }
            at = next;
        }
        if let Some(start) = pending {
            Self::base_read(&st.base, start, &mut buf[(start - offset) as usize..])?;
        }
        Ok(())
    }

    /// Applies `f` to block `idx`'s current contents (read-modify-write for partial blocks).
    fn modify(st: &State, idx: u64, f: impl FnOnce(&mut [u8; BLOCK])) -> Result<(), ExportError> {
        {
            let mut shard = st.overlay.shard(idx);
            match shard.get_mut(&idx) {
                Some(Block::Data(d)) => {
                    f(d);
                    return Ok(());
                }
                Some(slot @ Block::Zero) => {
                    let mut d = Box::new([0u8; BLOCK]);
                    f(&mut d);
                    *slot = Block::Data(d);
                    return Ok(());
                }
                None => {}
            }
        }
        // Not in the overlay: read the block from the frozen layer or the base without holding the
        // shard lock. Neither can change under our shared state guard, so re-checking after the read
        // is enough.
        let mut d = Box::new([0u8; BLOCK]);
        let at = idx * BLOCK_U64;
        let n = (st.base.size() - at).min(BLOCK_U64) as usize;
        if !st.frozen_read(idx, 0, &mut d[..n]) {
            Self::base_read(&st.base, at, &mut d[..n])?;
        }
        let mut shard = st.overlay.shard(idx);
        match shard.get_mut(&idx) {
            Some(Block::Data(cur)) => f(cur),
            Some(slot @ Block::Zero) => {
                let mut z = Box::new([0u8; BLOCK]);
                f(&mut z);
                *slot = Block::Data(z);
            }
            None => {
                f(&mut d);
                shard.insert(idx, Block::Data(d));
                st.overlay.count.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset`. Whole blocks are replaced; partial blocks are read-modify-written.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), ExportError> {
        if self.read_only {
            return Err(ExportError::ReadOnly);
        }
        self.check(offset, data.len() as u64)?;
        let st = self.state();
        let end = offset + data.len() as u64;
        let mut at = offset;
        while at < end {
            let idx = at / BLOCK_U64;
            let next = ((idx + 1) * BLOCK_U64).min(end);
            let within = (at - idx * BLOCK_U64) as usize;
            let src = &data[(at - offset) as usize..(next - offset) as usize];
            if src.len() == BLOCK {
                let mut d = Box::new([0u8; BLOCK]);
                d.copy_from_slice(src);
                st.overlay.set(idx, Block::Data(d));
            } else {
                Self::modify(&st, idx, |d| d[within..within + src.len()].copy_from_slice(src))?;
            }
            at = next;
        }
        Ok(())
    }

    /// Makes `[offset, offset + len)` read as zeros. Whole blocks become zero markers (no data is
    /// kept, with or without NO_HOLE, since the overlay never runs out of space); partial blocks
    /// are read-modify-written.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        if self.read_only {
            return Err(ExportError::ReadOnly);
        }
        self.check(offset, len)?;
        let st = self.state();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let idx = at / BLOCK_U64;
            let next = ((idx + 1) * BLOCK_U64).min(end);
            let within = (at - idx * BLOCK_U64) as usize;
            let n = (next - at) as usize;
            if n == BLOCK || (within == 0 && next == self.size) {
                st.overlay.set(idx, Block::Zero);
            } else {
                Self::modify(&st, idx, |d| d[within..within + n].fill(0))?;
            }
            at = next;
        }
        Ok(())
    }

    /// Discards `[offset, offset + len)`: whole blocks become zeros, partial blocks are left alone
    /// (the protocol allows either).
    pub fn trim(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        if self.read_only {
            return Err(ExportError::ReadOnly);
        }
        self.check(offset, len)?;
        let st = self.state();
        let first = offset.div_ceil(BLOCK_U64);
        let end = offset + len;
        let last = if end == self.size { end.div_ceil(BLOCK_U64) } else { end / BLOCK_U64 };
        for idx in first..last {
            st.overlay.set(idx, Block::Zero);
        }
        Ok(())
    }

    /// Allocation map of `[offset, offset + len)` for `base:allocation`: overlay zero blocks and
    /// the base's zero extents are zero, everything else is data. Adjacent runs are merged.
    pub fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError> {
        self.check(offset, len)?;
        let st = self.state();
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |e: Extent| match out.last_mut() {
            Some(last) if last.zero == e.zero && last.offset + last.len == e.offset => last.len += e.len,
            _ => out.push(e),
        };
        if st.only_base() {
            st.base.extents(offset, len).into_iter().for_each(&mut push);
            return Ok(out);
        }
        let end = offset + len;
        let mut at = offset;
        let mut pending: Option<u64> = None;
        while at < end {
            let idx = at / BLOCK_U64;
            let next = ((idx + 1) * BLOCK_U64).min(end);
            let hit = match st.overlay.shard(idx).get(&idx) {
                Some(Block::Data(_)) => Some(false),
                Some(Block::Zero) => Some(true),
                None => st.frozen_kind(idx),
            };
            if let Some(zero) = hit {
                if let Some(start) = pending.take() {
                    st.base.extents(start, at - start).into_iter().for_each(&mut push);
                }
                push(Extent { offset: at, len: next - at, zero });
            } else if pending.is_none() {
                pending = Some(at);
            }
            at = next;
        }
        if let Some(start) = pending {
            st.base.extents(start, end - start).into_iter().for_each(&mut push);
        }
        Ok(out)
    }

    /// Turns the overlay into a new complete image and continues on top of it with an empty
    /// overlay; returns the new image's id. Waits for requests in flight and holds back new ones
    /// while it runs. Take it while the guest is paused or right after a flush.
    pub fn snapshot(&self) -> Result<String, ExportError> {
        self.freeze()?;
        self.commit()
    }

    /// Phase one of a snapshot: moves the overlay aside as a frozen layer (no block is copied) and
    /// starts a new empty overlay, so the guest may write on at once; returns how many blocks were
    /// frozen. Only requests in flight are waited for. A layer still frozen from an earlier call is
    /// committed first. Take it while the guest is paused or right after a flush.
    pub fn freeze(&self) -> Result<usize, ExportError> {
        let snapshotter = self.snapshotter.as_ref().ok_or(ExportError::NoSnapshotter)?;
        let _one = self.committing.lock();
        self.commit_locked(snapshotter)?;
        let mut st = self.state.write().unwrap_or_else(PoisonError::into_inner);
        let overlay = std::mem::replace(&mut st.overlay, Overlay::new());
        let n = overlay.count.load(Ordering::Relaxed);
        st.frozen = Some(Arc::new(overlay));
        Ok(n)
    }

    /// Phase two: writes the frozen layer through the snapshotter while requests go on, then makes
    /// the new image the base and drops the layer; returns the new image's id (the base's id when
    /// nothing is frozen). On failure the layer stays frozen and a retry is safe. Concurrent commits
    /// are serialized.
    pub fn commit(&self) -> Result<String, ExportError> {
        let snapshotter = self.snapshotter.as_ref().ok_or(ExportError::NoSnapshotter)?;
        let _one = self.committing.lock();
        self.commit_locked(snapshotter)
    }

    /// [`Export::commit`] with `committing` held.
    fn commit_locked(&self, snapshotter: &Arc<dyn Snapshotter>) -> Result<String, ExportError> {
        let (base, frozen) = {
            let st = self.state();
            match &st.frozen {
                Some(f) => (st.base.clone(), f.clone()),
                None => return Ok(st.base.id()),
            }
        };
        // The frozen layer is never written again: locking its shards only excludes readers briefly.
        let new_base = {
            let guards: Vec<_> = frozen.shards.iter().map(Mutex::lock).collect();
            let mut blocks: Vec<(u64, Change<'_>)> = Vec::with_capacity(frozen.count.load(Ordering::Relaxed));
            for g in &guards {
                for (&idx, b) in g.iter() {
                    blocks.push((
                        idx,
                        match b {
                            Block::Data(d) => Change::Data(d),
                            Block::Zero => Change::Zero,
                        },
                    ));
                }
            }
            blocks.sort_unstable_by_key(|&(idx, _)| idx);
            snapshotter.snapshot(&base, &Changes { blocks })?
        };
        let mut st = self.state.write().unwrap_or_else(PoisonError::into_inner);
        let id = new_base.id();
        st.base = new_base;
        st.frozen = None;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{MemSnapshotter, MemSource};

    fn export(data: Vec<u8>) -> Export {
        Export::new(Arc::new(MemSource::new("m", data)), false, Some(Arc::new(MemSnapshotter::default())))
    }

    #[test]
    fn concurrent_partial_writes_to_one_block_all_land() {
        let e = Arc::new(export(vec![7u8; 2 * BLOCK]));
        let threads: Vec<_> = (0..8u8)
            .map(|t| {
                let e = e.clone();
                std::thread::spawn(move || {
                    for i in 0..64u64 {
                        let at = u64::from(t) * 512 + i * 8;
                        e.write(at, &[t + 1; 8]).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let mut buf = vec![0u8; 2 * BLOCK];
        e.read(0, &mut buf).unwrap();
        for t in 0..8usize {
            assert!(buf[t * 512..(t + 1) * 512].iter().all(|&b| b == t as u8 + 1), "writer {t} lost bytes");
        }
        assert!(buf[BLOCK..].iter().all(|&b| b == 7));
        assert_eq!(e.stats().dirty_blocks, 1);
    }

    #[test]
    fn zeroes_trim_and_extents() {
        let e = export(vec![1u8; 4 * BLOCK + 100]);
        e.write_zeroes(10, 20).unwrap(); // partial: read-modify-write
        e.write_zeroes(BLOCK_U64, BLOCK_U64).unwrap(); // whole block: a marker
        e.trim(2 * BLOCK_U64 + 1, BLOCK_U64).unwrap(); // covers no whole block: ignored
        e.trim(4 * BLOCK_U64, 100).unwrap(); // the short last block, to the end: zero
        let mut buf = vec![9u8; 4 * BLOCK + 100];
        e.read(0, &mut buf).unwrap();
        assert!(buf[..10].iter().all(|&b| b == 1) && buf[10..30].iter().all(|&b| b == 0));
        assert!(buf[BLOCK..2 * BLOCK].iter().all(|&b| b == 0));
        assert!(buf[2 * BLOCK..4 * BLOCK].iter().all(|&b| b == 1));
        assert!(buf[4 * BLOCK..].iter().all(|&b| b == 0));
        let x = e.extents(0, 4 * BLOCK_U64 + 100).unwrap();
        assert_eq!(
            x,
            vec![
                Extent { offset: 0, len: BLOCK_U64, zero: false },
                Extent { offset: BLOCK_U64, len: BLOCK_U64, zero: true },
                Extent { offset: 2 * BLOCK_U64, len: 2 * BLOCK_U64, zero: false },
                Extent { offset: 4 * BLOCK_U64, len: 100, zero: true },
            ]
        );
        assert!(matches!(e.read(4 * BLOCK_U64, &mut [0u8; 101]), Err(ExportError::OutOfRange { .. })));
        assert_eq!(e.write(u64::MAX, &[1]).unwrap_err().errno(true), crate::proto::ENOSPC);
    }

    #[test]
    fn snapshot_folds_overlay_into_new_base() {
        let e = export(vec![3u8; 3 * BLOCK]);
        e.write(BLOCK_U64 + 1, b"ab").unwrap();
        e.write_zeroes(2 * BLOCK_U64, BLOCK_U64).unwrap();
        assert_eq!(e.snapshot().unwrap(), "mem-1");
        assert_eq!(e.stats().dirty_blocks, 0);
        let mut buf = vec![0u8; 3 * BLOCK];
        e.base().read_at(0, &mut buf).unwrap();
        assert_eq!(&buf[BLOCK..BLOCK + 3], &[3, b'a', b'b']);
        assert!(buf[2 * BLOCK..].iter().all(|&b| b == 0));
        let ro = Export::new(e.base(), true, None);
        assert!(matches!(ro.write(0, &[1]), Err(ExportError::ReadOnly)));
        assert!(matches!(ro.snapshot(), Err(ExportError::NoSnapshotter)));
    }

    #[test]
    fn freeze_lets_writes_go_on_and_commit_stores_only_the_frozen_blocks() {
        let e = export(vec![5u8; 4 * BLOCK]);
        e.write(0, &[1u8; BLOCK]).unwrap();
        e.write_zeroes(BLOCK_U64, BLOCK_U64).unwrap();
        assert_eq!(e.freeze().unwrap(), 2);
        assert_eq!(e.stats().dirty_blocks, 0);
        // Written while frozen: a partial write over a frozen block merges with the frozen bytes,
        // a partial write over a frozen zero block with zeros.
        e.write(10, b"xy").unwrap();
        e.write(BLOCK_U64 + 3, b"z").unwrap();
        e.write(3 * BLOCK_U64, &[7u8; BLOCK]).unwrap();
        let mut buf = vec![0u8; 4 * BLOCK];
        e.read(0, &mut buf).unwrap();
        assert_eq!(&buf[..12], &[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, b'x', b'y']);
        assert!(buf[BLOCK..BLOCK + 3].iter().all(|&b| b == 0) && buf[BLOCK + 3] == b'z');
        assert!(buf[2 * BLOCK..3 * BLOCK].iter().all(|&b| b == 5));
        assert!(buf[3 * BLOCK..].iter().all(|&b| b == 7));
        let x = e.extents(0, 4 * BLOCK_U64).unwrap();
        assert!(x.iter().all(|x| !x.zero), "{x:?}");
        // The committed image holds the frozen state, not what came after.
        let id = e.commit().unwrap();
        assert_eq!(id, "mem-1");
        let mut snap = vec![0u8; 4 * BLOCK];
        e.base().read_at(0, &mut snap).unwrap();
        assert!(snap[..BLOCK].iter().all(|&b| b == 1));
        assert!(snap[BLOCK..2 * BLOCK].iter().all(|&b| b == 0));
        assert!(snap[3 * BLOCK..].iter().all(|&b| b == 5));
        // The guest's view did not change with the swap.
        let mut after = vec![0u8; 4 * BLOCK];
        e.read(0, &mut after).unwrap();
        assert!(after == buf);
        assert_eq!(e.stats().dirty_blocks, 3);
        // Nothing frozen: commit is a no-op returning the base. A freeze over a layer still frozen commits
        // that one first (mem-2), then the snapshot stores the rest (mem-3).
        assert_eq!(e.commit().unwrap(), "mem-1");
        e.freeze().unwrap();
        assert_eq!(e.snapshot().unwrap(), "mem-3");
        let mut last = vec![0u8; 4 * BLOCK];
        e.base().read_at(0, &mut last).unwrap();
        assert!(last == buf);
    }

    #[test]
    fn concurrent_writes_during_commit_are_kept() {
        let e = Arc::new(export(vec![0u8; 64 * BLOCK]));
        for i in 0..32u64 {
            e.write(i * BLOCK_U64, &[1u8; BLOCK]).unwrap();
        }
        e.freeze().unwrap();
        let w = {
            let e = e.clone();
            std::thread::spawn(move || {
                for i in 0..64u64 {
                    e.write(i * BLOCK_U64 + 100, &[2u8; 8]).unwrap();
                }
            })
        };
        e.commit().unwrap();
        w.join().unwrap();
        let mut buf = vec![0u8; 64 * BLOCK];
        e.read(0, &mut buf).unwrap();
        for i in 0..64usize {
            let blk = &buf[i * BLOCK..(i + 1) * BLOCK];
            assert_eq!(&blk[100..108], &[2u8; 8], "block {i}");
            assert_eq!(blk[0], if i < 32 { 1 } else { 0 }, "block {i}");
        }
    }
}
