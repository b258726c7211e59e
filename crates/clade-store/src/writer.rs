//! Writing: a [`Session`] turns 4 KiB blocks into deduplicated, compressed frames in packs; an image's
//! [`ManifestBuilder`] records which block goes where and, at the end, publishes a complete manifest.
//!
//! Per block: all-zero blocks are dropped (implicit zeros); otherwise BLAKE3 names it, and a block the store
//! (or this session) already holds costs nothing but its place in the manifest. New blocks are appended, in
//! image order, to the frame being filled; a full frame (256 blocks = 1 MiB) is compressed and appended to the
//! session's pack; a full pack (32 MiB) is fsynced and published, and only then do its frames enter the shared
//! index. The manifest is written after every pack it names is durable (and uploaded, with a blob tier).
//! Hashing and compression run on all cores (rayon).

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::Arc;

use rayon::prelude::*;

use crate::ids::{FrameId, ManifestId, ObjectId};
use crate::index::IdMap;
use crate::manifest::{Extent, ImageKind, Manifest};
use crate::pack::{Codec, PackWriter};
use crate::store::Store;
use crate::{fsutil, StoreError, BLOCK};

/// Bytes hashed per parallel task (a multiple of [`BLOCK`]).
const HASH_SLICE: usize = 1 << 20;

/// Zero check and batched SIMD hashing (hash.rs) of 4 KiB blocks, in slices spread over the cores.
pub(crate) fn hash_parallel(data: &[u8]) -> Vec<Option<ObjectId>> {
    if data.len() <= HASH_SLICE {
        return crate::hash::hash_blocks(data);
    }
    let parts: Vec<Vec<Option<ObjectId>>> = data.par_chunks(HASH_SLICE).map(crate::hash::hash_blocks).collect();
    parts.concat()
}

/// What a put did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PutReport {
    /// The manifest published (for a tree's files: the id it would have).
    pub id: Option<ManifestId>,
    /// Image size.
    pub size: u64,
    /// Plain bytes of blocks written that were new to the store.
    pub bytes_new: u64,
    /// Plain bytes of blocks written that the store already held.
    pub bytes_dedup: u64,
    /// Bytes written as zero blocks (stored as nothing).
    pub bytes_zero: u64,
    /// Bytes appended to packs for the new blocks (after compression).
    pub bytes_stored: u64,
    /// Size of the encoded manifest.
    pub manifest_bytes: u64,
    /// New objects (4 KiB blocks) and frames.
    pub new_objects: u64,
    /// New frames.
    pub new_frames: u64,
    /// Packs published.
    pub packs: u64,
    /// The file was unchanged since an earlier put (same path, inode, size, mtime, ctime): not read again.
    pub unchanged_file: bool,
}

impl PutReport {
    fn add(&mut self, o: &PutReport) {
        self.bytes_new += o.bytes_new;
        self.bytes_dedup += o.bytes_dedup;
        self.bytes_zero += o.bytes_zero;
        self.bytes_stored += o.bytes_stored;
        self.new_objects += o.new_objects;
        self.new_frames += o.new_frames;
        self.packs += o.packs;
    }
}

/// Where a block of an image lives: a session frame number and the block's place in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    Zero,
    Data(u32, u16),
}

struct Closed {
    raw: Vec<u8>,
    objects: Vec<ObjectId>,
}

/// One writer's state: the frame being filled, frames waiting for compression, the open pack.
pub(crate) struct Session {
    pub store: Store,
    _lock: File,
    frames: Vec<Option<FrameId>>,
    frame_num: IdMap<FrameId, u32>,
    pending: IdMap<ObjectId, (u32, u16)>,
    cur: Vec<u8>,
    cur_ids: Vec<ObjectId>,
    cur_num: Option<u32>,
    /// The pack writer thread, started at the first new frame.
    writer: Option<PackThread>,
    pub stats: PutReport,
}

impl Session {
    pub fn new(store: &Store) -> Result<Self, StoreError> {
        let lock = crate::lease::lock_shared(store)?;
        // Under the shared lock no gc runs; if one ran since this handle loaded its index (in another
        // process), drop what it deleted so this writer never dedups against a vanished frame.
        store.sync_after_gc()?;
        Ok(Session {
            store: store.clone(),
            _lock: lock,
            frames: Vec::new(),
            frame_num: IdMap::default(),
            pending: IdMap::default(),
            cur: Vec::with_capacity(store.inner.cfg.frame_blocks * BLOCK),
            cur_ids: Vec::new(),
            cur_num: None,
            writer: None,
            stats: PutReport::default(),
        })
    }

