//! Everything the store writes is its owner's alone: directories 0700, files 0600 (packs hold guest RAM and
//! disks). Under the usual umask (022) a file or directory created without an explicit mode is 0644/0755, so
//! this fails unless the store sets modes itself.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use clade_store::ImageKind;
use common::*;

fn walk(dir: &Path, out: &mut Vec<(std::path::PathBuf, bool, u32)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let md = std::fs::symlink_metadata(e.path()).unwrap();
        out.push((e.path(), md.is_dir(), md.permissions().mode() & 0o777));
        if md.is_dir() {
            walk(&e.path(), out);
        }
    }
}

#[test]
fn store_dirs_are_0700_and_files_0600() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("s");
    let s = open(&root);
    let id = s.put_bytes(&pages(3, 600), ImageKind::Mem).unwrap().id.unwrap();
    let got = d.path().join("restored.img");
    s.get_file(&id, &got).unwrap();
    let mut all = vec![(root.clone(), true, std::fs::metadata(&root).unwrap().permissions().mode() & 0o777)];
    walk(&root, &mut all);
    assert!(all.iter().any(|(p, _, _)| p.extension().is_some_and(|e| e == "pack")), "no pack written: {all:?}");
    for (p, dir, mode) in &all {
        let want = if *dir { 0o700 } else { 0o600 };
        assert_eq!(*mode, want, "{} is {mode:o}", p.display());
    }
    let restored = std::fs::metadata(&got).unwrap().permissions().mode() & 0o777;
    assert_eq!(restored, 0o600, "an image restored from the store (guest RAM, a disk) is private too");
}
