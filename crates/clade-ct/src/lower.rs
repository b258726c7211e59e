//! Overlay lower layers named as store trees.
//!
//! A ct mark names its lower layers (`rootfs` role) as a `:`-separated list. An entry is a directory on this
//! host (a template's rootfs, clade's agent directory), or `tree=<id>` (`:` separates layers): a directory stored in the store, as a
//! sandbox pushed from another host names the layers that lived in that host's home (docs/roam.md). A restore
//! mounts each tree lazily ([`clade_lazyfs::LazyTree`], a read-only FUSE file system that fetches a file's
//! frames when it is first read) under the sandbox's run dir and gives overlayfs the mount points, while the
//! sandbox keeps the mark's own names, so its next mark names the same trees.

use std::path::Path;

use clade_store::{Store, TreeId};

/// The prefix of a lower layer that is a store tree.
pub const TREE_PREFIX: &str = "tree=";

/// The tree a lower-layer entry names, if it names one.
pub fn tree_of(entry: &str) -> Option<TreeId> {
    entry.strip_prefix(TREE_PREFIX)?.parse().ok()
}

/// The `lowerdir=` value for `lowers`: directories as they are, trees mounted under `run_dir/lower/<n>` (the
/// mounts are pushed onto `mounts`, which the sandbox's resources own), their owners shown shifted by
/// `id_shift` (a jailed sandbox's user namespace, crate::userns).
pub fn resolve(
    store: &Store,
    lowers: &str,
    run_dir: &Path,
    mounts: &mut Vec<clade_lazyfs::LazyTree>,
    id_shift: u32,
) -> Result<String, String> {
    let mut out = Vec::new();
    for (n, entry) in lowers.split(':').filter(|e| !e.is_empty()).enumerate() {
        match tree_of(entry) {
            Some(t) => {
                let dir = run_dir.join("lower").join(n.to_string());
                let m = clade_lazyfs::LazyTree::mount_shifted(store, &t, &dir, id_shift)
                    .map_err(|e| format!("lower layer {entry}: {e}"))?;
                out.push(m.dir().display().to_string());
                mounts.push(m);
            }
            None if entry.starts_with(TREE_PREFIX) => return Err(format!("lower layer {entry:?} names no tree id")),
            None => out.push(entry.to_string()),
        }
    }
    Ok(out.join(":"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn tree_entries_are_told_from_paths() {
        let id = "ab".repeat(32);
        assert!(super::tree_of(&format!("tree={id}")).is_some());
        assert!(super::tree_of("/var/lib/clade/templates/x/rootfs").is_none());
        assert!(super::tree_of("tree=nothex").is_none());
    }
}