    /// The session number of a frame already stored.
    pub fn num_of(&mut self, fid: FrameId) -> u32 {
        if let Some(n) = self.frame_num.get(&fid) {
            return *n;
        }
        let n = self.frames.len() as u32;
        self.frames.push(Some(fid));
        self.frame_num.insert(fid, n);
        n
    }

    /// Store blocks (each 4 KiB, the last maybe shorter), returning their slots in order.
    pub fn put_blocks(&mut self, data: &[u8], out: &mut Vec<Slot>) -> Result<(), StoreError> {
        let hashes = hash_parallel(data);
        let found: Vec<Option<(FrameId, u16)>> = {
            let idx = self.store.dedup_index();
            hashes.iter().map(|h| h.and_then(|h| idx.blocks.get(&h).copied())).collect()
        };
        for ((block, h), hit) in data.chunks(BLOCK).zip(hashes).zip(found) {
            let len = block.len() as u64;
            let Some(h) = h else {
                self.stats.bytes_zero += len;
                out.push(Slot::Zero);
                continue;
            };
            if let Some((fid, pos)) = hit {
                self.stats.bytes_dedup += len;
                let n = self.num_of(fid);
                out.push(Slot::Data(n, pos));
                continue;
            }
            if let Some((n, pos)) = self.pending.get(&h) {
                self.stats.bytes_dedup += len;
                out.push(Slot::Data(*n, *pos));
                continue;
            }
            let n = match self.cur_num {
                Some(n) => n,
                None => {
                    let n = self.frames.len() as u32;
                    self.frames.push(None);
                    self.cur_num = Some(n);
                    n
                }
            };
            let pos = self.cur_ids.len() as u16;
            self.cur.extend_from_slice(block);
            self.cur_ids.push(h);
            self.pending.insert(h, (n, pos));
            self.stats.bytes_new += len;
            self.stats.new_objects += 1;
            out.push(Slot::Data(n, pos));
            if block.len() < BLOCK || self.cur_ids.len() >= self.store.inner.cfg.frame_blocks {
                self.close_frame()?;
            }
        }
        Ok(())
    }

    fn close_frame(&mut self) -> Result<(), StoreError> {
        let Some(n) = self.cur_num.take() else { return Ok(()) };
        let objects = std::mem::take(&mut self.cur_ids);
        let fid = FrameId::of_objects(&objects);
        self.frames[n as usize] = Some(fid);
        self.frame_num.insert(fid, n);
        let cap = self.store.inner.cfg.frame_blocks * BLOCK;
        if self.writer.is_none() {
            self.writer = Some(PackThread::start(&self.store));
        }
        let w = self.writer.as_mut().ok_or_else(|| StoreError::Invalid("no pack writer".into()))?;
        let next = w.pool.try_recv().unwrap_or_else(|_| Vec::with_capacity(cap));
        let raw = std::mem::replace(&mut self.cur, next);
        self.stats.new_frames += 1;
        w.send(Msg::Frame(Closed { raw, objects }))
    }

    /// Make every block written so far durable (and uploaded).
    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.close_frame()?;
        let Some(w) = self.writer.as_mut() else { return Ok(()) };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        w.send(Msg::Flush(tx))?;
        let (stored, packs) = rx.recv().map_err(|_| w.failure())??;
        self.stats.bytes_stored += stored;
        self.stats.packs += packs;
        Ok(())
    }

    fn frame_id(&self, n: u32) -> Result<FrameId, StoreError> {
        self.frames
            .get(n as usize)
            .copied()
            .flatten()
            .ok_or_else(|| StoreError::Invalid(format!("frame {n} not closed (flush before building the manifest)")))
    }

    /// Publish a manifest (after [`Session::flush`]).
    pub fn publish_manifest(&self, m: &Manifest) -> Result<ManifestId, StoreError> {
        publish_manifest(&self.store, m)
    }
}

