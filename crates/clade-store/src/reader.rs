//! Reading images: random access for the NBD server and memory loaders ([`ImageReader`]), and whole-image
//! restore into a file ([`Store::get_file`]), both verifying every block they return.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::IoCtx;
use crate::ids::ManifestId;
use crate::manifest::Manifest;
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

    /// Restore an image into `dest` (a sparse file: zero ranges are holes). Written to a temp file next to
    /// `dest` and renamed over it, so `dest` is either the old file or the whole image. Not fsynced: the
    /// destination is a working copy, the store holds the durable one.
    pub fn get_file(&self, id: &ManifestId, dest: &Path) -> Result<(), StoreError> {
        let m = self.manifest(id)?;
        let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let tmp = fsutil::temp_path(dir, ".clade-get");
        let res = (|| {
            let f = OpenOptions::new().write(true).create_new(true).open(&tmp).ctx("create", &tmp)?;
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
        // Runs of consecutive extents that use the same frame: one frame load each, in parallel.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut uses = vec![0u32; m.frames.len()];
        for (i, x) in m.extents.iter().enumerate() {
            match runs.last_mut() {
                Some((_, e)) if m.extents[*e - 1].frame == x.frame => *e = i + 1,
                _ => {
                    runs.push((i, i + 1));
                    uses[x.frame as usize] += 1;
                }
            }
        }
        let write_run = |frame: &[u8], a: usize, b: usize| -> Result<(), StoreError> {
            for x in &m.extents[a..b] {
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
        let work = |(stored, scratch): &mut (Vec<u8>, Vec<u8>), &(a, b): &(usize, usize)| -> Result<(), StoreError> {
            let fi = m.extents[a].frame as usize;
            let fid = &m.frames[fi];
            if let Some(fr) = self.cached_frame(fid) {
                return write_run(&fr, a, b);
            }
            if uses[fi] > 1 {
                let fr = self.frame(fid, true)?;
                return write_run(&fr, a, b);
            }
            let loc = self.frame_loc(fid)?;
            let location = self.read_stored(&loc, stored)?;
            let raw = crate::pack::decode_frame_in(stored, scratch, &loc.entry, &|| location.clone())?;
            write_run(raw, a, b)
        };
        runs.par_iter().try_for_each_init(|| (Vec::new(), Vec::new()), work)
    }
}

impl Store {
    /// Write a manifest's data into an existing file of the right length (zeros are left as holes).
    pub(crate) fn write_manifest_into(&self, m: &Manifest, path: &Path) -> Result<(), StoreError> {
        let f = OpenOptions::new().write(true).open(path).ctx("open", path)?;
        self.write_image_to(m, &f, path)
    }
}
