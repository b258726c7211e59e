//! Building blocks for tests of clade above this crate (and of this crate): a tiny root filesystem of busybox and
//! the agent, made into an ext4 image without mounting. Real templates come from clade-template; this one boots
//! in a couple of seconds and needs no network.

use std::path::{Path, PathBuf};
use std::process::Command;

pub use clade_core::host::agent_binary;

/// Copy `bin` and the shared libraries `ldd` names into `root` at `dest`.
pub fn install_with_libs(bin: &Path, root: &Path, dest: &str) -> std::io::Result<()> {
    let target = root.join(dest.trim_start_matches('/'));
    std::fs::create_dir_all(target.parent().unwrap_or(root))?;
    std::fs::copy(bin, &target)?;
    let out = Command::new("ldd").arg(bin).output()?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(p) = line.split_whitespace().find(|w| w.starts_with('/')) {
            let t = root.join(p.trim_start_matches('/'));
            std::fs::create_dir_all(t.parent().unwrap_or(root))?;
            std::fs::copy(p, &t)?;
        }
    }
    Ok(())
}

/// A busybox root (sh and a few applets linked) with the agent at its place, as an ext4 image of `mib` MiB.
/// The directory tree is left at `work/root`.
pub fn busybox_root_image(work: &Path, agent: &Path, img: &Path, mib: u32) -> std::io::Result<PathBuf> {
    let root = work.join("root");
    for d in ["bin", "dev", "proc", "sys", "run", "tmp", "etc", "root"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox"))?;
    for applet in ["sh", "hostname", "cat", "echo", "head", "od", "sleep", "dd", "ls", "rm", "sync"] {
        let link = root.join("bin").join(applet);
        if !link.exists() {
            std::os::unix::fs::symlink("busybox", link)?;
        }
    }
    install_with_libs(agent, &root, crate::boot::AGENT_PATH)?;
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(&root)
        .arg(img)
        .arg(format!("{mib}M"))
        .status()?;
    if !st.success() {
        return Err(std::io::Error::other("mkfs.ext4 failed"));
    }
    Ok(root)
}
