//! Cold start: boot a template's disk (a clade-nbd export of its manifest) with clade's initramfs, guest RAM a
//! fresh shared file on tmpfs. Only base builds boot cold; everything else restores a mark (`restore.rs`). Kept
//! apart from the backend (`mod.rs`) as clade-ct keeps its cold start in `spawn.rs`.

use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use clade_core::backend::{BackendError, Identity, Sandbox, TemplateImage};
use clade_core::sandbox_net::SandboxNet;

use super::run_dir::RunDir;
use super::{await_hello, failed, FailPoint, VmBackend, VmSandbox, COLD_TIMEOUT};
use crate::machine::RamBacking;

impl VmBackend {
    /// The body of `Backend::cold_start`.
    pub(super) fn cold_start_vm(&self, image: &TemplateImage, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError> {
        let disk_manifest = image
            .disk_manifest
            .as_deref()
            .ok_or_else(|| failed(format!("template {} has no vm disk image", image.name)))?;
        let ram = self.inner.shm.join("run").join(format!("{}.ram", id.sandbox_id));
        self.check_shm_room(image.shape.memory_mib as u64 * 1024 * 1024, "a cold guest's RAM file")?;
        let run = RunDir::create(&self.inner.home, &id.sandbox_id)?;
        self.check_fail(FailPoint::RunDir)?;
        let disk = self.inner.disks.export(disk_manifest, &run.path.join("disk.sock")).map_err(failed)?;
        let leases = vec![self.lease(disk_manifest)?];
        self.check_fail(FailPoint::Disk)?;
        let agent_sock = run.path.join("agent.sock");
        let mut spec = self.spec(
            &image.shape,
            RamBacking { path: ram.clone(), share: true },
            disk.socket(),
            &agent_sock,
            false,
            false,
        );
        let net = self.sandbox_net(&id.sandbox_id, image.egress)?;
        crate::net::apply(&mut spec, net.as_ref().map(SandboxNet::netns_path));
        let qemu_dir = run.path.join("qemu");
        let guard = RamGuard(Some(ram.clone()));
        // Created here, 0600: QEMU would create it 0644.
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&ram)
            .map_err(|e| failed(format!("create RAM file {}: {e}", ram.display())))?;
        let mut vm = self.spawn(&id.sandbox_id, &image.shape, spec, &qemu_dir)?;
        self.check_fail(FailPoint::Process)?;
        let agent = await_hello(&mut vm, &agent_sock, self.hello_timeout(COLD_TIMEOUT))?;
        self.check_fail(FailPoint::Agent)?;
        std::mem::forget(guard);
        Ok(Box::new(VmSandbox {
            backend: self.clone(),
            id: id.sandbox_id.clone(),
            shape: image.shape.clone(),
            vm: Some(vm),
            disk,
            agent,
            agent_sock,
            ram_file: ram,
            root: None,
            leases,
            run,
            generation: 0,
            last_mark: None,
            egress: image.egress,
            lazy: None,
            net,
        }))
    }
}

/// Removes a cold sandbox's private RAM file unless it became a mark's root.
struct RamGuard(Option<PathBuf>);
impl Drop for RamGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}
