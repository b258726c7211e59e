//! Disk-only marks (E2B's filesystem-only pause and snapshot; docs/vm.md, "Disk-only marks"): the guest's
//! disk alone, no RAM or device state. The guest flushes its file systems (`sync` through the agent), QEMU
//! stops (draining its block layer), the disk export turns what was written into a manifest, and the guest
//! either continues (a mark) or ends (a suspend). The restore of such a mark boots that disk cold with a fresh
//! RAM file: a new kernel, a new boot id, as after a power cycle. Kept apart as clade-ct keeps its own in
//! `disk.rs`.

use std::collections::BTreeMap;
use std::time::Instant;

use clade_core::backend::{
    BackendError, BackendKind, Identity, MarkOptions, MarkState, Sandbox, TemplateImage, BOOT_COLD, ROLE_BOOT,
};

use super::{failed, manifest, mid, role, VmBackend, VmSandbox};

impl VmSandbox {
    /// Store the guest's disk as a disk-only mark; the guest goes on unless `end` (then the caller drops it).
    pub(super) fn disk_mark(&mut self, opts: &MarkOptions, end: bool) -> Result<MarkState, BackendError> {
        for warning in clade_core::hygiene::pre_mark(&self.agent, !opts.not_clean) {
            eprintln!("clade-vm: {}: mark goes on: {warning}", self.id);
        }
        // What the guest's page cache holds reaches the disk first; a guest that cannot sync is marked as
        // a power cut would leave it (ext4's journal recovers it at the next boot).
        let spec = clade_agent::ExecSpec { argv: vec!["sync".into()], ..Default::default() };
        if let Err(e) = self.agent.run(spec) {
            eprintln!("clade-vm: {}: sync before a disk-only mark failed ({e}); the disk is taken as it is", self.id);
        }
        let dirty = self.disk.dirty_bytes();
        let t0 = Instant::now();
        self.vm().qmp.execute("stop", serde_json::json!({})).map_err(failed)?;
        let disk = self.disk.snapshot().map_err(failed);
        if !end {
            let cont = self.vm().qmp.execute("cont", serde_json::json!({}));
            cont.map_err(failed)?;
        }
        let pause = t0.elapsed();
        let disk = disk?;
        let manifests: BTreeMap<String, String> =
            [(role::DISK.to_string(), disk), (ROLE_BOOT.to_string(), BOOT_COLD.to_string())].into();
        Ok(self.mark_state(manifests, u64::from(self.shape.disk_gib) << 30, dirty, pause, opts))
    }
}

impl VmBackend {
    /// Boot a disk-only mark's disk cold, with the shape and network its mark records.
    pub(super) fn boot_disk(&self, mark: &MarkState, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError> {
        if mark.backend != BackendKind::Vm {
            return Err(failed(format!("not a vm mark (a {} one)", mark.backend.as_str())));
        }
        let disk = manifest(mark, role::DISK)?;
        // A disk written on another host (a roamed sandbox) may have frames only in the blob tier, whose
        // indexes are listed here, not on the guest's first read inside the NBD export's runtime.
        if self.inner.store.blob_tier().is_some() {
            self.inner.store.locate(&mid(disk)?).map_err(|e| BackendError::Corrupt(format!("the mark's disk: {e}")))?;
        }
        let image = TemplateImage {
            name: format!("the disk of mark {disk}"),
            hash: disk.to_string(),
            rootfs: std::path::PathBuf::new(),
            disk_manifest: Some(disk.to_string()),
            shape: mark.shape.clone(),
            egress: crate::net::mark_egress(mark)?,
            no_new_privs: true,
        };
        self.cold_start_vm(&image, id)
    }
}
