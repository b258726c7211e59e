//! Fetching a restore's frames from the blob tier several at once, before it reads them.
//!
//! Why: a restore reads its frames one after another (a tree's files in order, an image's frames on a
//! pool of one thread per core). Each frame the local tier lacks is a ranged GET to the blob tier, and a GET
//! to an S3 cluster waits on the network and the store's quorum, not on this host's CPU: on 2 cores, two
//! at a time left a ct sandbox resumed on another host waiting on the network for most of its restore
//! (docs/roam.md). So the frames a restore will read and this host lacks are fetched first, up to
//! `CLADE_BLOB_CONCURRENCY` at once, verified and put in the frame cache, where the restore then finds them.
//! At most half the cache is filled this way, so prefetched frames are not evicted before they are read;
//! the rest are read as before.

use std::collections::HashSet;
use std::sync::Arc;

use rayon::prelude::*;

use crate::ids::FrameId;
use crate::manifest::Manifest;
use crate::{pack, Store, StoreError};

impl Store {
    /// Put the frames of `manifests` that are neither cached nor in a local pack into the frame cache,
    /// fetched from the blob tier several at once. No blob tier, or nothing missing: nothing to do.
    pub(crate) fn prefetch<'a>(&self, manifests: impl IntoIterator<Item = &'a Manifest>) -> Result<(), StoreError> {
        self.prefetch_frames(manifests.into_iter().flat_map(|m| m.frames.iter().copied()), false).map(|_| ())
    }

    /// Put the frames holding the byte `ranges` of each image into the frame cache, fetched from the blob tier
    /// several at once (a restore that knows which parts of which files it will read: crate docs above).
    /// Returns how many frames were fetched; ranges past an image's end are cut at it.
    pub fn prefetch_ranges(&self, wanted: &[(&Manifest, Vec<std::ops::Range<u64>>)]) -> Result<usize, StoreError> {
        self.prefetch_frames(frames_of_ranges(wanted), false)
    }

    /// [`Store::prefetch_ranges`], and the frames fetched are kept on this host's disk (`blob-frames/`,
    /// crate::kept), where another process's read of them finds them: the command that takes a sandbox from
    /// another host fetches what its supervisor's restore will read, before that supervisor exists.
    pub fn prefetch_ranges_kept(&self, wanted: &[(&Manifest, Vec<std::ops::Range<u64>>)]) -> Result<usize, StoreError> {
        self.prefetch_frames(frames_of_ranges(wanted), true)
    }

    /// Fetch `frames` the host lacks into the frame cache: from the copies kept on this host's disk
    /// (crate::kept) when they verify, else from the blob tier several at once; `keep`: the fetched ones are
    /// kept on disk too. Returns how many frames were fetched or read from kept copies.
    fn prefetch_frames(&self, frames: impl IntoIterator<Item = FrameId>, keep: bool) -> Result<usize, StoreError> {
        let Some(blob) = &self.inner.blob else { return Ok(0) };
        let budget = self.inner.cfg.cache_bytes / 2;
        let mut seen = HashSet::new();
        let (mut want, mut bytes) = (Vec::new(), 0u64);
        for f in frames {
            // A frame to keep for another process is fetched even when this one has it in memory.
            if !seen.insert(f) || (!keep && self.cached_frame(&f).is_some()) {
                continue;
            }
            let loc = self.frame_loc(&f)?;
            if pack::pack_path(&self.inner.packs, &loc.pack).exists() {
                continue;
            }
            bytes += loc.entry.raw_len as u64;
            if bytes > budget {
                break;
            }
            want.push((f, loc));
        }
        // Kept copies first: one that is torn or wrong fails to decode and is fetched instead.
        let kept: Vec<Option<Vec<u8>>> = want.par_iter().map(|(id, loc)| self.kept_frame(id, &loc.entry)).collect();
        let mut found = Vec::new();
        let mut fetch = Vec::new();
        for ((id, loc), plain) in want.into_iter().zip(kept) {
            match plain {
                Some(p) => found.push((id, p)),
                None => fetch.push((id, loc)),
            }
        }
        if fetch.len() < 2 && !keep {
            // One frame is read as soon when it is asked for.
            fetch.clear();
        }
        let reqs: Vec<(String, std::ops::Range<u64>)> = fetch
            .iter()
            .map(|(_, loc)| {
                let key = crate::store::blob_key(&pack::pack_path(&self.inner.packs, &loc.pack), &self.inner.dir);
                (key, loc.entry.offset..loc.entry.offset + loc.entry.stored_len as u64)
            })
            .collect();
        let got = if reqs.is_empty() { Vec::new() } else { blob.get_ranges(&reqs)? };
        let mut frames: Vec<(FrameId, Vec<u8>)> = fetch
            .into_par_iter()
            .zip(got.into_par_iter().zip(reqs.into_par_iter()))
            .map(|((id, loc), (stored, (key, _)))| {
                let at = || format!("{}/{key}", blob.describe());
                if keep {
                    self.keep(KEPT_FRAMES, &id.to_hex(), &stored);
                }
                pack::decode_frame(stored, &loc.entry, &at).map(|plain| (id, plain))
            })
            .collect::<Result<_, _>>()?;
        frames.extend(found);
        let mut cache = self.cache();
        let n = frames.len();
        for (id, plain) in frames {
            cache.insert(id, Arc::new(plain));
        }
        Ok(n)
    }

    /// The plain bytes of frame `id` from its copy kept on this host's disk, if there is one and it decodes and
    /// verifies against its index entry (every block's hash).
    pub(crate) fn kept_frame(&self, id: &FrameId, entry: &pack::FrameEntry) -> Option<Vec<u8>> {
        let stored = self.kept(KEPT_FRAMES, &id.to_hex(), |b| b.len() == entry.stored_len as usize)?;
        pack::decode_frame(stored, entry, &|| format!("{KEPT_FRAMES}/{id}")).ok()
    }

    /// The stored bytes of the frame `entry` from its kept copy, if it verifies (decoded once here, so that a
    /// torn copy is fetched from the tier instead of failing the caller's decode).
    pub(crate) fn kept_stored(&self, entry: &pack::FrameEntry) -> Option<Vec<u8>> {
        let id = entry.id();
        self.kept(KEPT_FRAMES, &id.to_hex(), |b| {
            b.len() == entry.stored_len as usize
                && pack::decode_frame_slice(b, &mut Vec::new(), entry, &|| format!("{KEPT_FRAMES}/{id}")).is_ok()
        })
    }
}

/// Where frames fetched for another process of this host are kept (crate::kept; the store's gc removes them
/// after its grace period).
pub(crate) const KEPT_FRAMES: &str = "blob-frames";

/// The frames holding the byte `ranges` of each image (ranges past an image's end are cut at it).
fn frames_of_ranges(wanted: &[(&Manifest, Vec<std::ops::Range<u64>>)]) -> Vec<FrameId> {
    let mut frames = Vec::new();
    for (m, ranges) in wanted {
        for r in ranges {
            let end = r.end.min(m.size);
            let mut i = m.find(r.start);
            while let Some(x) = m.extents.get(i).filter(|x| x.offset < end) {
                if x.end() > r.start {
                    frames.push(m.frames[x.frame as usize]);
                }
                i += 1;
            }
        }
    }
    frames
}
