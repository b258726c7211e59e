//! Maintenance: `fsck` (verify everything), `gc` (mark and sweep), `stats`.
//!
//! gc is mark-and-sweep (as in rustic and Proxmox Backup). Roots are the published manifests and trees, plus
//! whatever a live lease names (even if deleted since). It runs under the exclusive store lock, so no writer
//! is in flight; packs and temp files younger than the grace period are left alone anyway, as a second guard
//! for writers on other hosts sharing the directory. A pack with no live frame is deleted; a pack whose live
//! frames are less than half its bytes is repacked (live frames copied, verified, into a new pack, then the
//! old one deleted). If any root is unreadable or names a frame the store lacks, gc stops and deletes nothing.

use std::collections::HashSet;
use std::time::Duration;

use crate::ids::{FrameId, ManifestId, PackId, TreeId};
use crate::lease::{is_older_than, lock_exclusive, Root};
use crate::manifest::Manifest;
use crate::pack::{self, PackWriter};
use crate::store::{load_idx_file, Store};
use crate::{fsutil, StoreError};

/// A frame of a pack: id, stored bytes, live.
type FrameUse = (FrameId, u64, bool);

/// What gc did (or, with `dry_run`, would do).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct GcReport {
    /// Nothing was deleted.
    pub dry_run: bool,
    /// Live manifests, trees and leases.
    pub live_manifests: u64,
    /// Live trees.
    pub live_trees: u64,
    /// Live leases.
    pub live_leases: u64,
    /// Live frames.
    pub live_frames: u64,
    /// Frames freed.
    pub frames_deleted: u64,
    /// Packs deleted outright.
    pub packs_deleted: u64,
    /// Packs rewritten without their dead frames.
    pub packs_repacked: u64,
    /// Packs kept as they are (all live, mostly live, or younger than the grace period).
    pub packs_kept: u64,
    /// Of those, packs kept only because they are younger than the grace period.
    pub packs_kept_young: u64,
    /// Bytes of pack files kept (including the repacked ones' new packs).
    pub bytes_kept: u64,
    /// Crash leftovers removed (temp files, packs without index).
    pub leftovers_deleted: u64,
    /// Deleted manifests/trees purged from the trash.
    pub trash_purged: u64,
    /// Stale lease files removed.
    pub stale_leases: u64,
    /// Frames fetched from the blob tier and kept for another process of this host (crate::kept), removed once
    /// older than the grace period.
    #[serde(default)]
    pub kept_frames_deleted: u64,
    /// Copies of the tier's pack indexes and trees (and its listing) kept likewise (`blob-idx/`, `blob-trees/`),
    /// removed once older than the grace period: a later process fetches them again.
    #[serde(default)]
    pub kept_copies_deleted: u64,
    /// Bytes freed on disk.
    pub bytes_freed: u64,
}

/// What fsck found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FsckReport {
    /// No errors.
    pub ok: bool,
    /// Packs checked.
    pub packs: u64,
    /// Frames verified.
    pub frames: u64,
    /// Objects (blocks) verified.
    pub objects: u64,
    /// Plain bytes verified.
    pub bytes: u64,
    /// Manifests checked.
    pub manifests: u64,
    /// Trees checked.
    pub trees: u64,
    /// Problems that lose or misrepresent data.
    pub errors: Vec<String>,
    /// Harmless leftovers (gc removes them).
    pub warnings: Vec<String>,
}

/// Sizes and counts.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StoreStats {
    /// Store directory.
    pub dir: String,
    /// Packs, frames and unique objects.
    pub packs: u64,
    /// Frames.
    pub frames: u64,
    /// Unique 4 KiB objects.
    pub objects: u64,
    /// Plain bytes of unique objects.
    pub unique_bytes: u64,
    /// Bytes of pack files on disk.
    pub pack_bytes: u64,
    /// Published manifests and their total logical size and data bytes.
    pub manifests: u64,
    /// Sum of the image sizes of all manifests.
    pub logical_bytes: u64,
    /// Sum of the non-zero bytes of all manifests.
    pub data_bytes: u64,
    /// Trees.
    pub trees: u64,
    /// Frame cache hits and misses in this process.
    pub cache_hits: u64,
    /// Misses.
    pub cache_misses: u64,
    /// Blob tier, if any.
    pub blob: Option<String>,
}

impl Store {
    fn list_manifests(&self) -> Result<Vec<ManifestId>, StoreError> {
        Ok(fsutil::list_fanout(&self.inner.manifests, "")?
            .iter()
            .filter_map(|p| fsutil::stem(p).parse().ok())
            .collect())
    }

    fn list_trees(&self) -> Result<Vec<TreeId>, StoreError> {
        Ok(fsutil::list_fanout(&self.inner.trees, "")?.iter().filter_map(|p| fsutil::stem(p).parse().ok()).collect())
    }

