//! Guest tier: a QEMU guest (TCG) mounts an ext4 filesystem served by clade's NBD server, writes
//! files, and finds them again after a snapshot and a new export from that snapshot; a snapshot
//! taken while the guest is paused mid-write passes the guest's own e2fsck. Images live in a real
//! store: the filesystem is `put_file`d, snapshots are manifests derived from it.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use clade_nbd::{store_export, Export};
use clade_store::{ImageKind, ManifestId, Store, StoreConfig};
use common::guest::{initramfs, kernel, Guest};
use common::*;

const BOOT: Duration = Duration::from_secs(120);

const WRITE: &str = r#"
echo "HELLO=$(cat /mnt/hello.txt)"
echo guest-wrote-this > /mnt/new.txt
dd if=/dev/urandom of=/mnt/blob bs=64k count=32 2>/dev/null
echo "MD5=$(md5sum /mnt/blob | cut -d' ' -f1)"
sync
umount /mnt
"#;
const READ: &str = r#"
echo "NEW=$(cat /mnt/new.txt)"
echo "MD5=$(md5sum /mnt/blob | cut -d' ' -f1)"
umount /mnt
"#;
// Rewrites 40 files of 512 KiB in a loop: 20 MiB live on the 64 MiB disk, so it never runs out of space
// (with 101 files it filled the disk and the guest sometimes ended before the test could stop it).
const CHURN: &str = r#"
echo WRITING
i=0
while true; do
  dd if=/dev/urandom of=/mnt/f$i bs=64k count=8 2>/dev/null
  i=$((i+1)); [ $i -ge 40 ] && i=0 && sync
done
"#;

/// An ext4 image of 64 MiB made with `mkfs.ext4 -d` holding hello.txt.
fn ext4_image(dir: &Path) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("hello.txt"), "from-the-host\n").unwrap();
    let img = dir.join("fs.img");
    let (ok, out) =
        run(Command::new("mkfs.ext4").args(["-q", "-F", "-b", "4096", "-d"]).arg(&src).arg(&img).arg("64M"));
    assert!(ok, "mkfs.ext4: {out}");
    img
}

