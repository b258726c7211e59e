//! A check of the blob tier on its own: every manifest and tree it publishes names only frames that the blob
//! tier's own packs hold (an index whose pack is there too). A push keeps this true by uploading each pack,
//! then its index, and only then the roots that name them; a push cut short (its process killed, its network
//! cut) leaves packs without roots, never roots without packs. Another host resumes from exactly what this
//! check reads, so it is what the tests of faults between hosts assert (docs/roam.md).

use std::collections::{HashMap, HashSet};

use crate::blobgc::key_stem as stem;
use crate::ids::{FrameId, ManifestId, PackId, TreeId};
use crate::manifest::Manifest;
use crate::tree::Tree;
use crate::{pack, Store, StoreError};

/// What [`Store::check_blob`] found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BlobCheckReport {
    /// The blob tier (`s3://bucket`, `file:///dir`).
    pub blob: String,
    /// Manifests and trees published there.
    pub manifests: u64,
    pub trees: u64,
    /// Packs with both their index and their data there, and the frames they hold.
    pub packs: u64,
    pub frames: u64,
    /// Packs whose index has not arrived (an upload cut short: harmless, blob gc removes them).
    pub packs_without_index: u64,
    /// Roots naming a frame no complete pack holds, and other damage. Empty when the tier is whole.
    pub problems: Vec<String>,
}

impl BlobCheckReport {
    /// Nothing published in the blob tier lacks its data.
    pub fn whole(&self) -> bool {
        self.problems.is_empty()
    }
}

impl Store {
    /// Check that every root the blob tier publishes can be read from the blob tier alone.
    pub fn check_blob(&self) -> Result<BlobCheckReport, StoreError> {
        let Some(blob) = &self.inner.blob else {
            return Err(StoreError::Invalid("this store has no blob tier to check (set CLADE_BLOB)".into()));
        };
        let mut rep = BlobCheckReport { blob: blob.describe().to_string(), ..Default::default() };
        let keys: HashSet<String> = blob.list("packs")?.into_iter().collect();
        let mut held: HashMap<FrameId, PackId> = HashMap::new();
        for key in keys.iter().filter(|k| k.ends_with(".idx")) {
            let Ok(id) = stem(key).parse::<PackId>() else { continue };
            if !keys.contains(&format!("{}.pack", key.trim_end_matches(".idx"))) {
                rep.problems.push(format!("pack {id}: its index is there but not its data"));
                continue;
            }
            let Some(bytes) = blob.get(key)? else { continue };
            if PackId::of(&bytes) != id {
                rep.problems.push(format!("pack index {key}: its bytes do not hash to its id"));
                continue;
            }
            match pack::decode_index(&bytes) {
                Ok(frames) => {
                    rep.packs += 1;
                    for f in frames {
                        held.insert(f.id(), id);
                    }
                }
                Err(e) => rep.problems.push(format!("pack index {key}: {e}")),
            }
        }
        rep.frames = held.len() as u64;
        rep.packs_without_index = keys
            .iter()
            .filter(|k| k.ends_with(".pack") && !keys.contains(&format!("{}.idx", k.trim_end_matches(".pack"))))
            .count() as u64;

        let check = |what: String, m: &Manifest, rep: &mut BlobCheckReport| {
            let missing = m.frames.iter().filter(|f| !held.contains_key(f)).count();
            if missing > 0 {
                rep.problems.push(format!("{what} names {missing} frames that no pack of the blob tier holds"));
            }
        };
        for key in blob.list("manifests")? {
            let Ok(id) = stem(&key).parse::<ManifestId>() else { continue };
            let Some(bytes) = blob.get(&key)? else { continue };
            rep.manifests += 1;
            match Manifest::decode(&bytes) {
                Ok(m) if ManifestId::of(&bytes) == id => check(format!("manifest {id}"), &m, &mut rep),
                _ => rep.problems.push(format!("manifest {key}: does not decode or hash to its id")),
            }
        }
        for key in blob.list("trees")? {
            let Ok(id) = stem(&key).parse::<TreeId>() else { continue };
            let Some(bytes) = blob.get(&key)? else { continue };
            rep.trees += 1;
            match Tree::decode(&bytes) {
                Ok(t) if TreeId::of(&bytes) == id => {
                    for m in t.manifests() {
                        check(format!("tree {id}"), m, &mut rep);
                    }
                }
                _ => rep.problems.push(format!("tree {key}: does not decode or hash to its id")),
            }
        }
        Ok(rep)
    }
}
