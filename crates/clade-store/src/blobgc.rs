//! gc of the blob tier: delete the packs (and their indexes) in the `object_store` tier that no live root
//! needs, with the rules of the local gc.
//!
//! Roots are every manifest and tree published in the blob tier or in the local tier, plus what a live
//! lease of this host names (read from the local trash even after `delete_manifest`). If any root cannot be
//! read, or names a frame that neither tier holds, nothing is deleted. A blob pack is deleted when both its
//! `.pack` and `.idx` are older than the grace period (writers in flight upload packs before their
//! manifest) and either none of its frames is live, or every live frame it holds is also held by another
//! blob pack that is kept (after a local repack uploaded a new pack with the live frames). Packs are not
//! rewritten in the blob tier: that would download and upload them again; the local gc's repack already
//! uploads the compacted pack, which makes the old one redundant here. A `.pack` whose `.idx` never arrived
//! (an interrupted upload) is deleted after the grace period; an `.idx` without its `.pack` is damage and
//! only reported.
//!
//! Leases of this host are flocks; other hosts' leases are their records in the blob tier (`leases/<host>.json`,
//! crate::hostlease): the packs a live record names are kept, an expired record is deleted. With several hosts
//! sharing one bucket, run the blob gc on one host at a time and keep `gc_grace` longer than any writer session;
//! see docs/store.md.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use crate::blob::BlobMeta;
use crate::ids::{FrameId, ManifestId, PackId, TreeId};
use crate::lease::{lock_exclusive, Root};
use crate::pack::{self, FrameEntry};
use crate::store::{blob_key, Store};
use crate::{fsutil, StoreError};

/// What a gc of the blob tier did (or, with `dry_run`, would do).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct BlobGcReport {
    /// Nothing was deleted.
    pub dry_run: bool,
    /// The blob tier (`s3://bucket`, `file:///dir`).
    pub blob: String,
    /// Roots: manifests published in either tier.
    pub live_manifests: u64,
    /// Trees published in either tier.
    pub live_trees: u64,
    /// Live leases of this host.
    pub live_leases: u64,
    /// Hosts' lease records in the blob tier that are live (their packs are kept), and expired ones (deleted:
    /// what only they kept is collected).
    pub host_leases_live: u64,
    pub host_leases_expired: u64,
    /// Packs kept because a live host lease names them.
    pub packs_kept_leased: u64,
    /// Frames those roots use.
    pub live_frames: u64,
    /// Packs kept (live, or younger than the grace period).
    pub packs_kept: u64,
    /// Of those, packs kept only because they are younger than the grace period.
    pub packs_kept_young: u64,
    /// Bytes of the packs and indexes kept.
    pub bytes_kept: u64,
    /// Packs deleted (with their index).
    pub packs_deleted: u64,
    /// Frames that went with them (dead, or also held by a kept pack).
    pub frames_deleted: u64,
    /// Packs without index (interrupted uploads) deleted.
    pub leftovers_deleted: u64,
    /// Bytes freed in the blob tier.
    pub bytes_freed: u64,
    /// The keys deleted.
    pub deleted: Vec<String>,
    /// Things worth knowing that did not stop the gc (unreadable indexes are kept, never deleted).
    pub warnings: Vec<String>,
}

/// The id in a key such as `packs/ab/<hex>.idx` or `manifests/ab/<hex>`.
pub(crate) fn key_stem(key: &str) -> &str {
    fsutil::stem(Path::new(key.rsplit('/').next().unwrap_or("")))
}

/// A pack of the blob tier, as gc sees it.
struct BlobPack {
    id: PackId,
    idx: BlobMeta,
    pack: Option<BlobMeta>,
    frames: Vec<FrameEntry>,
}