    /// Tell other handles (other processes) that packs went away: they resync before their next write.
    pub(crate) fn bump_gc_gen(&self) -> Result<(), StoreError> {
        let g = self.read_gc_gen() + 1;
        fsutil::write_atomic(&self.inner.tmp, &self.inner.dir.join("gcgen"), g.to_string().as_bytes())?;
        *self.inner.gc_gen.lock().unwrap_or_else(|p| p.into_inner()) = g;
        Ok(())
    }

    /// Every published tree id (local tier).
    pub fn trees(&self) -> Result<Vec<TreeId>, StoreError> {
        self.list_trees()
    }

    /// Every published manifest id.
    pub fn manifests(&self) -> Result<Vec<ManifestId>, StoreError> {
        self.list_manifests()
    }

    /// The frames every root uses; fails if a root is unreadable or names a missing frame.
    fn mark(&self, leases: &[Root], rep: &mut GcReport) -> Result<HashSet<FrameId>, StoreError> {
        let mut live = HashSet::new();
        let idx = self.read_index();
        let mut add = |what: String, m: &Manifest| -> Result<(), StoreError> {
            for f in &m.frames {
                if !idx.frames.contains_key(f) {
                    return Err(StoreError::Missing { what: what.clone(), kind: "frame", id: f.to_hex() });
                }
                live.insert(*f);
            }
            Ok(())
        };
        let mut roots: Vec<Root> = self.list_manifests()?.into_iter().map(Root::Manifest).collect();
        rep.live_manifests = roots.len() as u64;
        let trees = self.list_trees()?;
        rep.live_trees = trees.len() as u64;
        roots.extend(trees.into_iter().map(Root::Tree));
        roots.extend(leases.iter().copied());
        for r in roots {
            match r {
                Root::Manifest(id) => add(format!("manifest {id}"), &*self.manifest(&id)?)?,
                Root::Tree(id) => {
                    for m in self.tree(&id)?.manifests() {
                        add(format!("tree {id}"), m)?;
                    }
                }
            }
        }
        Ok(live)
    }

    /// Collect garbage: delete what no live manifest, tree or lease uses.
    pub fn gc(&self, dry_run: bool) -> Result<GcReport, StoreError> {
        let _lock = lock_exclusive(self, Duration::from_secs(10))?;
        self.reload_index()?;
        let grace = self.inner.cfg.gc_grace;
        let mut rep = GcReport { dry_run, ..Default::default() };
        let (leases, stale) = self.live_leases(dry_run)?;
        rep.stale_leases = stale as u64;
        rep.live_leases = leases.len() as u64;
        let live = self.mark(&leases, &mut rep)?;
        rep.live_frames = live.len() as u64;

        // Sweep packs.
        let packs: Vec<(PackId, Vec<FrameUse>)> = {
            let idx = self.read_index();
            let mut by_pack: std::collections::HashMap<PackId, Vec<FrameUse>> = Default::default();
            for (fid, loc) in idx.frames.iter() {
                by_pack.entry(loc.pack).or_default().push((*fid, loc.entry.stored_len as u64, live.contains(fid)));
            }
            for p in idx.packs.keys() {
                by_pack.entry(*p).or_default();
            }
            by_pack.into_iter().collect()
        };
        for (pid, frames) in packs {
            let ppath = pack::pack_path(&self.inner.packs, &pid);
            let ipath = pack::idx_path(&self.inner.packs, &pid);
            let live_bytes: u64 = frames.iter().filter(|f| f.2).map(|f| f.1).sum();
            let dead = frames.iter().filter(|f| !f.2).count() as u64;
            let size = std::fs::metadata(&ppath).map(|m| m.len()).unwrap_or(0);
            if !is_older_than(&ipath, grace) {
                rep.packs_kept += 1;
                rep.packs_kept_young += 1;
                rep.bytes_kept += size;
                continue;
            }
            if dead == 0 {
                rep.packs_kept += 1;
                rep.bytes_kept += size;
                continue;
            }
            if live_bytes == 0 {
                rep.packs_deleted += 1;
            } else if live_bytes * 2 < size {
                rep.packs_repacked += 1;
                rep.bytes_kept += live_bytes;
                if !dry_run {
                    self.repack(&pid, &live)?;
                }
            } else {
                rep.packs_kept += 1;
                rep.bytes_kept += size;
                continue;
            }
            rep.frames_deleted += dead;
            rep.bytes_freed += size.saturating_sub(live_bytes);
            if !dry_run {
                // Index first: a pack without index is a leftover, an index without pack is damage.
                let isize = std::fs::metadata(&ipath).map(|m| m.len()).unwrap_or(0);
                rep.bytes_freed += isize;
                std::fs::remove_file(&ipath).map_err(|e| StoreError::io("delete", &ipath, e))?;
                std::fs::remove_file(&ppath).map_err(|e| StoreError::io("delete", &ppath, e))?;
                self.write_index().remove_pack(&pid);
                // A copy in the blob tier may still be named by manifests of other hosts: let it load again.
                self.inner.blob_seen.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.blob_key_of(&ipath));
            }
        }

