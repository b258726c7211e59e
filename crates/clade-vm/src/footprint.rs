//! The vm backend's host footprint (`clade_core::footprint`): the root RAM file of a mark and a cold sandbox's
//! RAM file on tmpfs, the lazy RAM mounts, the vCPUs admission reserves, and the QEMU jail audit (the QEMU
//! process's uid, capabilities, seccomp, `-sandbox` flags, chroot and mount namespace).

use std::path::{Path, PathBuf};

use clade_core::backend::BackendKind;
use clade_core::footprint::{Footprint, Leftover};
use clade_core::CladeHome;

pub struct VmFootprint;

impl Footprint for VmFootprint {
    fn kind(&self) -> BackendKind {
        BackendKind::Vm
    }

    /// A mark's root RAM file (`ram/<manifest>.ram` under `CLADE_SHM`), which siblings map MAP_PRIVATE.
    fn derived_files(&self, home: &CladeHome, manifest: &str) -> Vec<PathBuf> {
        vec![home.shm_dir().join("ram").join(format!("{manifest}.ram"))]
    }

    /// Lazy RAM mounts of a sandbox restored from a root it never held (`lazy/<sandbox>`).
    fn mount_roots(&self, home: &CladeHome, sandbox: &str) -> Vec<PathBuf> {
        vec![home.shm_dir().join("lazy").join(sandbox)]
    }

    /// A guest's network mode and a disk-only mark's `boot` are words, not stored data.
    fn word_roles(&self) -> &'static [&'static str] {
        &[crate::net::ROLE_NETWORK, clade_core::backend::ROLE_BOOT]
    }

    /// A cold sandbox's RAM file (`run/<sandbox>.ram` under `CLADE_SHM`), and the network namespace of a guest
    /// with egress (its QEMU's: clade_core::sandbox_net).
    fn leftovers(&self, home: &CladeHome, sandbox: &str, fix: bool, settled: &dyn Fn(&Path) -> bool) -> Vec<Leftover> {
        let mut left: Vec<Leftover> =
            clade_core::sandbox_net::network_leftover(sandbox, fix, settled).into_iter().collect();
        let ram = home.shm_dir().join("run").join(format!("{sandbox}.ram"));
        if ram.exists() && settled(&ram) {
            let fixed = fix && std::fs::remove_file(&ram).is_ok();
            left.push(Leftover { kind: "leftover-ram-file", detail: ram.display().to_string(), fixed });
        }
        left
    }

    /// An eighth of its RAM its own (what a sibling dirties at first), the mark's RAM file shared by all.
    fn memory_estimate(&self, _mark_bytes: u64, shape_bytes: u64) -> (u64, u64) {
        (shape_bytes / 8, shape_bytes)
    }

    /// Its disk is served from the store by its supervisor's NBD server.
    fn reads_store_while_running(&self) -> bool {
        true
    }

    /// The sandbox's processes are its QEMU; the first is audited.
    fn jail_audit(&self, _sandbox: &str, pids: &[u32]) -> serde_json::Value {
        match pids.first() {
            Some(qemu) => qemu_audit(*qemu),
            None => serde_json::json!({"deviations": ["no QEMU process to audit"]}),
        }
    }
}

/// The vm backend's jail as seen on its QEMU process.
fn qemu_audit(qemu: u32) -> serde_json::Value {
    let st = clade_core::host::proc_status(qemu).unwrap_or_default();
    let get = |k: &str| st.get(k).cloned().unwrap_or_default();
    let cmdline: Vec<String> = std::fs::read(format!("/proc/{qemu}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let flag = |name: &str| cmdline.iter().position(|a| a == name).and_then(|i| cmdline.get(i + 1)).cloned();
    let sandbox = flag("-sandbox").unwrap_or_default();
    let root = std::fs::read_link(format!("/proc/{qemu}/root")).map(|p| p.display().to_string()).unwrap_or_default();
    let own_mnt =
        std::fs::read_link(format!("/proc/{qemu}/ns/mnt")).ok() != std::fs::read_link("/proc/self/ns/mnt").ok();
    let mut dev = Vec::new();
    if get("Uid") == "0" || get("Uid").is_empty() {
        dev.push(format!("QEMU {qemu} runs as uid {:?}", get("Uid")));
    }
    for k in ["CapEff", "CapPrm"] {
        if get(k) != "0000000000000000" {
            dev.push(format!("QEMU {qemu}: {k} {}", get(k)));
        }
    }
    if get("Seccomp") != "2" {
        dev.push(format!("QEMU {qemu}: seccomp mode {:?}", get("Seccomp")));
    }
    for want in ["on", "obsolete=deny", "spawn=deny", "resourcecontrol=deny"] {
        if !sandbox.split(',').any(|f| f == want) {
            dev.push(format!("QEMU {qemu}: -sandbox lacks {want} ({sandbox:?})"));
        }
    }
    if root == "/" || root.is_empty() {
        dev.push(format!("QEMU {qemu} is not chrooted"));
    }
    if !own_mnt {
        dev.push(format!("QEMU {qemu} shares the host's mount namespace"));
    }
    serde_json::json!({
        "qemu_pid": qemu, "uid": get("Uid"), "cap_eff": get("CapEff"), "cap_bnd": get("CapBnd"),
        "seccomp": get("Seccomp"), "no_new_privs": get("NoNewPrivs"), "sandbox_flags": sandbox, "root": root,
        "own_mount_namespace": own_mnt, "deviations": dev,
    })
}
