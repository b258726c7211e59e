//! The blob tier: a second host (a fresh local tier) reads what the first wrote, through object_store's
//! LocalFileSystem and through S3 against a real moto server on loopback.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clade_store::{BlobConfig, ImageKind, Store, StoreConfig, StoreError};
use common::*;

fn with_blob(dir: &std::path::Path, blob: BlobConfig) -> Store {
    Store::open(dir, StoreConfig { blob: Some(blob), cache_bytes: 8 << 20, ..cfg() }).unwrap()
}

fn exercise(blob: BlobConfig, root: &std::path::Path) {
    let a = with_blob(&root.join("host-a"), blob.clone());
    let data = pages(40, 1500);
    let r = a.put_bytes(&data, ImageKind::Mem).unwrap();
    let id = r.id.unwrap();
    let src = root.join("tree-src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    std::fs::write(src.join("d/core-1.img"), pages(41, 20)).unwrap();
    let t = a.put_dir(&src).unwrap();

    // Host B: empty local tier, same blob tier.
    let b = with_blob(&root.join("host-b"), blob);
    assert_eq!(read_all(&b, &id), data);
    let out = root.join("b.out");
    b.get_file(&id, &out).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), data);
    b.get_dir(&t.id, &root.join("tree-dest")).unwrap();
    assert_eq!(std::fs::read(root.join("tree-dest/d/core-1.img")).unwrap(), pages(41, 20));
    // Dedup against what is in the blob tier: B putting the same data writes nothing new.
    let r2 = b.put_bytes(&data, ImageKind::Mem).unwrap();
    assert_eq!(r2.id, Some(id));
    let f = b.fsck().unwrap();
    assert!(f.ok, "{f:?}");

    // Without the blob tier, host B's local tier alone does not have it.
    let local_only = open(&root.join("host-c"));
    assert!(matches!(local_only.manifest(&id), Err(StoreError::NotFound { .. })));
}

#[test]
fn blob_tier_local_filesystem() {
    let d = tempfile::tempdir().unwrap();
    let blob = BlobConfig::Local { root: d.path().join("blob") };
    exercise(blob.clone(), d.path());

    // A corrupted pack in the blob tier is detected on read and never returned.
    let s = with_blob(&d.path().join("host-d"), blob);
    let mut packs = Vec::new();
    let mut stack = vec![d.path().join("blob/packs")];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else if e.path().extension().is_some_and(|x| x == "pack") {
                packs.push(e.path());
            }
        }
    }
    for p in &packs {
        let mut b = std::fs::read(p).unwrap();
        b[20] ^= 0xff;
        std::fs::write(p, b).unwrap();
    }
    let ids = open(&d.path().join("host-a")).manifests().unwrap();
    let err = ids
        .iter()
        .find_map(|id| {
            let r = s.image(id).ok()?;
            let mut buf = vec![0u8; r.size() as usize];
            r.read_at(0, &mut buf).err()
        })
        .expect("a corrupted blob pack was read without error");
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
}

struct Moto(Child);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A home that wrote data before it named a blob tier, then publishes a root deduplicated against it: the
/// packs the root needs go up first, so the blob tier never names a frame it lacks (another host reads the
/// root from there alone). `check_blob` would report the tree and manifest as naming missing frames otherwise.
#[test]
fn roots_written_through_bring_their_older_packs() {
    let d = tempfile::tempdir().unwrap();
    let (home, tier) = (d.path().join("home"), d.path().join("tier"));
    let data = pages(7, 300);
    let src = d.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("f.img"), pages(8, 40)).unwrap();
    {
        let local = Store::open(&home, cfg()).unwrap();
        local.put_bytes(&data, ImageKind::Mem).unwrap();
        local.put_dir(&src).unwrap();
    }
    let s = with_blob(&home, BlobConfig::Local { root: tier.clone() });
    assert_eq!(s.check_blob().unwrap().packs, 0, "nothing was uploaded before the blob tier was named");
    let m = s.put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();
    let t = s.put_dir(&src).unwrap().id;
    let rep = s.check_blob().unwrap();
    assert!(rep.whole() && rep.manifests == 1 && rep.trees == 1 && rep.packs >= 1, "{rep:?}");
    // And another host reads both from the blob tier alone.
    let b = with_blob(&d.path().join("b"), BlobConfig::Local { root: tier });
    assert_eq!(read_all(&b, &m), data);
    b.get_dir(&t, &d.path().join("out")).unwrap();
    assert_eq!(std::fs::read(d.path().join("out/f.img")).unwrap(), pages(8, 40));
}