        if !dry_run && (rep.packs_deleted > 0 || rep.packs_repacked > 0) {
            // Tell other handles (other processes) that packs went away.
            self.bump_gc_gen()?;
        }

        // Crash leftovers: packs without index, temp files.
        for p in fsutil::list_fanout(&self.inner.packs, ".pack")? {
            if !p.with_extension("idx").exists() && is_older_than(&p, grace) {
                rep.leftovers_deleted += 1;
                rep.bytes_freed += std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
                if !dry_run {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        rep.leftovers_deleted += remove_older(&self.inner.tmp, grace, dry_run, &mut rep.bytes_freed);
        // Frames kept for another process (a restore reads them within seconds of their fetch).
        let kept = self.inner.dir.join(crate::prefetch::KEPT_FRAMES);
        rep.kept_frames_deleted += remove_older(&kept, grace, dry_run, &mut rep.bytes_freed);
        for dir in [crate::store::KEPT_INDEXES, crate::tree::KEPT_TREES] {
            rep.kept_copies_deleted += remove_older(&self.inner.dir.join(dir), grace, dry_run, &mut rep.bytes_freed);
        }
        // Trash not named by a live lease.
        let leased: HashSet<String> = leases
            .iter()
            .map(|r| match r {
                Root::Manifest(m) => format!("{m}.manifest"),
                Root::Tree(t) => format!("{t}.tree"),
            })
            .collect();
        if let Ok(rd) = std::fs::read_dir(&self.inner.trash) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !leased.contains(&name) {
                    rep.trash_purged += 1;
                    if !dry_run {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
        Ok(rep)
    }

    /// Copy a pack's live frames into a new pack (verifying each), publish it.
    fn repack(&self, pid: &PackId, live: &HashSet<FrameId>) -> Result<(), StoreError> {
        let ipath = pack::idx_path(&self.inner.packs, pid);
        let frames = load_idx_file(&ipath, pid)?;
        let ppath = pack::pack_path(&self.inner.packs, pid);
        let f = std::fs::File::open(&ppath).map_err(|e| StoreError::io("open pack", &ppath, e))?;
        let mut w = PackWriter::create(&self.inner.tmp)?;
        for e in frames.into_iter().filter(|e| live.contains(&e.id())) {
            let mut buf = vec![0u8; e.stored_len as usize];
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, e.offset)
                .map_err(|er| StoreError::io("read pack", &ppath, er))?;
            pack::decode_frame(buf.clone(), &e, &|| ppath.display().to_string())?;
            w.add(&buf, e.raw_len, e.codec, e.objects)?;
        }
        let (nid, npath, nframes) = w.finish(&self.inner.packs, &self.inner.tmp)?;
        self.blob_upload(&npath)?;
        self.blob_upload(&pack::idx_path(&self.inner.packs, &nid))?;
        // The old pack's frames must stop resolving to it before it is deleted.
        let mut idx = self.write_index();
        idx.remove_pack(pid);
        idx.add_pack(nid, nframes);
        Ok(())
    }

    /// Verify every pack, frame, object, manifest and tree. Never changes anything.
    pub fn fsck(&self) -> Result<FsckReport, StoreError> {
        let mut rep = FsckReport::default();
        let mut known: HashSet<FrameId> = HashSet::new();
        for ipath in fsutil::list_fanout(&self.inner.packs, ".idx")? {
            rep.packs += 1;
            let Ok(pid) = fsutil::stem(&ipath).parse::<PackId>() else {
                rep.warnings.push(format!("{}: not a pack index name", ipath.display()));
                continue;
            };
            let frames = match load_idx_file(&ipath, &pid) {
                Ok(f) => f,
                Err(e) => {
                    rep.errors.push(e.to_string());
                    continue;
                }
            };
            let ppath = pack::pack_path(&self.inner.packs, &pid);
            if !ppath.exists() {
                if self.inner.blob.is_some() {
                    rep.warnings.push(format!("pack {pid} is only in the blob tier"));
                    known.extend(frames.iter().map(|f| f.id()));
                } else {
                    rep.errors.push(format!("pack {pid}: index present but {} is missing", ppath.display()));
                }
                continue;
            }
            match pack::read_trailer(&ppath) {
                Ok(t) if PackId::of(&t) == pid => {}
                Ok(_) => rep.errors.push(format!("pack {pid}: trailer index differs from {}", ipath.display())),
                Err(e) => rep.errors.push(e.to_string()),
            }
            let idx = self.read_index();
            for e in frames {
                let fid = e.id();
                let loc = crate::index::FrameLoc { pack: pid, entry: std::sync::Arc::new(e) };
                match self.load_frame_at(&loc) {
                    Ok(raw) => {
                        rep.frames += 1;
                        rep.objects += loc.entry.objects.len() as u64;
                        rep.bytes += raw.len() as u64;
                        known.insert(fid);
                    }
                    Err(er) => rep.errors.push(er.to_string()),
                }
                if !idx.frames.contains_key(&fid) {
                    rep.warnings.push(format!("frame {fid} of pack {pid} was not loaded at open"));
                }
            }
        }
        // Frames only the blob tier holds (packs other hosts wrote): verify them there.
        if self.inner.blob.is_some() {
            if let Err(e) = self.refresh_from_blob() {
                rep.errors.push(e.to_string());
            }
            let remote: Vec<(FrameId, crate::index::FrameLoc)> = {
                let idx = self.read_index();
                idx.frames.iter().filter(|(f, _)| !known.contains(*f)).map(|(f, l)| (*f, l.clone())).collect()
            };
            let n = remote.len();
            for (fid, loc) in remote {
                match self.load_frame_at(&loc) {
                    Ok(raw) => {
                        rep.frames += 1;
                        rep.objects += loc.entry.objects.len() as u64;
                        rep.bytes += raw.len() as u64;
                        known.insert(fid);
                    }
                    Err(er) => rep.errors.push(er.to_string()),
                }
            }
            if n > 0 {
                rep.warnings.push(format!("{n} frames are only in the blob tier (verified there)"));
            }
        }
        for p in fsutil::list_fanout(&self.inner.packs, ".pack")? {
            if !p.with_extension("idx").exists() {
                rep.warnings.push(format!("{}: pack without index (an interrupted write; gc removes it)", p.display()));
            }
        }
        let check = |what: String, m: &Manifest, rep: &mut FsckReport| {
            for f in &m.frames {
                if !known.contains(f) {
                    rep.errors.push(format!("{what} names frame {f}, which no pack holds intact"));
                }
            }
        };
        for id in self.list_manifests()? {
            rep.manifests += 1;
            match self.manifest(&id) {
                Ok(m) => check(format!("manifest {id}"), &m, &mut rep),
                Err(e) => rep.errors.push(e.to_string()),
            }
        }
        for id in self.list_trees()? {
            rep.trees += 1;
            match self.tree(&id) {
                Ok(t) => {
                    for m in t.manifests() {
                        check(format!("tree {id}"), m, &mut rep);
                    }
                }
                Err(e) => rep.errors.push(e.to_string()),
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.inner.tmp) {
            let n = rd.count();
            if n > 0 {
                rep.warnings.push(format!("{n} temp files (writers in flight or interrupted; gc removes old ones)"));
            }
        }
        for e in self.inner.load_errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if !rep.errors.contains(e) {
                rep.errors.push(e.clone());
            }
        }
        rep.ok = rep.errors.is_empty();
        Ok(rep)
    }

    /// Counts and sizes.
    pub fn stats(&self) -> Result<StoreStats, StoreError> {
        self.reload_index()?;
        let mut s = StoreStats { dir: self.inner.dir.display().to_string(), ..Default::default() };
        {
            let idx = self.dedup_index();
            s.packs = idx.packs.len() as u64;
            s.frames = idx.frames.len() as u64;
            s.objects = idx.blocks.len() as u64;
            s.unique_bytes = idx.frames.values().map(|l| l.entry.raw_len as u64).sum();
        }
        for p in fsutil::list_fanout(&self.inner.packs, ".pack")? {
            s.pack_bytes += std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
        }
        for id in self.list_manifests()? {
            s.manifests += 1;
            if let Ok(m) = self.manifest(&id) {
                s.logical_bytes += m.size;
                s.data_bytes += m.data_bytes();
            }
        }
        s.trees = self.list_trees()?.len() as u64;
        (s.cache_hits, s.cache_misses) = self.cache_counters();
        s.blob = self.inner.blob.as_ref().map(|b| b.describe().to_string());
        Ok(s)
    }
}

/// Remove (unless `dry_run`) the files directly in `dir` older than `grace`; how many, their bytes added to
/// `freed`.
fn remove_older(dir: &std::path::Path, grace: Duration, dry_run: bool, freed: &mut u64) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if is_older_than(&p, grace) {
            n += 1;
            *freed += e.metadata().map(|m| m.len()).unwrap_or(0);
            if !dry_run {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    n
}
