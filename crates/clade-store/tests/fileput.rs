//! Storing files (`put_file_rehash`): sparse and dense files, holes anywhere, a short last block, pages
//! repeated within and across 1 MiB cells, new pages scattered among known ones, zstd on and off, small
//! frames and packs. Each is read back byte for byte and checked with fsck.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use clade_store::{ImageKind, Store, StoreConfig, BLOCK};
use common::*;
use rand::{Rng, SeedableRng};

/// Write `data` to `path`, leaving every all-zero 4 KiB page of it a hole when `sparse`.
fn write_file(path: &Path, data: &[u8], sparse: bool) {
    let _ = std::fs::remove_file(path);
    let f = std::fs::File::create(path).unwrap();
    f.set_len(data.len() as u64).unwrap();
    for (i, p) in data.chunks(BLOCK).enumerate() {
        if !sparse || p.iter().any(|b| *b != 0) {
            f.write_all_at(p, (i * BLOCK) as u64).unwrap();
        }
    }
}

/// ~9 MiB: runs of zero pages (holes when sparse), random pages, a page repeated everywhere (within one
/// cell and across cells), and a short last block.
fn image(seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n = 2300;
    let mut out = vec![0u8; n * BLOCK - 777];
    let mut i = 0;
    while i < n {
        let run = rng.random_range(1..200).min(n - i);
        let kind = rng.random_range(0..4);
        for p in i..i + run {
            let page = &mut out[p * BLOCK..((p + 1) * BLOCK).min(n * BLOCK - 777)];
            match kind {
                0 => {}
                1 => page.fill(0x5a),
                _ => rng.fill(page),
            }
        }
        i += run;
    }
    out
}

fn check(s: &Store, path: &Path, data: &[u8]) -> clade_store::PutReport {
    let r = s.put_file_rehash(path, ImageKind::Mem).unwrap();
    let id = r.id.unwrap();
    assert_eq!(r.size, data.len() as u64);
    assert_eq!(r.bytes_new + r.bytes_dedup + r.bytes_zero, data.len() as u64, "{r:?}");
    assert_eq!(read_all(s, &id), data);
    r
}

#[test]
fn files_sparse_or_dense_round_trip_and_name_the_same_manifest() {
    let d = tempfile::tempdir().unwrap();
    let configs = [
        StoreConfig { compression_level: None, ..cfg() },
        StoreConfig { compression_level: Some(1), ..cfg() },
        StoreConfig { compression_level: None, frame_blocks: 16, pack_bytes: 256 << 10, ..cfg() },
        StoreConfig { compression_level: Some(3), frame_blocks: 7, pack_bytes: 100 << 10, ..cfg() },
    ];
    for (ci, c) in configs.into_iter().enumerate() {
        let s = Store::open(&d.path().join(format!("s{ci}")), c).unwrap();
        let data = image(ci as u64);
        let (fs, fd) = (d.path().join("sparse"), d.path().join("dense"));
        write_file(&fs, &data, true);
        write_file(&fd, &data, false);
        let r1 = check(&s, &fs, &data);
        assert!(r1.bytes_new > 0 && r1.bytes_dedup > 0 && r1.bytes_zero > 0, "{r1:?}");
        // Within one put, the repeated page is stored once.
        assert!(r1.bytes_dedup >= 100 * BLOCK as u64, "{r1:?}");
        // The same content without holes: same manifest, nothing new.
        let r2 = check(&s, &fd, &data);
        assert_eq!(r2.id, r1.id, "config {ci}: a sparse and a dense copy must name the same manifest");
        assert_eq!(r2.bytes_new, 0);
        // Into a fresh store, the dense copy also names the same manifest (frames depend on content only).
        let s2 = Store::open(&d.path().join(format!("t{ci}")), s.config().clone()).unwrap();
        assert_eq!(check(&s2, &fd, &data).id, r1.id);
        let f = s.fsck().unwrap();
        assert!(f.ok, "{:?}", f.errors);
        // A fresh handle (index from disk) reads it back too.
        let s3 = Store::open(&d.path().join(format!("s{ci}")), s.config().clone()).unwrap();
        assert_eq!(read_all(&s3, r1.id.as_ref().unwrap()), data);
    }
}

#[test]
fn scattered_new_pages_are_gathered_into_full_frames() {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(&d.path().join("s"), StoreConfig { compression_level: None, ..cfg() }).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    // 48 MiB: more cells than the workers may hold ahead of their turn.
    let n = 12288;
    let mut data = vec![0u8; n * BLOCK];
    rng.fill(&mut data[..]);
    let f = d.path().join("img");
    write_file(&f, &data, false);
    let r1 = check(&s, &f, &data);
    assert_eq!(r1.new_frames, 48, "{r1:?}");
    // 2% of pages changed at random: ~245 new pages, in a single frame, not one tiny frame per 1 MiB.
    for _ in 0..245 {
        let p = rng.random_range(0..n);
        rng.fill(&mut data[p * BLOCK..(p + 1) * BLOCK]);
    }
    write_file(&f, &data, false);
    let r2 = check(&s, &f, &data);
    assert!(r2.new_objects > 230 && r2.new_frames == 1, "{r2:?}");
    assert!(s.fsck().unwrap().ok);
}

#[test]
fn empty_hole_only_and_tiny_files() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let f = d.path().join("f");
    for data in [vec![], vec![0u8; 10 << 20], vec![7u8; 1], vec![9u8; BLOCK + 1], {
        let mut v = vec![0u8; 3 << 20];
        v[(3 << 20) - 1] = 1;
        v
    }] {
        write_file(&f, &data, true);
        let r = check(&s, &f, &data);
        if data.iter().all(|b| *b == 0) {
            assert_eq!(r.bytes_zero, data.len() as u64);
        }
    }
    assert!(s.fsck().unwrap().ok);
}
