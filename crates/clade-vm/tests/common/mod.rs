//! Helpers shared by the guest-tier tests: where setup put things, and the testkit's tiny root image.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

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

pub fn agent_binary() -> Option<PathBuf> {
    clade_vm::testkit::agent_binary()
}

pub fn busybox_root_image(work: &Path, agent: &Path, img: &Path, mib: u32) {
    clade_vm::testkit::busybox_root_image(work, agent, img, mib).expect("root image");
}

/// Kills a helper process on drop.
pub struct Child(pub std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
