//! Pushing roots to the blob tier, and small metadata records next to them (docs/roam.md).
//!
//! Puts write through to the blob tier, so a store opened with one already holds there everything it wrote
//! since. What it wrote before (a base built before the home named a blob tier) is uploaded by
//! [`Store::push_roots`]: the manifests and trees named, and every pack a frame of theirs lives in.
//! Metadata records (`roam/...`) live beside `packs/`, `manifests/` and `trees/`, which blob gc alone
//! touches.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::ids::{ManifestId, TreeId};
use crate::manifest::Manifest;
use crate::StoreError;

/// What [`Store::push_roots`] found and uploaded.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PushReport {
    /// Packs holding the roots' frames, and how many of them had to be uploaded.
    pub packs: usize,
    pub packs_uploaded: usize,
    /// Manifests and trees uploaded (the rest were there already).
    pub roots_uploaded: usize,
    /// Bytes sent.
    pub bytes_uploaded: u64,
}

/// What [`Store::push_packs`] did and left to [`Store::push_finish`].
#[derive(Debug)]
pub struct PackedPush {
    man_files: Vec<Vec<(String, std::path::PathBuf)>>,
    tree_files: Vec<Vec<(String, std::path::PathBuf)>>,
    /// Whether the tier held each of `man_files` then `tree_files`.
    root_have: Vec<bool>,
    /// The pack groups (pack, index) the tier held already.
    present: Vec<Vec<(String, std::path::PathBuf)>>,
    /// Every pack the roots' frames live in.
    packs: Vec<crate::PackId>,
    rep: PushReport,
}

impl PackedPush {
    /// Every pack the roots' frames live in (what [`crate::Store::packs_of_roots`] answers).
    pub fn packs(&self) -> &[crate::PackId] {
        &self.packs
    }
}

/// Bytes this process read from the blob tier (frames by range, roots, pack indexes), and how many reads.
pub(crate) static FETCHED_BYTES: AtomicU64 = AtomicU64::new(0);
pub(crate) static FETCHES: AtomicU64 = AtomicU64::new(0);

pub(crate) fn count_fetch(bytes: usize) {
    FETCHED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    FETCHES.fetch_add(1, Ordering::Relaxed);
}

/// Key of a metadata record: only `[A-Za-z0-9._/-]`, under `roam/`.
fn meta_key(key: &str) -> Result<String, StoreError> {
    if key.is_empty() || key.contains("..") || !key.chars().all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c)) {
        return Err(StoreError::Invalid(format!("bad metadata key {key:?}")));
    }
    Ok(format!("roam/{key}"))
}

impl crate::Store {
    /// The blob tier's name (`s3://bucket`, `file:///dir`), or `None` when the store is local only.
    pub fn blob_tier(&self) -> Option<String> {
        self.inner.blob.as_ref().map(|b| b.describe().to_string())
    }

    /// Bytes and reads this process fetched from the blob tier so far (every store of the process).
    pub fn blob_fetched() -> (u64, u64) {
        (FETCHED_BYTES.load(Ordering::Relaxed), FETCHES.load(Ordering::Relaxed))
    }

    pub(crate) fn need_blob(&self) -> Result<&crate::blob::Blob, StoreError> {
        self.inner.blob.as_ref().ok_or_else(|| {
            StoreError::Invalid("this store has no blob tier: set CLADE_BLOB=s3://BUCKET (docs/roam.md)".into())
        })
    }

    /// The packs the frames of `manifests` and `trees` live in: what a host that reads them from the blob tier
    /// needs the indexes of ([`Store::load_blob_packs`]).
    pub fn packs_of_roots(&self, manifests: &[ManifestId], trees: &[TreeId]) -> Result<Vec<crate::PackId>, StoreError> {
        let mans = self.manifests_of_roots(manifests, trees)?;
        Ok(self.packs_of(mans.iter().map(|m| &**m))?.into_iter().collect())
    }

    /// The manifests `manifests` and those of the files of `trees`.
    fn manifests_of_roots(
        &self,
        manifests: &[ManifestId],
        trees: &[TreeId],
    ) -> Result<Vec<std::sync::Arc<Manifest>>, StoreError> {
        let mut mans: Vec<std::sync::Arc<Manifest>> = Vec::new();
        for id in manifests {
            mans.push(self.manifest(id)?);
        }
        for t in trees {
            mans.extend(self.tree(t)?.manifests().cloned().map(std::sync::Arc::new));
        }
        Ok(mans)
    }