/// Puts through a deferred handle stay local (nothing in the blob tier, and another host cannot read them);
/// `push_roots` then uploads the tree's packs, several at once, and its root, and reports the bytes it sent;
/// a second push sends nothing. Another host reads the tree from the blob tier alone.
#[test]
fn deferred_puts_stay_local_until_pushed() {
    let d = tempfile::tempdir().unwrap();
    let tier = d.path().join("tier");
    let s = Store::open(
        &d.path().join("home"),
        StoreConfig { blob: Some(BlobConfig::Local { root: tier.clone() }), pack_bytes: 1 << 20, ..cfg() },
    )
    .unwrap();
    let src = d.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..6u64 {
        std::fs::write(src.join(format!("f{i}.img")), pages(100 + i, 300)).unwrap();
    }
    let t = s.deferred().put_dir(&src).unwrap().id;
    let rep = s.check_blob().unwrap();
    assert_eq!((rep.packs, rep.trees), (0, 0), "a deferred put wrote nothing through: {rep:?}");
    let b = with_blob(&d.path().join("b"), BlobConfig::Local { root: tier.clone() });
    assert!(b.get_dir(&t, &d.path().join("early")).is_err(), "another host cannot read it yet");
    let pushed = s.push_roots(&[], &[t]).unwrap();
    assert!(pushed.packs >= 2 && pushed.packs_uploaded == pushed.packs && pushed.roots_uploaded == 1, "{pushed:?}");
    assert!(pushed.bytes_uploaded > 0, "{pushed:?}");
    let rep = s.check_blob().unwrap();
    assert!(rep.whole() && rep.trees == 1 && rep.packs == pushed.packs as u64, "{rep:?}");
    let again = s.push_roots(&[], &[t]).unwrap();
    assert_eq!((again.packs_uploaded, again.roots_uploaded, again.bytes_uploaded), (0, 0, 0), "{again:?}");
    let b = with_blob(&d.path().join("b2"), BlobConfig::Local { root: tier });
    b.get_dir(&t, &d.path().join("out")).unwrap();
    for i in 0..6u64 {
        assert_eq!(std::fs::read(d.path().join(format!("out/f{i}.img"))).unwrap(), pages(100 + i, 300));
    }
}

fn http(port: u16, req: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(req.as_bytes())?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    Ok(out)
}

