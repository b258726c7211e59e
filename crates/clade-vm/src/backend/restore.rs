//! Restore: map the root RAM file `share=off` (rebuilt from the store, or fetched lazily, when missing), write
//! the mark's own pages into the private mapping, load the device state, continue, and reconnect the agent.
//! Split in two as the `Prepared` trait wants: `VmBackend::prepare_vm` gets everything up to QEMU waiting on
//! `-incoming defer`, [`VmPrepared`] starts it. Kept apart from the backend (`mod.rs`) as clade-ct keeps its
//! restore in `restore.rs`.

use std::path::{Path, PathBuf};

use clade_core::backend::{check_compat, BackendError, BackendKind, Identity, MarkState, Prepared, Sandbox, Shape};
use clade_core::sandbox_net::SandboxNet;
use clade_store::{Lease, Store};

use super::run_dir::RunDir;
use super::{await_hello, failed, manifest, mid, role, FailPoint, VmBackend, VmSandbox, RESTORE_TIMEOUT};
use crate::disks::DiskExport;
use crate::machine::{RamBacking, Vm};

impl VmBackend {
    /// Rebuild a root RAM file from the store. Siblings restored at once may race here: each writes its own
    /// temp file and links it into place without replacing (a file other QEMUs already map must never be
    /// swapped under them), so the first one wins and the others use it.
    fn materialize_root(&self, root: &str, dest: &Path) -> Result<(), BackendError> {
        let tmp = dest.with_extension(format!("fetch{}", std::process::id()));
        if let Err(e) = self.inner.store.get_file(&mid(root)?, &tmp) {
            // A half-written file (a full tmpfs, a corrupt object) is never left behind.
            let _ = std::fs::remove_file(&tmp);
            return Err(match e {
                io @ clade_store::StoreError::Io { .. } => failed(format!("rebuild RAM file {}: {io}", dest.display())),
                other => BackendError::Corrupt(other.to_string()),
            });
        }
        let linked = std::fs::hard_link(&tmp, dest);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(failed(format!("publish RAM file {}: {e}", dest.display()))),
        }
    }

    /// Everything of a restore up to the guest running: the root RAM file (rebuilt from the store if missing),
    /// the device state and the mark's own pages fetched, the disk export up, QEMU started on `-incoming defer`
    /// with the pages written into its private mapping.
    pub(super) fn prepare_vm(&self, mark: &MarkState, id: &Identity) -> Result<VmPrepared, BackendError> {
        if mark.backend != BackendKind::Vm {
            return Err(failed("not a vm mark"));
        }
        if mark.boots_cold() {
            return Err(BackendError::Unsupported(
                "a disk-only mark has no memory to prepare: restore it (it boots cold)".into(),
            ));
        }
        check_compat(&mark.compat, &self.compat(&mark.shape))?;
        let egress = crate::net::mark_egress(mark)?;
        let store = &self.inner.store;
        let root = manifest(mark, role::RAM_ROOT)?.to_string();
        let disk_manifest = manifest(mark, role::DISK)?;
        // Verify what the mark names before anything starts: the RAM's size against the mark's shape, the device
        // state's header, the page list's bounds (the store checks every byte's hash as it reads).
        let ram_bytes = mark.shape.memory_mib as u64 * 1024 * 1024;
        let corrupt = |e: clade_store::StoreError| BackendError::Corrupt(e.to_string());
        let root_size = store.manifest(&mid(&root)?).map_err(corrupt)?.size;
        if root_size != ram_bytes {
            return Err(BackendError::Corrupt(format!(
                "the mark's RAM ({root}) has {root_size} bytes but its shape says {} MiB: the mark is damaged; \
                 restore an earlier one",
                mark.shape.memory_mib
            )));
        }
        let (state_role, devstate_only) = match mark.manifests.get(role::DEVSTATE_ONLY) {
            Some(_) => (role::DEVSTATE_ONLY, true),
            None => (role::DEVSTATE, false),
        };
        let state_id = manifest(mark, state_role)?;
        let state_bytes = read_all(store, state_id)?;
        verify_device_state(&state_bytes, state_id)?;
        let mut leases = vec![self.lease(&root)?, self.lease(disk_manifest)?];
        let (pages, data) = match mark.manifests.get(role::RAM_PAGES) {
            Some(p) => {
                let ram = manifest(mark, role::RAM)?;
                leases.push(self.lease(ram)?);
                read_pages(store, p, ram, ram_bytes)?
            }
            None => (Vec::new(), Vec::new()),
        };
        let (ram_file, lazy) = self.root_backing(&root, &id.sandbox_id, ram_bytes)?;
        let run = RunDir::create(&self.inner.home, &id.sandbox_id)?;
        self.check_fail(FailPoint::RunDir)?;
        let state = run.path.join("devstate");
        std::fs::write(&state, &state_bytes).map_err(|e| failed(format!("write {}: {e}", state.display())))?;
        let disk = self.inner.disks.export(disk_manifest, &run.path.join("disk.sock")).map_err(failed)?;
        self.check_fail(FailPoint::Disk)?;
        let agent_sock = run.path.join("agent.sock");
        let mut spec = self.spec(
            &mark.shape,
            RamBacking { path: ram_file.clone(), share: false },
            disk.socket(),
            &agent_sock,
            true,
            devstate_only,
        );
        let net = self.sandbox_net(&id.sandbox_id, egress)?;
        crate::net::apply(&mut spec, net.as_ref().map(SandboxNet::netns_path));
        let vm = self.spawn(&id.sandbox_id, &mark.shape, spec, &run.path.join("qemu"))?;
        self.check_fail(FailPoint::Process)?;
        crate::templating::write_mark_pages(&vm, &pages, &data).map_err(failed)?;
        self.check_fail(FailPoint::Pages)?;
        Ok(VmPrepared {
            backend: self.clone(),
            id: id.sandbox_id.clone(),
            shape: mark.shape.clone(),
            vm,
            state,
            disk,
            agent_sock,
            ram_file,
            root,
            leases,
            run,
            generation: id.generation,
            egress,
            lazy,
            net,
        })
    }

    /// The file a restore maps its root RAM from: the host's shared root file (rebuilt from the store when
    /// missing), or, for a root this host has never held whose bytes live in the blob tier (a sandbox resumed
    /// here from another host, docs/roam.md), a lazy file that fetches pages as the guest touches them.
    /// `CLADE_LAZY_RAM=always|never` overrides the choice.
    fn root_backing(
        &self,
        root: &str,
        sandbox: &str,
        ram_bytes: u64,
    ) -> Result<(PathBuf, Option<clade_lazyfs::LazyFile>), BackendError> {
        let ram_file = self.root_ram_file(root);
        match std::fs::metadata(&ram_file) {
            Ok(m) if m.len() == ram_bytes => return Ok((ram_file, None)),
            // A root file of the wrong size was damaged on the host: QEMUs mapping it keep their pages; new
            // restores get a copy rebuilt from the store.
            Ok(_) => {
                let _ = std::fs::remove_file(&ram_file);
            }
            Err(_) => {}
        }
        let store = &self.inner.store;
        let lazy = match std::env::var("CLADE_LAZY_RAM").as_deref() {
            Ok("always") => true,
            Ok("never") => false,
            _ => store.blob_tier().is_some() && !store.has_manifest(&mid(root)?),
        };
        if !lazy {
            self.check_shm_room(ram_bytes, "rebuilding the mark's RAM file")?;
            self.materialize_root(root, &ram_file)?;
            return Ok((ram_file, None));
        }
        let dir = self.inner.shm.join("lazy").join(sandbox);
        let file = clade_lazyfs::LazyFile::mount(store, &mid(root)?, &dir, &format!("{root}.ram"))
            .map_err(|e| failed(format!("lazy RAM: {e}")))?;
        Ok((file.path(), Some(file)))
    }
}

