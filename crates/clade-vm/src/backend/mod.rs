//! The `vm` backend behind clade-core's `Backend` trait.
//!
//! - **Cold start** boots the template's disk (a clade-nbd export of its manifest) with clade's initramfs; guest
//!   RAM is a shared file on tmpfs. Only base builds boot cold.
//! - **Mark of a cold sandbox** saves device state with `x-ignore-shared` (the RAM file *is* the RAM), snapshots
//!   the disk, stores the RAM file as a memory manifest and renames it to `ram/<manifest>.ram`: that file is the
//!   root every descendant maps. The sandbox then goes on as a clone of its own mark.
//! - **Restore** maps the root RAM file `share=off` (rebuilt from the store when missing), writes the mark's own
//!   pages into the private mapping, loads the device state, continues, and reconnects the agent. A fresh vmgenid
//!   makes the guest kernel reseed its CRNG.
//! - **Mark of a clone** pauses it, saves device state alone (`xen-save-devices-state`: no RAM streamed), reads
//!   the pages that diverged from the root file (`/proc/PID/pagemap`), snapshots the disk, and continues: a pause
//!   proportional to what changed. The pages are stored after the guest runs again, as a complete manifest
//!   derived from the root's.

use std::collections::BTreeMap;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clade_agent::client::AgentClient;
use clade_core::backend::{
    check_compat, Backend, BackendError, BackendKind, Identity, MarkOptions, MarkState, Prepared, Sandbox, Shape,
    TemplateImage,
};
use clade_core::CladeHome;
use clade_store::{ImageKind, Lease, ManifestId, Store};

use crate::accel::Accel;
use crate::agent_link::NoHello;
use crate::disks::{DiskExport, DiskHost};
use crate::jail::{CgroupPlan, VmJail};
use crate::machine::{MachineType, NbdDisk, RamBacking, Vm, VmSpec};

/// Roles of a `vm` mark's manifests.
pub mod role {
    /// The RAM file every descendant maps (a memory manifest; its tmpfs copy is `ram/<id>.ram`).
    pub const RAM_ROOT: &str = "ram_root";
    /// The mark's complete guest RAM.
    pub const RAM: &str = "ram";
    /// Page indexes (u64 LE) where `ram` differs from `ram_root`.
    pub const RAM_PAGES: &str = "ram_pages";
    /// A migration stream without RAM (`x-ignore-shared`), from a mark of a cold sandbox.
    pub const DEVSTATE: &str = "devstate";
    /// Device state alone (`xen-save-devices-state`), from a mark of a clone.
    pub const DEVSTATE_ONLY: &str = "devstate_only";
    pub const DISK: &str = "disk";
}

/// Where uid slots are claimed, under `$CLADE_HOME/run`. The leading dot keeps it out of what `clade audit`
/// takes for a sandbox's run dir (sandbox ids never start with one): an audit `--fix` must not remove it.
pub const UIDS_DIR: &str = ".vm-uids";

/// How long a guest may take to answer its first hello.
const COLD_TIMEOUT: Duration = Duration::from_secs(120);
const RESTORE_TIMEOUT: Duration = Duration::from_secs(30);

struct Inner {
    home: CladeHome,
    store: Store,
    disks: DiskHost,
    qemu: PathBuf,
    qemu_version: String,
    accel: Accel,
    machine: MachineType,
    kernel: PathBuf,
    kernel_release: String,
    initrd: PathBuf,
    shm: PathBuf,
    /// The agent's first hello must come within this (ms; 0: the defaults above).
    hello_timeout_ms: AtomicU64,
    /// Every QEMU runs in a jail (crate::jail) unless turned off for a measurement ([`VmBackend::set_jailed`]).
    jailed: AtomicBool,
    fail_at: Mutex<Option<FailPoint>>,
}

/// A step of a cold start or a restore after which a test can make it fail, to prove nothing is left behind
/// (no QEMU process, socket, run dir or private RAM file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPoint {
    /// The run dir exists.
    RunDir,
    /// The disk export listens on its socket.
    Disk,
    /// QEMU runs (a cold boot, or waiting on `-incoming defer`).
    Process,
    /// A restore's pages are in QEMU's private mapping.
    Pages,
    /// A restore's device state is loaded and the guest runs.
    Running,
    /// The agent answered.
    Agent,
}