/// Publish a manifest whose frames are all durable (and uploaded).
pub(crate) fn publish_manifest(store: &Store, m: &Manifest) -> Result<ManifestId, StoreError> {
    let bytes = m.encode();
    let id = ManifestId::of(&bytes);
    let path = store.manifest_path(&id);
    if !path.exists() {
        fsutil::write_atomic(&store.inner.tmp, &path, &bytes)?;
    }
    store.blob_cover([m])?;
    store.blob_upload(&path)?;
    Ok(id)
}

enum Msg {
    Frame(Closed),
    /// Publish the open pack; reply with (bytes stored, packs published) since the last flush.
    Flush(std::sync::mpsc::SyncSender<Result<(u64, u64), StoreError>>),
}

/// A thread that compresses closed frames and appends them to packs, publishing full packs, so hashing
/// and pack I/O overlap. Frame buffers go back to the session through `pool`.
struct PackThread {
    tx: Option<std::sync::mpsc::SyncSender<Msg>>,
    pool: std::sync::mpsc::Receiver<Vec<u8>>,
    handle: Option<std::thread::JoinHandle<Result<(), StoreError>>>,
}

impl PackThread {
    fn start(store: &Store) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Msg>(2 * rayon::current_num_threads());
        let (pool_tx, pool) = std::sync::mpsc::channel();
        let store = store.clone();
        let handle = std::thread::Builder::new()
            .name("clade-store-pack".into())
            .spawn(move || pack_loop(&store, rx, pool_tx))
            .ok();
        PackThread { tx: Some(tx), pool, handle }
    }

    fn send(&mut self, m: Msg) -> Result<(), StoreError> {
        match &self.tx {
            Some(tx) if tx.send(m).is_ok() => Ok(()),
            _ => Err(self.failure()),
        }
    }

    /// The writer thread's error (it stopped).
    fn failure(&mut self) -> StoreError {
        self.tx = None;
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(Err(e))) => e,
            Some(Err(_)) => StoreError::Invalid("the pack writer thread panicked".into()),
            _ => StoreError::Invalid("the pack writer thread stopped".into()),
        }
    }
}