/// A `vm` restore waiting to run: QEMU on `-incoming defer` with its RAM in place.
pub struct VmPrepared {
    backend: VmBackend,
    id: String,
    shape: Shape,
    vm: Vm,
    state: PathBuf,
    disk: DiskExport,
    agent_sock: PathBuf,
    ram_file: PathBuf,
    root: String,
    leases: Vec<Lease>,
    run: RunDir,
    generation: u64,
    egress: bool,
    /// The lazily fetched root RAM this restore maps, when it has no root file (see `root_backing`).
    lazy: Option<clade_lazyfs::LazyFile>,
    /// Egress: the namespace its QEMU runs in (last: released after QEMU is gone).
    net: Option<SandboxNet>,
}

impl VmBackend {
    /// A restore returning the concrete sandbox (benches read its [`MarkStats`](super::MarkStats)).
    pub fn restore_vm(&self, mark: &MarkState, id: &Identity) -> Result<VmSandbox, BackendError> {
        self.prepare_vm(mark, id)?.start_concrete()
    }
}

impl VmPrepared {
    pub(super) fn start_vm(self) -> Result<Box<dyn Sandbox>, BackendError> {
        Ok(Box::new(self.start_concrete()?))
    }

    fn start_concrete(self) -> Result<VmSandbox, BackendError> {
        let mut vm = self.vm;
        crate::templating::load_and_continue(&mut vm, &self.state).map_err(failed)?;
        self.backend.check_fail(FailPoint::Running)?;
        let agent = await_hello(&mut vm, &self.agent_sock, self.backend.hello_timeout(RESTORE_TIMEOUT))?;
        self.backend.check_fail(FailPoint::Agent)?;
        Ok(VmSandbox {
            backend: self.backend,
            id: self.id,
            shape: self.shape,
            vm: Some(vm),
            disk: self.disk,
            agent,
            agent_sock: self.agent_sock,
            ram_file: self.ram_file,
            root: Some(self.root),
            leases: self.leases,
            run: self.run,
            generation: self.generation,
            last_mark: None,
            egress: self.egress,
            lazy: self.lazy,
            net: self.net,
        })
    }
}

