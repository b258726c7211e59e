//! gc of the blob tier, through object_store's LocalFileSystem and through S3 against a real moto server on
//! loopback: what no root needs is deleted from the tier, leases and the grace period keep data, other
//! handles stop deduplicating against what went away, and another host still reads everything live.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clade_store::{BlobConfig, ImageKind, Store, StoreConfig};
use common::*;

fn with_blob(dir: &std::path::Path, blob: &BlobConfig, grace: Duration) -> Store {
    Store::open(dir, StoreConfig { blob: Some(blob.clone()), gc_grace: grace, cache_bytes: 8 << 20, ..cfg() }).unwrap()
}

/// Lists the keys of the blob tier under a prefix (independently of the store).
type Lister<'a> = &'a dyn Fn(&str) -> Vec<String>;
/// Writes a raw key into the blob tier (to plant an interrupted upload).
type Planter<'a> = &'a dyn Fn(&str, &[u8]);

fn exercise_gc(blob: BlobConfig, root: &std::path::Path, list: Lister, plant: Planter) {
    let a = with_blob(&root.join("host-a"), &blob, Duration::ZERO);
    let x = pages(60, 3000);
    let y = pages(61, 3000);
    let rx = a.put_bytes(&x, ImageKind::Mem).unwrap();
    let ry = a.put_bytes(&y, ImageKind::Mem).unwrap();
    let (idx, idy) = (rx.id.unwrap(), ry.id.unwrap());
    let packs_before = list("packs").iter().filter(|k| k.ends_with(".pack")).count();
    assert!(packs_before >= 3, "several packs per image: {packs_before}");

    // Everything is live: nothing to delete, and the report says what it kept.
    let r = a.gc_blob(false).unwrap();
    assert_eq!((r.packs_deleted, r.leftovers_deleted, r.bytes_freed), (0, 0, 0), "{r:?}");
    assert_eq!(r.packs_kept as usize, packs_before, "{r:?}");
    assert!(r.bytes_kept > (x.len() / 2) as u64, "{r:?}");
    assert_eq!(r.live_manifests, 2);

    // A second handle of this host, opened now, knows X's frames.
    let a2 = with_blob(&root.join("host-a"), &blob, Duration::ZERO);

    // Deleting X unpublishes it in both tiers; a lease still keeps its data in the blob tier.
    let lease = a.lease(idx).unwrap();
    assert!(a.delete_manifest(&idx).unwrap());
    assert!(!list("manifests").iter().any(|k| k.contains(&idx.to_hex())), "blob copy of the manifest deleted");
    let r = a.gc_blob(false).unwrap();
    assert_eq!(r.packs_deleted, 0, "leased: {r:?}");
    assert_eq!(r.live_leases, 1);
    drop(lease);

    // The grace period keeps young packs (writers in flight upload packs before their manifest).
    let young = with_blob(&root.join("host-a"), &blob, Duration::from_secs(3600));
    let r = young.gc_blob(false).unwrap();
    assert_eq!(r.packs_deleted, 0, "{r:?}");
    assert!(r.packs_kept_young >= 3, "{r:?}");
    drop(young);

    // A dry run says what would go and changes nothing.
    let dry = a.gc_blob(true).unwrap();
    assert!(dry.dry_run && dry.packs_deleted >= 1 && dry.bytes_freed > 0, "{dry:?}");
    assert_eq!(list("packs").iter().filter(|k| k.ends_with(".pack")).count(), packs_before);

    // An interrupted upload: a pack without its index.
    let stray = format!("packs/ee/{}.pack", "ee".repeat(32));
    plant(&stray, b"CLADEPK1 half a pack");

    let r = a.gc_blob(false).unwrap();
    assert_eq!(r.packs_deleted, dry.packs_deleted, "{r:?}");
    assert_eq!(r.leftovers_deleted, 1, "{r:?}");
    assert!(r.bytes_freed >= dry.bytes_freed && r.frames_deleted > 0, "{r:?}");
    assert!(r.deleted.contains(&stray), "{r:?}");
    let keys = list("packs");
    for k in &r.deleted {
        assert!(!keys.contains(k), "{k} still in the blob tier");
    }
    assert_eq!(keys.iter().filter(|k| k.ends_with(".pack")).count() as u64, r.packs_kept, "{keys:?}");
    assert!(r.packs_kept > 0 && r.packs_kept < packs_before as u64);

    // The other handle resyncs before writing: storing X again writes X's blocks anew instead of
    // naming frames whose only blob copy is gone ... once the local tier lost them too.
    a.gc(false).unwrap();
    let again = a2.put_bytes(&x, ImageKind::Mem).unwrap();
    assert!(again.bytes_new > 0, "deduplicated against collected frames: {again:?}");

    // Host B (empty local tier) reads everything live, verified, and fsck is clean.
    let b = with_blob(&root.join("host-b"), &blob, Duration::ZERO);
    assert_eq!(read_all(&b, &idy), y);
    assert_eq!(read_all(&b, &again.id.unwrap()), x);
    let f = b.fsck().unwrap();
    assert!(f.ok, "{f:?}");

    // Without a blob tier, gc_blob says what to do.
    let err = open(&root.join("host-c")).gc_blob(false).unwrap_err();
    assert!(err.to_string().contains("no blob tier"), "{err}");
}

