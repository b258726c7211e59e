//! Fixtures of broken stores: each damage is detected, named, and nothing is deleted because of it.

mod common;

use std::path::{Path, PathBuf};

use clade_store::{ImageKind, StoreError};
use common::*;

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in std::fs::read_dir(dir).unwrap().flatten() {
        for f in std::fs::read_dir(sub.path()).unwrap().flatten() {
            if f.path().to_string_lossy().ends_with(ext) {
                out.push(f.path());
            }
        }
    }
    out.sort();
    out
}

fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x55;
    f.write_all_at(&b, at).unwrap();
}

fn count_files(dir: &Path) -> usize {
    walk(dir).len()
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

#[test]
fn corrupted_object_is_detected_named_and_never_returned() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let cfg = clade_store::StoreConfig { compression_level: None, ..cfg() };
    let s = clade_store::Store::open(&dir, cfg.clone()).unwrap();
    let data = pages(20, 200);
    let id = s.put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();
    let pack = &files(&dir.join("packs"), ".pack")[0];
    flip_byte(pack, 8 + 5000); // inside the frame, in some block
    let s = clade_store::Store::open(&dir, cfg).unwrap();
    let r = s.image(&id).unwrap();
    let mut buf = vec![0u8; data.len()];
    let err = r.read_at(0, &mut buf).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Corrupt { kind: "object", .. }), "{msg}");
    assert!(msg.contains(&pack.display().to_string()), "names the pack: {msg}");
    assert!(s.get_file(&id, &d.path().join("out")).is_err());
    assert!(!d.path().join("out").exists(), "no partial output left behind");
    let f = s.fsck().unwrap();
    assert!(!f.ok && f.errors.iter().any(|e| e.contains("corrupt object")), "{f:?}");
    // gc does not delete the damaged data (it is still referenced).
    let before = count_files(&dir);
    s.gc(false).unwrap();
    assert_eq!(count_files(&dir), before);
}

#[test]
fn corrupted_zstd_frame_is_detected() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let s = open(&dir);
    let data = vec![b'x'; 1 << 20];
    let id = s.put_bytes(&data, ImageKind::Other).unwrap().id.unwrap();
    let pack = &files(&dir.join("packs"), ".pack")[0];
    flip_byte(pack, 12);
    let s = open(&dir);
    let err = s.image(&id).unwrap().read_at(0, &mut [0u8; 4096]).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
}

#[test]
fn truncated_pack_is_a_clear_error_and_nothing_is_deleted() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let s = open(&dir);
    let data = pages(21, 300);
    let id = s.put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();
    let pack = files(&dir.join("packs"), ".pack").pop().unwrap();
    let len = std::fs::metadata(&pack).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&pack).unwrap().set_len(len / 2).unwrap();
    let s = open(&dir);
    let f = s.fsck().unwrap();
    assert!(!f.ok, "{f:?}");
    assert!(f.errors.iter().any(|e| e.contains("truncated")), "{:?}", f.errors);
    let mut buf = vec![0u8; data.len()];
    let err = s.image(&id).unwrap().read_at(0, &mut buf).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
    // A restore reads packs through a memory map: a short pack is an error there too, never a fault.
    let out = d.path().join("out");
    let err = s.get_file(&id, &out).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
    assert!(!out.exists(), "no partial output left behind");
    let before = count_files(&dir);
    s.gc(false).unwrap();
    assert_eq!(count_files(&dir), before);
}