impl FailPoint {
    pub const ALL: [FailPoint; 6] = [
        FailPoint::RunDir,
        FailPoint::Disk,
        FailPoint::Process,
        FailPoint::Pages,
        FailPoint::Running,
        FailPoint::Agent,
    ];
}

/// The `vm` backend of this host.
#[derive(Clone)]
pub struct VmBackend {
    inner: Arc<Inner>,
}

fn failed(what: impl std::fmt::Display) -> BackendError {
    BackendError::Failed(what.to_string())
}

impl VmBackend {
    /// Open the backend: find QEMU and the guest kernel, take the accelerator from the probe (cached per boot),
    /// and build the initramfs once. `shm` holds RAM files (default `/dev/shm/clade`).
    pub fn open(home: &CladeHome, store: Store, shm: Option<PathBuf>) -> Result<Self, BackendError> {
        let qemu = crate::qemu::qemu_binary().ok_or_else(|| failed("no qemu-system-x86_64: run ./x setup"))?;
        let qemu_version =
            crate::qemu::qemu_version(&qemu).ok_or_else(|| failed(format!("cannot run {}", qemu.display())))?;
        let kdir = home.kernel_dir();
        let kernel = kdir.join("vmlinux");
        let kernel_release = std::fs::read_to_string(kdir.join("release"))
            .map(|s| s.trim().to_string())
            .map_err(|_| failed(format!("no guest kernel in {}: run ./x setup", kdir.display())))?;
        let busybox = Path::new("/bin/busybox");
        let cache = home.cache_dir();
        let boot_id = clade_core::host::boot_id();
        let choice = crate::accel::choose(
            &crate::accel::ProbeInputs {
                qemu: &qemu,
                qemu_version: &qemu_version,
                kernel: &kernel,
                kernel_release: &kernel_release,
                busybox,
                cache_dir: &cache,
                boot_id: &boot_id,
            },
            false,
        )
        .map_err(|e| failed(format!("accelerator probe: {e}")))?;
        let machine = MachineType::Q35;
        let initrd = crate::boot::cached_initramfs(&kdir, busybox, machine, &cache).map_err(failed)?;
        let shm = shm.unwrap_or_else(|| home.shm_dir());
        for d in [shm.join("ram"), shm.join("run"), home.run_dir()] {
            std::fs::create_dir_all(&d).map_err(|e| failed(format!("create {}: {e}", d.display())))?;
        }
        let disks = DiskHost::new(store.clone()).map_err(failed)?;
        Ok(VmBackend {
            inner: Arc::new(Inner {
                home: home.clone(),
                store,
                disks,
                qemu,
                qemu_version,
                accel: choice.chosen,
                machine,
                kernel,
                kernel_release,
                initrd,
                shm,
                hello_timeout_ms: AtomicU64::new(0),
                jailed: AtomicBool::new(true),
                fail_at: Mutex::new(None),
            }),
        })
    }

    pub fn accel(&self) -> Accel {
        self.inner.accel
    }

    /// How long a guest may take to answer its first hello (`None`: 120 s for a cold boot, 30 s for a restore).
    /// A guest that does not answer in time is killed and reported with its console's last lines.
    pub fn set_hello_timeout(&self, t: Option<Duration>) {
        self.inner.hello_timeout_ms.store(t.map(|d| d.as_millis().max(1) as u64).unwrap_or(0), Ordering::Relaxed);
    }

    fn hello_timeout(&self, default: Duration) -> Duration {
        match self.inner.hello_timeout_ms.load(Ordering::Relaxed) {
            0 => default,
            ms => Duration::from_millis(ms),
        }
    }

    /// Run QEMUs jailed (the default) or not. Off only to measure what the jail costs (docs/vm.md, "The jail"):
    /// an unjailed QEMU runs as root with every capability.
    pub fn set_jailed(&self, on: bool) {
        self.inner.jailed.store(on, Ordering::Relaxed);
    }

