//! gc: what is unreferenced goes, what is referenced or leased stays, writers in flight block it.

mod common;

use clade_store::{ImageKind, StoreError};
use common::*;

#[test]
fn gc_frees_deleted_manifests_and_keeps_shared_data() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let shared = pages(30, 800);
    let a = s.put_bytes(&shared, ImageKind::Mem).unwrap().id.unwrap();
    let mut bdata = shared.clone();
    bdata.extend_from_slice(&pages(31, 800));
    let b = s.put_bytes(&bdata, ImageKind::Mem).unwrap().id.unwrap();
    let before = s.stats().unwrap();

    // Dry run deletes nothing.
    s.delete_manifest(&b).unwrap();
    let dry = s.gc(true).unwrap();
    assert!(dry.dry_run && dry.bytes_freed > 0, "{dry:?}");
    assert_eq!(s.stats().unwrap().pack_bytes, before.pack_bytes);

    let r = s.gc(false).unwrap();
    assert!(r.packs_deleted + r.packs_repacked > 0 && r.bytes_freed > 0, "{r:?}");
    let after = s.stats().unwrap();
    assert!(after.pack_bytes < before.pack_bytes, "{before:?} {after:?}");
    assert_eq!(read_all(&s, &a), shared);
    assert!(s.fsck().unwrap().ok);
    assert!(s.manifest(&b).is_err());
    // A second gc finds nothing more.
    let r2 = s.gc(false).unwrap();
    assert_eq!(r2.packs_deleted + r2.packs_repacked, 0, "{r2:?}");
}

#[test]
fn leases_keep_deleted_manifests_alive_until_dropped() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let data = pages(32, 500);
    let id = s.put_bytes(&data, ImageKind::Disk).unwrap().id.unwrap();
    let lease = s.lease(id).unwrap();
    s.delete_manifest(&id).unwrap();
    let r = s.gc(false).unwrap();
    assert_eq!(r.live_leases, 1);
    assert_eq!(r.packs_deleted, 0, "{r:?}");
    // Still readable through the lease (a restore in progress).
    let fresh = open(&d.path().join("s"));
    assert_eq!(read_all(&fresh, &id), data);
    drop(lease);
    let r = s.gc(false).unwrap();
    assert!(r.packs_deleted > 0, "{r:?}");
    assert!(open(&d.path().join("s")).manifest(&id).is_err());
}

#[test]
fn stale_lease_of_a_dead_process_is_ignored() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let id = s.put_bytes(&pages(33, 50), ImageKind::Disk).unwrap().id.unwrap();
    // A lease file nobody holds (its owner died).
    std::fs::write(d.path().join("s/leases/dead.lease"), format!("manifest {id}\n")).unwrap();
    s.delete_manifest(&id).unwrap();
    let r = s.gc(false).unwrap();
    assert_eq!((r.live_leases, r.stale_leases), (0, 1), "{r:?}");
    assert!(r.packs_deleted > 0);
}

#[test]
fn writer_in_flight_makes_gc_wait_then_refuse() {
    let d = tempfile::tempdir().unwrap();
    let s = open(&d.path().join("s"));
    let mut b = s.derive(None, 1 << 20).unwrap();
    b.write(0, &pages(34, 256)).unwrap();
    let t = std::time::Instant::now();
    let err = s.gc(false).unwrap_err();
    assert!(matches!(err, StoreError::Busy(..)), "{err}");
    assert!(t.elapsed().as_secs() >= 5);
    let r = b.finish().unwrap();
    s.gc(false).unwrap();
    assert_eq!(read_all(&s, r.id.as_ref().unwrap()), pages(34, 256));
}

#[test]
fn grace_period_protects_young_packs() {
    let d = tempfile::tempdir().unwrap();
    let cfg = clade_store::StoreConfig { gc_grace: std::time::Duration::from_secs(3600), ..cfg() };
    let s = clade_store::Store::open(&d.path().join("s"), cfg).unwrap();
    let id = s.put_bytes(&pages(35, 100), ImageKind::Mem).unwrap().id.unwrap();
    s.delete_manifest(&id).unwrap();
    let r = s.gc(false).unwrap();
    assert_eq!(r.packs_deleted, 0, "{r:?}");
}

#[test]
fn a_handle_opened_before_another_handles_gc_does_not_dedup_against_deleted_packs() {
    let d = tempfile::tempdir().unwrap();
    let old = open(&d.path().join("s")); // e.g. the daemon
    let data = pages(36, 300);
    let id = old.put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();
    // Another process (here: another handle) deletes it and collects.
    let cli = open(&d.path().join("s"));
    cli.delete_manifest(&id).unwrap();
    assert!(cli.gc(false).unwrap().packs_deleted > 0);
    // The old handle puts the same data again: it must store it anew, not point at the vanished frames.
    let r = old.put_bytes(&data, ImageKind::Mem).unwrap();
    assert!(r.bytes_new > 0, "{r:?}");
    assert_eq!(read_all(&open(&d.path().join("s")), r.id.as_ref().unwrap()), data);
    assert!(open(&d.path().join("s")).fsck().unwrap().ok);
}

#[test]
fn mostly_dead_pack_is_repacked_and_the_live_part_kept() {
    let d = tempfile::tempdir().unwrap();
    let cfg = clade_store::StoreConfig { pack_bytes: 64 << 20, compression_level: None, ..cfg() };
    let s = clade_store::Store::open(&d.path().join("s"), cfg).unwrap();
    let mut x = vec![0u8; 1024 * 4096];
    rand::Rng::fill(&mut rand::rng(), &mut x[..]);
    let xid = s.put_bytes(&x, ImageKind::Mem).unwrap().id.unwrap();
    let y = x[..256 * 4096].to_vec();
    let yr = s.put_bytes(&y, ImageKind::Mem).unwrap();
    assert_eq!(yr.bytes_new, 0);
    let before = s.stats().unwrap();
    assert_eq!(before.packs, 1);
    s.delete_manifest(&xid).unwrap();
    let r = s.gc(false).unwrap();
    assert_eq!((r.packs_repacked, r.frames_deleted), (1, 3), "{r:?}");
    let after = s.stats().unwrap();
    assert!(after.pack_bytes < before.pack_bytes / 2, "{before:?} {after:?}");
    assert_eq!(read_all(&s, yr.id.as_ref().unwrap()), y);
    assert_eq!(read_all(&open(&d.path().join("s")), yr.id.as_ref().unwrap()), y);
    assert!(s.fsck().unwrap().ok);
}