#[test]
fn manifest_naming_a_missing_frame_stops_gc() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let s = open(&dir);
    let a = s.put_bytes(&pages(22, 100), ImageKind::Mem).unwrap().id.unwrap();
    let b = s.put_bytes(&pages(23, 100), ImageKind::Mem).unwrap().id.unwrap();
    s.delete_manifest(&b).unwrap();
    // Lose a's data: remove the index of the pack a uses.
    let m = s.manifest(&a).unwrap();
    let mut removed = false;
    for idx in files(&dir.join("packs"), ".idx") {
        let bytes = std::fs::read(&idx).unwrap();
        if bytes.windows(32).any(|_| true) {
            // find the pack holding a's first frame by trying: remove, reopen, check
            std::fs::rename(&idx, idx.with_extension("bak")).unwrap();
            let s2 = open(&dir);
            if s2.image(&a).unwrap().read_at(0, &mut vec![0u8; m.size as usize]).is_err() {
                removed = true;
                break;
            }
            std::fs::rename(idx.with_extension("bak"), &idx).unwrap();
        }
    }
    assert!(removed);
    let s = open(&dir);
    let before = count_files(&dir);
    let err = s.gc(false).unwrap_err();
    assert!(matches!(err, StoreError::Missing { .. }), "{err}");
    assert!(err.to_string().contains(&a.to_hex()), "names the manifest: {err}");
    assert_eq!(count_files(&dir), before, "gc deleted something despite the error");
    let f = s.fsck().unwrap();
    assert!(!f.ok && f.errors.iter().any(|e| e.contains(&a.to_hex())), "{f:?}");
}

#[test]
fn corrupted_manifest_and_newer_format_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let s = open(&dir);
    let id = s.put_bytes(&pages(24, 10), ImageKind::Mem).unwrap().id.unwrap();
    let mpath = files(&dir.join("manifests"), "").pop().unwrap();
    flip_byte(&mpath, 30);
    let s = open(&dir);
    let err = s.manifest(&id).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { kind: "manifest", .. }), "{err}");
    assert!(!s.fsck().unwrap().ok);
    assert!(s.gc(false).is_err(), "gc must stop on an unreadable root");
    assert!(mpath.exists());

    // A manifest written by a newer clade: correct hash, newer version.
    let mut bytes = std::fs::read(&mpath).unwrap();
    flip_byte(&mpath, 30); // restore
    bytes = {
        let mut b = std::fs::read(&mpath).unwrap();
        b[8] = 99;
        let _ = bytes;
        b
    };
    let nid = clade_store::ManifestId::of(&bytes);
    let npath = dir.join("manifests").join(nid.fanout()).join(nid.to_hex());
    std::fs::create_dir_all(npath.parent().unwrap()).unwrap();
    std::fs::write(&npath, &bytes).unwrap();
    let err = open(&dir).manifest(&nid).unwrap_err();
    assert!(err.to_string().contains("newer"), "{err}");
}

#[test]
fn corrupted_pack_index_is_reported_not_fatal() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let s = open(&dir);
    let id = s.put_bytes(&pages(25, 50), ImageKind::Mem).unwrap().id.unwrap();
    let idx = files(&dir.join("packs"), ".idx").pop().unwrap();
    flip_byte(&idx, 20);
    let s = open(&dir); // opens anyway
    let f = s.fsck().unwrap();
    assert!(!f.ok && f.errors.iter().any(|e| e.contains("pack index")), "{f:?}");
    assert!(s.image(&id).unwrap().read_at(0, &mut [0u8; 4096 * 50]).is_err());
}

#[test]
fn restore_of_many_frames_detects_a_corrupted_block_among_them() {
    // Enough frames for the parallel restore (frames verified on the pool, written by one writer thread).
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("s");
    let cfg = clade_store::StoreConfig { compression_level: None, ..cfg() };
    let s = clade_store::Store::open(&dir, cfg.clone()).unwrap();
    let data = pages(22, 4000);
    let id = s.put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();
    let out = d.path().join("out");
    s.get_file(&id, &out).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), data);
    std::fs::remove_file(&out).unwrap();
    let packs = files(&dir.join("packs"), ".pack");
    assert!(packs.len() > 1, "{packs:?}");
    let pack = &packs[packs.len() / 2];
    flip_byte(pack, 8 + 3 * 4096 + 17);
    let s = clade_store::Store::open(&dir, cfg).unwrap();
    let err = s.get_file(&id, &out).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { kind: "object", .. }), "{err}");
    assert!(err.to_string().contains(&pack.display().to_string()), "names the pack: {err}");
    assert!(!out.exists(), "no partial output left behind");
}
