//! Helpers shared by the guest-tier tests: where setup put things, and a tiny root filesystem (busybox + the
//! agent with its libraries) made into an ext4 image without mounting.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use clade_vm::accel::Accel;

pub fn home() -> PathBuf {
    PathBuf::from(std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into()))
}

/// The accelerator `clade doctor` chose on this host (TCG when it never ran).
pub fn accel() -> Accel {
    std::fs::read(home().join("cache/accel.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .map(|v| if v["chosen"] == "kvm" { Accel::Kvm } else { Accel::Tcg })
        .unwrap_or(Accel::Tcg)
}

/// The agent binary built next to this test (`cargo build --workspace` puts it in the target dir).
pub fn agent_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_AGENT_BIN") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("clade-agent"); // target/debug/deps -> target/debug
    p.exists().then_some(p)
}

/// Copy `bin` and the shared libraries `ldd` names into `root` at `dest`.
pub fn install_with_libs(bin: &Path, root: &Path, dest: &str) {
    let target = root.join(dest.trim_start_matches('/'));
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    std::fs::copy(bin, &target).unwrap();
    let out = Command::new("ldd").arg(bin).output().unwrap();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(p) = line.split_whitespace().find(|w| w.starts_with('/')) {
            let t = root.join(p.trim_start_matches('/'));
            std::fs::create_dir_all(t.parent().unwrap()).unwrap();
            std::fs::copy(p, &t).unwrap();
        }
    }
}

/// A root filesystem of busybox (with sh and a few applet links) and the agent at its place, as an ext4 image
/// of `mib` MiB at `img`.
pub fn busybox_root_image(work: &Path, agent: &Path, img: &Path, mib: u32) {
    let root = work.join("root");
    for d in ["bin", "dev", "proc", "sys", "run", "tmp", "etc", "root"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for applet in ["sh", "hostname", "cat", "echo", "head", "od", "sleep", "dd"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    install_with_libs(agent, &root, clade_vm::boot::AGENT_PATH);
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(&root)
        .arg(img)
        .arg(format!("{mib}M"))
        .status()
        .unwrap();
    assert!(st.success(), "mkfs.ext4 failed");
}

/// Kills a helper process on drop.
pub struct Child(pub std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
