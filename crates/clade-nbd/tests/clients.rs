//! Real NBD clients (qemu-io, qemu-img, nbdinfo, nbdcopy) against the server, over a unix socket.

mod common;

use std::process::Command;

use clade_nbd::control;
use common::*;

const MIB: usize = 1 << 20;

macro_rules! need {
    ($name:expr) => {
        match tool($name) {
            Some(p) => p,
            None => {
                eprintln!("skipping: {} is not installed", $name);
                return;
            }
        }
    };
}

fn qemu_io(uri: &str, cmds: &[&str]) -> (bool, String) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for x in cmds {
        c.args(["-c", x]);
    }
    c.arg(uri);
    let (ok, out) = run(&mut c);
    // qemu-io exits 0 even when a pattern check fails; treat its failure messages as failures.
    let bad = out.contains("Pattern verification failed") || out.contains("failed:");
    (ok && !bad, out)
}

#[test]
fn qemu_io_writes_aligned_and_unaligned_and_reads_back() {
    need!("qemu-io");
    let base = pattern(8 * MIB);
    let srv = TestServer::start(vec![("base", mem_export(base.clone(), false))]);
    let (ok, out) = qemu_io(
        &srv.uri(),
        &[
            "write -P 0xab 4k 8k",
            "write -P 0xcd 100 1000",
            "write -z 1M 64k",
            "read -P 0xab 4k 8k",
            "read -P 0xcd 100 1000",
            "read -P 0 1M 64k",
            "flush",
        ],
    );
    assert!(ok, "qemu-io failed:\n{out}");
    // The bytes around the unaligned write still come from the base.
    let mut buf = vec![0u8; 4096];
    let export = srv.server.export("").unwrap();
    export.read(0, &mut buf).unwrap();
    assert_eq!(&buf[..100], &base[..100]);
    assert!(buf[100..1100].iter().all(|&b| b == 0xcd));
    assert_eq!(&buf[1100..], &base[1100..4096]);
    // A pattern that is not there is caught (the check above could fail).
    let (ok, _) = qemu_io(&srv.uri(), &["read -P 0xab 0 4k"]);
    assert!(!ok);
}

#[test]
fn qemu_img_convert_and_map_see_base_plus_overlay() {
    need!("qemu-img");
    let base = pattern(4 * MIB);
    let srv = TestServer::start(vec![("base", mem_export(base.clone(), false))]);
    let (ok, out) = qemu_io(&srv.uri(), &["write -P 0x11 2M 12k"]);
    assert!(ok, "{out}");
    let dst = srv.dir.path().join("out.raw");
    let (ok, out) = run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw", &srv.uri()]).arg(&dst));
    assert!(ok, "{out}");
    let got = std::fs::read(&dst).unwrap();
    let mut want = base.clone();
    want[2 * MIB..2 * MIB + 12288].fill(0x11);
    assert!(got == want, "converted image differs from base + writes");
    // qemu-img map reports the zero quarter (1 MiB..2 MiB) as zero via base:allocation.
    let (ok, out) = run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &srv.uri()]));
    assert!(ok, "{out}");
    let map: serde_json::Value = serde_json::from_str(&out).unwrap();
    let zero_at_1m = map.as_array().unwrap().iter().any(|e| {
        e["start"].as_u64() == Some(MIB as u64) && e["length"].as_u64() == Some(MIB as u64) && e["zero"] == true
    });
    assert!(zero_at_1m, "no zero extent at 1 MiB in {out}");
}

#[test]
fn nbdinfo_and_nbdcopy_work() {
    need!("nbdinfo");
    need!("nbdcopy");
    need!("qemu-io");
    let base = pattern(4 * MIB);
    let srv = TestServer::start(vec![("base", mem_export(base.clone(), true))]);
    let (ok, out) = run(Command::new("nbdinfo").arg("--json").arg(srv.uri()));
    assert!(ok, "{out}");
    let info: serde_json::Value = serde_json::from_str(&out).unwrap();
    let e = &info["exports"][0];
    assert_eq!(e["export-size"].as_u64(), Some(4 * MIB as u64), "{out}");
    assert_eq!(e["is_read_only"], true, "{out}");
    assert_eq!(e["can_multi_conn"], true, "{out}");
    let (ok, out) = run(Command::new("nbdinfo").arg("--map").arg(srv.uri()));
    assert!(ok, "{out}");
    assert!(out.contains("hole,zero"), "{out}");
    let (ok, out) = run(Command::new("nbdinfo").arg("--list").arg(srv.uri()));
    assert!(ok && out.contains("base"), "{out}");
    let dst = srv.dir.path().join("copy.raw");
    std::fs::write(&dst, b"").unwrap();
    let (ok, out) = run(Command::new("nbdcopy").arg(srv.uri()).arg(&dst));
    assert!(ok, "{out}");
    assert!(std::fs::read(&dst).unwrap() == base);
    // Writes to a read-only export are refused.
    let (ok, _) = qemu_io(&srv.uri(), &["write -P 1 0 4k"]);
    assert!(!ok);
}

#[test]
fn snapshot_over_control_socket_keeps_serving_on_new_base() {
    need!("qemu-io");
    let base = pattern(2 * MIB);
    let srv = TestServer::start(vec![("base", mem_export(base, false))]);
    let (ok, out) = qemu_io(&srv.uri(), &["write -P 0x5a 64k 128k"]);
    assert!(ok, "{out}");
    let sock = srv.socket.clone();
    let reply = std::thread::spawn(move || control::snapshot(&sock)).join().unwrap().unwrap();
    assert_eq!(reply.dirty_blocks, Some(32));
    let id = reply.manifest.unwrap();
    assert_eq!(id, "mem-1");
    let stats = srv.server.export("").unwrap().stats();
    assert_eq!(stats.base, "mem-1");
    assert_eq!(stats.dirty_blocks, 0);
    let (ok, out) = qemu_io(&srv.uri(), &["read -P 0x5a 64k 128k"]);
    assert!(ok, "{out}");
}

#[test]
fn two_exports_of_one_base_are_private() {
    need!("qemu-io");
    use clade_nbd::{BlockSource, Export, MemSource};
    use std::sync::Arc;
    let base: Arc<dyn BlockSource> = Arc::new(MemSource::new("b", pattern(MIB)));
    let a = Arc::new(Export::new(base.clone(), false, None));
    let b = Arc::new(Export::new(base, false, None));
    let srv = TestServer::start(vec![("a", a), ("b", b)]);
    let (ok, out) = qemu_io(&srv.uri_named("a"), &["write -P 0x77 0 64k"]);
    assert!(ok, "{out}");
    let (ok, _) = qemu_io(&srv.uri_named("b"), &["read -P 0x77 0 64k"]);
    assert!(!ok, "export b saw a's write");
    let (ok, out) = qemu_io(&srv.uri_named("a"), &["read -P 0x77 0 64k"]);
    assert!(ok, "{out}");
}