    /// Make sure the blob tier holds `manifests`, `trees` and every pack (and its index) their frames live
    /// in, uploading what it lacks from the local tier. The caller holds a lease on the roots already.
    pub fn push_roots(&self, manifests: &[ManifestId], trees: &[TreeId]) -> Result<PushReport, StoreError> {
        let packed = self.push_packs(manifests, trees)?;
        self.push_finish(packed, false)
    }

    /// The first half of [`Store::push_roots`]: one round of HEADs for the packs (by their index) and roots the
    /// tier lacks, then the packs it lacks, several at once (each before its index). It may run while the
    /// caller's lease on the roots goes up: a pack uploaded now is younger than the blob gc's grace period, and
    /// [`Store::push_finish`] asks again for the packs that were there already.
    pub fn push_packs(&self, manifests: &[ManifestId], trees: &[TreeId]) -> Result<PackedPush, StoreError> {
        let blob = self.need_blob()?;
        let mut rep = PushReport::default();
        let mans = self.manifests_of_roots(manifests, trees)?;
        let file = |path: std::path::PathBuf| vec![(crate::store::blob_key(&path, &self.inner.dir), path)];
        let man_files: Vec<_> = manifests.iter().map(|id| file(self.manifest_path(id))).collect();
        let tree_files: Vec<_> = trees.iter().map(|t| file(self.tree_path(t))).collect();
        let packs = self.packs_of(mans.iter().map(|m| &**m))?;
        rep.packs = packs.len();
        let all: Vec<crate::PackId> = packs.iter().copied().collect();
        let (ids, groups) = self.pack_groups(packs);
        let mut keys: Vec<String> = groups.iter().map(|g| g[1].0.clone()).collect();
        keys.extend(man_files.iter().chain(&tree_files).map(|g| g[0].0.clone()));
        let have = blob.has_many(&keys)?;
        let (pack_have, root_have) = have.split_at(groups.len());
        (rep.packs_uploaded, rep.bytes_uploaded) = self.blob_upload_missing(&ids, &groups, pack_have)?;
        let present = groups.iter().zip(pack_have).filter(|(_, h)| **h).map(|(g, _)| g.clone()).collect();
        Ok(PackedPush { man_files, tree_files, root_have: root_have.to_vec(), present, packs: all, rep })
    }

    /// The second half of [`Store::push_roots`]: with `ask_again` (the lease went up while
    /// [`Store::push_packs`] ran), the packs that were in the tier already are asked for again, since a blob gc
    /// may have freed them before it could see the lease, and any gone is uploaded. Then the manifests naming
    /// their frames, then the trees naming those: a reader that finds a key finds everything it names.
    pub fn push_finish(&self, packed: PackedPush, ask_again: bool) -> Result<PushReport, StoreError> {
        let blob = self.need_blob()?;
        let PackedPush { man_files, tree_files, root_have, present, mut rep, .. } = packed;
        if ask_again && !present.is_empty() {
            let keys: Vec<String> = present.iter().map(|g| g[1].0.clone()).collect();
            let still = blob.has_many(&keys)?;
            let (n, bytes) = self.blob_upload_missing(&[], &present, &still)?;
            rep.packs_uploaded += n;
            rep.bytes_uploaded += bytes;
        }
        let mut root_have = root_have.iter();
        let mut missing = |files: Vec<Vec<(String, std::path::PathBuf)>>| -> Vec<_> {
            files.into_iter().filter(|_| !root_have.next().copied().unwrap_or(false)).collect()
        };
        let (man_files, tree_files) = (missing(man_files), missing(tree_files));
        for files in [man_files, tree_files] {
            let sent = blob.upload_groups(&files)?;
            rep.roots_uploaded += sent.len();
            rep.bytes_uploaded += sent.iter().sum::<u64>();
        }
        Ok(rep)
    }

    /// Write a small metadata record to the blob tier (`roam/KEY`).
    pub fn blob_put_meta(&self, key: &str, data: Vec<u8>) -> Result<(), StoreError> {
        self.need_blob()?.put(&meta_key(key)?, data)
    }

    /// Read a metadata record, `None` when absent.
    pub fn blob_get_meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.need_blob()?.get(&meta_key(key)?)
    }

    /// Delete a metadata record (absent is fine).
    pub fn blob_delete_meta(&self, key: &str) -> Result<(), StoreError> {
        self.need_blob()?.delete(&meta_key(key)?)
    }

    /// Keys of metadata records under `prefix` (without the `roam/`).
    pub fn blob_list_meta(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let keys = self.need_blob()?.list(&meta_key(prefix)?)?;
        Ok(keys.into_iter().filter_map(|k| k.strip_prefix("roam/").map(String::from)).collect())
    }
}