/// One guest at a time: with both tests' TCG guests running side by side on this 2-core host, the churning
/// guest now and then reset itself silently (QEMU exit 0, nothing on the console, 2026-12-03: about 1 run
/// in 4; never in 24 runs alone). Not understood; the property under test does not need the parallelism.
static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn setup() -> Option<(tempfile::TempDir, std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)> {
    for t in ["qemu-system-x86_64", "mkfs.ext4", "cpio"] {
        if tool(t).is_none() {
            eprintln!("skipping: {t} is not installed");
            return None;
        }
    }
    let Some(k) = kernel() else {
        eprintln!("skipping: no guest kernel under /var/lib/clade/kernel/current (run ./x setup)");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let initrd = initramfs(dir.path(), &[("write", WRITE), ("read", READ), ("churn", CHURN)]);
    let img = ext4_image(dir.path());
    Some((dir, k, initrd, img))
}

/// The image put into a fresh store in `dir`, and that store.
fn stored(dir: &Path, img: &Path) -> (Store, ManifestId) {
    let s = Store::open(&dir.join("store"), StoreConfig::default()).unwrap();
    let id = s.put_file(img, ImageKind::Disk).unwrap().id.unwrap();
    (s, id)
}

fn export_of(s: &Store, id: &ManifestId) -> Arc<Export> {
    Arc::new(store_export(s, id, false).unwrap())
}

#[test]
fn guest_files_survive_snapshot_and_new_export() {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let Some((dir, k, initrd, img)) = setup() else { return };
    let (s, id0) = stored(dir.path(), &img);
    let e1 = export_of(&s, &id0);
    let srv = TestServer::start(vec![("disk", e1.clone())]);
    let mut g = Guest::boot(dir.path(), &k, &initrd, &srv.socket, "write");
    g.wait_for("PHASE-DONE", BOOT);
    g.wait_exit(BOOT);
    assert_eq!(g.value("HELLO=").as_deref(), Some("from-the-host"));
    let md5 = g.value("MD5=").unwrap();
    assert!(e1.stats().dirty_blocks > 32, "the guest's writes should be in the overlay");
    let id = e1.snapshot().unwrap();
    assert_eq!(e1.stats().dirty_blocks, 0);
    // A fresh export (another server, as for a forked sibling) from the snapshot sees the files.
    let id1: ManifestId = id.parse().unwrap();
    assert_ne!(id1, id0);
    let e2 = export_of(&s, &id1);
    let srv2 = TestServer::start(vec![("disk", e2)]);
    let mut g = Guest::boot(dir.path(), &k, &initrd, &srv2.socket, "read");
    g.wait_for("PHASE-DONE", BOOT);
    g.wait_exit(BOOT);
    assert_eq!(g.value("NEW=").as_deref(), Some("guest-wrote-this"));
    assert_eq!(g.value("MD5=").unwrap(), md5);
    // The original image is untouched: it still has no new.txt.
    let (_, out) = run(Command::new("debugfs").args(["-R", "ls -l /"]).arg(&img));
    assert!(!out.contains("new.txt"), "{out}");
}

#[test]
fn guest_fsck_is_clean_after_snapshot_taken_paused_mid_write() {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let Some((dir, k, initrd, img)) = setup() else { return };
    let (s, id0) = stored(dir.path(), &img);
    // Under TCG on a loaded host, the churning guest now and then resets itself silently (a triple fault:
    // `-no-reboot` turns it into QEMU exiting 0 with nothing on the console; ~1 run in 4 beside another guest,
    // seen once in CI beside a release build). That is the emulator, not what is tested here, so such a
    // run is started again on a fresh export, at most three times.
    let mut attempt = 0;
    let (e, _srv, mut g) = loop {
        attempt += 1;
        let e = export_of(&s, &id0);
        let srv = TestServer::start(vec![("disk", e.clone())]);
        let mut g = Guest::boot(dir.path(), &k, &initrd, &srv.socket, "churn");
        g.wait_for("WRITING", BOOT);
        std::thread::sleep(Duration::from_secs(1));
        if !g.exited() || attempt == 3 {
            break (e, srv, g);
        }
        eprintln!("guest_disk: the churning guest reset itself (QEMU exited) in attempt {attempt}; again");
    };
    let r = g.qmp(r#"{"execute":"stop"}"#);
    assert!(r.contains("return"), "{r}");
    let before = e.stats().dirty_blocks;
    assert!(before > 0);
    let id1: ManifestId = e.snapshot().unwrap().parse().unwrap();
    let _ = g.qmp(r#"{"execute":"quit"}"#);
    drop(g);
    let e2 = export_of(&s, &id1);
    let srv2 = TestServer::start(vec![("disk", e2)]);
    let mut g = Guest::boot(dir.path(), &k, &initrd, &srv2.socket, "fsck");
    g.wait_for("PHASE-DONE", BOOT);
    g.wait_exit(BOOT);
    let console = g.console.lock().unwrap().join("\n");
    // The first pass may replay the journal (exit 0 or 1) but must fix nothing else; the second
    // pass must find a clean filesystem.
    let f1: i32 = g.value("FSCK1=").unwrap().parse().unwrap();
    assert!(f1 <= 1, "{console}");
    // ext4 keeps the superblock's free block and inode totals only lazily (the kernel does not journal them;
    // the group descriptors are the truth), so after any crash-consistent image e2fsck may recompute those two
    // summary counts: that is not damage. Any other fix is.
    let lines: Vec<&str> = console.lines().map(|l| l.trim_start_matches("guest: ")).collect();
    let fixes: Vec<&str> = lines
        .windows(2)
        .filter(|w| w[1].starts_with("Fix? yes"))
        .map(|w| w[0])
        .filter(|l| !(l.starts_with("Free blocks count wrong (") || l.starts_with("Free inodes count wrong (")))
        .collect();
    assert!(fixes.is_empty(), "e2fsck had to fix {fixes:?}:\n{console}");
    assert_eq!(g.value("FSCK2=").as_deref(), Some("0"), "{console}");
}
