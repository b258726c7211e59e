//! The lazy file with a real FUSE mount (root): it reads back the image byte for byte, through read(2) and
//! through a private mapping; a write into the mapping stays the writer's own; only what is touched is read
//! from the store; a second mapping is served from the page cache; the mount is gone after drop.

use std::io::Read;
use std::os::unix::fs::FileExt;

use clade_lazyfs::LazyFile;
use clade_store::{ImageKind, Store, StoreConfig};

fn image(n_pages: usize) -> Vec<u8> {
    // Pages of varied content, with zero runs (free in the store).
    let mut out = vec![0u8; n_pages * 4096];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for (i, p) in out.chunks_mut(4096).enumerate() {
        if i % 5 == 0 {
            continue;
        }
        for b in p.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 24) as u8;
        }
    }
    out
}

fn mounted(dir: &std::path::Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").unwrap().lines().any(|l| l.contains(&*dir.to_string_lossy()))
}

#[test]
fn privileged_lazy_file_reads_back_and_maps_privately() {
    if !std::path::Path::new("/dev/fuse").exists() {
        eprintln!("skip: no /dev/fuse on this host");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let store = Store::open(&d.path().join("store"), StoreConfig::default()).unwrap();
    let data = image(2048); // 8 MiB
    let src = d.path().join("ram");
    std::fs::write(&src, &data).unwrap();
    let id = store.put_file(&src, ImageKind::Mem).unwrap().id.unwrap();
    let mnt = d.path().join("mnt");
    let lazy = LazyFile::mount(&store, &id, &mnt, "ram").unwrap();
    assert!(mounted(&mnt));
    let path = lazy.path();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), data.len() as u64);

    // One page far in: only around it is read from the store.
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut page = vec![0u8; 4096];
    f.read_exact_at(&mut page, 1000 * 4096).unwrap();
    assert_eq!(page, data[1000 * 4096..1001 * 4096]);
    let touched = lazy.counters().bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(touched > 0 && touched <= 2 << 20, "one page read pulled {touched} bytes through FUSE");

    // A private mapping sees the image; its writes stay its own.
    // SAFETY: a private (copy-on-write) mapping of a file nobody else writes (the mount refuses writes); it
    // is dropped before the file and the mount.
    let mut map = unsafe { memmap2::MmapOptions::new().map_copy(&f).unwrap() };
    assert!(map[..] == data[..], "the mapping reads the image");
    map[4096..8192].fill(0xee);
    drop(map);
    let mut whole = Vec::new();
    std::fs::File::open(&path).unwrap().read_to_end(&mut whole).unwrap();
    assert!(whole == data, "a private write never reaches the file");
    assert_eq!(lazy.counters().errors.load(std::sync::atomic::Ordering::Relaxed), 0);

    // Served once: a second full read comes from the page cache.
    let before = lazy.counters().bytes.load(std::sync::atomic::Ordering::Relaxed);
    std::fs::File::open(&path).unwrap().read_to_end(&mut Vec::new()).unwrap();
    let after = lazy.counters().bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(before, after, "cached pages are not read again");
    assert!(f.write_at(b"x", 0).is_err(), "the file refuses writes");
    drop(f);
    drop(lazy);
    assert!(!mounted(&mnt), "unmounted on drop");
}
