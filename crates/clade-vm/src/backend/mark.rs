//! Mark: a cold sandbox's RAM file becomes the mark's root (device state saved with `x-ignore-shared`) and the
//! sandbox goes on as a clone of its own mark; a clone saves device state alone plus the pages that diverged from
//! its root, paused only for what changed. Kept apart from the running sandbox (`sandbox.rs`) as clade-ct keeps
//! its mark in `dump.rs`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use clade_core::backend::{BackendError, BackendKind, MarkOptions, MarkState};
use clade_store::ImageKind;

use super::{await_hello, failed, mid, role, VmSandbox, RESTORE_TIMEOUT};
use crate::machine::RamBacking;

/// What the last mark of a sandbox changed, for benches: the truth the stored bytes are held against.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct MarkStats {
    /// Guest pages that differed from the root RAM file (4 KiB each).
    pub diverged_bytes: u64,
    /// Disk blocks written since the last snapshot (4 KiB each).
    pub disk_dirty_bytes: u64,
    /// `stop` to `cont`: device state, diverged pages and the disk snapshot.
    pub pause_ms: f64,
    /// Of that, device state and diverged pages alone.
    pub ram_pause_ms: f64,
    /// The pages' phases (before and inside the pause).
    pub phases: crate::templating::ClonePhases,
    /// Freezing the disk overlay (inside the pause) and `cont`.
    pub disk_freeze_ms: f64,
    pub cont_ms: f64,
}

impl VmSandbox {
    fn put_bytes(&self, data: &[u8], kind: ImageKind) -> Result<clade_store::PutReport, BackendError> {
        self.backend.inner.store.put_bytes(data, kind).map_err(|e| failed(format!("store: {e}")))
    }

    /// Mark a cold sandbox: its RAM file becomes the root of the mark, and the sandbox continues as a clone.
    pub(super) fn mark_cold(&mut self, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        let start = Instant::now();
        let state_path = self.run.path.join("devstate.mark");
        let saved = crate::templating::save_device_state(self.vm(), &state_path).map_err(failed)?;
        let disk = self.disk.snapshot().map_err(failed)?;
        let store = self.backend.inner.store.clone();
        let ram =
            store.put_file_rehash(&self.ram_file, ImageKind::Mem).map_err(|e| failed(format!("store RAM: {e}")))?;
        let dev =
            store.put_file_rehash(&state_path, ImageKind::Other).map_err(|e| failed(format!("store state: {e}")))?;
        let root = put_id(&ram)?;
        let root_file = self.backend.root_ram_file(&root);
        // The guest is paused and about to be replaced: its RAM file becomes the mark's root (same tmpfs, so a
        // rename), unless an identical root is there already.
        self.vm = None;
        if root_file.exists() {
            let _ = std::fs::remove_file(&self.ram_file);
        } else {
            std::fs::rename(&self.ram_file, &root_file).map_err(|e| failed(format!("publish RAM file: {e}")))?;
        }
        let mut manifests = BTreeMap::new();
        manifests.insert(role::RAM_ROOT.to_string(), root.clone());
        manifests.insert(role::RAM.to_string(), root.clone());
        manifests.insert(role::DEVSTATE.to_string(), put_id(&dev)?);
        manifests.insert(role::DISK.to_string(), disk);
        let pause = Duration::from_secs_f64(saved.pause_ms / 1e3);
        let mark = self.mark_state(manifests, ram.size + dev.size, stored(&ram) + stored(&dev), pause, opts);
        // Go on as a clone of the mark (same guest state; a new QEMU mapping the root privately).
        let mut spec = self.backend.spec(
            &self.shape,
            RamBacking { path: root_file.clone(), share: false },
            self.disk.socket(),
            &self.agent_sock,
            true,
            false,
        );
        crate::net::apply(&mut spec, self.net.as_ref().map(clade_core::sandbox_net::SandboxNet::netns_path));
        let jail = self.backend.jail(&self.id, &self.shape);
        let (vm, _) = crate::templating::restore_jailed(
            &self.backend.inner.qemu,
            spec,
            &state_path,
            &self.run.path.join("qemu"),
            jail.as_ref(),
        )
        .map_err(failed)?;
        self.vm = Some(vm);
        self.ram_file = root_file;
        self.root = Some(root.clone());
        self.leases.push(self.backend.lease(&root)?);
        let timeout = self.backend.hello_timeout(RESTORE_TIMEOUT);
        let agent = await_hello(self.vm.as_mut().expect("just set"), &self.agent_sock, timeout)?;
        self.agent = agent;
        let mut mark = mark;
        mark.pause = start.elapsed();
        Ok(mark)
    }