impl Store {
    /// Collect the blob tier: delete the packs no live root needs. Errors if no blob tier is configured.
    /// Takes the store lock exclusively (as [`Store::gc`]): no writer of this host is in flight.
    pub fn gc_blob(&self, dry_run: bool) -> Result<BlobGcReport, StoreError> {
        let Some(blob) = &self.inner.blob else {
            return Err(StoreError::Invalid(
                "this store has no blob tier to collect; open it with a blob tier (StoreConfig::blob)".into(),
            ));
        };
        let _lock = lock_exclusive(self, Duration::from_secs(10))?;
        let grace = self.inner.cfg.gc_grace;
        let mut rep = BlobGcReport { dry_run, blob: blob.describe().to_string(), ..Default::default() };

        // Mark: roots of both tiers and this host's leases.
        let (leases, _) = self.live_leases(true)?;
        rep.live_leases = leases.len() as u64;
        let (leased_packs, live, expired) = self.leased_packs(dry_run)?;
        (rep.host_leases_live, rep.host_leases_expired) = (live, expired);
        let mut manifests: HashSet<ManifestId> = self.manifests()?.into_iter().collect();
        manifests.extend(blob.list("manifests")?.iter().filter_map(|k| key_stem(k).parse::<ManifestId>().ok()));
        let mut trees: HashSet<TreeId> = self.trees()?.into_iter().collect();
        trees.extend(blob.list("trees")?.iter().filter_map(|k| key_stem(k).parse::<TreeId>().ok()));
        rep.live_manifests = manifests.len() as u64;
        rep.live_trees = trees.len() as u64;
        let mut roots: Vec<Root> = manifests.into_iter().map(Root::Manifest).collect();
        roots.extend(trees.into_iter().map(Root::Tree));
        roots.extend(leases);
        let mut live: HashMap<FrameId, String> = HashMap::new();
        for r in roots {
            match r {
                Root::Manifest(id) => {
                    for f in &self.manifest(&id)?.frames {
                        live.entry(*f).or_insert_with(|| format!("manifest {id}"));
                    }
                }
                Root::Tree(id) => {
                    for m in self.tree(&id)?.manifests() {
                        for f in &m.frames {
                            live.entry(*f).or_insert_with(|| format!("tree {id}"));
                        }
                    }
                }
            }
        }
        rep.live_frames = live.len() as u64;

        // The packs of the blob tier, with their verified indexes.
        let listed = blob.list_meta("packs")?;
        let mut pack_meta: HashMap<String, BlobMeta> = HashMap::new();
        let mut idx_meta: Vec<BlobMeta> = Vec::new();
        for m in listed {
            if m.key.ends_with(".pack") {
                pack_meta.insert(m.key.clone(), m);
            } else if m.key.ends_with(".idx") {
                idx_meta.push(m);
            }
        }
        let mut packs: Vec<BlobPack> = Vec::new();
        for m in idx_meta {
            let Ok(id) = key_stem(&m.key).parse::<PackId>() else {
                rep.warnings.push(format!("{}: not a pack index name (left alone)", m.key));
                continue;
            };
            let pack_key = format!("{}.pack", m.key.trim_end_matches(".idx"));
            let pack = pack_meta.remove(&pack_key);
            if pack.is_none() {
                rep.warnings.push(format!("pack {id}: index present but {pack_key} is missing (left alone)"));
            }
            let frames = match blob.get(&m.key)? {
                Some(b) if PackId::of(&b) == id => match pack::decode_index(&b) {
                    Ok(f) => f,
                    Err(e) => {
                        rep.warnings.push(format!("pack index {}: {e} (kept)", m.key));
                        rep.packs_kept += 1;
                        continue;
                    }
                },
                Some(_) => {
                    rep.warnings.push(format!("pack index {}: bytes do not hash to the pack id (kept)", m.key));
                    rep.packs_kept += 1;
                    continue;
                }
                None => continue, // deleted since the listing
            };
            packs.push(BlobPack { id, idx: m, pack, frames });
        }

        // Every live frame must be held somewhere, or gc stops before deleting anything.
        let mut holders: HashMap<FrameId, Vec<usize>> = HashMap::new();
        for (i, p) in packs.iter().enumerate() {
            for f in &p.frames {
                holders.entry(f.id()).or_default().push(i);
            }
        }
        let mut local_only = 0u64;
        {
            let idx = self.read_index();
            for (f, what) in &live {
                if holders.contains_key(f) {
                    continue;
                }
                if !idx.frames.contains_key(f) {
                    return Err(StoreError::Missing { what: what.clone(), kind: "frame", id: f.to_hex() });
                }
                local_only += 1;
            }
        }
        if local_only > 0 {
            rep.warnings.push(format!("{local_only} live frames are only in the local tier (not uploaded)"));
        }

        // Sweep: young packs stay; packs with live frames stay unless every live frame is held by another
        // kept pack.
        let n = packs.len();
        let old = |p: &BlobPack| p.idx.age >= grace && p.pack.as_ref().is_none_or(|m| m.age >= grace);
        let mut keep = vec![true; n];
        let live_bytes = |p: &BlobPack| -> u64 {
            p.frames.iter().filter(|f| live.contains_key(&f.id())).map(|f| f.stored_len as u64).sum()
        };
        let mut order: Vec<usize> = (0..n).filter(|&i| old(&packs[i]) && packs[i].pack.is_some()).collect();
        // Packs with the smallest live share go first, so the compacted packs are the ones kept.
        let share = |p: &BlobPack| -> u128 {
            let total: u64 = p.frames.iter().map(|f| f.stored_len as u64).sum();
            ((live_bytes(p) as u128) << 32) / total.max(1) as u128
        };
        order.sort_by_key(|&i| share(&packs[i]));
        for i in order {
            if leased_packs.contains(&packs[i].id) {
                rep.packs_kept_leased += 1;
                continue;
            }
            let redundant = packs[i].frames.iter().filter(|f| live.contains_key(&f.id())).all(|f| {
                holders.get(&f.id()).is_some_and(|hs| hs.iter().any(|&h| h != i && keep[h] && packs[h].pack.is_some()))
            });
            if redundant {
                keep[i] = false;
            }
        }
        for (i, p) in packs.iter().enumerate() {
            let size = p.idx.size + p.pack.as_ref().map(|m| m.size).unwrap_or(0);
            if keep[i] {
                rep.packs_kept += 1;
                rep.bytes_kept += size;
                if !old(p) {
                    rep.packs_kept_young += 1;
                }
                continue;
            }
            rep.packs_deleted += 1;
            rep.frames_deleted += p.frames.len() as u64;
            rep.bytes_freed += size;
            // Index first: a pack without index is a leftover, an index without pack is damage.
            let pack_key = p.pack.as_ref().map(|m| m.key.clone()).unwrap_or_default();
            rep.deleted.push(p.idx.key.clone());
            rep.deleted.push(pack_key.clone());
            if !dry_run {
                blob.delete(&p.idx.key)?;
                blob.delete(&pack_key)?;
            }
        }
        // Packs whose index never arrived (an upload cut short).
        for m in pack_meta.into_values() {
            if m.age < grace || key_stem(&m.key).parse::<PackId>().is_ok_and(|id| leased_packs.contains(&id)) {
                continue;
            }
            rep.leftovers_deleted += 1;
            rep.bytes_freed += m.size;
            rep.deleted.push(m.key.clone());
            if !dry_run {
                blob.delete(&m.key)?;
            }
        }

        if !dry_run && rep.packs_deleted > 0 {
            // Other handles on this host (other processes) rebuild their index before their next write, so
            // none dedups against a frame whose only copy just went away.
            self.bump_gc_gen()?;
            self.rebuild_index()?;
        }
        Ok(rep)
    }

    /// Forget everything loaded and load the indexes of both tiers again (after a gc of the blob tier:
    /// a frame may have lost one of the packs that held it).
    pub(crate) fn rebuild_index(&self) -> Result<(), StoreError> {
        *self.raw_index_mut() = crate::index::Index::default();
        self.inner.blob_seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.reload_index()?;
        self.refresh_from_blob()?;
        Ok(())
    }

    /// The blob key of a local store path.
    pub(crate) fn blob_key_of(&self, path: &Path) -> String {
        blob_key(path, &self.inner.dir)
    }
}
