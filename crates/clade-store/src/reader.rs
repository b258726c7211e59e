//! Reading images: random access for the NBD server and memory loaders ([`ImageReader`]), and whole-image
//! restore into a file ([`Store::get_file`]), both verifying every block they return.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::error::IoCtx;
use crate::ids::{ManifestId, PackId};
use crate::manifest::Manifest;
use crate::map::PackMap;
use crate::store::Store;
use crate::{fsutil, StoreError};

/// A stretch of an image: data, or zeros that cost nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ImageExtent {
    /// Offset in the image.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// True if this stretch is zeros (holes; NBD block status can report them, copies can skip them).
    pub zero: bool,
}

/// Random access to one stored image. Cheap to clone, `Send + Sync`; concurrent readers share the store's
/// bounded frame cache (two readers of the same base decode each frame once).
#[derive(Clone)]
pub struct ImageReader {
    store: Store,
    id: ManifestId,
    manifest: Arc<Manifest>,
}

impl ImageReader {
    pub(crate) fn new(store: &Store, id: ManifestId) -> Result<Self, StoreError> {
        let manifest = store.manifest(&id)?;
        Ok(ImageReader { store: store.clone(), id, manifest })
    }

    /// The image's size in bytes.
    pub fn size(&self) -> u64 {
        self.manifest.size
    }

    /// The manifest this reader serves.
    pub fn id(&self) -> &ManifestId {
        &self.id
    }

    /// The manifest itself.
    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// Fill `buf` with the image bytes at `off` (zeros where the image is zero). Fails, naming the object,
    /// if any stored byte does not match its hash.
    pub fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let end = off.checked_add(buf.len() as u64).filter(|e| *e <= self.manifest.size).ok_or_else(|| {
            StoreError::Invalid(format!("read {off}+{} beyond image of {} bytes", buf.len(), self.manifest.size))
        })?;
        let m = &self.manifest;
        let mut pos = off;
        let mut i = m.find(off);
        while pos < end {
            let Some(x) = m.extents.get(i).filter(|x| x.offset < end) else {
                buf[(pos - off) as usize..].fill(0);
                break;
            };
            if x.offset > pos {
                buf[(pos - off) as usize..(x.offset - off) as usize].fill(0);
                pos = x.offset;
            }
            let take_end = x.end().min(end);
            let frame = self.store.frame(&m.frames[x.frame as usize], true)?;
            let fstart = (x.frame_offset as u64 + (pos - x.offset)) as usize;
            let n = (take_end - pos) as usize;
            let src = frame.get(fstart..fstart + n).ok_or_else(|| StoreError::Corrupt {
                kind: "manifest",
                id: self.id.to_hex(),
                location: "extent table".into(),
                detail: format!("extent {x:?} reaches past its frame of {} bytes", frame.len()),
            })?;
            buf[(pos - off) as usize..(take_end - off) as usize].copy_from_slice(src);
            pos = take_end;
            i += 1;
        }
        Ok(())
    }

    /// The whole image as data and zero stretches, in order, adjacent data merged.
    pub fn extents(&self) -> Vec<ImageExtent> {
        let mut out: Vec<ImageExtent> = Vec::new();
        let mut pos = 0u64;
        for x in &self.manifest.extents {
            if x.offset > pos {
                out.push(ImageExtent { offset: pos, len: x.offset - pos, zero: true });
            }
            match out.last_mut() {
                Some(l) if !l.zero && l.offset + l.len == x.offset => l.len += x.len as u64,
                _ => out.push(ImageExtent { offset: x.offset, len: x.len as u64, zero: false }),
            }
            pos = x.end();
        }
        if pos < self.manifest.size {
            out.push(ImageExtent { offset: pos, len: self.manifest.size - pos, zero: true });
        }
        out
    }
}

impl Store {
    /// Random access to a stored image.
    pub fn image(&self, id: &ManifestId) -> Result<ImageReader, StoreError> {
        ImageReader::new(self, *id)
    }

