//! Storing a file: the put path of guest RAM files, disk images and state files, on every core.
//!
//! Why it is not [`crate::ManifestBuilder`] fed with buffers: that path copies each new block twice in
//! user space (`read` into a buffer, then into the frame being filled) and lets one thread read and hash
//! while another writes, so new data crosses cores and leaves the cache between stages. Here the file is cut
//! into cells of 1 MiB on a fixed grid, and each of N workers takes every N-th cell through all stages
//! itself, while the cell is in its core's L2 cache:
//!
//! 1. `pread` only the cell's *data* ranges (`SEEK_DATA`/`SEEK_HOLE`): holes of a sparse file (untouched
//!    guest RAM on tmpfs) are zeros, which manifests leave implicit, so they are neither read nor hashed;
//! 2. zero-check and hash the blocks (`hash.rs`, 16 blocks per SIMD call);
//! 3. take the cell's turn (a ticket: cells are deduplicated strictly in file order, so frames and the
//!    manifest do not depend on N or on timing) and, under the lock, look each block up in the store's
//!    index and in this put's pending blocks, and append the cell's extents to the manifest;
//! 4. release the lock and append the cell's new blocks as one frame to the worker's own pack, with one
//!    `writev` straight from the read buffer (no copy in user space), or through zstd.
//!
//! The turn is the only point where workers meet. A worker whose turn has not come waits a moment (on an
//! idle machine it comes while the cell is still cached), then reads and hashes its next cells ahead, up to
//! 16 MiB: on a busy host a preempted worker would otherwise stall the others in turn (measured under a load
//! of 12 on 2 cores: without reading ahead the workers spent half the put waiting for each other).
//!
//! A cell with few new blocks (under half a frame: sparse changes, or mostly duplicates) would make a tiny
//! frame, so its new blocks are copied into a shared carry frame instead, closed when full: frames stay near
//! 1 MiB, and the copy only ever touches less than half of a cell.
//!
//! Safety is the [`crate::ManifestBuilder`]'s: blocks are hashed from the private buffer they are written
//! from (the input may change under us: the image is then torn, but every object matches its id); a pack's
//! frames enter the shared index only once the pack is durable; the manifest is published after every
//! worker published its packs. A failed worker stops the others; nothing is published.

use std::fs::File;
use std::io::IoSlice;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Condvar, Mutex};

use crate::ids::{FrameId, ObjectId};
use crate::index::IdMap;
use crate::manifest::{Extent, ImageKind, Manifest};
use crate::pack::{Codec, PackWriter};
use crate::store::Store;
use crate::writer::{publish_manifest, publish_pack, PutReport};
use crate::{StoreError, BLOCK};

/// Blocks per cell: the unit a worker reads, hashes and deduplicates at once (1 MiB, fits in L2).
const CELL_BLOCKS: usize = 256;
const CELL: u64 = (CELL_BLOCKS * BLOCK) as u64;

