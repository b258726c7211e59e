//! Large files of a mark's upper that this host does not hold are left lazy (docs/ct.md, "Lazy upper files").
//!
//! A restore copies the mark's upper onto the new sandbox's tmpfs before CRIU runs. On a host that takes a
//! sandbox from another (docs/roam.md), every byte of that upper is first fetched from the blob tier, and a
//! large file (a dataset, a model, a build output) held the sandbox back although nothing may read it soon.
//! So such a restore lays out the upper without those files and mounts the mark's upper tree itself as the
//! top lower layer (`upper=<tree>`, crate::lower): its files are fetched when first read. The rules that keep
//! the overlay the same as the mark's upper:
//! - every entry but the large files is still laid out in the real upper, which sits above the lazy layer, so
//!   the lazy layer's copies of whiteouts, small files and directories are all hidden by the same entries;
//! - a file under a directory that carries an overlay attribute (`trusted.overlay.opaque` hides the layers
//!   below; `trusted.overlay.redirect` looks them up at another path) stays in the real upper, as it would
//!   be hidden or looked for elsewhere in the lazy layer; so does a file with overlay attributes of its own;
//! - a file whose frames are all on this host stays in the real upper (a copy from local packs is fast).
//!
//! The sandbox keeps `upper=<tree>` among its lower layers, so its next mark names it and the next host
//! mounts it too. A sandbox that roams on and on would stack layers: past [`MAX_LAYERS`] lower layers, the
//! upper is laid out whole again.

use std::collections::{BTreeSet, HashSet};

use clade_store::{EntryKind, Store, Tree, TreeEntry};

/// Files at least this large may be left lazy.
pub(crate) const MIN_BYTES: u64 = 1 << 20;

/// A mark with this many lower layers has its upper laid out whole (overlayfs takes at most 500; each lazy
/// upper adds one).
pub(crate) const MAX_LAYERS: usize = 16;

/// Whether `e` carries an overlay attribute that changes what the layers below show: `opaque` (a directory
/// hides them), `redirect` (looks them up at another path), `metacopy` (a file whose data is below). Others
/// (`origin`, `impure`: what overlayfs notes of copied-up entries) change nothing here.
fn overlay_attr(e: &TreeEntry) -> bool {
    e.xattrs.iter().any(|(k, _)| {
        let name = k.strip_prefix(b"trusted.overlay.").or_else(|| k.strip_prefix(b"user.overlay."));
        name.is_some_and(|n| matches!(n, b"opaque" | b"redirect" | b"metacopy"))
    })
}

/// The paths of `upper`'s files a restore of a mark with lower layers `lowers` leaves to the lazy layer
/// (empty: the upper is laid out whole). `held_here` says whether a file's frames are all on this host.
pub(crate) fn lazy_files_by(
    upper: &Tree,
    lowers: &str,
    held_here: impl Fn(&clade_store::Manifest) -> bool,
) -> BTreeSet<Vec<u8>> {
    if lowers.split(':').filter(|e| !e.is_empty()).count() >= MAX_LAYERS {
        return BTreeSet::new();
    }
    let marked: HashSet<&[u8]> = upper
        .entries
        .iter()
        .filter(|e| matches!(e.kind, EntryKind::Dir) && overlay_attr(e))
        .map(|e| e.path.as_slice())
        .collect();
    let under_marked = |p: &[u8]| p.iter().enumerate().any(|(i, &c)| c == b'/' && marked.contains(&p[..i]));
    upper
        .entries
        .iter()
        .filter(|e| match &e.kind {
            EntryKind::File(m) => m.size >= MIN_BYTES && !overlay_attr(e) && !under_marked(&e.path) && !held_here(m),
            _ => false,
        })
        .map(|e| e.path.clone())
        .collect()
}

/// [`lazy_files_by`] with the store's answer to whether the frames are on this host.
pub(crate) fn lazy_files(store: &Store, upper: &Tree, lowers: &str) -> BTreeSet<Vec<u8>> {
    lazy_files_by(upper, lowers, |m| store.held_here(m))
}

/// Where a cached upper's layout notes the files it left out (beside the layout, named after its tree; gc
/// removes both together). Written before the layout is renamed into place.
pub(crate) fn marker_of(layout: &std::path::Path) -> std::path::PathBuf {
    layout.with_extension("lazy")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clade_store::{ImageKind, Manifest};

    fn entry(path: &str, kind: EntryKind, xattrs: &[(&str, &str)]) -> TreeEntry {
        TreeEntry {
            path: path.as_bytes().to_vec(),
            mode: 0o100644,
            uid: 0,
            gid: 0,
            mtime: (0, 0),
            xattrs: xattrs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())).collect(),
            kind,
        }
    }

    fn file(path: &str, size: u64) -> TreeEntry {
        let m = Manifest { kind: ImageKind::Other, size, frames: vec![], extents: vec![] };
        entry(path, EntryKind::File(m), &[])
    }

    fn upper() -> Tree {
        let opaque = [("trusted.overlay.opaque", "y")];
        Tree {
            entries: vec![
                entry("root", EntryKind::Dir, &[("trusted.overlay.impure", "y"), ("trusted.overlay.origin", "")]),
                file("root/data", 8 << 20),
                file("root/small", 4096),
                entry("root/fresh", EntryKind::Dir, &opaque),
                file("root/fresh/data", 8 << 20),
                entry("root/fresh/sub", EntryKind::Dir, &[]),
                file("root/fresh/sub/data", 8 << 20),
                entry("moved", EntryKind::Dir, &[("trusted.overlay.redirect", "/old")]),
                file("moved/data", 8 << 20),
                entry("root/gone", EntryKind::Special(0), &[]),
                TreeEntry {
                    xattrs: vec![(b"trusted.overlay.metacopy".to_vec(), vec![])],
                    ..file("root/meta", 8 << 20)
                },
                file("root/fresh2", 8 << 20),
            ],
        }
    }

    #[test]
    fn only_large_files_the_lazy_layer_shows_unhidden_are_left_out() {
        let lazy = lazy_files_by(&upper(), "/t/rootfs", |_| false);
        let got: Vec<&str> = lazy.iter().map(|p| std::str::from_utf8(p).unwrap()).collect();
        // Not the small file, nothing under the opaque or the redirected directory (a sibling whose name only
        // starts like one is fine), not a file with overlay attributes of its own.
        assert_eq!(got, ["root/data", "root/fresh2"]);
    }

    #[test]
    fn files_held_here_and_long_layer_stacks_are_laid_out_whole() {
        assert!(lazy_files_by(&upper(), "/t/rootfs", |_| true).is_empty(), "frames on this host: copied");
        let many = vec!["/t/rootfs"; MAX_LAYERS].join(":");
        assert!(lazy_files_by(&upper(), &many, |_| false).is_empty(), "{MAX_LAYERS} layers: laid out whole");
        let fewer = vec!["/t/rootfs"; MAX_LAYERS - 1].join(":");
        assert_eq!(lazy_files_by(&upper(), &fewer, |_| false).len(), 2);
    }
}