#[test]
fn blob_tier_s3_against_moto() {
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
    let resp = http(
        port,
        &format!(
            "PUT /clade-test HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    )
    .unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "create bucket: {resp}");
    let d = tempfile::tempdir().unwrap();
    let blob = BlobConfig::S3 {
        bucket: "clade-test".into(),
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: "us-east-1".into(),
        access_key_id: "test".into(),
        secret_access_key: "test".into(),
        allow_http: true,
    };
    exercise(blob, d.path());
    // The objects really are in the bucket.
    let list = http(port, &format!("GET /clade-test?list-type=2&prefix=manifests HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")).unwrap();
    assert!(list.contains("<Key>manifests/"), "{list}");
}

/// Called from inside another runtime (a vm disk's NBD export reading a frame only the tier holds), the sync
/// API still works: the blob call waits on a plain thread of its own. Before 2026-12-06 it refused, and a guest
/// booting a disk written on another host saw I/O errors.
#[test]
fn sync_api_works_inside_an_async_runtime() {
    let d = tempfile::tempdir().unwrap();
    let s = with_blob(&d.path().join("s"), BlobConfig::Local { root: d.path().join("blob") });
    let data = pages(42, 10);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let put = rt.block_on(async { s.put_bytes(&data, ImageKind::Mem) }).expect("a put from inside a runtime");
    assert!(put.id.is_some());
    rt.block_on(async { s.blob_put_meta("meta/x", b"inside".to_vec()) }).expect("a tier call from inside a runtime");
    let got = rt.block_on(async { s.blob_get_meta("meta/x") }).expect("and a read");
    assert_eq!(got.as_deref(), Some(&b"inside"[..]));
}

/// What one process read from the blob tier (pack indexes, trees) is kept for the next process on the host
/// (`blob-idx/`, `blob-trees/`): a second handle on the same local tier reads the tree with the tier's copy gone,
/// and a kept copy that no longer hashes right (torn) is not used but fetched again, and kept anew.
#[test]
fn reads_from_the_blob_tier_are_kept_for_the_next_process() {
    let d = tempfile::tempdir().unwrap();
    let tier_dir = d.path().join("tier");
    let tier = BlobConfig::Local { root: tier_dir.clone() };
    let src = d.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("f.img"), pages(9, 40)).unwrap();
    let t = with_blob(&d.path().join("a"), tier.clone()).put_dir(&src).unwrap().id;
    let find = |dir: &std::path::Path, name: &str| -> std::path::PathBuf {
        let mut stack = vec![dir.to_path_buf()];
        while let Some(p) = stack.pop() {
            for e in std::fs::read_dir(&p).unwrap().flatten() {
                if e.path().is_dir() {
                    stack.push(e.path());
                } else if e.file_name().to_string_lossy() == name {
                    return e.path();
                }
            }
        }
        panic!("no {name} under {}", dir.display())
    };
    let in_tier = find(&tier_dir, &t.to_hex());

    let b_dir = d.path().join("b");
    with_blob(&b_dir, tier.clone()).get_dir(&t, &d.path().join("out1")).unwrap();
    let kept_tree = b_dir.join("blob-trees").join(t.to_hex());
    assert!(kept_tree.is_file(), "the tree is kept");
    // (`.listed`, the tier's listing, is kept beside them: see the next test.)
    let idx: Vec<_> = std::fs::read_dir(b_dir.join("blob-idx"))
        .unwrap()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    assert!(!idx.is_empty(), "the pack indexes are kept");

    // The next process reads the kept tree: the tier's copy is not needed.
    let tier_copy = std::fs::read(&in_tier).unwrap();
    std::fs::remove_file(&in_tier).unwrap();
    let tree = with_blob(&b_dir, tier.clone()).tree(&t).unwrap();
    assert_eq!(tree.entries.len(), 1);
    // Control: a process on a host without the copy cannot read it now.
    assert!(with_blob(&d.path().join("c"), tier.clone()).tree(&t).is_err());

    // A torn copy is not used (the tier's is gone, so the read fails rather than return it), then, with the
    // tier whole again, fetched and kept anew.
    std::fs::write(&kept_tree, &tier_copy[..tier_copy.len() / 2]).unwrap();
    for i in &idx {
        std::fs::write(i, b"torn").unwrap();
    }
    assert!(with_blob(&b_dir, tier.clone()).tree(&t).is_err(), "a torn copy is never read as the tree");
    std::fs::write(&in_tier, &tier_copy).unwrap();
    let third = with_blob(&b_dir, tier);
    assert_eq!(third.tree(&t).unwrap(), tree);
    assert_eq!(std::fs::read(&kept_tree).unwrap(), tier_copy, "kept anew");
    third.get_dir(&t, &d.path().join("out3")).unwrap();
    assert_eq!(std::fs::read(d.path().join("out3/f.img")).unwrap(), pages(9, 40));
    assert!(idx.iter().all(|i| std::fs::read(i).unwrap() != b"torn"), "torn indexes are replaced");
}