/// The data (non-hole) ranges of `f` below `size`, widened to 4 KiB blocks. A file system without
/// `SEEK_DATA` reports the whole file as data.
pub(crate) fn data_ranges(f: &File, size: u64) -> Vec<(u64, u64)> {
    use rustix::fs::{seek, SeekFrom};
    let b = BLOCK as u64;
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut off = 0u64;
    while off < size {
        let start = match seek(f, SeekFrom::Data(off)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return vec![(0, size)],
        };
        if start >= size {
            break;
        }
        let end = match seek(f, SeekFrom::Hole(start)) {
            Ok(e) => e.min(size),
            Err(_) => size,
        };
        let (s, e) = (start / b * b, end.div_ceil(b).saturating_mul(b).min(size));
        match out.last_mut() {
            Some(last) if last.1 >= s => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
        off = end.max(start + 1);
    }
    out
}

/// A frame being filled across cells (the carry): its blocks, their ids, its number in the manifest.
#[derive(Default)]
struct Carry {
    buf: Vec<u8>,
    ids: Vec<ObjectId>,
    num: Option<u32>,
}

/// A frame of a cell's own new blocks being built: byte ranges in the cell buffer, ids, frame number.
type OwnFrame = (Vec<(usize, usize)>, Vec<ObjectId>, u32);

/// A closed frame a worker must write.
enum Out {
    /// Blocks of the worker's cell buffer: (byte ranges in the buffer, ids, manifest frame number).
    Own(Vec<(usize, usize)>, Vec<ObjectId>),
    /// A carry frame (its own buffer).
    Carry(Vec<u8>, Vec<ObjectId>),
}

/// The put's shared state, under one lock.
struct State {
    /// The cell (index into the list of cells with data) whose turn it is.
    turn: usize,
    failed: bool,
    frames: Vec<Option<FrameId>>,
    fmap: IdMap<FrameId, u32>,
    pending: IdMap<ObjectId, (u32, u16)>,
    extents: Vec<Extent>,
    carry: Carry,
    bytes_new: u64,
    bytes_dedup: u64,
    new_objects: u64,
    new_frames: u64,
}

impl State {
    fn frame_num(&mut self, fid: FrameId) -> u32 {
        if let Some(n) = self.fmap.get(&fid) {
            return *n;
        }
        let n = self.frames.len() as u32;
        self.frames.push(Some(fid));
        self.fmap.insert(fid, n);
        n
    }

    fn reserve_frame(&mut self) -> u32 {
        self.frames.push(None);
        self.frames.len() as u32 - 1
    }

    fn close_frame(&mut self, n: u32, ids: &[ObjectId]) {
        let fid = FrameId::of_objects(ids);
        self.frames[n as usize] = Some(fid);
        self.fmap.insert(fid, n);
        self.new_frames += 1;
    }

    fn extent(&mut self, offset: u64, len: u32, frame: u32, pos: u16) {
        let foff = pos as u32 * BLOCK as u32;
        if let Some(last) = self.extents.last_mut() {
            if last.frame == frame && last.end() == offset && last.frame_offset + last.len == foff {
                last.len += len;
                return;
            }
        }
        self.extents.push(Extent { offset, len, frame, frame_offset: foff });
    }

    fn close_carry(&mut self, out: &mut Vec<Out>) {
        let c = std::mem::take(&mut self.carry);
        if let Some(n) = c.num {
            self.close_frame(n, &c.ids);
            out.push(Out::Carry(c.buf, c.ids));
        }
    }

    /// Deduplicate one cell (its turn): extents into the manifest, new blocks into frames to write.
    fn dedup(
        &mut self,
        store: &Store,
        start: u64,
        buf: &[u8],
        ids: &[Option<ObjectId>],
        frame_blocks: usize,
    ) -> Vec<Out> {
        let found: Vec<Option<(FrameId, u16)>> = {
            let idx = store.dedup_index();
            ids.iter().map(|h| h.and_then(|h| idx.blocks.get(&h).copied())).collect()
        };
        let candidates = ids
            .iter()
            .zip(&found)
            .filter(|(h, f)| f.is_none() && h.is_some_and(|h| !self.pending.contains_key(&h)))
            .count();
        let own = candidates >= frame_blocks.div_ceil(2);
        let mut out = Vec::new();
        // Own frames of this cell: (block ranges, ids, number).
        let mut cur: Option<OwnFrame> = None;
        for (i, (h, hit)) in ids.iter().zip(found).enumerate() {
            let Some(h) = *h else { continue };
            let (b0, b1) = (i * BLOCK, ((i + 1) * BLOCK).min(buf.len()));
            let len = (b1 - b0) as u32;
            let off = start + b0 as u64;
            if let Some((fid, pos)) = hit {
                self.bytes_dedup += len as u64;
                let n = self.frame_num(fid);
                self.extent(off, len, n, pos);
                continue;
            }
            if let Some(&(n, pos)) = self.pending.get(&h) {
                self.bytes_dedup += len as u64;
                self.extent(off, len, n, pos);
                continue;
            }
            self.bytes_new += len as u64;
            self.new_objects += 1;
            let (n, pos) = if own {
                if cur.as_ref().is_some_and(|c| c.1.len() >= frame_blocks) {
                    if let Some((r, v, n)) = cur.take() {
                        self.close_frame(n, &v);
                        out.push(Out::Own(r, v));
                    }
                }
                if cur.is_none() {
                    cur = Some((Vec::new(), Vec::new(), self.reserve_frame()));
                }
                let Some((ranges, v, n)) = cur.as_mut() else { continue };
                match ranges.last_mut() {
                    Some(r) if r.1 == b0 => r.1 = b1,
                    _ => ranges.push((b0, b1)),
                }
                v.push(h);
                (*n, v.len() as u16 - 1)
            } else {
                if self.carry.ids.len() >= frame_blocks {
                    self.close_carry(&mut out);
                }
                let n = match self.carry.num {
                    Some(n) => n,
                    None => {
                        let n = self.reserve_frame();
                        self.carry.num = Some(n);
                        self.carry.buf.reserve(frame_blocks * BLOCK);
                        n
                    }
                };
                self.carry.buf.extend_from_slice(&buf[b0..b1]);
                self.carry.ids.push(h);
                (n, self.carry.ids.len() as u16 - 1)
            };
            self.pending.insert(h, (n, pos));
            self.extent(off, len, n, pos);
            if (len as usize) < BLOCK {
                // Only an image's last block is short, and it must end its frame.
                self.close_carry(&mut out);
            }
        }
        if let Some((r, v, n)) = cur.take() {
            self.close_frame(n, &v);
            out.push(Out::Own(r, v));
        }
        out
    }
}

struct Shared<'a> {
    store: &'a Store,
    file: &'a File,
    path: &'a Path,
    size: u64,
    /// Cells with data: (cell start, data ranges inside it, relative to the cell).
    cells: Vec<(u64, Vec<(usize, usize)>)>,
    state: Mutex<State>,
    turn: Condvar,
}

