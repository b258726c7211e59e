//! Packs: many frames in one file, so a store of a million 4 KiB blocks is a few hundred files, not a million
//! (restic, borg and git do the same).
//!
//! A pack is `CLADEPK1`, then frames (each the raw or zstd-compressed bytes of up to 256 blocks), then the
//! pack's index, its length (u64) and `CLADEPKE`. The same index is also published next to the pack as
//! `<packid>.idx`, so opening a store reads only the small index files; the copy inside the pack lets fsck
//! rebuild a lost index. The pack id is the BLAKE3 of the index, which names every object in the pack, so the
//! id covers the content without hashing the pack's bytes a second time. Every frame read is verified block by
//! block against the object ids in the index.

use std::fs::File;
use std::io::{IoSlice, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::codec::{Dec, DecodeError, Enc};
use crate::error::IoCtx;
use crate::fsutil;
use crate::ids::{FrameId, ObjectId, PackId};
use crate::{StoreError, BLOCK};

pub(crate) const PACK_MAGIC: &[u8; 8] = b"CLADEPK1";
const PACK_END: &[u8; 8] = b"CLADEPKE";
const IDX_MAGIC: &[u8; 8] = b"CLADEIX1";
const IDX_VERSION: u32 = 1;

/// How a frame is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codec {
    Raw = 0,
    Zstd = 1,
}

/// One frame's place in a pack, and the objects (blocks) it holds, in order.
#[derive(Clone, Debug)]
pub(crate) struct FrameEntry {
    pub offset: u64,
    pub stored_len: u32,
    pub raw_len: u32,
    pub codec: Codec,
    pub objects: Vec<ObjectId>,
}

impl FrameEntry {
    pub fn id(&self) -> FrameId {
        FrameId::of_objects(&self.objects)
    }
}

/// Encode a pack index.
pub(crate) fn encode_index(frames: &[FrameEntry]) -> Vec<u8> {
    let mut e = Enc::with_magic(IDX_MAGIC, IDX_VERSION);
    e.u32(frames.len() as u32);
    for f in frames {
        e.u64(f.offset);
        e.u32(f.stored_len);
        e.u32(f.raw_len);
        e.u8(f.codec as u8);
        e.u16(f.objects.len() as u16);
        for o in &f.objects {
            e.bytes(&o.0);
        }
    }
    e.buf
}

/// Decode a pack index, checking its internal consistency.
pub(crate) fn decode_index(buf: &[u8]) -> Result<Vec<FrameEntry>, DecodeError> {
    let mut d = Dec::new(buf);
    d.magic(IDX_MAGIC, IDX_VERSION)?;
    let n = d.count(19, "frame count")?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let offset = d.u64("frame offset")?;
        let stored_len = d.u32("stored length")?;
        let raw_len = d.u32("raw length")?;
        let codec = match d.u8("codec")? {
            0 => Codec::Raw,
            1 => Codec::Zstd,
            c => return Err(DecodeError::Bad(format!("unknown codec {c}"))),
        };
        let nobj = d.u16("object count")? as usize;
        if nobj == 0 || raw_len as usize > nobj * BLOCK || (raw_len as usize) <= (nobj - 1) * BLOCK {
            return Err(DecodeError::Bad(format!("frame of {nobj} blocks cannot be {raw_len} bytes")));
        }
        let mut objects = Vec::with_capacity(nobj);
        for _ in 0..nobj {
            objects.push(ObjectId(d.id("object id")?));
        }
        out.push(FrameEntry { offset, stored_len, raw_len, codec, objects });
    }
    d.end()?;
    Ok(out)
}

/// Writes one pack to a temp file; [`PackWriter::finish`] publishes it.
pub(crate) struct PackWriter {
    tmp: PathBuf,
    file: File,
    offset: u64,
    frames: Vec<FrameEntry>,
}

impl PackWriter {
    pub fn create(tmp_dir: &Path) -> Result<Self, StoreError> {
        let tmp = fsutil::temp_path(tmp_dir, "pack");
        let mut file = fsutil::new_private().open(&tmp).ctx("create temp pack", &tmp)?;
        file.write_all(PACK_MAGIC).ctx("write", &tmp)?;
        Ok(PackWriter { tmp, file, offset: PACK_MAGIC.len() as u64, frames: Vec::new() })
    }

