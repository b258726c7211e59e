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

/// What the backend tests start from: a work dir on /dev/shm, a store holding the busybox root image as a disk,
/// and a `VmBackend` over the real home with its own RAM dir (`shm`). `None` (and a printed reason) where
/// setup has not put QEMU, the guest kernel or the agent in place.
pub struct VmEnv {
    pub work: tempfile::TempDir,
    pub store: clade_store::Store,
    pub home: clade_core::CladeHome,
    pub shm: PathBuf,
    pub backend: clade_vm::backend::VmBackend,
    /// The root image's manifest id in `store`.
    pub disk: String,
}

impl VmEnv {
    /// The busybox test root as a template image (256 MiB, one vCPU, no network).
    #[allow(dead_code)]
    pub fn busybox_image(&self, name: &str) -> clade_core::backend::TemplateImage {
        clade_core::backend::TemplateImage {
            name: name.into(),
            hash: "test".into(),
            rootfs: self.work.path().join("root"),
            disk_manifest: Some(self.disk.clone()),
            shape: clade_core::backend::Shape { memory_mib: 256, vcpus: 1, disk_gib: 1 },
            egress: false,
            no_new_privs: true,
        }
    }
}

pub fn vm_env(prefix: &str) -> Option<VmEnv> {
    let Some(agent) = agent_binary() else {
        eprintln!("skip: no built clade-agent (cargo build --workspace)");
        return None;
    };
    if clade_vm::qemu::qemu_binary().is_none() || !home().join("kernel/current/vmlinux").exists() {
        eprintln!("skip: no QEMU or guest kernel (run ./x setup)");
        return None;
    }
    let work = tempfile::Builder::new().prefix(prefix).tempdir_in("/dev/shm").unwrap();
    let w = work.path();
    let store = clade_store::Store::open(&w.join("store"), clade_store::StoreConfig::default()).unwrap();
    let img = w.join("root.img");
    busybox_root_image(w, &agent, &img, 64);
    let disk = store.put_file(&img, clade_store::ImageKind::Disk).unwrap().id.unwrap().to_string();
    let home = clade_core::CladeHome::at(home());
    let shm = w.join("shm");
    let backend = clade_vm::backend::VmBackend::open(&home, store.clone(), Some(shm.clone())).unwrap();
    Some(VmEnv { work, store, home, shm, backend, disk })
}
