//! Exports over the real store: shared cache between exports of one base, snapshots through NBD
//! clients, and a corrupt pack byte turning into EIO for the reads that touch it.

mod common;

use std::process::Command;
use std::sync::Arc;

use clade_nbd::proto::EIO;
use clade_nbd::{control, store_export};
use clade_store::{ImageKind, ManifestId, Store, StoreConfig};
use common::*;

const MIB: usize = 1 << 20;

fn store(dir: &std::path::Path) -> Store {
    Store::open(&dir.join("store"), StoreConfig { compression_level: None, ..StoreConfig::default() }).unwrap()
}

#[test]
fn two_exports_of_one_base_share_the_cache() {
    let d = tempfile::tempdir().unwrap();
    let s = store(d.path());
    let id = s.put_bytes(&pattern(8 * MIB), ImageKind::Disk).unwrap().id.unwrap();
    let s = store(d.path()); // fresh cache
    let a = store_export(&s, &id, true).unwrap();
    let b = store_export(&s, &id, true).unwrap();
    let mut buf = vec![0u8; 8 * MIB];
    a.read(0, &mut buf).unwrap();
    assert!(buf == pattern(8 * MIB));
    let (_, misses_a) = s.cache_counters();
    assert!(misses_a > 0);
    b.read(0, &mut buf).unwrap();
    let (hits, misses) = s.cache_counters();
    assert_eq!(misses, misses_a, "the second export decoded frames again instead of sharing them");
    assert!(hits > 0);
}

#[test]
fn qemu_io_writes_then_cli_style_snapshot_gives_a_manifest_with_those_writes() {
    if tool("qemu-io").is_none() {
        eprintln!("skipping: qemu-io is not installed");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = store(d.path());
    let base = pattern(4 * MIB);
    let id = s.put_bytes(&base, ImageKind::Disk).unwrap().id.unwrap();
    let srv = TestServer::start(vec![(&id.to_hex(), Arc::new(store_export(&s, &id, false).unwrap()))]);
    let (ok, out) = run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x42 1M 64k", "-c", "write -z 3M 1M"])
        .arg(srv.uri()));
    assert!(ok && !out.contains("failed"), "{out}");
    let sock = srv.socket.clone();
    let reply = std::thread::spawn(move || control::snapshot(&sock)).join().unwrap().unwrap();
    let new: ManifestId = reply.manifest.unwrap().parse().unwrap();
    assert_ne!(new, id);
    let mut want = base;
    want[MIB..MIB + 65536].fill(0x42);
    want[3 * MIB..].fill(0);
    let mut got = vec![0u8; 4 * MIB];
    s.image(&new).unwrap().read_at(0, &mut got).unwrap();
    assert!(got == want, "snapshot content differs");
    // The export keeps serving on the new manifest, and qemu-img map sees its zero tail.
    assert_eq!(srv.server.export("").unwrap().stats().base, new.to_hex());
    let (ok, out) = run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &srv.uri()]));
    assert!(ok, "{out}");
    let map: serde_json::Value = serde_json::from_str(&out).unwrap();
    let tail_zero =
        map.as_array().unwrap().iter().any(|e| e["start"].as_u64() == Some(3 * MIB as u64) && e["zero"] == true);
    assert!(tail_zero, "{out}");
}

#[test]
fn a_corrupt_pack_byte_is_eio_not_wrong_bytes() {
    let d = tempfile::tempdir().unwrap();
    let s = store(d.path());
    let img = pattern(4 * MIB);
    let id = s.put_bytes(&img, ImageKind::Disk).unwrap().id.unwrap();
    drop(s);
    // Flip one byte in the middle of the largest file (the pack holding the frames).
    let mut files: Vec<_> = walk(&d.path().join("store"));
    files.sort_by_key(|p| std::fs::metadata(p).unwrap().len());
    let pack = files.last().unwrap();
    let mut bytes = std::fs::read(pack).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(pack, bytes).unwrap();
    let s = store(d.path());
    let e = Arc::new(store_export(&s, &id, true).unwrap());
    let srv = TestServer::start(vec![("x", e)]);
    let mut c = RawClient::connect(&srv.socket, "x");
    let (mut eio, mut good) = (0, 0);
    for i in 0..4u64 {
        c.send(0, 0, i, i * MIB as u64, MIB as u32, &[]);
        let (err, _, data) = c.simple(MIB);
        if err == EIO {
            eio += 1;
        } else {
            assert_eq!(err, 0);
            assert!(data[..] == img[i as usize * MIB..(i as usize + 1) * MIB], "wrong bytes served for MiB {i}");
            good += 1;
        }
    }
    assert!(eio >= 1, "the corrupt frame was served");
    assert!(good >= 1, "one bad frame should not fail every read");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
