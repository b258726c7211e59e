//! A tiny writer of the `newc` cpio format the Linux kernel unpacks as its initramfs. clade builds its
//! initramfs images itself (the KVM probe's, and the guest boot's with virtio and ext4 modules) so that the
//! bytes are deterministic and no host tool or host file layout leaks in.

use std::io::{self, Write};
use std::path::Path;

/// An initramfs under construction. Entries are written in the order they are added; parents first.
#[derive(Default)]
pub struct Initramfs {
    buf: Vec<u8>,
    next_ino: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

impl Initramfs {
    pub fn new() -> Self {
        Self { buf: Vec::new(), next_ino: 1 }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if mode & S_IFDIR != 0 { 2 } else { 1 };
        let namesize = name.len() + 1;
        // magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor, rdevminor, namesize, check
        let fields = [ino, mode, 0, 0, nlink, 0, data.len() as u32, 0, 0, 0, 0, namesize as u32, 0];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.buf.len() % 4 != 0 {
            self.buf.push(0);
        }
    }

    /// A directory (`name` without a leading slash, e.g. `bin`).
    pub fn dir(&mut self, name: &str) -> &mut Self {
        self.entry(name, S_IFDIR | 0o755, &[]);
        self
    }

    /// A regular file with the given permission bits.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> &mut Self {
        self.entry(name, S_IFREG | (perm & 0o7777), data);
        self
    }

    /// A host file copied in, keeping its permission bits.
    pub fn host_file(&mut self, name: &str, src: &Path) -> io::Result<&mut Self> {
        use std::os::unix::fs::PermissionsExt;
        let data = std::fs::read(src)?;
        let perm = std::fs::metadata(src)?.permissions().mode();
        Ok(self.file(name, perm, &data))
    }

    pub fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.entry(name, S_IFLNK | 0o777, target.as_bytes());
        self
    }

    /// The finished archive, with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.next_ino = 0;
        self.entry("TRAILER!!!", 0, &[]);
        self.buf
    }

    /// Write the finished archive to `path` through a temp file and rename.
    pub fn write_to(self, path: &Path) -> io::Result<()> {
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&self.finish())?;
        f.sync_all()?;
        std::fs::rename(tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout_is_aligned_and_terminated() {
        let mut i = Initramfs::new();
        i.dir("bin").file("init", 0o755, b"#!/bin/sh\n").symlink("sh", "bin/busybox");
        let out = i.finish();
        assert_eq!(out.len() % 4, 0);
        assert!(out.starts_with(b"070701"));
        let trailer = out.windows(10).position(|w| w == b"TRAILER!!!").expect("trailer present");
        assert!(trailer > out.len() - 128);
    }

    /// The archive is what the system's `cpio` reads back, when it is installed.
    #[test]
    fn cpio_tool_lists_entries() {
        let Ok(out) = std::process::Command::new("cpio").arg("--version").output() else {
            eprintln!("skip: no cpio on this host");
            return;
        };
        assert!(out.status.success());
        let mut i = Initramfs::new();
        i.dir("etc").file("etc/motd", 0o644, b"hello\n").symlink("link", "etc/motd");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.cpio");
        i.write_to(&path).unwrap();
        let listed =
            std::process::Command::new("sh").arg("-c").arg(format!("cpio -it < {}", path.display())).output().unwrap();
        let names = String::from_utf8_lossy(&listed.stdout);
        assert_eq!(names.lines().collect::<Vec<_>>(), vec!["etc", "etc/motd", "link"]);
    }
}
