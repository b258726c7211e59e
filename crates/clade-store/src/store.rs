//! The [`Store`] handle: layout on disk, opening, the frame cache, and reads through the tiers.
//!
//! Layout under the store directory:
//! ```text
//! lock                    writers hold a shared flock, gc an exclusive one
//! packs/ab/<pack>.pack    frames (+ a copy of the index in the trailer)
//! packs/ab/<pack>.idx     the pack's index, loaded at open
//! manifests/ab/<id>       published manifests (the roots gc keeps)
//! trees/ab/<id>           published directory trees (also roots)
//! trash/<id>.manifest     deleted manifests, kept while a lease names them
//! leases/<n>.lease        one per live lease, flock-held by its owner
//! tmp/                    temp files of writers in flight
//! ```

use std::num::NonZeroUsize;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use lru::LruCache;

use crate::blob::{Blob, BlobConfig};
use crate::codec::DecodeError;
use crate::error::IoCtx;
use crate::fsutil;
use crate::ids::{FrameId, ManifestId, PackId};
use crate::index::{FrameLoc, Index};
use crate::manifest::Manifest;
use crate::pack::{self, FrameEntry};
use crate::StoreError;

/// How a store is opened.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// zstd level for new frames; `None` stores them raw. Default `Some(1)` (see docs/store.md).
    pub compression_level: Option<i32>,
    /// Bound of the decoded-frame LRU cache, in bytes. Default 256 MiB.
    pub cache_bytes: u64,
    /// Optional blob tier; puts write through to it, reads fall back to it.
    pub blob: Option<BlobConfig>,
    /// Blocks per frame (1..=256). Default 256 (1 MiB frames).
    pub frame_blocks: usize,
    /// A pack is closed when it reaches this many bytes. Default 32 MiB.
    pub pack_bytes: u64,
    /// gc leaves packs and temp files younger than this alone (writers in flight). Default 1 hour.
    pub gc_grace: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            compression_level: Some(1),
            cache_bytes: 256 << 20,
            blob: None,
            frame_blocks: 256,
            pack_bytes: 32 << 20,
            gc_grace: Duration::from_secs(3600),
        }
    }
}

/// How many locks [`Store::frame`] spreads its loads over (two frames of one stripe load one after the other).
const FRAME_LOAD_STRIPES: usize = 64;

pub(crate) struct FrameCache {
    lru: LruCache<FrameId, Arc<Vec<u8>>>,
    bytes: u64,
    limit: u64,
    pub hits: u64,
    pub misses: u64,
}

impl FrameCache {
    fn get(&mut self, id: &FrameId) -> Option<Arc<Vec<u8>>> {
        let r = self.lru.get(id).cloned();
        if r.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        r
    }
    pub(crate) fn insert(&mut self, id: FrameId, data: Arc<Vec<u8>>) {
        if data.len() as u64 > self.limit {
            return;
        }
        self.bytes += data.len() as u64;
        if let Some(old) = self.lru.put(id, data) {
            self.bytes -= old.len() as u64;
        }
        while self.bytes > self.limit {
            match self.lru.pop_lru() {
                Some((_, d)) => self.bytes -= d.len() as u64,
                None => break,
            }
        }
    }
}

