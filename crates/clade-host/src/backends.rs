//! The backends this library carries. Each is opened only when an operation needs it: opening `vm` may run the
//! accelerator probe once per boot; opening `ct` checks the private CRIU and the agent layer. Their host
//! footprints ([`footprint`], [`footprints`]) need no opening: gc, the audit, admission and roaming ask them
//! what each backend keeps on the host instead of knowing its paths.

use std::sync::Arc;

use anyhow::Context;
use clade_core::backend::{Backend, BackendKind};
use clade_core::engine::Engine;
use clade_core::footprint::Footprint;

pub fn open(engine: &Engine, kind: BackendKind) -> anyhow::Result<Arc<dyn Backend>> {
    match kind {
        BackendKind::Vm => Ok(Arc::new(
            clade_vm::backend::VmBackend::open(&engine.home, engine.store.clone(), None)
                .context("open the vm backend")?,
        )),
        BackendKind::Ct => {
            let cfg = clade_ct::CtConfig::from_home(&engine.home).context("configure the ct backend")?;
            Ok(Arc::new(
                clade_ct::CtBackend::new(engine.home.clone(), engine.store.clone(), cfg)
                    .context("open the ct backend")?,
            ))
        }
    }
}

static VM: clade_vm::footprint::VmFootprint = clade_vm::footprint::VmFootprint;
static CT: clade_ct::footprint::CtFootprint = clade_ct::footprint::CtFootprint;

/// What backend `kind` keeps on the host.
pub fn footprint(kind: BackendKind) -> &'static dyn Footprint {
    match kind {
        BackendKind::Vm => &VM,
        BackendKind::Ct => &CT,
    }
}

/// Every backend's footprint.
pub fn footprints() -> [&'static dyn Footprint; 2] {
    [&VM, &CT]
}

#[cfg(test)]
mod tests {
    use super::*;
    use clade_core::backend::Shape;

    #[test]
    fn each_backend_names_its_own_host_state() {
        let dir = tempfile::tempdir().unwrap();
        let home = clade_core::CladeHome::at(dir.path().join("home")).with_shm(dir.path().join("shm"));
        let (vm, ct) = (footprint(BackendKind::Vm), footprint(BackendKind::Ct));
        assert_eq!(vm.derived_files(&home, "m1"), vec![dir.path().join("shm/ram/m1.ram")]);
        assert!(ct.derived_files(&home, "m1").is_empty());
        assert_eq!(ct.tree_caches(), &["ct-uppers", "ct-images"]);
        assert!(vm.tree_caches().is_empty());
        let shape = Shape { memory_mib: 512, vcpus: 2, disk_gib: 1 };
        assert_eq!((vm.reserved_vcpus(&shape), ct.reserved_vcpus(&shape)), (2, 0));
        assert_eq!(ct.layers_role(), Some("rootfs"));
        // Every word a mark of each backend records (roaming skips them as no store ids).
        for role in ["network", "no_new_privs", clade_core::backend::ROLE_BOOT] {
            assert!(ct.word_roles().contains(&role), "ct: {role}");
        }
        for role in ["network", clade_core::backend::ROLE_BOOT] {
            assert!(vm.word_roles().contains(&role), "vm: {role}");
        }
        let tree: clade_store::TreeId = ct.layer_tree(&ct.tree_layer(&clade_store::TreeId([7; 32]))).unwrap();
        assert_eq!(tree, clade_store::TreeId([7; 32]), "a layer entry names its tree and back");
        assert!(ct.layer_tree("/var/lib/clade/templates/x/rootfs").is_none());
        assert!(vm.reads_store_while_running() && !ct.reads_store_while_running());
    }

    #[test]
    fn a_cold_vm_sandboxs_ram_file_is_a_leftover_once_settled() {
        let dir = tempfile::tempdir().unwrap();
        let home = clade_core::CladeHome::at(dir.path().join("home")).with_shm(dir.path().join("shm"));
        let ram = dir.path().join("shm/run/sb-1.ram");
        std::fs::create_dir_all(ram.parent().unwrap()).unwrap();
        std::fs::write(&ram, b"x").unwrap();
        let vm = footprint(BackendKind::Vm);
        assert!(vm.leftovers(&home, "sb-1", true, &|_| false).is_empty(), "a starting sandbox's file is left alone");
        assert!(ram.exists());
        let seen = vm.leftovers(&home, "sb-1", false, &|_| true);
        assert_eq!((seen.len(), seen[0].kind, seen[0].fixed), (1, "leftover-ram-file", false));
        assert!(ram.exists(), "reported, not removed, without fix");
        let fixed = vm.leftovers(&home, "sb-1", true, &|_| true);
        assert!(fixed[0].fixed && !ram.exists());
        assert!(vm.leftovers(&home, "sb-2", true, &|_| true).is_empty());
    }
}