    pub fn len(&self) -> u64 {
        self.offset
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Append a frame's stored bytes.
    pub fn add(&mut self, stored: &[u8], raw_len: u32, codec: Codec, objects: Vec<ObjectId>) -> Result<(), StoreError> {
        self.file.write_all(stored).ctx("write", &self.tmp)?;
        self.frames.push(FrameEntry { offset: self.offset, stored_len: stored.len() as u32, raw_len, codec, objects });
        self.offset += stored.len() as u64;
        Ok(())
    }

    /// Append a raw frame given as slices (e.g. runs of new blocks in a read buffer), with one `writev`
    /// per call instead of a copy into a frame buffer first.
    pub fn add_vectored(
        &mut self,
        mut parts: Vec<IoSlice<'_>>,
        raw_len: u32,
        objects: Vec<ObjectId>,
    ) -> Result<(), StoreError> {
        let mut s = &mut parts[..];
        while !s.is_empty() {
            match self.file.write_vectored(s) {
                Ok(0) => return Err(StoreError::io("write", &self.tmp, std::io::ErrorKind::WriteZero.into())),
                Ok(n) => IoSlice::advance_slices(&mut s, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(StoreError::io("write", &self.tmp, e)),
            }
        }
        self.frames.push(FrameEntry { offset: self.offset, stored_len: raw_len, raw_len, codec: Codec::Raw, objects });
        self.offset += raw_len as u64;
        Ok(())
    }

    /// Write the trailer, fsync, and publish pack then index under `packs_dir/<fanout>/`. Returns the id,
    /// the published pack path, and the frames.
    pub fn finish(
        mut self,
        packs_dir: &Path,
        tmp_dir: &Path,
    ) -> Result<(PackId, PathBuf, Vec<FrameEntry>), StoreError> {
        let index = encode_index(&self.frames);
        let id = PackId::of(&index);
        self.file.write_all(&index).ctx("write", &self.tmp)?;
        self.file.write_all(&(index.len() as u64).to_le_bytes()).ctx("write", &self.tmp)?;
        self.file.write_all(PACK_END).ctx("write", &self.tmp)?;
        self.file.sync_all().ctx("fsync", &self.tmp)?;
        let pack_path = pack_path(packs_dir, &id);
        fsutil::publish(&self.tmp, &pack_path)?;
        fsutil::write_atomic(tmp_dir, &idx_path(packs_dir, &id), &index)?;
        Ok((id, pack_path, std::mem::take(&mut self.frames)))
    }

    /// Abandon the pack (its temp file is removed).
    pub fn abandon(self) {
        let _ = std::fs::remove_file(&self.tmp);
    }
}

pub(crate) fn pack_path(packs_dir: &Path, id: &PackId) -> PathBuf {
    packs_dir.join(id.fanout()).join(format!("{id}.pack"))
}

pub(crate) fn idx_path(packs_dir: &Path, id: &PackId) -> PathBuf {
    packs_dir.join(id.fanout()).join(format!("{id}.idx"))
}

/// Read the index stored inside a pack's trailer (to check or rebuild the `.idx` file).
pub(crate) fn read_trailer(path: &Path) -> Result<Vec<u8>, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        kind: "pack",
        id: fsutil::stem(path).to_string(),
        location: path.display().to_string(),
        detail,
    };
    let f = File::open(path).ctx("open pack", path)?;
    let len = f.metadata().ctx("stat pack", path)?.len();
    if len < 24 {
        return Err(corrupt(format!("truncated pack of {len} bytes")));
    }
    let mut tail = [0u8; 16];
    f.read_exact_at(&mut tail, len - 16).ctx("read pack", path)?;
    if &tail[8..] != PACK_END {
        return Err(corrupt("truncated pack: no end marker (it was cut short)".into()));
    }
    let ilen = u64::from_le_bytes(tail[..8].try_into().unwrap_or_default());
    if ilen > len - 24 {
        return Err(corrupt(format!("index length {ilen} exceeds pack size {len}")));
    }
    let mut idx = vec![0u8; ilen as usize];
    f.read_exact_at(&mut idx, len - 16 - ilen).ctx("read pack", path)?;
    Ok(idx)
}

/// Decode a frame's stored bytes and verify every block against its object id. Corruption is named
/// (frame, object, location) and the bytes are never returned.
pub(crate) fn decode_frame(
    stored: Vec<u8>,
    entry: &FrameEntry,
    location: &dyn Fn() -> String,
) -> Result<Vec<u8>, StoreError> {
    let mut scratch = Vec::new();
    decode_frame_slice(&stored, &mut scratch, entry, location)?;
    Ok(if entry.codec == Codec::Raw { stored } else { scratch })
}

/// Decode a frame from its stored bytes (borrowed, e.g. from a pack map) and verify every block. Returns the
/// plain bytes: `stored` itself for a raw frame, else `scratch`.
pub(crate) fn decode_frame_slice<'a>(
    stored: &'a [u8],
    scratch: &'a mut Vec<u8>,
    entry: &FrameEntry,
    location: &dyn Fn() -> String,
) -> Result<&'a [u8], StoreError> {
    let corrupt =
        |id: String, kind: &'static str, detail: String| StoreError::Corrupt { kind, id, location: location(), detail };
    if stored.len() != entry.stored_len as usize {
        return Err(corrupt(
            entry.id().to_hex(),
            "frame",
            format!("{} bytes where {} were expected (truncated pack?)", stored.len(), entry.stored_len),
        ));
    }
    let raw: &[u8] = match entry.codec {
        Codec::Raw => stored,
        Codec::Zstd => {
            scratch.clear();
            scratch.reserve(entry.raw_len as usize);
            zstd::bulk::Decompressor::new()
                .and_then(|mut d| d.decompress_to_buffer(stored, scratch))
                .map_err(|e| corrupt(entry.id().to_hex(), "frame", format!("zstd: {e}")))?;
            scratch
        }
    };
    if raw.len() != entry.raw_len as usize {
        return Err(corrupt(
            entry.id().to_hex(),
            "frame",
            format!("decoded {} bytes, expected {}", raw.len(), entry.raw_len),
        ));
    }
    verify_blocks(raw, &entry.objects).map_err(|(i, got)| {
        corrupt(entry.objects[i].to_hex(), "object", format!("block {i} of frame {} hashes to {got}", entry.id()))
    })?;
    Ok(raw)
}

/// Check each block of `raw` against `objects`; on mismatch, the block index and the hash found.
pub(crate) fn verify_blocks(raw: &[u8], objects: &[ObjectId]) -> Result<(), (usize, ObjectId)> {
    let got = crate::hash::hash_every_block(raw);
    for (i, (g, want)) in got.iter().zip(objects).enumerate() {
        if g != want {
            return Err((i, *g));
        }
    }
    if got.len() != objects.len() {
        let i = got.len().min(objects.len());
        return Err((i, got.get(i).copied().unwrap_or(ObjectId([0u8; 32]))));
    }
    Ok(())
}