pub(crate) struct Inner {
    pub dir: PathBuf,
    pub packs: PathBuf,
    pub manifests: PathBuf,
    pub trees: PathBuf,
    pub tmp: PathBuf,
    pub trash: PathBuf,
    pub leases: PathBuf,
    pub cfg: StoreConfig,
    pub index: RwLock<Index>,
    /// Whether every local `.idx` file has been loaded once (see [`Store::read_index`]).
    pub index_loaded: AtomicBool,
    /// Held while pack indexes are loaded (or the index released), so concurrent loads read each pack once.
    pub index_loading: Mutex<()>,
    pub cache: Mutex<FrameCache>,
    /// Held while a frame of the stripe is loaded into the cache ([`Store::frame`]).
    pub frame_loads: [Mutex<()>; FRAME_LOAD_STRIPES],
    pub manifest_cache: Mutex<LruCache<ManifestId, Arc<Manifest>>>,
    /// Trees read from the blob tier (a local tree is a file read): a host that resumes a sandbox from another
    /// reads each of its trees several times (verify, lay out, mount lazily), each a GET otherwise.
    pub tree_cache: Mutex<LruCache<crate::TreeId, Arc<crate::Tree>>>,
    pub blob: Option<Blob>,
    /// Held while pack indexes are read from the blob tier: a second caller waits, then finds them loaded
    /// (two threads of one restore that both miss a frame must not each conclude it is missing).
    pub blob_loading: Mutex<()>,
    /// Blob `.idx` keys already loaded.
    pub blob_seen: Mutex<std::collections::HashSet<String>>,
    /// The gc generation (`gcgen` file) the index reflects.
    pub gc_gen: Mutex<u64>,
    /// Pack indexes that could not be loaded (reported by fsck; their frames read as missing).
    pub load_errors: Mutex<Vec<String>>,
}

/// A content-addressed chunk store. Cheap to clone (an `Arc` inside), `Send + Sync`.
///
/// The API is synchronous and may block on disk or network: from async code, call it through
/// `tokio::task::spawn_blocking` (on a runtime worker it blocks that worker).
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<Inner>,
    /// Puts through this handle stay local (see [`Store::deferred`]).
    pub(crate) deferred: bool,
}

pub(crate) fn corrupt(kind: &'static str, id: String, location: &Path, e: DecodeError) -> StoreError {
    StoreError::Corrupt { kind, id, location: location.display().to_string(), detail: e.to_string() }
}

pub(crate) fn blob_key(local: &Path, dir: &Path) -> String {
    local.strip_prefix(dir).unwrap_or(local).to_string_lossy().into_owned()
}