    /// The jail of sandbox `id`'s QEMU: a uid of its own, its cgroup (`clade/<id>`) with limits from `shape`,
    /// and the other sandboxes' mounts (under `$CLADE_HOME` and the RAM dir) detached from its mount namespace.
    pub fn jail(&self, id: &str, shape: &Shape) -> Option<VmJail> {
        if !self.inner.jailed.load(Ordering::Relaxed) {
            return None;
        }
        let i = &self.inner;
        let mut j = VmJail::new(i.home.run_dir().join(UIDS_DIR));
        j.cgroup = Some(CgroupPlan {
            name: id.to_string(),
            limits: crate::jail::limits_for_guest(shape.memory_mib, shape.vcpus, i.accel),
        });
        j.detach_mounts_under = vec![i.home.root().to_path_buf(), i.shm.clone()];
        Some(j)
    }

    fn spawn(&self, id: &str, shape: &Shape, spec: VmSpec, run_dir: &Path) -> Result<Vm, BackendError> {
        match self.jail(id, shape) {
            Some(j) => Vm::spawn_jailed(&self.inner.qemu, spec, run_dir, &j),
            None => Vm::spawn(&self.inner.qemu, spec, run_dir),
        }
        .map_err(failed)
    }

    /// Test hook: make the next cold starts and restores fail right after `at` (None: never).
    pub fn inject_failure(&self, at: Option<FailPoint>) {
        *self.inner.fail_at.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    fn check_fail(&self, here: FailPoint) -> Result<(), BackendError> {
        if *self.inner.fail_at.lock().unwrap_or_else(|e| e.into_inner()) == Some(here) {
            return Err(failed(format!("injected failure after {here:?}")));
        }
        Ok(())
    }

    /// Refuse to start what would fill the RAM tmpfs: a guest or a root file of `bytes` needs that much free
    /// (a full tmpfs would kill QEMU with SIGBUS mid-run, or leave a half-written file).
    fn check_shm_room(&self, bytes: u64, what: &str) -> Result<(), BackendError> {
        let dir = &self.inner.shm;
        let st = nix::sys::statvfs::statvfs(dir).map_err(|e| failed(format!("statvfs {}: {e}", dir.display())))?;
        let free = st.blocks_available() as u64 * st.fragment_size() as u64;
        if free < bytes {
            return Err(BackendError::Resource {
                resource: "memory".into(),
                detail: format!(
                    "{what} needs {} MiB on {}, which has {} MiB free: kill or suspend sandboxes, or run `clade gc`",
                    bytes >> 20,
                    dir.display(),
                    free >> 20
                ),
            });
        }
        Ok(())
    }
    fn compat(&self, shape: &Shape) -> BTreeMap<String, String> {
        let i = &self.inner;
        let mut m = BTreeMap::new();
        m.insert("qemu".into(), i.qemu_version.clone());
        m.insert("machine".into(), format!("{:?}", i.machine).to_lowercase());
        m.insert("accel".into(), i.accel.as_str().into());
        m.insert("cpu".into(), i.accel.cpu_model());
        m.insert("kernel".into(), i.kernel_release.clone());
        m.insert("memory_mib".into(), shape.memory_mib.to_string());
        m.insert("vcpus".into(), shape.vcpus.to_string());
        m
    }

    pub fn spec(
        &self,
        shape: &Shape,
        ram: RamBacking,
        disk: &Path,
        agent: &Path,
        incoming: bool,
        devstate_only: bool,
    ) -> VmSpec {
        let i = &self.inner;
        VmSpec {
            accel: i.accel,
            machine: i.machine,
            memory_mib: shape.memory_mib,
            vcpus: shape.vcpus,
            kernel: i.kernel.clone(),
            initrd: Some(i.initrd.clone()),
            append: format!(
                "console=ttyS0 panic=-1 quiet {}=virtio:/dev/virtio-ports/{}{}",
                clade_agent::CMDLINE_KEY,
                clade_agent::VM_PORT_NAME,
                i.accel.guest_cmdline_extra()
            ),
            ram,
            disks: vec![NbdDisk { socket: disk.to_path_buf(), export: String::new(), read_only: false }],
            agent_socket: Some(agent.to_path_buf()),
            vmgenid: true,
            incoming,
            devstate_only,
            net: None,
        }
    }

    pub fn root_ram_file(&self, root: &str) -> PathBuf {
        self.inner.shm.join("ram").join(format!("{root}.ram"))
    }

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

    fn lease(&self, id: &str) -> Result<Lease, BackendError> {
        let m: ManifestId = id.parse().map_err(|_| BackendError::Corrupt(format!("'{id}' is not a manifest id")))?;
        self.inner.store.lease(m).map_err(|e| BackendError::Corrupt(e.to_string()))
    }
}

fn manifest<'a>(mark: &'a MarkState, role: &str) -> Result<&'a str, BackendError> {
    mark.manifests
        .get(role)
        .map(String::as_str)
        .ok_or_else(|| BackendError::Corrupt(format!("vm mark has no '{role}'")))
}

