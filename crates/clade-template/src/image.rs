//! The `vm` backend's disk: an ext4 image of the root filesystem made without mounting anything
//! (`mkfs.ext4 -d`), in a sparse file of `disk_gib`. Only blocks mkfs writes are allocated, and the store
//! skips zero blocks, so the stored image costs about what the files do. Lazy inode-table and journal
//! initialisation keep mkfs from writing zeros over the whole disk.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use crate::chroot::run;
use crate::debian::which;
use crate::error::{IoCtx, Result, TemplateError};

/// Apparent and allocated size of an image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSize {
    pub apparent_bytes: u64,
    pub allocated_bytes: u64,
}

/// Makes `image` (replaced if it exists) an ext4 filesystem of `disk_gib` GiB holding `rootfs`, owned by
/// root at its top, labelled `clade-root`.
pub fn make_ext4(rootfs: &Path, image: &Path, disk_gib: u32) -> Result<ImageSize> {
    let mkfs = which("mkfs.ext4")
        .ok_or_else(|| TemplateError::Host("mkfs.ext4 is not installed: `apt-get install e2fsprogs`".into()))?;
    let _ = std::fs::remove_file(image);
    let f = std::fs::File::create(image).ctx("create", image)?;
    f.set_len(u64::from(disk_gib) << 30).ctx("size", image)?;
    drop(f);
    let mut c = Command::new(mkfs);
    c.args(["-q", "-F", "-t", "ext4", "-L", "clade-root", "-m", "0"])
        .args(["-E", "root_owner=0:0,lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg("-d")
        .arg(rootfs)
        .arg(image);
    if let Err(e) = run("image: mkfs.ext4", &mut c) {
        let _ = std::fs::remove_file(image);
        return Err(match e {
            TemplateError::Command { output, .. }
                if output.contains("Could not allocate") || output.contains("No space") =>
            {
                TemplateError::Host(format!(
                    "the root filesystem does not fit in disk_gib = {disk_gib}; raise disk_gib in the spec\n{output}"
                ))
            }
            other => other,
        });
    }
    let m = std::fs::metadata(image).ctx("stat", image)?;
    Ok(ImageSize { apparent_bytes: m.len(), allocated_bytes: m.blocks() * 512 })
}

/// Puts a sparse image into the store reading only its data extents (`SEEK_DATA`/`SEEK_HOLE`): holes are
/// zeros and cost nothing, and reading gigabytes of them would dominate the build.
pub fn put_sparse(store: &clade_store::Store, image: &Path) -> Result<clade_store::PutReport> {
    use nix::unistd::{lseek, Whence};
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::AsRawFd;

    const BLOCK: u64 = clade_store::BLOCK as u64;
    let mut f = std::fs::File::open(image).ctx("open", image)?;
    let size = f.metadata().ctx("stat", image)?.len();
    let mut b = store.derive(None, size)?.kind(clade_store::ImageKind::Disk);
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0u64;
    while off < size {
        let data = match lseek(f.as_raw_fd(), off as i64, Whence::SeekData) {
            Ok(d) => d as u64,
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(std::io::Error::from(e)).ctx("seek data in", image),
        };
        let hole = lseek(f.as_raw_fd(), data as i64, Whence::SeekHole).map(|h| h as u64).unwrap_or(size);
        let (start, end) = (data / BLOCK * BLOCK, hole.div_ceil(BLOCK).saturating_mul(BLOCK).min(size));
        f.seek(SeekFrom::Start(start)).ctx("seek", image)?;
        let mut pos = start;
        while pos < end {
            let want = ((end - pos) as usize).min(buf.len());
            f.read_exact(&mut buf[..want]).ctx("read", image)?;
            b.write(pos, &buf[..want])?;
            pos += want as u64;
        }
        off = end.max(off + BLOCK);
    }
    Ok(b.finish()?)
}

/// Checks an image with `e2fsck -fn` (read-only); used by tests and `--verify`.
pub fn fsck(image: &Path) -> Result<()> {
    let e2fsck = which("e2fsck").ok_or_else(|| TemplateError::Host("e2fsck is not installed".into()))?;
    let mut c = Command::new(e2fsck);
    c.arg("-fn").arg(image);
    run("image: e2fsck", &mut c).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ext4_image_holds_the_tree_and_is_sparse() {
        if which("mkfs.ext4").is_none() {
            eprintln!("skipping: mkfs.ext4 is not installed");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/hello"), vec![7u8; 300_000]).unwrap();
        let img = d.path().join("disk.ext4");
        let s = make_ext4(&root, &img, 1).unwrap();
        assert_eq!(s.apparent_bytes, 1 << 30);
        assert!(s.allocated_bytes < 40 << 20, "sparse: {} bytes allocated", s.allocated_bytes);
        fsck(&img).unwrap();
        // Only the data extents are read, and the stored image reads back byte for byte.
        let store = clade_store::Store::open(&d.path().join("store"), clade_store::StoreConfig::default()).unwrap();
        let put = put_sparse(&store, &img).unwrap();
        assert_eq!(put.size, 1 << 30);
        assert!(put.bytes_new + put.bytes_dedup <= s.allocated_bytes);
        let full = store.put_file(&img, clade_store::ImageKind::Disk).unwrap();
        assert_eq!(full.id, put.id, "same manifest as reading every byte");
        let out = Command::new(which("debugfs").unwrap()).arg("-R").arg("cat /etc/hello").arg(&img).output().unwrap();
        assert_eq!(out.stdout.len(), 300_000);
        let e = make_ext4(&d.path().join("missing"), &d.path().join("x.ext4"), 1).unwrap_err();
        assert!(e.to_string().contains("mkfs.ext4"), "{e}");
        assert!(!d.path().join("x.ext4").exists(), "a failed image is removed");
    }
}
