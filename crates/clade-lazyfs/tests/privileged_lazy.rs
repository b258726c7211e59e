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

#[test]
fn privileged_lazy_tree_serves_a_directory_and_works_as_an_overlay_lower() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !std::path::Path::new("/dev/fuse").exists() {
        eprintln!("skip: no /dev/fuse on this host");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let store = Store::open(&d.path().join("store"), StoreConfig::default()).unwrap();
    let src = d.path().join("src");
    std::fs::create_dir_all(src.join("usr/bin")).unwrap();
    std::fs::create_dir_all(src.join("etc/deep/er")).unwrap();
    std::fs::write(src.join("etc/hostname"), "lazy\n").unwrap();
    std::fs::write(src.join("etc/deep/er/big"), image(300)).unwrap();
    std::fs::write(src.join("usr/bin/tool"), b"#!/bin/sh\necho tool\n").unwrap();
    std::fs::set_permissions(src.join("usr/bin/tool"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::os::unix::fs::symlink("../etc/hostname", src.join("usr/name")).unwrap();
    std::os::unix::fs::chown(src.join("etc/hostname"), Some(1000), Some(1000)).unwrap();
    let _ = set_user_xattr(&src.join("etc/hostname"));
    let tree = store.put_dir(&src).unwrap().id;

    let mnt = d.path().join("lower");
    let lazy = clade_lazyfs::LazyTree::mount(&store, &tree, &mnt).unwrap();
    assert_eq!(std::fs::read_to_string(mnt.join("etc/hostname")).unwrap(), "lazy\n");
    let md = std::fs::metadata(mnt.join("etc/hostname")).unwrap();
    assert_eq!((md.uid(), md.gid()), (1000, 1000));
    assert_eq!(std::fs::metadata(mnt.join("usr/bin/tool")).unwrap().mode() & 0o7777, 0o4755);
    assert_eq!(std::fs::read_link(mnt.join("usr/name")).unwrap(), std::path::Path::new("../etc/hostname"));
    let mut names: Vec<String> =
        std::fs::read_dir(mnt.join("etc")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["deep", "hostname"]);
    let read = lazy.counters().bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(read < 100_000, "only the small file was read, not the 1.2 MB one: {read}");
    assert_eq!(std::fs::read(mnt.join("etc/deep/er/big")).unwrap(), image(300));
    assert!(std::fs::write(mnt.join("etc/new"), "x").is_err(), "read-only");
    if let Some(v) = getxattr(&mnt.join("etc/hostname")) {
        assert_eq!(v, b"kept");
    }

    // As an overlay lower layer: reads come through, writes land in the upper.
    let (upper, work, merged) = (d.path().join("upper"), d.path().join("work"), d.path().join("merged"));
    for p in [&upper, &work, &merged] {
        std::fs::create_dir_all(p).unwrap();
    }
    let opts = format!("lowerdir={},upperdir={},workdir={}", mnt.display(), upper.display(), work.display());
    nix::mount::mount(Some("overlay"), &merged, Some("overlay"), nix::mount::MsFlags::empty(), Some(opts.as_str()))
        .unwrap();
    assert_eq!(std::fs::read_to_string(merged.join("usr/name")).unwrap(), "lazy\n");
    std::fs::write(merged.join("etc/hostname"), "changed\n").unwrap();
    assert_eq!(std::fs::read_to_string(upper.join("etc/hostname")).unwrap(), "changed\n");
    assert_eq!(std::fs::read_to_string(mnt.join("etc/hostname")).unwrap(), "lazy\n");
    nix::mount::umount2(&merged, nix::mount::MntFlags::MNT_DETACH).unwrap();
    drop(lazy);
    assert!(!mounted(&mnt));
}

/// Set `user.clade=kept` (false where the file system refuses user xattrs).
fn set_user_xattr(p: &std::path::Path) -> bool {
    std::process::Command::new("setfattr")
        .args(["-n", "user.clade", "-v", "kept"])
        .arg(p)
        .status()
        .is_ok_and(|s| s.success())
}

fn getxattr(p: &std::path::Path) -> Option<Vec<u8>> {
    let out =
        std::process::Command::new("getfattr").args(["--only-values", "-n", "user.clade"]).arg(p).output().ok()?;
    out.status.success().then_some(out.stdout)
}