impl Store {
    /// Open (creating if needed) the store in `dir`. Its pack indexes are loaded on first use, not here: on a
    /// store of a few GB that load is ~0.4 s and ~200 MB of memory, which every CLI command and every
    /// sandbox's supervisor paid at open whether it read the store or not (`clade ls`, a ct restore from
    /// images already laid out on this host).
    pub fn open(dir: &Path, cfg: StoreConfig) -> Result<Store, StoreError> {
        if cfg.frame_blocks == 0 || cfg.frame_blocks > 256 {
            return Err(StoreError::Invalid(format!("frame_blocks must be 1..=256, not {}", cfg.frame_blocks)));
        }
        let inner = Inner {
            dir: dir.to_path_buf(),
            packs: dir.join("packs"),
            manifests: dir.join("manifests"),
            trees: dir.join("trees"),
            tmp: dir.join("tmp"),
            trash: dir.join("trash"),
            leases: dir.join("leases"),
            cache: Mutex::new(FrameCache {
                lru: LruCache::unbounded(),
                bytes: 0,
                limit: cfg.cache_bytes,
                hits: 0,
                misses: 0,
            }),
            frame_loads: std::array::from_fn(|_| Mutex::new(())),
            manifest_cache: Mutex::new(LruCache::new(NonZeroUsize::new(64).unwrap_or(NonZeroUsize::MIN))),
            tree_cache: Mutex::new(LruCache::new(NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN))),
            blob: cfg.blob.as_ref().map(Blob::open).transpose()?,
            blob_loading: Mutex::new(()),
            blob_seen: Mutex::new(Default::default()),
            load_errors: Mutex::new(Vec::new()),
            gc_gen: Mutex::new(0),
            index: RwLock::new(Index::default()),
            index_loaded: AtomicBool::new(false),
            index_loading: Mutex::new(()),
            cfg,
        };
        for d in [&inner.dir, &inner.packs, &inner.manifests, &inner.trees, &inner.tmp, &inner.trash, &inner.leases] {
            fsutil::ensure_dir(d)?;
        }
        let lock = inner.dir.join("lock");
        crate::lease::lock_options().open(&lock).ctx("create lock file", &lock)?;
        let store = Store { inner: Arc::new(inner), deferred: false };
        *store.inner.gc_gen.lock().unwrap_or_else(|p| p.into_inner()) = store.read_gc_gen();
        Ok(store)
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.cfg
    }

    /// Load any `.idx` files not yet in the index (packs written by other processes since open). Loads are
    /// serialised: a second caller meanwhile waits and then finds those packs loaded (no pack read twice).
    pub fn reload_index(&self) -> Result<(), StoreError> {
        let _once = self.inner.index_loading.lock().unwrap_or_else(|p| p.into_inner());
        self.load_new_indexes()?;
        self.inner.index_loaded.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether the pack indexes have been loaded into memory yet (they are on first use).
    pub fn index_loaded(&self) -> bool {
        self.inner.index_loaded.load(Ordering::Acquire)
    }

    fn load_new_indexes(&self) -> Result<(), StoreError> {
        let files = fsutil::list_fanout(&self.inner.packs, ".idx")?;
        for f in files {
            let Ok(id) = fsutil::stem(&f).parse::<PackId>() else { continue };
            if self.raw_index().packs.contains_key(&id) {
                continue;
            }
            match load_idx_file(&f, &id) {
                Ok(frames) => self.raw_index_mut().add_pack(id, frames),
                Err(e) => self.note_load_error(e.to_string()),
            }
        }
        Ok(())
    }

    fn note_load_error(&self, msg: String) {
        let mut errs = self.inner.load_errors.lock().unwrap_or_else(|p| p.into_inner());
        if !errs.contains(&msg) {
            errs.push(msg);
        }
    }

    /// Forget the in-memory index and the trees cached from the blob tier (loaded again on next use): a long-lived process that wrote a mark
    /// and will mostly sit idle (a ct sandbox's supervisor) gives its ~200 MB back. Readers that hold the
    /// index meanwhile finish first (the write lock waits for them).
    pub fn release_index(&self) {
        let _once = self.inner.index_loading.lock().unwrap_or_else(|p| p.into_inner());
        let mut idx = self.raw_index_mut();
        *idx = Index::default();
        self.inner.index_loaded.store(false, Ordering::Release);
        self.inner.blob_seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.inner.tree_cache.lock().unwrap_or_else(|p| p.into_inner()).clear();
        drop(idx);
        crate::trim::return_free_memory();
    }

    /// Forget only the dedup table (rebuilt by the next writer); the frames stay for readers (a vm
    /// sandbox's disk server keeps reading through them).
    pub fn release_dedup(&self) {
        let mut idx = self.raw_index_mut();
        idx.blocks = Default::default();
        idx.blocks_built = false;
        drop(idx);
        crate::trim::return_free_memory();
    }

    /// Loads every local pack index the first time anything needs the index. A failure to list the packs
    /// is kept with the load errors (fsck reports them) and retried on the next use.
    fn ensure_index(&self) {
        if self.inner.index_loaded.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.reload_index() {
            self.note_load_error(format!("listing the pack indexes: {e}"));
        }
    }

    pub(crate) fn read_gc_gen(&self) -> u64 {
        std::fs::read_to_string(self.inner.dir.join("gcgen")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    /// After a gc (here or in another process) deleted packs: forget packs whose index is gone.
    pub(crate) fn sync_after_gc(&self) -> Result<(), StoreError> {
        let now = self.read_gc_gen();
        let mut seen = self.inner.gc_gen.lock().unwrap_or_else(|p| p.into_inner());
        if *seen == now {
            return Ok(());
        }
        if self.inner.blob.is_some() {
            // A gc of either tier ran: frames may have lost a pack here or there; load both tiers afresh.
            *seen = now;
            drop(seen);
            return self.rebuild_index();
        }
        let gone: Vec<PackId> = self
            .read_index()
            .packs
            .keys()
            .filter(|p| !pack::idx_path(&self.inner.packs, p).exists())
            .copied()
            .collect();
        let mut idx = self.write_index();
        for p in gone {
            idx.remove_pack(&p);
        }
        drop(idx);
        *seen = now;
        drop(seen);
        self.reload_index()
    }

    /// The index, loaded first if this is its first use.
    pub(crate) fn read_index(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.ensure_index();
        self.raw_index()
    }

    pub(crate) fn write_index(&self) -> std::sync::RwLockWriteGuard<'_, Index> {
        self.ensure_index();
        self.raw_index_mut()
    }

    /// The index with its dedup table built (for writers: the first one in a process builds it).
    pub(crate) fn dedup_index(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        let idx = self.read_index();
        if idx.blocks_built {
            return idx;
        }
        drop(idx);
        self.write_index().build_blocks();
        self.read_index()
    }

    /// The index as it is, loaded or not (for the loading itself).
    pub(crate) fn raw_index(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        self.inner.index.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn raw_index_mut(&self) -> std::sync::RwLockWriteGuard<'_, Index> {
        self.inner.index.write().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn cache(&self) -> std::sync::MutexGuard<'_, FrameCache> {
        self.inner.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn manifest_path(&self, id: &ManifestId) -> PathBuf {
        self.inner.manifests.join(id.fanout()).join(id.to_hex())
    }

    /// Load pack indexes from the blob tier that are not known yet (a LIST of the tier's indexes). Returns how
    /// many were added.
    pub(crate) fn refresh_from_blob(&self) -> Result<usize, StoreError> {
        let Some(blob) = &self.inner.blob else { return Ok(0) };
        let _once = self.inner.blob_loading.lock().unwrap_or_else(|p| p.into_inner());
        self.list_and_load(blob)
    }

    /// Load the blob tier's indexes of `packs` that this store has not loaded (kept copies first), without a
    /// LIST of the tier: a host that takes a sandbox from another is told the packs its mark needs (its state
    /// record names them), and a tier holds many more. Returns how many were added. They are noted in the
    /// host's kept listing for its other processes ([`Store::locate_in_blob`]).
    pub fn load_blob_packs(&self, packs: &[PackId]) -> Result<usize, StoreError> {
        let Some(blob) = &self.inner.blob else { return Ok(0) };
        let keys: Vec<String> =
            packs.iter().map(|p| blob_key(&pack::idx_path(&self.inner.packs, p), &self.inner.dir)).collect();
        let _once = self.inner.blob_loading.lock().unwrap_or_else(|p| p.into_inner());
        let mut listed = self.recent_listing().unwrap_or_default();
        listed.extend(keys.iter().cloned());
        listed.sort();
        listed.dedup();
        self.keep(KEPT_INDEXES, LISTED, listed.join("\n").as_bytes());
        self.load_blob_indexes(blob, keys)
    }

    /// The kept listing's keys if it is younger than [`LISTED_FRESH`].
    fn recent_listing(&self) -> Option<Vec<String>> {
        let path = self.inner.dir.join(KEPT_INDEXES).join(LISTED);
        let fresh = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age < LISTED_FRESH));
        if !fresh {
            return None;
        }
        let text = std::fs::read_to_string(&path).ok()?;
        Some(text.lines().filter(|k| k.ends_with(".idx")).map(String::from).collect())
    }

    /// [`Store::refresh_from_blob`] with `blob_loading` held: LIST, then load what is new. The listing is kept
    /// for the other processes of this host ([`Store::locate_in_blob`]).
    fn list_and_load(&self, blob: &crate::blob::Blob) -> Result<usize, StoreError> {
        let all: Vec<String> = blob.list("packs")?.into_iter().filter(|k| k.ends_with(".idx")).collect();
        self.keep(KEPT_INDEXES, LISTED, all.join("\n").as_bytes());
        self.load_blob_indexes(blob, all)
    }

    /// Load the indexes `keys` not loaded yet: kept copies first (crate::kept), the rest fetched several at once
    /// (a host joining a tier reads them all). A key gone from the tier meanwhile is skipped.
    fn load_blob_indexes(&self, blob: &crate::blob::Blob, keys: Vec<String>) -> Result<usize, StoreError> {
        let seen = |k: &String| self.inner.blob_seen.lock().unwrap_or_else(|p| p.into_inner()).contains(k);
        let keys: Vec<String> = keys.into_iter().filter(|k| !seen(k)).collect();
        let name = |k: &str| k.rsplit('/').next().unwrap_or("").to_string();
        let ids: Vec<Option<PackId>> = keys.iter().map(|k| fsutil::stem(Path::new(&name(k))).parse().ok()).collect();
        let mut got: Vec<Option<Vec<u8>>> = keys
            .iter()
            .zip(&ids)
            .map(|(k, id)| id.as_ref().and_then(|id| self.kept(KEPT_INDEXES, &name(k), |b| PackId::of(b) == *id)))
            .collect();
        let missing: Vec<String> = keys.iter().zip(&got).filter(|(_, g)| g.is_none()).map(|(k, _)| k.clone()).collect();
        let mut fetched = blob.get_many(&missing)?.into_iter();
        for (k, g) in keys.iter().zip(got.iter_mut()) {
            if g.is_none() {
                *g = fetched.next().flatten();
                if let Some(b) = g.as_ref() {
                    self.keep(KEPT_INDEXES, &name(k), b);
                }
            }
        }
        let mut added = 0;
        for ((k, got), id) in keys.iter().zip(got).zip(ids) {
            let Some(id) = id else { continue };
            if let Some(bytes) = got {
                if PackId::of(&bytes) != id {
                    return Err(StoreError::Corrupt {
                        kind: "pack index",
                        id: id.to_hex(),
                        location: format!("{}/{k}", blob.describe()),
                        detail: "bytes do not hash to the pack id".into(),
                    });
                }
                let frames = pack::decode_index(&bytes).map_err(|e| StoreError::Corrupt {
                    kind: "pack index",
                    id: id.to_hex(),
                    location: format!("{}/{k}", blob.describe()),
                    detail: e.to_string(),
                })?;
                self.write_index().add_pack(id, frames);
                added += 1;
            }
            self.inner.blob_seen.lock().unwrap_or_else(|p| p.into_inner()).insert(k.clone());
        }
        Ok(added)
    }

    pub(crate) fn frame_loc(&self, id: &FrameId) -> Result<FrameLoc, StoreError> {
        if let Some(l) = self.read_index().frames.get(id) {
            return Ok(l.clone());
        }
        // Another process may have published it, locally or in the blob tier.
        self.reload_index()?;
        if let Some(l) = self.read_index().frames.get(id) {
            return Ok(l.clone());
        }
        if let Some(l) = self.locate_in_blob(id)? {
            return Ok(l);
        }
        Err(StoreError::NotFound {
            kind: "frame",
            id: id.to_hex(),
            blob: if self.inner.blob.is_some() { ", blob tier" } else { "" },
        })
    }

    /// Where frame `id` is, from the blob tier's pack indexes; `None` when a LIST of the tier, begun after this
    /// call, does not find it. Cheaper ways first: the indexes another thread loaded while this one waited for
    /// it (a LIST, or the packs a record names: `Store::load_blob_packs`), then a listing another process of
    /// this host made moments ago (each looked up again whatever it added: the index holding the frame may have
    /// come from elsewhere meanwhile).
    fn locate_in_blob(&self, id: &FrameId) -> Result<Option<FrameLoc>, StoreError> {
        let Some(blob) = &self.inner.blob else { return Ok(None) };
        let look = || self.read_index().frames.get(id).cloned();
        let _once = self.inner.blob_loading.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = look() {
            return Ok(Some(l));
        }
        // The tier's index keys another process of this host listed moments ago (the command that took a
        // sandbox from another host, then its supervisor), without a LIST of its own (~45 ms on a 3-node
        // Garage). Once per process: the keys are then seen.
        let recent = self.recent_listing().unwrap_or_default();
        if self.load_blob_indexes(blob, recent)? > 0 {
            if let Some(l) = look() {
                return Ok(Some(l));
            }
        }
        self.list_and_load(blob)?;
        Ok(look())
    }

    /// Read and verify a frame from the local tier, else the blob tier (no caching).
    pub(crate) fn load_frame(&self, id: &FrameId) -> Result<Vec<u8>, StoreError> {
        let loc = self.frame_loc(id)?;
        self.load_frame_at(&loc)
    }

    pub(crate) fn load_frame_at(&self, loc: &FrameLoc) -> Result<Vec<u8>, StoreError> {
        let mut buf = Vec::new();
        let location = self.read_stored(loc, &mut buf)?;
        pack::decode_frame(buf, &loc.entry, &|| location.clone())
    }

    /// Read a frame's stored bytes into `buf` (local pack, else blob tier); returns where they came from.
    pub(crate) fn read_stored(&self, loc: &FrameLoc, buf: &mut Vec<u8>) -> Result<String, StoreError> {
        let e: &FrameEntry = &loc.entry;
        let path = pack::pack_path(&self.inner.packs, &loc.pack);
        match std::fs::File::open(&path) {
            Ok(f) => {
                buf.resize(e.stored_len as usize, 0);
                let mut got = 0usize;
                while got < buf.len() {
                    let n = f.read_at(&mut buf[got..], e.offset + got as u64).ctx("read pack", &path)?;
                    if n == 0 {
                        break;
                    }
                    got += n;
                }
                buf.truncate(got);
                Ok(path.display().to_string())
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                let Some(blob) = &self.inner.blob else {
                    return Err(StoreError::Missing {
                        what: format!("the index of pack {}", loc.pack),
                        kind: "pack file",
                        id: path.display().to_string(),
                    });
                };
                // Another process of this host may have fetched it already (crate::kept).
                if let Some(kept) = self.kept_stored(e) {
                    *buf = kept;
                    return Ok(format!("{}/{}", crate::prefetch::KEPT_FRAMES, e.id()));
                }
                let key = blob_key(&path, &self.inner.dir);
                *buf = blob.get_range(&key, e.offset..e.offset + e.stored_len as u64)?;
                Ok(format!("{}/{key}", blob.describe()))
            }
            Err(err) => Err(StoreError::io("open pack", &path, err)),
        }
    }

    /// The cached copy of a frame, if any.
    pub(crate) fn cached_frame(&self, id: &FrameId) -> Option<Arc<Vec<u8>>> {
        self.cache().get(id)
    }

    /// A verified frame through the LRU cache. `keep` = insert into the cache on a miss.
    pub(crate) fn frame(&self, id: &FrameId, keep: bool) -> Result<Arc<Vec<u8>>, StoreError> {
        if let Some(f) = self.cache().get(id) {
            return Ok(f);
        }
        if !keep {
            return Ok(Arc::new(self.load_frame(id)?));
        }
        // Readers of one frame at once (a file read through a lazy mount, its 128 KiB requests answered in
        // parallel) wait for the first to load it rather than each fetching it from the blob tier: one lock
        // per stripe of frame ids, and a look into the cache again once it is held.
        let _one =
            self.inner.frame_loads[usize::from(id.0[0]) % FRAME_LOAD_STRIPES].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = self.cache().lru.get(id).cloned() {
            return Ok(f);
        }
        let data: Arc<Vec<u8>> = Arc::new(self.load_frame(id)?);
        self.cache().insert(*id, data.clone());
        Ok(data)
    }

    /// Cache hits and misses so far.
    pub fn cache_counters(&self) -> (u64, u64) {
        let c = self.cache();
        (c.hits, c.misses)
    }

    /// Read a manifest (local tier, then blob tier), verified against its id.
    pub fn manifest(&self, id: &ManifestId) -> Result<Arc<Manifest>, StoreError> {
        if let Some(m) = self.inner.manifest_cache.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
            return Ok(m.clone());
        }
        let path = self.manifest_path(id);
        let (bytes, location) = match fsutil::read_opt(&path)? {
            Some(b) => (b, path.display().to_string()),
            None => {
                let trash = self.inner.trash.join(format!("{id}.manifest"));
                match fsutil::read_opt(&trash)? {
                    Some(b) => (b, trash.display().to_string()),
                    None => self.blob_get_root(&path, "manifest", &id.to_hex())?,
                }
            }
        };
        if ManifestId::of(&bytes) != *id {
            return Err(StoreError::Corrupt {
                kind: "manifest",
                id: id.to_hex(),
                location,
                detail: "bytes do not hash to the manifest id".into(),
            });
        }
        let m = Manifest::decode(&bytes).map_err(|e| corrupt("manifest", id.to_hex(), Path::new(&location), e))?;
        let m = Arc::new(m);
        self.inner.manifest_cache.lock().unwrap_or_else(|p| p.into_inner()).put(*id, m.clone());
        Ok(m)
    }

    pub(crate) fn blob_get_root(
        &self,
        path: &Path,
        kind: &'static str,
        id: &str,
    ) -> Result<(Vec<u8>, String), StoreError> {
        let not_found = || StoreError::NotFound {
            kind,
            id: id.to_string(),
            blob: if self.inner.blob.is_some() { ", blob tier" } else { "" },
        };
        let Some(blob) = &self.inner.blob else { return Err(not_found()) };
        let key = blob_key(path, &self.inner.dir);
        match blob.get(&key)? {
            Some(b) => Ok((b, format!("{}/{key}", blob.describe()))),
            None => Err(not_found()),
        }
    }

    /// True if a manifest with this id is published (local tier).
    pub fn has_manifest(&self, id: &ManifestId) -> bool {
        self.manifest_path(id).exists()
    }

    /// The same store, whose puts do not write through to the blob tier: what they store stays local until
    /// [`Store::push_roots`] uploads it, several objects at once (writing through uploads each pack as it is
    /// published, one at a time). Reads still fall back to the blob tier.
    pub fn deferred(&self) -> Store {
        Store { inner: self.inner.clone(), deferred: true }
    }

    /// The blob tier puts write through to: none without one, or through a [`Store::deferred`] handle.
    fn write_through(&self) -> Option<&Blob> {
        self.inner.blob.as_ref().filter(|_| !self.deferred)
    }

    /// Write a local file through to the blob tier under the same relative key (no-op without a blob tier,
    /// or through a [`Store::deferred`] handle).
    pub(crate) fn blob_upload(&self, path: &Path) -> Result<(), StoreError> {
        let Some(blob) = self.write_through() else { return Ok(()) };
        let data = std::fs::read(path).ctx("read", path)?;
        blob.put(&blob_key(path, &self.inner.dir), data)
    }

    /// Note that the blob tier holds pack `id` and its index (uploaded by this process).
    pub(crate) fn blob_has_pack(&self, id: &PackId) {
        let key = blob_key(&crate::pack::idx_path(&self.inner.packs, id), &self.inner.dir);
        self.inner.blob_seen.lock().unwrap_or_else(|p| p.into_inner()).insert(key);
    }

    /// Before a root naming `manifests` is written through to the blob tier: make sure the blob tier holds
    /// every pack their frames live in, uploading (pack, then index) those it lacks. A frame deduplicated
    /// against a pack written before this home named a blob tier lives only here until then, and a root in
    /// the blob tier must never name a frame the blob tier lacks (another host reads it from there alone).
    pub(crate) fn blob_cover<'a>(&self, manifests: impl IntoIterator<Item = &'a Manifest>) -> Result<(), StoreError> {
        if self.write_through().is_none() {
            return Ok(());
        }
        self.blob_upload_packs(self.packs_of(manifests)?).map(|_| ())
    }

    /// Make sure every frame of image `id` can be found: in a local pack, else through the blob tier's pack
    /// indexes (the tier is listed once for those this host has not read). Call it from a plain thread before
    /// an async reader (an NBD export) reads the image: listing the tier is a blocking call, which a tokio
    /// worker may not make.
    pub fn locate(&self, id: &ManifestId) -> Result<(), StoreError> {
        let m = self.manifest(id)?;
        self.packs_of([&*m]).map(|_| ())
    }

    /// The packs the frames of `manifests` live in.
    pub(crate) fn packs_of<'a>(
        &self,
        manifests: impl IntoIterator<Item = &'a Manifest>,
    ) -> Result<std::collections::BTreeSet<PackId>, StoreError> {
        let mut packs = std::collections::BTreeSet::new();
        for m in manifests {
            for f in &m.frames {
                packs.insert(self.frame_loc(f)?.pack);
            }
        }
        Ok(packs)
    }

    /// Make sure the blob tier holds `packs` (each pack, then its index), uploading those it lacks several
    /// at once. Answers how many were uploaded and the bytes sent.
    pub(crate) fn blob_upload_packs(
        &self,
        packs: impl IntoIterator<Item = PackId>,
    ) -> Result<(usize, u64), StoreError> {
        let (ids, groups) = self.pack_groups(packs);
        let Some(blob) = &self.inner.blob else { return Ok((0, 0)) };
        let have = blob.has_many(&groups.iter().map(|g| g[1].0.clone()).collect::<Vec<_>>())?;
        self.blob_upload_missing(&ids, &groups, &have)
    }

    /// The packs among `packs` this process has not seen in the blob tier, with their (pack, index) files.
    pub(crate) fn pack_groups(
        &self,
        packs: impl IntoIterator<Item = PackId>,
    ) -> (Vec<PackId>, Vec<Vec<(String, PathBuf)>>) {
        let key = |path: &Path| (blob_key(path, &self.inner.dir), path.to_path_buf());
        let (mut ids, mut groups) = (Vec::new(), Vec::new());
        for p in packs {
            let idx = crate::pack::idx_path(&self.inner.packs, &p);
            if self.inner.blob_seen.lock().unwrap_or_else(|p| p.into_inner()).contains(&key(&idx).0) {
                continue;
            }
            groups.push(vec![key(&crate::pack::pack_path(&self.inner.packs, &p)), key(&idx)]);
            ids.push(p);
        }
        (ids, groups)
    }

    /// Upload the pack groups whose index the tier lacks (`have[i]` false), several at once; answers how many
    /// were uploaded and the bytes sent.
    pub(crate) fn blob_upload_missing(
        &self,
        ids: &[PackId],
        groups: &[Vec<(String, PathBuf)>],
        have: &[bool],
    ) -> Result<(usize, u64), StoreError> {
        let Some(blob) = &self.inner.blob else { return Ok((0, 0)) };
        let missing: Vec<Vec<(String, PathBuf)>> =
            groups.iter().zip(have).filter(|(_, h)| !**h).map(|(g, _)| g.clone()).collect();
        let sent = blob.upload_groups(&missing)?;
        for p in ids {
            self.blob_has_pack(p);
        }
        Ok((sent.len(), sent.iter().sum()))
    }
}

/// Where copies of the tier's pack indexes are kept for the host's other processes (crate::kept).
pub(crate) const KEPT_INDEXES: &str = "blob-idx";

/// The kept listing of the tier's pack indexes (`blob-idx/.listed`, crate::kept) and how long it is trusted.
/// Its keys are only candidates: a frame still missing after them is looked for with a LIST.
const LISTED: &str = ".listed";
const LISTED_FRESH: std::time::Duration = std::time::Duration::from_secs(30);

/// Read and verify a `.idx` file.
pub(crate) fn load_idx_file(path: &Path, id: &PackId) -> Result<Vec<FrameEntry>, StoreError> {
    let bytes = std::fs::read(path).ctx("read pack index", path)?;
    if PackId::of(&bytes) != *id {
        return Err(StoreError::Corrupt {
            kind: "pack index",
            id: id.to_hex(),
            location: path.display().to_string(),
            detail: "bytes do not hash to the pack id".into(),
        });
    }
    pack::decode_index(&bytes).map_err(|e| corrupt("pack index", id.to_hex(), path, e))
}
