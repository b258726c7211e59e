//! Blob gc with several hosts over a real 3-node Garage cluster (docs/roam.md, "Blob gc with several hosts"):
//! host A leases what it needs in the blob tier (`leases/<host>.json`); host B's gc keeps the packs a live
//! lease names even when no published root does (a push in flight: its packs are up, its roots not yet), with
//! one Garage node down; once A stops renewing it (a dead host), the lease expires, B's gc deletes the record
//! and collects what only it kept: the control that shows the packs were kept by the lease alone.

mod common;

use std::time::Duration;

use clade_store::testkit::Garage;
use clade_store::{ImageKind, Root, Store, StoreConfig};
use common::*;

#[test]
fn multihost_gc_keeps_leased_packs_until_the_lease_expires() {
    let home = std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into());
    let bin = std::path::Path::new(&home).join("garage/bin/garage");
    if !bin.exists() {
        eprintln!("skip: {} is not installed (run ./x setup)", bin.display());
        return;
    }
    let mut g = Garage::start(&bin, "clade-gc").unwrap();
    let d = tempfile::tempdir().unwrap();
    let with_blob = |name: &str| {
        let c = StoreConfig { blob: Some(g.config()), gc_grace: Duration::ZERO, cache_bytes: 8 << 20, ..cfg() };
        Store::open(&d.path().join(name), c).unwrap()
    };
    // Host A wrote a mark before it named the blob tier; its push has uploaded the packs but not the root.
    let data = pages(90, 2000);
    let m = Store::open(&d.path().join("a"), cfg()).unwrap().put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();
    let a = with_blob("a");
    let lease = a.blob_lease("host-a", &[Root::Manifest(m)], Duration::from_secs(4)).unwrap();
    assert!(!lease.packs.is_empty(), "{lease:?}");
    a.push_roots(&[m], &[]).unwrap();
    a.delete_manifest(&m).unwrap();
    let b = with_blob("b");
    let packs = b.check_blob().unwrap().packs;
    assert!(packs >= lease.packs.len() as u64);

    // B's gc, one Garage node down: nothing leased is freed.
    g.stop_node(2);
    let r = b.gc_blob(false).unwrap();
    assert_eq!((r.host_leases_live, r.packs_deleted, r.bytes_freed), (1, 0, 0), "{r:?}");
    assert_eq!(r.packs_kept_leased, lease.packs.len() as u64, "{r:?}");
    assert_eq!(b.check_blob().unwrap().packs, packs);
    g.start_node(2).unwrap();

    // A stops renewing its lease (a dead host): once it expires, the same gc collects those packs.
    std::thread::sleep(Duration::from_millis(4200));
    let r = b.gc_blob(false).unwrap();
    assert_eq!(r.host_leases_expired, 1, "{r:?}");
    assert_eq!(r.packs_deleted, lease.packs.len() as u64, "{r:?}");
    assert!(r.bytes_freed > 0, "{r:?}");
    assert!(b.blob_leases().unwrap().is_empty(), "the expired record is deleted");
    assert!(b.check_blob().unwrap().whole());
}