fn mid(s: &str) -> Result<ManifestId, BackendError> {
    s.parse().map_err(|_| BackendError::Corrupt(format!("'{s}' is not a manifest id")))
}

impl Backend for VmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vm
    }

    fn host_compat(&self) -> BTreeMap<String, String> {
        // Shape keys are checked against the mark's own shape at restore; the host offers any.
        self.compat(&Shape { memory_mib: 0, vcpus: 0, disk_gib: 0 })
            .into_iter()
            .filter(|(k, _)| k != "memory_mib" && k != "vcpus")
            .collect()
    }

    fn cold_start(&self, image: &TemplateImage, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError> {
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
        crate::net::apply(&mut spec, image.egress);
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
        }))
    }

    fn restore(&self, mark: &MarkState, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError> {
        self.prepare_vm(mark, id)?.start_vm()
    }

    fn prepare(&self, mark: &MarkState, id: &Identity) -> Result<Option<Box<dyn Prepared>>, BackendError> {
        Ok(Some(Box::new(self.prepare_vm(mark, id)?)))
    }
}

impl VmBackend {
    /// Everything of a restore up to the guest running: the root RAM file (rebuilt from the store if missing),
    /// the device state and the mark's own pages fetched, the disk export up, QEMU started on `-incoming defer`
    /// with the pages written into its private mapping.
    fn prepare_vm(&self, mark: &MarkState, id: &Identity) -> Result<VmPrepared, BackendError> {
        if mark.backend != BackendKind::Vm {
            return Err(failed("not a vm mark"));
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
        crate::net::apply(&mut spec, egress);
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
}

impl VmBackend {
    /// A restore returning the concrete sandbox (benches read its [`MarkStats`]).
    pub fn restore_vm(&self, mark: &MarkState, id: &Identity) -> Result<VmSandbox, BackendError> {
        self.prepare_vm(mark, id)?.start_concrete()
    }
}

impl VmPrepared {
    fn start_vm(self) -> Result<Box<dyn Sandbox>, BackendError> {
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

/// Wait for the agent's first hello. A QEMU that exits meanwhile is reported at once with its exit status and
/// stderr; a guest that does not answer in time is reported with its console's last lines. Either way the
/// caller's `Vm` is dropped on the error path, which kills QEMU and removes its run dir.
fn await_hello(vm: &mut Vm, sock: &Path, timeout: Duration) -> Result<AgentClient, BackendError> {
    match crate::agent_link::hello_while(sock, timeout, || vm.exited()) {
        Ok((agent, _)) => Ok(agent),
        Err(NoHello::Died(why)) => Err(failed(format!("{why}; last console lines: {}", vm.console_tail(8)))),
        Err(NoHello::Timeout(waited)) => Err(BackendError::NotReady {
            timeout: waited,
            detail: format!(
                "the guest's agent never answered hello; QEMU killed; last console lines: {}",
                vm.console_tail(8)
            ),
        }),
    }
}

fn put_id(r: &clade_store::PutReport) -> Result<String, BackendError> {
    r.id.map(|i| i.to_string()).ok_or_else(|| failed("store published no manifest"))
}

/// Bytes a put added to the store: new packed data plus the manifest.
fn stored(r: &clade_store::PutReport) -> u64 {
    r.bytes_stored + r.manifest_bytes
}

/// QEMU is handed its sockets (QMP, agent, disk) by path, and a unix socket path holds 107 bytes: a home too
/// deep for a sandbox `id`'s sockets is refused up front with what to do, not by QEMU half-way through a start.
/// (`clade doctor` asks the same with a sandbox id's usual length.)
pub fn check_socket_room(home: &CladeHome, id: &str) -> Result<(), String> {
    let longest = home.run_dir().join(id).join("agent.sock").as_os_str().len();
    if longest <= 107 {
        return Ok(());
    }
    Err(format!(
        "CLADE_HOME {} is too long for a vm sandbox: its sockets would be {longest} bytes, and a unix socket \
         path holds 107; use a CLADE_HOME of at most {} bytes",
        home.root().display(),
        home.root().as_os_str().len().saturating_sub(longest - 107)
    ))
}

/// A sandbox's run dir under `$CLADE_HOME/run`; removed on drop.
struct RunDir {
    path: PathBuf,
}

impl RunDir {
    fn create(home: &CladeHome, id: &str) -> Result<Self, BackendError> {
        let path = home.run_dir().join(id);
        check_socket_room(home, id).map_err(failed)?;
        if path.exists() {
            return Err(failed(format!("sandbox {id} already has a run dir {}", path.display())));
        }
        std::fs::create_dir_all(&path).map_err(|e| failed(format!("create {}: {e}", path.display())))?;
        Ok(RunDir { path })
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
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

/// A running `vm` sandbox: its QEMU, its disk export, its agent connection and the store leases that keep what
/// it runs from alive.
pub struct VmSandbox {
    backend: VmBackend,
    id: String,
    shape: Shape,
    vm: Option<Vm>,
    disk: DiskExport,
    agent: AgentClient,
    agent_sock: PathBuf,
    /// The RAM file QEMU maps: private to a cold sandbox (shared mapping), else the root file (private mapping).
    ram_file: PathBuf,
    /// The root RAM manifest this sandbox's RAM is relative to; `None` for a cold sandbox.
    root: Option<String>,
    leases: Vec<Lease>,
    run: RunDir,
    generation: u64,
    last_mark: Option<MarkStats>,
    /// `network = "egress"`: a user-mode NIC (crate::net), recorded in every mark.
    egress: bool,
    /// The lazily fetched root RAM QEMU maps, when this host had no root file (last: unmounted after QEMU ends).
    lazy: Option<clade_lazyfs::LazyFile>,
}

impl VmSandbox {
    /// Bytes served so far by the lazily fetched root RAM, when this sandbox maps one.
    pub fn lazy_ram_bytes(&self) -> Option<u64> {
        self.lazy.as_ref().map(|l| l.counters().bytes.load(std::sync::atomic::Ordering::Relaxed))
    }
}

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
    /// The stats of this sandbox's last mark of a clone.
    pub fn last_mark_stats(&self) -> Option<MarkStats> {
        self.last_mark
    }

    fn vm(&mut self) -> &mut Vm {
        self.vm.as_mut().expect("a live sandbox has its QEMU")
    }

    pub fn qemu_pid(&self) -> Option<u32> {
        self.vm.as_ref().map(|v| v.pid())
    }

    /// The uid its QEMU runs as (`None`: unjailed).
    pub fn qemu_uid(&self) -> Option<u32> {
        self.vm.as_ref().and_then(|v| v.jailed()).map(|j| j.uid())
    }

    /// The RAM file its QEMU maps.
    pub fn ram_file(&self) -> &Path {
        &self.ram_file
    }

    fn put_bytes(&self, data: &[u8], kind: ImageKind) -> Result<clade_store::PutReport, BackendError> {
        self.backend.inner.store.put_bytes(data, kind).map_err(|e| failed(format!("store: {e}")))
    }

    /// Mark a cold sandbox: its RAM file becomes the root of the mark, and the sandbox continues as a clone.
    fn mark_cold(&mut self, opts: &MarkOptions) -> Result<MarkState, BackendError> {
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
        crate::net::record(&mut manifests, self.egress);
        let mark = MarkState {
            backend: BackendKind::Vm,
            manifests,
            compat: self.backend.compat(&self.shape),
            shape: self.shape.clone(),
            logical_bytes: ram.size + dev.size,
            stored_bytes: stored(&ram) + stored(&dev),
            pause: Duration::from_secs_f64(saved.pause_ms / 1e3),
            clean: !opts.not_clean,
        };
        // Go on as a clone of the mark (same guest state; a new QEMU mapping the root privately).
        let mut spec = self.backend.spec(
            &self.shape,
            RamBacking { path: root_file.clone(), share: false },
            self.disk.socket(),
            &self.agent_sock,
            true,
            false,
        );
        crate::net::apply(&mut spec, self.egress);
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
    fn mark_clone(&mut self, root: String, opts: &MarkOptions) -> Result<MarkState, BackendError> {
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
        crate::net::record(&mut manifests, self.egress);
        Ok(MarkState {
            backend: BackendKind::Vm,
            manifests,
            compat: self.backend.compat(&self.shape),
            shape: self.shape.clone(),
            logical_bytes: size + dev.size,
            stored_bytes: stored(&ram) + stored(&pages) + stored(&dev),
            pause,
            clean: !opts.not_clean,
        })
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl Sandbox for VmSandbox {
    fn kind(&self) -> BackendKind {
        BackendKind::Vm
    }
    fn id(&self) -> &str {
        &self.id
    }
    fn agent(&self) -> &AgentClient {
        &self.agent
    }
    fn pids(&self) -> Vec<u32> {
        self.qemu_pid().into_iter().collect()
    }
    fn mark(&mut self, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        // The guest's own preparations first (pre-mark.d hooks): they run before the pause.
        for warning in clade_core::hygiene::pre_mark(&self.agent, !opts.not_clean) {
            eprintln!("clade-vm: {}: mark goes on: {warning}", self.id);
        }
        match self.root.clone() {
            None => self.mark_cold(opts),
            Some(root) => self.mark_clone(root, opts),
        }
    }
    fn suspend(mut self: Box<Self>, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        let m = self.mark(opts)?;
        self.kill()?;
        Ok(m)
    }
    fn kill(self: Box<Self>) -> Result<(), BackendError> {
        drop(self);
        Ok(())
    }
    fn pause(&mut self) -> Result<(), BackendError> {
        self.vm().qmp.execute("stop", serde_json::json!({})).map(|_| ()).map_err(failed)
    }
    fn resume(&mut self) -> Result<(), BackendError> {
        self.vm().qmp.execute("cont", serde_json::json!({})).map(|_| ()).map_err(failed)
    }
    fn exited(&mut self) -> Option<String> {
        let vm = self.vm.as_mut()?;
        let why = vm.exited()?;
        Some(format!("{why}; last console lines: {}", vm.console_tail(8)))
    }
}

impl Drop for VmSandbox {
    fn drop(&mut self) {
        self.vm = None;
        if self.root.is_none() {
            let _ = std::fs::remove_file(&self.ram_file);
        }
        self.leases.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_home_too_deep_for_qemus_sockets_is_refused_with_the_length_to_use() {
        let t = tempfile::tempdir().unwrap();
        let deep = t.path().join("x".repeat(60));
        let id = format!("sb-{}", "0".repeat(32));
        let err = RunDir::create(&CladeHome::at(&deep), &id).err().expect("refused");
        let msg = err.to_string();
        assert!(msg.contains("too long") && msg.contains("at most"), "{msg}");
        assert!(!deep.join("run").join(&id).exists(), "no run dir is left");
        let ok = RunDir::create(&CladeHome::at(t.path()), &id).expect("a short home works");
        assert!(ok.path.exists());
    }
}