fn walk(dir: &std::path::Path, base: &std::path::Path, out: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, base, out);
        } else {
            out.push(p.strip_prefix(base).unwrap().to_string_lossy().into_owned());
        }
    }
}

#[test]
fn blob_gc_local_filesystem() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("blob");
    let blob = BlobConfig::Local { root: root.clone() };
    let list = |prefix: &str| {
        let mut out = Vec::new();
        walk(&root.join(prefix), &root, &mut out);
        out
    };
    let plant = |key: &str, data: &[u8]| {
        let p = root.join(key);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    };
    exercise_gc(blob, d.path(), &list, &plant);
}

struct Moto(Child);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn http(port: u16, req: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(req).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn blob_gc_s3_against_moto() {
    let moto = "/var/lib/clade/py/bin/moto_server";
    if !std::path::Path::new(moto).exists() {
        eprintln!("skipping: {moto} is not installed (run ./x setup)");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _server = Moto(
        Command::new(moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(30), "moto_server did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let host = format!("127.0.0.1:{port}");
    let resp = http(
        port,
        format!("PUT /clade-gc HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    assert!(resp.starts_with("HTTP/1.1 200"), "create bucket: {resp}");
    let list = |prefix: &str| {
        let mut keys = Vec::new();
        let mut token = String::new();
        loop {
            let q = if token.is_empty() { String::new() } else { format!("&continuation-token={token}") };
            let resp = http(
                port,
                format!("GET /clade-gc?list-type=2&prefix={prefix}{q} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            );
            for part in resp.split("<Key>").skip(1) {
                keys.push(part.split("</Key>").next().unwrap().to_string());
            }
            match resp.split("<NextContinuationToken>").nth(1) {
                Some(t) => token = t.split('<').next().unwrap().to_string(),
                None => break,
            }
        }
        keys
    };
    let plant = |key: &str, data: &[u8]| {
        let mut req = format!(
            "PUT /clade-gc/{key} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            data.len()
        )
        .into_bytes();
        req.extend_from_slice(data);
        let resp = http(port, &req);
        assert!(resp.starts_with("HTTP/1.1 200"), "put {key}: {resp}");
    };
    let d = tempfile::tempdir().unwrap();
    let blob = BlobConfig::S3 {
        bucket: "clade-gc".into(),
        endpoint: Some(format!("http://{host}")),
        region: "us-east-1".into(),
        access_key_id: "test".into(),
        secret_access_key: "test".into(),
        allow_http: true,
    };
    exercise_gc(blob, d.path(), &list, &plant);
}

#[test]
fn blob_gc_drops_a_pack_made_redundant_by_a_local_repack() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("blob");
    let blob = BlobConfig::Local { root: root.clone() };
    let cfg = StoreConfig { blob: Some(blob.clone()), compression_level: None, pack_bytes: 64 << 20, ..cfg() };
    let a = Store::open(&d.path().join("host-a"), cfg.clone()).unwrap();
    // One pack: a 1 MiB frame that stays live, then 3 MiB that die.
    let mut rng_data = pages(70, 1024);
    for p in rng_data.chunks_mut(4096) {
        p[0] |= 1; // no zero pages: every block is stored
    }
    let keep = rng_data[..1 << 20].to_vec();
    let both = a.put_bytes(&rng_data, ImageKind::Mem).unwrap().id.unwrap();
    let small = a.put_bytes(&keep, ImageKind::Mem).unwrap().id.unwrap();
    let packs = |d: &std::path::Path| {
        let mut out = Vec::new();
        walk(&d.join("packs"), d, &mut out);
        out.into_iter().filter(|k| k.ends_with(".pack")).collect::<Vec<_>>()
    };
    let old = packs(&root);
    assert_eq!(old.len(), 1, "{old:?}");
    assert!(a.delete_manifest(&both).unwrap());
    let g = a.gc(false).unwrap();
    assert_eq!(g.packs_repacked, 1, "{g:?}");
    assert_eq!(packs(&root).len(), 2, "the repacked pack was uploaded next to the old one");

    let r = a.gc_blob(false).unwrap();
    assert_eq!(r.packs_deleted, 1, "{r:?}");
    assert_eq!(r.packs_kept, 1, "{r:?}");
    assert!(r.deleted.contains(&old[0]), "{r:?}");
    let now = packs(&root);
    assert_eq!(now.len(), 1);
    assert_ne!(now[0], old[0]);

    // Another host reads the live image from what is left.
    let b = Store::open(&d.path().join("host-b"), cfg).unwrap();
    assert_eq!(read_all(&b, &small), keep);
    assert!(b.fsck().unwrap().ok);
}