/// A host that takes a sandbox from another loads the indexes of the packs its record names, without a LIST of
/// the tier, and notes them for its other processes; the frames its fetch-ahead fetches for the restore
/// (`prefetch_ranges_kept`) are kept on its disk, where the next process reads them with the tier's packs gone.
/// Control: frames fetched without keeping are not there for the next process. A torn kept frame is never read
/// as the frame, and gc removes kept frames after its grace period.
#[test]
fn frames_fetched_for_another_process_are_kept_on_disk() {
    let d = tempfile::tempdir().unwrap();
    let tier_dir = d.path().join("tier");
    let tier = BlobConfig::Local { root: tier_dir.clone() };
    let a = with_blob(&d.path().join("a"), tier.clone());
    let data = pages(7, 600);
    let id = a.put_bytes(&data, ImageKind::Mem).unwrap().id.unwrap();
    let packs = a.packs_of_roots(std::slice::from_ref(&id), &[]).unwrap();
    assert!(!packs.is_empty());

    let b_dir = d.path().join("b");
    let b1 = with_blob(&b_dir, tier.clone());
    assert_eq!(b1.load_blob_packs(&packs).unwrap(), packs.len(), "each named index is loaded");
    let listed = std::fs::read_to_string(b_dir.join("blob-idx/.listed")).unwrap();
    assert!(packs.iter().all(|p| listed.contains(&p.to_hex())), "noted for the next process: {listed}");
    let m = b1.manifest(&id).unwrap();
    assert!(b1.prefetch_ranges_kept(&[(&m, std::iter::once(0..m.size).collect())]).unwrap() >= 2);
    let kept_dir = b_dir.join("blob-frames");
    let kept: Vec<_> = std::fs::read_dir(&kept_dir).unwrap().flatten().map(|e| e.path()).collect();
    assert!(kept.len() >= 2, "{kept:?}");
    let c_dir = d.path().join("c");
    let c1 = with_blob(&c_dir, tier.clone());
    let mc = c1.manifest(&id).unwrap();
    assert!(c1.prefetch_ranges(&[(&mc, std::iter::once(0..mc.size).collect())]).unwrap() >= 2);
    assert!(!c_dir.join("blob-frames").exists(), "prefetch_ranges keeps nothing on disk");

    // The tier's packs go (their indexes stay): only kept frames can answer now.
    let mut stack = vec![tier_dir.clone()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else if e.path().extension().is_some_and(|x| x == "pack") {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
    }
    let read = |s: &Store| {
        let r = s.image(&id)?;
        let mut buf = vec![0u8; r.size() as usize];
        r.read_at(0, &mut buf).map(|()| buf)
    };
    assert_eq!(read(&with_blob(&b_dir, tier.clone())).unwrap(), data, "the next process reads the kept frames");
    assert!(read(&with_blob(&c_dir, tier.clone())).is_err(), "control: nothing kept, nothing to read");

    // A torn kept frame is not read as the frame.
    for k in &kept {
        let b = std::fs::read(k).unwrap();
        std::fs::write(k, &b[..b.len() / 2]).unwrap();
    }
    assert!(read(&with_blob(&b_dir, tier.clone())).is_err(), "a torn copy is never read as the frame");

    let g = with_blob(&b_dir, tier.clone()).gc(false).unwrap();
    assert_eq!(g.kept_frames_deleted, kept.len() as u64, "{g:?}");
    assert_eq!(std::fs::read_dir(&kept_dir).unwrap().count(), 0);
    // The kept index copies and the listing go too; the next process reads the indexes from the tier again.
    assert!(g.kept_copies_deleted > packs.len() as u64, "{g:?}");
    assert_eq!(std::fs::read_dir(b_dir.join("blob-idx")).unwrap().count(), 0);
    assert_eq!(with_blob(&b_dir, tier).load_blob_packs(&packs).unwrap(), packs.len());
}