impl Prepared for VmPrepared {
    fn start(self: Box<Self>) -> Result<Box<dyn Sandbox>, BackendError> {
        self.start_vm()
    }
}

/// The diverged page list and the pages' bytes of a clone's mark (every page within `ram_bytes`).
fn read_pages(
    store: &Store,
    pages_id: &str,
    ram_id: &str,
    ram_bytes: u64,
) -> Result<(Vec<u64>, Vec<u8>), BackendError> {
    let corrupt = |e: clade_store::StoreError| BackendError::Corrupt(e.to_string());
    let raw = read_all(store, pages_id)?;
    if raw.len() % 8 != 0 {
        return Err(BackendError::Corrupt(format!("page list {pages_id} is {} bytes, not a list of u64", raw.len())));
    }
    let pages: Vec<u64> = raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    let total = ram_bytes / crate::ramdiff::PAGE;
    if pages.windows(2).any(|w| w[0] >= w[1]) || pages.last().is_some_and(|&p| p >= total) {
        return Err(BackendError::Corrupt(format!(
            "page list {pages_id} is not an ascending list of pages below {total}: the mark is damaged"
        )));
    }
    let ram = store.image(&mid(ram_id)?).map_err(corrupt)?;
    if ram.size() != ram_bytes {
        return Err(BackendError::Corrupt(format!(
            "the mark's RAM {ram_id} has {} bytes, not {ram_bytes}",
            ram.size()
        )));
    }
    let page = crate::ramdiff::PAGE as usize;
    let mut data = vec![0u8; pages.len() * page];
    let mut off = 0usize;
    for (first, n) in crate::ramdiff::runs(&pages) {
        let len = n as usize * page;
        ram.read_at(first * crate::ramdiff::PAGE, &mut data[off..off + len]).map_err(corrupt)?;
        off += len;
    }
    Ok((pages, data))
}

/// A whole stored image in memory (device state and page lists: kilobytes).
fn read_all(store: &Store, id: &str) -> Result<Vec<u8>, BackendError> {
    let corrupt = |e: clade_store::StoreError| BackendError::Corrupt(e.to_string());
    let r = store.image(&mid(id)?).map_err(corrupt)?;
    let mut raw = vec![0u8; r.size() as usize];
    r.read_at(0, &mut raw).map_err(corrupt)?;
    Ok(raw)
}

/// QEMU's migration stream header: the magic `QEVM` and version 3. Both device-state formats clade stores
/// (`migrate` with x-ignore-shared, `xen-save-devices-state`) start with it.
fn verify_device_state(bytes: &[u8], id: &str) -> Result<(), BackendError> {
    if bytes.len() < 8 || &bytes[..4] != b"QEVM" || bytes[4..8] != [0, 0, 0, 3] {
        let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        return Err(BackendError::Corrupt(format!(
            "device state {id} is not a QEMU migration stream (starts {}): the mark is damaged; restore an earlier one",
            head.join(" ")
        )));
    }
    Ok(())
}
