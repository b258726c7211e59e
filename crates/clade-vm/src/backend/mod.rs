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
//!
//! - **Disk-only mark** (`disk.rs`): the disk alone; its restore boots that disk cold.
//!
//! Each operation lives in a file of its own, as in clade-ct: `cold_start.rs` (a template's disk booted cold),
//! `restore.rs` (a mark brought up; [`VmPrepared`]), `mark.rs` (mark of a cold sandbox and of a clone;
//! [`MarkStats`]), `sandbox.rs` (the running [`VmSandbox`]) and `run_dir.rs` (a sandbox's run dir and the socket
//! path check). This file keeps the backend itself: opening it, the QEMU spec and jail, the test failure hooks,
//! the helpers the operations share, and the `Backend` impl.

mod cold_start;
mod disk;
mod mark;
mod restore;
mod run_dir;
mod sandbox;
mod volumes;

pub use mark::MarkStats;
pub use restore::VmPrepared;
pub use run_dir::check_socket_room;
pub use sandbox::VmSandbox;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clade_agent::client::AgentClient;
use clade_core::backend::{
    Backend, BackendError, BackendKind, Identity, MarkState, Prepared, Sandbox, Shape, TemplateImage,
};
use clade_core::CladeHome;
use clade_store::{Lease, ManifestId, Store};

use crate::accel::Accel;
use crate::agent_link::NoHello;
use crate::disks::DiskHost;
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

    /// A guest with egress gets a network namespace of its own, which its QEMU runs in (slirp's sockets are
    /// made there: clade_core::sandbox_net); `None` without egress.
    fn sandbox_net(
        &self,
        sandbox: &str,
        egress: bool,
    ) -> Result<Option<clade_core::sandbox_net::SandboxNet>, BackendError> {
        if !egress {
            return Ok(None);
        }
        clade_core::sandbox_net::SandboxNet::create(sandbox).map(Some).map_err(failed)
    }

    pub fn root_ram_file(&self, root: &str) -> PathBuf {
        self.inner.shm.join("ram").join(format!("{root}.ram"))
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
        self.cold_start_vm(image, id)
    }

    fn restore(&self, mark: &MarkState, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError> {
        if mark.boots_cold() {
            return self.boot_disk(mark, id);
        }
        self.prepare_vm(mark, id)?.start_vm()
    }

    fn prepare(&self, mark: &MarkState, id: &Identity) -> Result<Option<Box<dyn Prepared>>, BackendError> {
        // A disk-only mark has nothing to prepare ahead: it boots.
        if mark.boots_cold() {
            return Ok(None);
        }
        Ok(Some(Box::new(self.prepare_vm(mark, id)?)))
    }
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
