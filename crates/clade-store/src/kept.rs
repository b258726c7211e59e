//! Copies of what this host read from the blob tier that another process here will read again: pack indexes
//! (`blob-idx/`) and trees (`blob-trees/`) under the store's directory.
//!
//! Why: on a host that takes a sandbox from another, the resume is several processes (the command that takes it
//! and fetches its data ahead, the heartbeat, the sandbox's supervisor), and each would otherwise GET every pack
//! index in the tier and each of the mark's trees itself (docs/roam.md). Both are named by the hash of their
//! bytes, so a copy that hashes right is the object in the tier, and one that does not (torn, lost) is fetched
//! again: the copies are written without fsync, to a temp name then renamed. They are not roots: the local gc
//! does not read them, and a copy whose object left the tier is never asked for again.

use std::path::PathBuf;

use crate::{fsutil, Store};

impl Store {
    fn kept_path(&self, kind: &str, name: &str) -> PathBuf {
        self.inner.dir.join(kind).join(name)
    }

    /// The kept copy `kind/name`, if there is one and `verify` accepts its bytes.
    pub(crate) fn kept(&self, kind: &str, name: &str, verify: impl Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        std::fs::read(self.kept_path(kind, name)).ok().filter(|b| verify(b))
    }

    /// Keep `bytes` as `kind/name` (best effort: without the copy, the next process fetches it again).
    pub(crate) fn keep(&self, kind: &str, name: &str, bytes: &[u8]) {
        let dest = self.kept_path(kind, name);
        let tmp = fsutil::temp_path(&self.inner.tmp, kind);
        let put = std::fs::create_dir_all(self.inner.dir.join(kind))
            .and_then(|()| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &dest));
        if put.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}