impl Drop for PackThread {
    fn drop(&mut self) {
        self.tx = None; // the thread abandons its open pack and exits
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn pack_loop(
    store: &Store,
    rx: std::sync::mpsc::Receiver<Msg>,
    pool: std::sync::mpsc::Sender<Vec<u8>>,
) -> Result<(), StoreError> {
    let inner = &store.inner;
    let mut pack: Option<PackWriter> = None;
    let (mut stored_total, mut packs) = (0u64, 0u64);
    let res = (|| {
        let mut batch: Vec<Closed> = Vec::new();
        while let Ok(first) = rx.recv() {
            let mut flush = None;
            match first {
                Msg::Frame(c) => batch.push(c),
                Msg::Flush(r) => flush = Some(r),
            }
            // Take whatever else is queued, up to one frame per core, to compress in parallel.
            while flush.is_none() && batch.len() < rayon::current_num_threads() {
                match rx.try_recv() {
                    Ok(Msg::Frame(c)) => batch.push(c),
                    Ok(Msg::Flush(r)) => flush = Some(r),
                    Err(_) => break,
                }
            }
            let stored: Vec<(Codec, Option<Vec<u8>>)> = batch
                .par_iter()
                .map(|c| match inner.cfg.compression_level {
                    Some(l) => match zstd::bulk::compress(&c.raw, l) {
                        Ok(z) if z.len() < c.raw.len() => (Codec::Zstd, Some(z)),
                        _ => (Codec::Raw, None),
                    },
                    None => (Codec::Raw, None),
                })
                .collect();
            for (c, (codec, z)) in batch.drain(..).zip(stored) {
                if pack.is_none() {
                    pack = Some(PackWriter::create(&inner.tmp)?);
                }
                let p = pack.as_mut().ok_or_else(|| StoreError::Invalid("no pack".into()))?;
                let bytes = z.as_deref().unwrap_or(&c.raw);
                stored_total += bytes.len() as u64;
                p.add(bytes, c.raw.len() as u32, codec, c.objects)?;
                let mut raw = c.raw;
                raw.clear();
                let _ = pool.send(raw);
                if p.len() >= inner.cfg.pack_bytes {
                    publish_pack(store, pack.take())?;
                    packs += 1;
                }
            }
            if let Some(reply) = flush {
                let r = publish_pack(store, pack.take()).map(|published| {
                    packs += published as u64;
                    let out = (stored_total, packs);
                    (stored_total, packs) = (0, 0);
                    out
                });
                let failed = r.is_err();
                let _ = reply.send(r);
                if failed {
                    return Ok(());
                }
            }
        }
        Ok(())
    })();
    if let Some(p) = pack.take() {
        p.abandon();
    }
    res
}

/// Publish a pack (fsync, rename, index, blob upload), then let its frames into the shared index.
pub(crate) fn publish_pack(store: &Store, pack: Option<PackWriter>) -> Result<bool, StoreError> {
    let Some(pack) = pack else { return Ok(false) };
    if pack.is_empty() {
        pack.abandon();
        return Ok(false);
    }
    let inner = &store.inner;
    let (id, path, frames) = pack.finish(&inner.packs, &inner.tmp)?;
    store.blob_upload(&path)?;
    store.blob_upload(&crate::pack::idx_path(&inner.packs, &id))?;
    if inner.blob.is_some() && !store.deferred {
        store.blob_has_pack(&id);
    }
    store.write_index().add_pack(id, frames);
    Ok(true)
}

/// One image being described: a base (maybe) plus blocks written over it.
pub(crate) struct ImageState {
    pub kind: ImageKind,
    size: u64,
    base: Option<(Arc<Manifest>, Vec<u32>)>,
    overlay: BTreeMap<u64, Slot>,
    zeros: Vec<(u64, u64)>,
    scratch: Vec<Slot>,
}

impl ImageState {
    pub fn new(session: &mut Session, kind: ImageKind, base: Option<Arc<Manifest>>, size: u64) -> Self {
        let base = base.map(|m| {
            let nums = m.frames.iter().map(|f| session.num_of(*f)).collect();
            (m, nums)
        });
        ImageState { kind, size, base, overlay: BTreeMap::new(), zeros: Vec::new(), scratch: Vec::new() }
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), StoreError> {
        let end = offset.checked_add(len).filter(|e| *e <= self.size);
        if offset % BLOCK as u64 != 0 || end.is_none() || (len % BLOCK as u64 != 0 && end != Some(self.size)) {
            return Err(StoreError::Invalid(format!(
                "range {offset}+{len} must be 4 KiB aligned and inside the image of {} bytes (only the image's last block may be short)",
                self.size
            )));
        }
        Ok(())
    }

    pub fn write(&mut self, s: &mut Session, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        self.check(offset, data.len() as u64)?;
        let mut slots = std::mem::take(&mut self.scratch);
        slots.clear();
        s.put_blocks(data, &mut slots)?;
        let first = offset / BLOCK as u64;
        for (i, slot) in slots.iter().enumerate() {
            self.overlay.insert(first + i as u64, *slot);
        }
        self.scratch = slots;
        Ok(())
    }

    pub fn zero(&mut self, offset: u64, len: u64) -> Result<(), StoreError> {
        self.check(offset, len)?;
        let (a, b) = (offset / BLOCK as u64, (offset + len).div_ceil(BLOCK as u64));
        let keys: Vec<u64> = self.overlay.range(a..b).map(|(k, _)| *k).collect();
        for k in keys {
            self.overlay.remove(&k);
        }
        self.zeros.push((a, b));
        Ok(())
    }

    /// The manifest (all frames must be flushed).
    pub fn build(&mut self, s: &Session) -> Result<Manifest, StoreError> {
        let nblocks = self.size.div_ceil(BLOCK as u64);
        self.zeros.sort_unstable();
        let mut zi = 0usize;
        let mut bi = 0usize;
        let mut over = self.overlay.iter().peekable();
        let mut frames: Vec<FrameId> = Vec::new();
        let mut fmap: IdMap<FrameId, u32> = IdMap::default();
        let mut extents: Vec<Extent> = Vec::new();
        let mut b = 0u64;
        while b < nblocks {
            let off = b * BLOCK as u64;
            // Fast skip over a stretch with no overlay entry and no base data: zeros.
            let mut cap = u64::MAX;
            let slot = match over.peek() {
                Some((k, v)) if **k == b => {
                    let v = **v;
                    over.next();
                    v
                }
                next => {
                    while zi < self.zeros.len() && self.zeros[zi].1 <= b {
                        zi += 1;
                    }
                    let zeroed = zi < self.zeros.len() && self.zeros[zi].0 <= b;
                    let mut slot = Slot::Zero;
                    if !zeroed {
                        if let Some((m, nums)) = &self.base {
                            while bi < m.extents.len() && m.extents[bi].end() <= off {
                                bi += 1;
                            }
                            match m.extents.get(bi) {
                                Some(x) if x.offset <= off => {
                                    let pos = (x.frame_offset as u64 + (off - x.offset)) / BLOCK as u64;
                                    slot = Slot::Data(nums[x.frame as usize], pos as u16);
                                    cap = x.end() - off;
                                }
                                Some(x) => {
                                    // Jump to the next base extent or overlay entry, whichever is first.
                                    let mut to = x.offset / BLOCK as u64;
                                    if let Some((k, _)) = next {
                                        to = to.min(**k);
                                    }
                                    if zi < self.zeros.len() {
                                        to = to.min(self.zeros[zi].0.max(b + 1));
                                    }
                                    b = to.max(b + 1);
                                    continue;
                                }
                                None => {
                                    b = next.map(|(k, _)| **k).unwrap_or(nblocks).max(b + 1);
                                    continue;
                                }
                            }
                        } else {
                            b = next.map(|(k, _)| **k).unwrap_or(nblocks).max(b + 1);
                            continue;
                        }
                    }
                    slot
                }
            };
            b += 1;
            let Slot::Data(n, pos) = slot else { continue };
            let fid = s.frame_id(n)?;
            let fi = *fmap.entry(fid).or_insert_with(|| {
                frames.push(fid);
                frames.len() as u32 - 1
            });
            let len = (self.size - off).min(BLOCK as u64).min(cap) as u32;
            let foff = pos as u32 * BLOCK as u32;
            if let Some(last) = extents.last_mut() {
                if last.frame == fi && last.end() == off && last.frame_offset + last.len == foff {
                    last.len += len;
                    continue;
                }
            }
            extents.push(Extent { offset: off, len, frame: fi, frame_offset: foff });
        }
        Ok(Manifest { kind: self.kind, size: self.size, frames, extents })
    }
}

/// Builds a new complete manifest: a base image (or nothing) plus written and zeroed 4 KiB blocks.
/// Dropping it without [`ManifestBuilder::finish`] publishes nothing (packs already written are
/// unreferenced and gc collects them).
pub struct ManifestBuilder {
    session: Session,
    image: ImageState,
}

impl ManifestBuilder {
    pub(crate) fn new(store: &Store, base: Option<&ManifestId>, size: u64) -> Result<Self, StoreError> {
        // Lock first: gc cannot collect the base between reading it and using it.
        let mut session = Session::new(store)?;
        let base = base.map(|id| store.manifest(id)).transpose()?;
        let kind = base.as_ref().map(|m| m.kind).unwrap_or(ImageKind::Other);
        let image = ImageState::new(&mut session, kind, base, size);
        Ok(ManifestBuilder { session, image })
    }

    /// Set the image kind recorded in the manifest.
    pub fn kind(mut self, kind: ImageKind) -> Self {
        self.image.kind = kind;
        self
    }

    /// Write `data` at `offset` (4 KiB aligned; a multiple of 4 KiB long unless it ends the image).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        self.image.write(&mut self.session, offset, data)
    }

    /// Make `offset..offset+len` zeros (4 KiB aligned).
    pub fn zero(&mut self, offset: u64, len: u64) -> Result<(), StoreError> {
        self.image.zero(offset, len)
    }

    /// Counters so far.
    pub fn report(&self) -> &PutReport {
        &self.session.stats
    }

    /// Flush every new block, then publish the manifest.
    pub fn finish(mut self) -> Result<PutReport, StoreError> {
        self.session.flush()?;
        let m = self.image.build(&self.session)?;
        let id = self.session.publish_manifest(&m)?;
        let mut r = self.session.stats.clone();
        r.id = Some(id);
        r.size = m.size;
        r.manifest_bytes = m.encode().len() as u64;
        Ok(r)
    }
}

pub(crate) fn merge_reports(total: &mut PutReport, part: &PutReport) {
    total.add(part);
}