impl Shared<'_> {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self) {
        self.state().failed = true;
        self.turn.notify_all();
    }
}

/// Store a file (see the module docs). `size` is its length when opened.
pub(crate) fn put(
    store: &Store,
    file: &File,
    path: &Path,
    size: u64,
    kind: ImageKind,
) -> Result<PutReport, StoreError> {
    let _lock = crate::lease::lock_shared(store)?;
    store.sync_after_gc()?;
    let ranges = data_ranges(file, size);
    let mut cells: Vec<(u64, Vec<(usize, usize)>)> = Vec::new();
    for (s, e) in ranges {
        let mut a = s;
        while a < e {
            let cell = a / CELL * CELL;
            let b = e.min(cell + CELL);
            let r = ((a - cell) as usize, (b - cell) as usize);
            match cells.last_mut() {
                Some((c, v)) if *c == cell => v.push(r),
                _ => cells.push((cell, vec![r])),
            }
            a = b;
        }
    }
    // One pending entry per new block at most: size the table once instead of rehashing as it grows.
    let data_blocks: usize = cells.iter().flat_map(|(_, r)| r.iter().map(|(a, b)| (b - a).div_ceil(BLOCK))).sum();
    let mut pending = IdMap::default();
    pending.reserve(data_blocks.min(1 << 20));
    let workers =
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).clamp(1, 8).min(cells.len().max(1));
    let sh = Shared {
        store,
        file,
        path,
        size,
        cells,
        state: Mutex::new(State {
            turn: 0,
            failed: false,
            frames: Vec::new(),
            fmap: IdMap::default(),
            pending,
            extents: Vec::new(),
            carry: Carry::default(),
            bytes_new: 0,
            bytes_dedup: 0,
            new_objects: 0,
            new_frames: 0,
        }),
        turn: Condvar::new(),
    };
    let results: Vec<Result<(u64, u64), StoreError>> = if workers == 1 {
        vec![worker(&sh, 0, 1)]
    } else {
        std::thread::scope(|scope| {
            let hs: Vec<_> = (0..workers)
                .map(|w| {
                    scope.spawn({
                        let sh = &sh;
                        move || worker(sh, w, workers)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(StoreError::Invalid("a put worker thread panicked".into()))))
                .collect()
        })
    };
    let (mut stored, mut packs) = (0u64, 0u64);
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok((s, p)) => {
                stored += s;
                packs += p;
            }
            Err(e) => errors.push(e),
        }
    }
    // A worker that stopped because another failed says so; report the cause.
    if let Some(i) = errors
        .iter()
        .position(|e| !matches!(e, StoreError::Invalid(m) if m == STOPPED))
        .or(if errors.is_empty() { None } else { Some(0) })
    {
        return Err(errors.swap_remove(i));
    }
    let st = sh.state.into_inner().unwrap_or_else(|e| e.into_inner());
    let frames = st
        .frames
        .into_iter()
        .collect::<Option<Vec<FrameId>>>()
        .ok_or_else(|| StoreError::Invalid("a frame was never closed".into()))?;
    let m = Manifest { kind, size, frames, extents: st.extents };
    let id = publish_manifest(store, &m)?;
    Ok(PutReport {
        id: Some(id),
        size,
        bytes_new: st.bytes_new,
        bytes_dedup: st.bytes_dedup,
        bytes_zero: size - st.bytes_new - st.bytes_dedup,
        bytes_stored: stored,
        manifest_bytes: m.encode().len() as u64,
        new_objects: st.new_objects,
        new_frames: st.new_frames,
        packs,
        unchanged_file: false,
    })
}

