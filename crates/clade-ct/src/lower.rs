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

/// The prefix of a lower layer that is a mark's upper tree whose large files a restore left lazy
/// (crate::lazy_upper). Its owners are stored as the host saw them in the upper (a jailed sandbox's already
/// shifted), so its mount shows them unshifted; a `tree=` layer's are the template's own, shifted when mounted.
pub const UPPER_PREFIX: &str = "upper=";

/// The tree a lower-layer entry names, if it names one (`tree=` or `upper=`).
pub fn tree_of(entry: &str) -> Option<TreeId> {
    entry.strip_prefix(TREE_PREFIX).or_else(|| entry.strip_prefix(UPPER_PREFIX))?.parse().ok()
}

/// Whether any of the `:`-separated lower layers is a store tree (a sandbox from another host).
pub fn has_trees(lowers: &str) -> bool {
    lowers.split(':').any(|l| tree_of(l).is_some())
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
                let shift = if entry.starts_with(UPPER_PREFIX) { 0 } else { id_shift };
                let m = clade_lazyfs::LazyTree::mount_shifted(store, &t, &dir, shift)
                    .map_err(|e| format!("lower layer {entry}: {e}"))?;
                out.push(m.dir().display().to_string());
                mounts.push(m);
            }
            None if entry.starts_with(TREE_PREFIX) || entry.starts_with(UPPER_PREFIX) => {
                return Err(format!("lower layer {entry:?} names no tree id"))
            }
            None => out.push(entry.to_string()),
        }
    }
    Ok(out.join(":"))
}

/// How far around a faulting page the kernel reads a file mapping (mmap read-around: up to 128 KiB).
const READ_AROUND: u64 = 128 << 10;

/// Files fetched whole: the agent, whose code pages the resume's hygiene runs fault in, and the files that
/// hygiene reads (`/etc/hosts`, to name the new hostname in it). Each left in a lazily mounted lower layer was a
/// GET the sandbox waited on before it was ready (~85 ms on a 2-core host: docs/roam.md).
const WHOLE_FILES: &[&str] = &[crate::spawn::AGENT_PATH, "/etc/hosts", "/etc/hostname", "/etc/machine-id"];

/// Read the store trees among `lowers` (each a GET on a host that resumes a sandbox from another), so that later
/// reads find them in the store's tree cache. A failure is left for those reads to report.
pub fn read_trees(store: &Store, lowers: &str) {
    for t in lowers.split(':').filter_map(tree_of) {
        let _ = store.tree(&t);
    }
}

/// Fetch, several at once, the parts of the lower layers' files that CRIU will read while it restores the
/// mark's images (`mapped`: crate::images, asked only when some lower layer is a store tree): a file found first in the mark's `upper` tree or in a lower layer
/// that is a host directory is left alone, one found first in a store tree has its ranges (and the kernel's
/// read-around of them) fetched into the store's frame cache, where the lazy mount then finds them. Returns
/// (files, frames fetched); errors are the caller's to log, never fatal. The files the resume's hygiene reads
/// and the agent ([`WHOLE_FILES`]) are fetched with them. The frames are also kept on this host's disk
/// (`Store::prefetch_ranges_kept`): a pull's fetch-ahead fetches them for the supervisor that restores the
/// sandbox next, and a sibling forked here later reads them again.
pub fn prefetch_mapped(
    store: &Store,
    lowers: &str,
    upper: &clade_store::Tree,
    mapped: impl FnOnce() -> std::collections::BTreeMap<String, Vec<std::ops::Range<u64>>>,
) -> Result<(usize, usize), String> {
    if !has_trees(lowers) {
        return Ok((0, 0));
    }
    let mut wanted = mapped();
    for p in WHOLE_FILES {
        wanted.entry(p.to_string()).or_default().push(0..u64::MAX);
    }
    let mut trees = Vec::new();
    for entry in lowers.split(':').filter(|e| !e.is_empty()) {
        trees.push(match tree_of(entry) {
            Some(t) => Some(store.tree(&t).map_err(|e| format!("tree {t}: {e}"))?),
            None => None,
        });
    }
    let layers: Vec<(&str, Option<&clade_store::Tree>)> =
        lowers.split(':').filter(|e| !e.is_empty()).zip(trees.iter().map(Option::as_ref)).collect();
    let mut parts = Vec::new();
    for (path, ranges) in &wanted {
        let rel = path.trim_start_matches('/');
        if upper.entries.iter().any(|e| e.path == rel.as_bytes()) {
            continue;
        }
        for (entry, tree) in &layers {
            match tree {
                None if Path::new(entry).join(rel).symlink_metadata().is_ok() => break,
                None => {}
                Some(t) => match t.entries.iter().find(|e| e.path == rel.as_bytes()) {
                    Some(clade_store::TreeEntry { kind: clade_store::EntryKind::File(m), .. }) => {
                        parts.push((
                            m,
                            ranges
                                .iter()
                                .map(|r| r.start.saturating_sub(READ_AROUND)..r.end.saturating_add(READ_AROUND))
                                .collect(),
                        ));
                        break;
                    }
                    Some(_) => break,
                    None => {}
                },
            }
        }
    }
    let files = parts.len();
    let frames = store.prefetch_ranges_kept(&parts).map_err(|e| e.to_string())?;
    Ok((files, frames))
}

#[cfg(test)]
mod tests {
    #[test]
    fn tree_entries_are_told_from_paths() {
        let id = "ab".repeat(32);
        assert!(super::tree_of(&format!("tree={id}")).is_some());
        assert!(super::tree_of(&format!("upper={id}")).is_some());
        assert!(super::tree_of("/var/lib/clade/templates/x/rootfs").is_none());
        assert!(super::tree_of("tree=nothex").is_none());
    }
}
