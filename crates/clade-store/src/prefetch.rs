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
        self.prefetch_frames(manifests.into_iter().flat_map(|m| m.frames.iter().copied())).map(|_| ())
    }

    /// Put the frames holding the byte `ranges` of each image into the frame cache, fetched from the blob tier
    /// several at once (a restore that knows which parts of which files it will read: crate docs above).
    /// Returns how many frames were fetched; ranges past an image's end are cut at it.
    pub fn prefetch_ranges(&self, wanted: &[(&Manifest, Vec<std::ops::Range<u64>>)]) -> Result<usize, StoreError> {
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
        self.prefetch_frames(frames)
    }

    fn prefetch_frames(&self, frames: impl IntoIterator<Item = FrameId>) -> Result<usize, StoreError> {
        let Some(blob) = &self.inner.blob else { return Ok(0) };
        let budget = self.inner.cfg.cache_bytes / 2;
        let mut seen = HashSet::new();
        let (mut want, mut bytes) = (Vec::new(), 0u64);
        for f in frames {
            if !seen.insert(f) || self.cached_frame(&f).is_some() {
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
        if want.len() < 2 {
            return Ok(0);
        }
        let reqs: Vec<(String, std::ops::Range<u64>)> = want
            .iter()
            .map(|(_, loc)| {
                let key = crate::store::blob_key(&pack::pack_path(&self.inner.packs, &loc.pack), &self.inner.dir);
                (key, loc.entry.offset..loc.entry.offset + loc.entry.stored_len as u64)
            })
            .collect();
        let got = blob.get_ranges(&reqs)?;
        let frames: Vec<(FrameId, Vec<u8>)> = want
            .into_par_iter()
            .zip(got.into_par_iter().zip(reqs.into_par_iter()))
            .map(|((id, loc), (stored, (key, _)))| {
                let at = || format!("{}/{key}", blob.describe());
                pack::decode_frame(stored, &loc.entry, &at).map(|plain| (id, plain))
            })
            .collect::<Result<_, _>>()?;
        let mut cache = self.cache();
        let n = frames.len();
        for (id, plain) in frames {
            cache.insert(id, Arc::new(plain));
        }
        Ok(n)
    }
}