const STOPPED: &str = "stopped: another put worker failed";

/// Worker `w` of `n`: cells w, w+n, ... Returns (bytes stored, packs published).
fn worker(sh: &Shared, w: usize, n: usize) -> Result<(u64, u64), StoreError> {
    let mut wr = Writer { pack: None, totals: (0, 0), comp: None, zbuf: Vec::new(), gathered: Vec::new() };
    let r = work(sh, w, n, &mut wr).and_then(|()| {
        if publish_pack(sh.store, wr.pack.take())? {
            wr.totals.1 += 1;
        }
        Ok(wr.totals)
    });
    if let Some(p) = wr.pack.take() {
        p.abandon();
    }
    if r.is_err() {
        sh.fail();
    }
    r
}

/// Cells a worker may read and hash ahead of its turn (1 MiB each): when the machine is busy and the worker
/// holding the turn is preempted, the others keep reading instead of sleeping on it.
const AHEAD: usize = 16;

/// How long a worker with cells in hand waits for its turn before reading further ahead instead. On an idle
/// machine the turn comes within that (the other worker is hashing its cell), and the cell is written while
/// still in this core's cache.
const PATIENCE: std::time::Duration = std::time::Duration::from_micros(300);

/// A cell read and hashed, waiting for its turn.
struct Held {
    ci: usize,
    buf: Vec<u8>,
    ids: Vec<Option<ObjectId>>,
}

/// Per-worker writing state: the open pack, (bytes stored, packs published), zstd context and buffers.
struct Writer {
    pack: Option<PackWriter>,
    totals: (u64, u64),
    comp: Option<zstd::bulk::Compressor<'static>>,
    zbuf: Vec<u8>,
    gathered: Vec<u8>,
}

fn work(sh: &Shared, w: usize, n: usize, wr: &mut Writer) -> Result<(), StoreError> {
    let frame_blocks = sh.store.inner.cfg.frame_blocks.clamp(1, 256);
    let mut held: std::collections::VecDeque<Held> = std::collections::VecDeque::new();
    let mut free: Vec<Vec<u8>> = Vec::new();
    let mut next = w;
    loop {
        if let Some(front) = held.front() {
            let can_read = held.len() < AHEAD && next < sh.cells.len();
            let mut st = sh.state();
            if st.turn != front.ci && !st.failed {
                st = if can_read {
                    sh.turn.wait_timeout(st, PATIENCE).map(|r| r.0).unwrap_or_else(|e| e.into_inner().0)
                } else {
                    sh.turn.wait_while(st, |st| st.turn != front.ci && !st.failed).unwrap_or_else(|e| e.into_inner())
                };
            }
            if st.failed {
                return Err(StoreError::Invalid(STOPPED.into()));
            }
            if st.turn == front.ci {
                let (start, _) = sh.cells[front.ci];
                let len = (sh.size - start).min(CELL) as usize;
                let mut outs = st.dedup(sh.store, start, &front.buf[..len], &front.ids, frame_blocks);
                st.turn += 1;
                if st.turn == sh.cells.len() {
                    st.close_carry(&mut outs);
                }
                drop(st);
                sh.turn.notify_all();
                let Some(h) = held.pop_front() else { continue };
                write_outs(sh, wr, &h.buf, outs)?;
                free.push(h.buf);
                continue;
            }
            drop(st);
            if !can_read {
                continue;
            }
        } else if next >= sh.cells.len() {
            return Ok(());
        }
        let mut buf = free.pop().unwrap_or_else(|| vec![0u8; CELL as usize]);
        let ids = read_cell(sh, next, &mut buf)?;
        held.push_back(Held { ci: next, buf, ids });
        next += n;
    }
}