    /// Mark a clone: device state alone + its diverged pages; the pause is what changed, not the guest size.
    pub(super) fn mark_clone(&mut self, root: String, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        let state_path = self.run.path.join("devstate.mark");
        let cm = crate::templating::save_clone_state(self.vm(), &state_path);
        let cm = match cm {
            Ok(cm) => cm,
            Err(e) => {
                // Whatever failed, the guest must not stay paused (a stop that went through stays in force).
                let _ = self.vm().qmp.execute("cont", serde_json::json!({}));
                return Err(failed(e));
            }
        };
        let disk_dirty_bytes = self.disk.dirty_bytes();
        // The disk is frozen while the guest is stopped (O(1)); its blocks are stored after `cont`.
        let t = Instant::now();
        let frozen = self.disk.freeze();
        let disk_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let cont = self.vm().qmp.execute("cont", serde_json::json!({}));
        let cont_ms = t.elapsed().as_secs_f64() * 1e3;
        // `stop` to `cont` returning (the page pre-scan and the buffer's faults happen before the stop).
        let pause = Duration::from_secs_f64((cm.stats.pause_ms + disk_ms + cont_ms) / 1e3);
        self.last_mark = Some(MarkStats {
            diverged_bytes: cm.pages.len() as u64 * crate::ramdiff::PAGE,
            disk_dirty_bytes,
            pause_ms: pause.as_secs_f64() * 1e3,
            ram_pause_ms: cm.stats.pause_ms,
            phases: cm.phases,
            disk_freeze_ms: disk_ms,
            cont_ms,
        });
        frozen.map_err(failed)?;
        cont.map_err(failed)?;
        let disk = self.disk.commit().map_err(failed)?;
        // Off the pause: store the pages as a complete manifest derived from the root, plus the page list.
        let store = self.backend.inner.store.clone();
        let size = self.shape.memory_mib as u64 * 1024 * 1024;
        let mut b =
            store.derive(Some(&mid(&root)?), size).map_err(|e| failed(format!("store: {e}")))?.kind(ImageKind::Mem);
        let page = crate::ramdiff::PAGE as usize;
        let mut off = 0usize;
        for (first, n) in crate::ramdiff::runs(&cm.pages) {
            let len = n as usize * page;
            b.write(first * crate::ramdiff::PAGE, &cm.data[off..off + len])
                .map_err(|e| failed(format!("store: {e}")))?;
            off += len;
        }
        let ram = b.finish().map_err(|e| failed(format!("store: {e}")))?;
        let list: Vec<u8> = cm.pages.iter().flat_map(|p| p.to_le_bytes()).collect();
        let pages = self.put_bytes(&list, ImageKind::Other)?;
        let dev =
            store.put_file_rehash(&state_path, ImageKind::Other).map_err(|e| failed(format!("store state: {e}")))?;
        let mut manifests = BTreeMap::new();
        manifests.insert(role::RAM_ROOT.to_string(), root);
        manifests.insert(role::RAM.to_string(), put_id(&ram)?);
        manifests.insert(role::RAM_PAGES.to_string(), put_id(&pages)?);
        manifests.insert(role::DEVSTATE_ONLY.to_string(), put_id(&dev)?);
        manifests.insert(role::DISK.to_string(), disk);
        let stored_bytes = stored(&ram) + stored(&pages) + stored(&dev);
        Ok(self.mark_state(manifests, size + dev.size, stored_bytes, pause, opts))
    }

    /// A mark of this sandbox naming `manifests`, its network mode recorded beside them.
    pub(super) fn mark_state(
        &self,
        mut manifests: BTreeMap<String, String>,
        logical_bytes: u64,
        stored_bytes: u64,
        pause: Duration,
        opts: &MarkOptions,
    ) -> MarkState {
        crate::net::record(&mut manifests, self.egress);
        MarkState {
            backend: BackendKind::Vm,
            manifests,
            compat: self.backend.compat(&self.shape),
            shape: self.shape.clone(),
            logical_bytes,
            stored_bytes,
            pause,
            clean: !opts.not_clean,
        }
    }
}

fn put_id(r: &clade_store::PutReport) -> Result<String, BackendError> {
    r.id.map(|i| i.to_string()).ok_or_else(|| failed("store published no manifest"))
}

/// Bytes a put added to the store: new packed data plus the manifest.
fn stored(r: &clade_store::PutReport) -> u64 {
    r.bytes_stored + r.manifest_bytes
}
