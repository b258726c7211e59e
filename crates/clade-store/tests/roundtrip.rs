//! Put, get, random reads, derive, dedup and trees, against a real store in a temp directory.

mod common;

use clade_store::{ImageKind, Store, BLOCK};
use common::*;
use rand::{Rng, SeedableRng};

#[test]
fn put_get_and_random_reads_match_the_input() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    // Not a multiple of 4 KiB, several frames and packs.
    let mut data = pages(1, 3000);
    data.truncate(data.len() - 1234);
    let r = s.put_bytes(&data, ImageKind::Mem).unwrap();
    let id = r.id.unwrap();
    assert_eq!(r.size, data.len() as u64);
    assert_eq!(r.bytes_new + r.bytes_dedup + r.bytes_zero, data.len() as u64);
    assert!(r.bytes_zero > 0 && r.bytes_dedup > 0, "{r:?}");
    assert_eq!(read_all(&s, &id), data);

    let reader = s.image(&id).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    for _ in 0..200 {
        let off = rng.random_range(0..data.len());
        let len = rng.random_range(0..=(data.len() - off).min(300_000));
        let mut buf = vec![1u8; len];
        reader.read_at(off as u64, &mut buf).unwrap();
        assert_eq!(buf, data[off..off + len]);
    }
    assert!(reader.read_at(data.len() as u64 - 1, &mut [0u8; 2]).is_err());

    // Extents cover the image exactly, zero stretches really are zero.
    let mut pos = 0;
    for x in reader.extents() {
        assert_eq!(x.offset, pos);
        if x.zero {
            assert!(data[x.offset as usize..(x.offset + x.len) as usize].iter().all(|b| *b == 0));
        }
        pos += x.len;
    }
    assert_eq!(pos, data.len() as u64);

    let out = d.path().join("out.bin");
    s.get_file(&id, &out).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), data);

    // A fresh handle (index loaded from disk) reads the same.
    let s2 = open(&d.path().join("s"));
    assert_eq!(read_all(&s2, &id), data);
    assert!(s2.fsck().unwrap().ok);
}

#[test]
fn identical_data_is_stored_once_across_unrelated_images() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let a = pages(2, 1000);
    let r1 = s.put_bytes(&a, ImageKind::Disk).unwrap();
    // b: a's pages shuffled in 4 KiB units at other offsets, plus 10 new pages.
    let mut b = Vec::new();
    for chunk in a.chunks(BLOCK).rev() {
        b.extend_from_slice(chunk);
    }
    b.extend_from_slice(&pages(3, 10));
    let r2 = s.put_bytes(&b, ImageKind::Other).unwrap();
    assert!(r2.bytes_new <= 10 * BLOCK as u64, "{r2:?}");
    assert_eq!(read_all(&s, r2.id.as_ref().unwrap()), b);
    assert_eq!(read_all(&s, r1.id.as_ref().unwrap()), a);
    // Same content: same manifest id, nothing new.
    let r3 = s.put_bytes(&a, ImageKind::Disk).unwrap();
    assert_eq!(r3.id, r1.id);
    assert_eq!(r3.bytes_new, 0);
    assert_eq!(r3.new_objects, 0);
}

#[test]
fn derive_applies_writes_and_zeros_over_a_base() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let base = pages(4, 2048);
    let bid = s.put_bytes(&base, ImageKind::Disk).unwrap().id.unwrap();
    let mut want = base.clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut b = s.derive(Some(&bid), base.len() as u64).unwrap();
    for _ in 0..40 {
        let p = rng.random_range(0..2048usize);
        let mut page = vec![0u8; BLOCK];
        rng.fill(&mut page[..]);
        b.write((p * BLOCK) as u64, &page).unwrap();
        want[p * BLOCK..(p + 1) * BLOCK].copy_from_slice(&page);
    }
    b.zero(100 * BLOCK as u64, 50 * BLOCK as u64).unwrap();
    want[100 * BLOCK..150 * BLOCK].fill(0);
    // A write after a zero wins.
    let page = vec![7u8; BLOCK];
    b.write(120 * BLOCK as u64, &page).unwrap();
    want[120 * BLOCK..121 * BLOCK].copy_from_slice(&page);
    assert!(b.write(3, &page).is_err(), "unaligned write must be refused");
    let r = b.finish().unwrap();
    assert!(r.bytes_new <= 41 * BLOCK as u64, "{r:?}");
    let m = s.manifest(r.id.as_ref().unwrap()).unwrap();
    assert_eq!(m.kind, ImageKind::Disk);
    assert_eq!(read_all(&s, r.id.as_ref().unwrap()), want);
    // The base is untouched.
    assert_eq!(read_all(&s, &bid), base);

    // Growing and shrinking.
    let grown = s.derive(Some(&bid), base.len() as u64 + 10_000).unwrap().finish().unwrap();
    let mut g = base.clone();
    g.resize(base.len() + 10_000, 0);
    assert_eq!(read_all(&s, grown.id.as_ref().unwrap()), g);
    let shrunk = s.derive(Some(&bid), 5000).unwrap().finish().unwrap();
    assert_eq!(read_all(&s, shrunk.id.as_ref().unwrap()), base[..5000]);
}