/// Read a cell's data ranges into `buf` and hash its blocks (`None`: zero, or in a hole).
fn read_cell(sh: &Shared, ci: usize, buf: &mut [u8]) -> Result<Vec<Option<ObjectId>>, StoreError> {
    let (start, ref ranges) = sh.cells[ci];
    let len = (sh.size - start).min(CELL) as usize;
    let mut ids: Vec<Option<ObjectId>> = vec![None; len.div_ceil(BLOCK)];
    for &(a, b) in ranges {
        sh.file.read_exact_at(&mut buf[a..b], start + a as u64).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                StoreError::Invalid(format!("{} shrank while being stored; retry", sh.path.display()))
            } else {
                StoreError::io("read", sh.path, e)
            }
        })?;
        let h = crate::hash::hash_blocks(&buf[a..b]);
        ids[a / BLOCK..a / BLOCK + h.len()].copy_from_slice(&h);
    }
    Ok(ids)
}

/// Append a cell's closed frames to the worker's pack (raw: one `writev` from the cell buffer), publishing
/// the pack when full.
fn write_outs(sh: &Shared, wr: &mut Writer, buf: &[u8], outs: Vec<Out>) -> Result<(), StoreError> {
    let cfg = &sh.store.inner.cfg;
    for o in outs {
        let (carried, ranges, objects) = match o {
            Out::Own(r, v) => (Vec::new(), r, v),
            Out::Carry(b, v) => {
                let l = b.len();
                (b, vec![(0, l)], v)
            }
        };
        let src: &[u8] = if carried.is_empty() { buf } else { &carried };
        let parts: Vec<&[u8]> = ranges.iter().map(|&(a, b)| &src[a..b]).collect();
        let raw_len: usize = parts.iter().map(|p| p.len()).sum();
        if wr.pack.is_none() {
            wr.pack = Some(PackWriter::create(&sh.store.inner.tmp)?);
        }
        let p = wr.pack.as_mut().ok_or_else(|| StoreError::Invalid("no pack".into()))?;
        let stored = match cfg.compression_level {
            None => {
                let slices: Vec<IoSlice> = parts.iter().map(|s| IoSlice::new(s)).collect();
                p.add_vectored(slices, raw_len as u32, objects)?;
                raw_len
            }
            Some(level) => {
                // One compressor per worker (a context per frame would be set up and zeroed each time).
                if wr.comp.is_none() {
                    wr.comp = Some(zstd::bulk::Compressor::new(level).map_err(|e| StoreError::io("zstd", sh.path, e))?);
                }
                let plain: &[u8] = match parts.as_slice() {
                    [one] => one,
                    _ => {
                        wr.gathered.clear();
                        for part in &parts {
                            wr.gathered.extend_from_slice(part);
                        }
                        &wr.gathered
                    }
                };
                wr.zbuf.clear();
                wr.zbuf.reserve(zstd::zstd_safe::compress_bound(raw_len));
                let zbuf = &mut wr.zbuf;
                let shrank =
                    wr.comp.as_mut().and_then(|c| c.compress_to_buffer(plain, zbuf).ok()).is_some_and(|n| n < raw_len);
                if shrank {
                    p.add(&wr.zbuf, raw_len as u32, Codec::Zstd, objects)?;
                    wr.zbuf.len()
                } else {
                    p.add(plain, raw_len as u32, Codec::Raw, objects)?;
                    raw_len
                }
            }
        };
        wr.totals.0 += stored as u64;
        if p.len() >= cfg.pack_bytes && publish_pack(sh.store, wr.pack.take())? {
            wr.totals.1 += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_ranges_of_a_sparse_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
        f.set_len(16 << 20).unwrap();
        f.write_all_at(&[1u8; 100], 5 << 20).unwrap();
        let r = data_ranges(&f, 16 << 20);
        // Wherever the file system reports data, it covers the written bytes, in whole blocks.
        assert!(r.iter().any(|&(s, e)| s <= 5 << 20 && e >= (5 << 20) + 100), "{r:?}");
        assert!(r.iter().all(|&(s, e)| s % BLOCK as u64 == 0 && (e % BLOCK as u64 == 0 || e == 16 << 20) && s < e));
        assert!(r.windows(2).all(|w| w[0].1 < w[1].0), "sorted, disjoint: {r:?}");
        assert_eq!(data_ranges(&f, 0), Vec::<(u64, u64)>::new());
    }
}