    /// Random access to an image whose manifest is at hand (a file inside a tree, which is not published on
    /// its own).
    pub fn image_of(&self, manifest: Manifest) -> ImageReader {
        ImageReader { store: self.clone(), id: manifest.id(), manifest: Arc::new(manifest) }
    }

    /// Restore an image into `dest` (a sparse file: zero ranges are holes). Written to a temp file next to
    /// `dest` and renamed over it, so `dest` is either the old file or the whole image. Not fsynced: the
    /// destination is a working copy, the store holds the durable one.
    pub fn get_file(&self, id: &ManifestId, dest: &Path) -> Result<(), StoreError> {
        let m = self.manifest(id)?;
        self.prefetch([&*m])?;
        let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let tmp = fsutil::temp_path(dir, ".clade-get");
        let res = (|| {
            let f = fsutil::new_private().open(&tmp).ctx("create", &tmp)?;
            f.set_len(m.size).ctx("set length", &tmp)?;
            self.write_image_to(&m, &f, &tmp)?;
            drop(f);
            std::fs::rename(&tmp, dest).ctx("rename into place", dest)
        })();
        if res.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        res
    }

    fn write_image_to(&self, m: &Manifest, f: &std::fs::File, path: &Path) -> Result<(), StoreError> {
        // The extents of each frame, frames in order of first use: every frame is loaded once, in parallel.
        let mut first = vec![u32::MAX; m.frames.len()];
        let mut groups: Vec<Vec<u32>> = Vec::new();
        for (i, x) in m.extents.iter().enumerate() {
            let fi = x.frame as usize;
            let g = match first.get(fi) {
                Some(&g) if g != u32::MAX => g as usize,
                Some(_) => {
                    first[fi] = groups.len() as u32;
                    groups.push(Vec::new());
                    groups.len() - 1
                }
                None => {
                    return Err(StoreError::Corrupt {
                        kind: "manifest",
                        id: m.id().to_hex(),
                        location: "extent table".into(),
                        detail: format!("extent {x:?} names frame {fi} of {}", m.frames.len()),
                    })
                }
            };
            groups[g].push(i as u32);
        }
        let write_run = |frame: &[u8], xs: &[u32]| -> Result<(), StoreError> {
            for x in xs.iter().map(|&i| &m.extents[i as usize]) {
                let s = x.frame_offset as usize;
                let src = frame.get(s..s + x.len as usize).ok_or_else(|| StoreError::Corrupt {
                    kind: "manifest",
                    id: m.id().to_hex(),
                    location: "extent table".into(),
                    detail: format!("extent {x:?} reaches past its frame"),
                })?;
                f.write_all_at(src, x.offset).ctx("write", path)?;
            }
            Ok(())
        };
        // Frames are read and verified in parallel; one writer thread does every pwrite (parallel writes
        // into one file only contend on its inode lock), so verification and writing overlap.
        let load = |pool: &Mutex<Vec<(Vec<u8>, Vec<u8>)>>, maps: &Maps, xs: &[u32]| -> Result<Loaded, StoreError> {
            let fi = m.extents[xs[0] as usize].frame as usize;
            let fid = &m.frames[fi];
            if let Some(fr) = self.cached_frame(fid) {
                return Ok(Loaded::Shared(fr));
            }
            let loc = self.frame_loc(fid)?;
            let (mut stored, mut scratch) = pool.lock().unwrap_or_else(|p| p.into_inner()).pop().unwrap_or_default();
            if let Some(map) = self.pack_map(maps, &loc.pack)? {
                // Verified straight from the page cache (no copy into a buffer), written from there.
                let e = &loc.entry;
                let path = || crate::pack::pack_path(&self.inner.packs, &loc.pack).display().to_string();
                let bytes = map.get(e.offset, e.stored_len as usize).unwrap_or_default();
                crate::pack::decode_frame_slice(bytes, &mut scratch, e, &path)?;
                if e.codec == crate::pack::Codec::Raw {
                    pool.lock().unwrap_or_else(|p| p.into_inner()).push((stored, scratch));
                    return Ok(Loaded::Mapped(map, e.offset as usize, e.stored_len as usize));
                }
                return Ok(Loaded::Own { stored, scratch, in_stored: false });
            }
            // Not in a local pack: from the blob tier. Keep the frame in the cache, since other files of a tree
            // (small files share frames) and the next restore on this host read it again.
            let location = self.read_stored(&loc, &mut stored)?;
            crate::pack::decode_frame_slice(&stored, &mut scratch, &loc.entry, &|| location.clone())?;
            let (plain, spare) = match loc.entry.codec {
                crate::pack::Codec::Raw => (stored, scratch),
                _ => (scratch, stored),
            };
            pool.lock().unwrap_or_else(|p| p.into_inner()).push((spare, Vec::new()));
            let fr = Arc::new(plain);
            self.cache().insert(*fid, fr.clone());
            Ok(Loaded::Shared(fr))
        };
        let pool = Mutex::new(Vec::new());
        let maps = Mutex::new(HashMap::new());
        if groups.len() <= 2 {
            return groups.iter().try_for_each(|xs| write_run(load(&pool, &maps, xs)?.bytes(), xs));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel::<(Loaded, &[u32])>(2 * rayon::current_num_threads());
        std::thread::scope(|scope| {
            let writer = scope.spawn(|| -> Result<(), StoreError> {
                for (l, xs) in rx {
                    write_run(l.bytes(), xs)?;
                    if let Loaded::Own { stored, scratch, .. } = l {
                        pool.lock().unwrap_or_else(|p| p.into_inner()).push((stored, scratch));
                    }
                }
                Ok(())
            });
            let read = groups.par_iter().try_for_each_with(tx, |tx, xs| {
                let l = load(&pool, &maps, xs)?;
                tx.send((l, xs.as_slice())).map_err(|_| StoreError::Invalid("the writer thread stopped".into()))
            });
            let wrote = writer.join().unwrap_or_else(|_| Err(StoreError::Invalid("the writer thread panicked".into())));
            // The writer's error explains a reader's "stopped".
            wrote.and(read)
        })
    }
}

/// A verified frame on its way to the writer thread.
enum Loaded {
    /// Read for this restore only: the plain bytes are `stored` (raw frame) or `scratch` (decompressed).
    Own { stored: Vec<u8>, scratch: Vec<u8>, in_stored: bool },
    /// From the shared cache.
    Shared(Arc<Vec<u8>>),
    /// A raw frame, verified in place in a pack map: (map, offset, length).
    Mapped(Arc<PackMap>, usize, usize),
}

type Maps = Mutex<HashMap<PackId, Option<Arc<PackMap>>>>;

impl Store {
    /// The map of a local pack, made once per restore (`None`: not in the local tier).
    fn pack_map(&self, maps: &Maps, pack: &PackId) -> Result<Option<Arc<PackMap>>, StoreError> {
        if let Some(m) = maps.lock().unwrap_or_else(|p| p.into_inner()).get(pack) {
            return Ok(m.clone());
        }
        let m = PackMap::open(&crate::pack::pack_path(&self.inner.packs, pack))?.map(Arc::new);
        maps.lock().unwrap_or_else(|p| p.into_inner()).insert(*pack, m.clone());
        Ok(m)
    }
}

impl Loaded {
    fn bytes(&self) -> &[u8] {
        match self {
            Loaded::Own { stored, in_stored: true, .. } => stored,
            Loaded::Own { scratch, .. } => scratch,
            Loaded::Shared(f) => f,
            Loaded::Mapped(m, off, len) => m.get(*off as u64, *len).unwrap_or_default(),
        }
    }
}

impl Store {
    /// Write a manifest's data into an existing file of the right length (zeros are left as holes).
    pub(crate) fn write_manifest_into(&self, m: &Manifest, path: &Path) -> Result<(), StoreError> {
        let f = OpenOptions::new().write(true).open(path).ctx("open", path)?;
        self.write_image_to(m, &f, path)
    }
}
