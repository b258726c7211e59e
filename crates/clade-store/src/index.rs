//! The in-memory index, loaded from the packs' `.idx` files when the store opens: where each frame lives,
//! and which frame holds each 4 KiB block (the dedup table, across every image in the store).
//!
//! Memory: about 40 bytes per stored block in the dedup table plus 32 per block for verification, so roughly
//! 18 MiB per GiB of unique stored data. Keys are already uniform hashes, so the maps use an identity hasher.
//! The dedup table is built only for writers ([`Index::build_blocks`]): a process that only reads (a vm
//! sandbox's disk server) holds the frames alone, about a third of the whole.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::ids::{FrameId, ObjectId, PackId};
use crate::pack::FrameEntry;

/// Takes the first 8 bytes of a BLAKE3 id as its hash (they are uniformly distributed already).
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for (i, b) in bytes.iter().take(8).enumerate() {
            self.0 ^= (*b as u64) << (8 * i);
        }
    }
}

pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Where a frame is: its pack and its entry there.
#[derive(Clone, Debug)]
pub(crate) struct FrameLoc {
    pub pack: PackId,
    pub entry: Arc<FrameEntry>,
}

#[derive(Default)]
pub(crate) struct Index {
    pub frames: IdMap<FrameId, FrameLoc>,
    /// object -> (frame, block position in the frame)
    pub blocks: IdMap<ObjectId, (FrameId, u16)>,
    /// packs loaded, and how many frames each holds
    pub packs: IdMap<PackId, usize>,
    /// Whether `blocks` holds every loaded frame's objects (built on a writer's first lookup).
    pub blocks_built: bool,
}

/// Point each of frame `fid`'s objects that the dedup table does not know yet at that frame.
fn add_objects(blocks: &mut IdMap<ObjectId, (FrameId, u16)>, fid: FrameId, f: &FrameEntry) {
    for (i, o) in f.objects.iter().enumerate() {
        blocks.entry(*o).or_insert((fid, i as u16));
    }
}

impl Index {
    /// Add a pack's frames. The first frame seen for an object stays its dedup target.
    pub fn add_pack(&mut self, pack: PackId, frames: Vec<FrameEntry>) {
        if self.packs.contains_key(&pack) {
            return;
        }
        self.packs.insert(pack, frames.len());
        if self.blocks_built {
            self.blocks.reserve(frames.iter().map(|f| f.objects.len()).sum());
        }
        for f in frames {
            let fid = f.id();
            if self.frames.contains_key(&fid) {
                continue;
            }
            if self.blocks_built {
                add_objects(&mut self.blocks, fid, &f);
            }
            self.frames.insert(fid, FrameLoc { pack, entry: Arc::new(f) });
        }
    }

    /// Build the dedup table (object -> frame) from the frames loaded so far; packs added later go into it
    /// as they come.
    pub fn build_blocks(&mut self) {
        if self.blocks_built {
            return;
        }
        self.blocks.reserve(self.frames.values().map(|l| l.entry.objects.len()).sum());
        for (fid, loc) in &self.frames {
            add_objects(&mut self.blocks, *fid, &loc.entry);
        }
        self.blocks_built = true;
    }

    /// Forget a pack (after gc removed it).
    pub fn remove_pack(&mut self, pack: &PackId) {
        if self.packs.remove(pack).is_none() {
            return;
        }
        let gone: Vec<FrameId> = self.frames.iter().filter(|(_, l)| &l.pack == pack).map(|(k, _)| *k).collect();
        for fid in gone {
            if let Some(loc) = self.frames.remove(&fid) {
                for o in &loc.entry.objects {
                    if self.blocks.get(o).is_some_and(|(f, _)| *f == fid) {
                        self.blocks.remove(o);
                    }
                }
            }
        }
    }
}