#[test]
fn compression_off_and_on_read_back_the_same() {
    let d = tempfile::tempdir().unwrap();
    let data = pages(6, 600);
    for level in [None, Some(1), Some(6)] {
        let cfg = clade_store::StoreConfig { compression_level: level, ..cfg() };
        let s = Store::open(&d.path().join(format!("{level:?}")), cfg).unwrap();
        let r = s.put_bytes(&data, ImageKind::Mem).unwrap();
        if level.is_some() {
            assert!(r.bytes_stored < r.bytes_new, "{r:?}");
        } else {
            assert_eq!(r.bytes_stored, r.bytes_new);
        }
        assert_eq!(read_all(&s, r.id.as_ref().unwrap()), data);
    }
}

#[test]
fn put_file_skips_unchanged_files_and_rereads_changed_ones() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let f = d.path().join("img");
    std::fs::write(&f, pages(7, 100)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let r1 = s.put_file(&f, ImageKind::Mem).unwrap();
    assert!(!r1.unchanged_file);
    let r2 = s.put_file(&f, ImageKind::Mem).unwrap();
    assert!(r2.unchanged_file);
    assert_eq!(r1.id, r2.id);
    let mut data = std::fs::read(&f).unwrap();
    data[5] ^= 1;
    std::fs::write(&f, &data).unwrap();
    let r3 = s.put_file(&f, ImageKind::Mem).unwrap();
    assert!(!r3.unchanged_file);
    assert_ne!(r3.id, r1.id);
    assert_eq!(read_all(&s, r3.id.as_ref().unwrap()), data);
}

#[test]
fn trees_round_trip_files_modes_symlinks_and_special_files() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let src = d.path().join("src");
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    std::fs::write(src.join("a/small.img"), b"tiny").unwrap();
    std::fs::write(src.join("a/b/pages-1.img"), pages(8, 300)).unwrap();
    std::fs::write(src.join("empty"), b"").unwrap();
    std::fs::set_permissions(src.join("a/small.img"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::symlink("a/small.img", src.join("link")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        src.join("fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let xattr_ok =
        rustix::fs::lsetxattr(src.join("a"), "user.clade", b"opaque", rustix::fs::XattrFlags::empty()).is_ok();

    let r = s.put_dir(&src).unwrap();
    assert_eq!((r.files, r.dirs, r.others), (3, 2, 2));
    let dest = d.path().join("dest");
    s.get_dir(&r.id, &dest).unwrap();
    assert_eq!(std::fs::read(dest.join("a/small.img")).unwrap(), b"tiny");
    assert_eq!(std::fs::read(dest.join("a/b/pages-1.img")).unwrap(), pages(8, 300));
    assert_eq!(std::fs::read(dest.join("empty")).unwrap(), b"");
    assert_eq!(std::fs::metadata(dest.join("a/small.img")).unwrap().mode() & 0o7777, 0o640);
    assert_eq!(std::fs::read_link(dest.join("link")).unwrap(), std::path::Path::new("a/small.img"));
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &std::fs::symlink_metadata(dest.join("fifo")).unwrap().file_type()
    ));
    assert_eq!(
        std::fs::metadata(dest.join("a/b/pages-1.img")).unwrap().mtime(),
        std::fs::metadata(src.join("a/b/pages-1.img")).unwrap().mtime()
    );
    if xattr_ok {
        let mut v = [0u8; 16];
        let n = rustix::fs::lgetxattr(dest.join("a"), "user.clade", &mut v).unwrap();
        assert_eq!(&v[..n], b"opaque");
    }
    // Restoring over an existing path is refused.
    assert!(s.get_dir(&r.id, &dest).is_err());
    // The same tree again stores nothing new.
    let r2 = s.put_dir(&src).unwrap();
    assert_eq!(r2.id, r.id);
    assert_eq!(r2.data.bytes_new, 0);
    assert!(s.fsck().unwrap().ok);
}

#[test]
fn concurrent_readers_share_the_cache() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let data = pages(10, 1024);
    let id = s.put_bytes(&data, ImageKind::Disk).unwrap().id.unwrap();
    let fresh = open(&d.path().join("s"));
    let r = fresh.image(&id).unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let r = r.clone();
            let data = data.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; data.len()];
                r.read_at(0, &mut buf).unwrap();
                assert_eq!(buf, data);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (hits, misses) = fresh.cache_counters();
    let frames = fresh.manifest(&id).unwrap().frames.len() as u64;
    assert!(misses <= frames * 4 && hits > 0, "hits {hits} misses {misses} frames {frames}");
}

#[test]
fn handles_are_send_sync_and_clone() {
    fn check<T: Send + Sync + Clone + 'static>() {}
    check::<Store>();
    check::<clade_store::ImageReader>();
    fn send<T: Send>() {}
    send::<clade_store::ManifestBuilder>();
    send::<clade_store::Lease>();
}

/// Opening a store reads no pack index (a CLI command or a supervisor that never touches data pays nothing);
/// the first read loads them, and a second handle sees what the first wrote.
#[test]
fn the_index_is_loaded_on_first_use_not_at_open() {
    let d = tempfile::tempdir().unwrap();
    let a = open(&d.path().join("s"));
    let data = pages(7, 600);
    let id = a.put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();

    let b = open(&d.path().join("s"));
    assert!(!b.index_loaded(), "open loaded the pack indexes");
    assert_eq!(read_all(&b, &id), data);
    assert!(b.index_loaded(), "a read did not load the pack indexes");
    // Dedup against what is on disk works from a fresh handle too: nothing new is stored.
    let c = open(&d.path().join("s"));
    let again = c.put_bytes(&data, ImageKind::Mem).unwrap();
    assert_eq!(again.bytes_new, 0, "{again:?}");
}
