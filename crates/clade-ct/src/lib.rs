//! The `ct` backend: namespace sandboxes (PID/mount/net/IPC/UTS, overlayfs root on a per-sandbox tmpfs, the
//! agent as init, a memory cgroup each) checkpointed and restored by a privately installed CRIU.
//!
//! * [`CtBackend::cold_start_ct`] boots a template's rootfs ([`spawn`]).
//! * [`CtSandbox`] marks (CRIU dump, leave running) and suspends (dump and release); the image directory and
//!   the overlay upper go into the store as trees ([`sandbox`], [`dump`]).
//! * A disk-only mark ([`disk`]) keeps the upper alone; its restore boots it cold.
//! * [`CtBackend::restore_ct`] brings a mark up in fresh namespaces with a fresh upper ([`restore`]); fork is N
//!   of those side by side. Restored tasks are KSM-mergeable so siblings share identical pages again.
//! * [`audit::audit`] is the sibling audit (two siblings share no namespace, PID, pipe, socket,
//!   eventfd, writable file or lock) as a library function.
//!
//! Everything a sandbox holds on the host sits in one drop guard ([`resources::Resources`]): a restore that fails
//! half-way leaves no process, mount or cgroup behind ([`FailPoint`] injects such failures in tests).

pub mod audit;
pub mod criu;
pub mod disk;
pub mod dump;
pub mod footprint;
pub mod images;
pub mod inroot;
pub mod jail;
pub mod jail_audit;
pub mod lazy_upper;
pub mod lower;
pub mod net;
pub mod resources;
pub mod restore;
pub mod roots;
pub mod sandbox;
pub mod spawn;
pub mod testroot;
pub mod userns;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clade_core::backend::{Backend, BackendError, BackendKind, Identity, MarkState, Sandbox, TemplateImage};
use clade_core::CladeHome;

pub use audit::{audit, audit_with_control, AuditReport};
pub use restore::CtPrepared;
pub use sandbox::CtSandbox;

/// How the backend runs.
#[derive(Debug, Clone)]
pub struct CtConfig {
    /// CRIU binary or wrapper.
    pub criu: PathBuf,
    /// The `clade-agent` binary copied into every cold sandbox.
    pub agent_bin: PathBuf,
    /// Size of each sandbox's tmpfs (upper, work dir, dump staging).
    pub rw_bytes: u64,
    /// Make restored tasks KSM-mergeable (`PR_SET_MEMORY_MERGE`) and make sure ksmd runs.
    pub ksm: bool,
    /// How long a sandbox may take to answer its agent.
    pub ready_timeout: Duration,
    /// Restore lazily when a mark's pages reach this size (see [`CtBackend::set_lazy_threshold`]).
    pub lazy_min_bytes: Option<u64>,
    /// Jail every sandbox ([`jail`]: capabilities, no_new_privs, seccomp, masked and read-only paths, cgroup
    /// namespace, device allow-list). Off only for tests' controls and an explicit `--unjailed-insecure`.
    pub jail: bool,
    /// Most processes and threads one sandbox may have (its pids cgroup; a fork bomb stays inside).
    pub pids_max: u64,
    /// Marks of a running sandbox pre-dump first with memory tracking (docs/ct.md, "Incremental marks"): on
    /// where the kernel tracks dirty pages, unless `CLADE_CT_PREDUMP=0`.
    pub predump: bool,
}

impl CtConfig {
    /// CRIU from `$CLADE_CRIU` or `$CLADE_HOME/criu`; the agent from `$CLADE_AGENT_BIN`, else next to the
    /// running executable (or its parent directory, as for test binaries in `target/debug/deps`).
    pub fn from_home(home: &CladeHome) -> Result<CtConfig, BackendError> {
        let agent_bin = find_agent().ok_or_else(|| BackendError::Resource {
            resource: "clade-agent binary".into(),
            detail: "set CLADE_AGENT_BIN or build it (cargo build -p clade-agent) next to this program".into(),
        })?;
        Ok(CtConfig {
            criu: criu::criu_binary(home),
            agent_bin,
            rw_bytes: 2 << 30,
            ksm: true,
            ready_timeout: Duration::from_secs(10),
            // Measured here (docs/ct.md): 41 MiB of pages restore faster eagerly (141 vs 160 ms), 137 MiB
            // slightly faster lazily (202 vs 215 ms) to a bare ready, but the browser's 160 MiB to ready
            // *with hygiene* (which touches much of that memory, each first touch a fault the lazy-pages daemon
            // serves) is faster eagerly, 574 vs 615 ms (6 interleaved pairs, 5 won by eager); a 1 GiB
            // Python heap measured before the backend existed: lazy 0.14-0.24 s vs eager 0.64 s. So lazy from 512 MiB.
            lazy_min_bytes: Some(512 << 20),
            jail: std::env::var(jail::UNJAILED_ENV).map(|v| v != "1").unwrap_or(true),
            pids_max: DEFAULT_PIDS_MAX,
            predump: predump_default(),
        })
    }
}

/// Whether marks pre-dump by default: the kernel must track dirty pages (else a pre-dump only doubles the copy)
/// and `CLADE_CT_PREDUMP` must not be `0`.
pub fn predump_default() -> bool {
    std::env::var("CLADE_CT_PREDUMP").map(|v| v != "0").unwrap_or(true)
        && clade_core::host::tracks_dirty_pages() == Some(true)
}

/// A sandbox's default process and thread limit: a browser runs ~100 threads, a build a few hundred.
pub const DEFAULT_PIDS_MAX: u64 = 4096;

fn find_agent() -> Option<PathBuf> {
    clade_core::host::agent_binary()
}

/// A step of a start or restore after which a test can make it fail, to prove nothing is left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPoint {
    /// The run dir and its tmpfs exist.
    RunDir,
    /// The upper and the images are in place.
    Files,
    /// The cgroup exists.
    Cgroup,
    /// The network namespace, veth pair and NAT entry exist (egress only; no-op otherwise).
    Network,
    /// The processes run (CRIU restored them / the init exec'd).
    Processes,
    /// The agent answered.
    Agent,
}

impl FailPoint {
    pub const ALL: [FailPoint; 6] = [
        FailPoint::RunDir,
        FailPoint::Files,
        FailPoint::Cgroup,
        FailPoint::Network,
        FailPoint::Processes,
        FailPoint::Agent,
    ];
}

/// The `ct` backend.
pub struct CtBackend {
    pub(crate) home: CladeHome,
    pub(crate) store: clade_store::Store,
    pub(crate) cfg: CtConfig,
    criu_version: String,
    fail_at: Mutex<Option<FailPoint>>,
    lazy_min: std::sync::atomic::AtomicU64,
}

impl CtBackend {
    /// A backend over `store`, with CRIU checked up front (`criu check` must pass).
    pub fn new(home: CladeHome, store: clade_store::Store, cfg: CtConfig) -> Result<CtBackend, BackendError> {
        let criu_version =
            criu::criu_version_cached(&cfg.criu, &home.cache_dir().join("criu-version")).ok_or_else(|| {
                BackendError::Resource {
                    resource: "criu".into(),
                    detail: format!("{} --version failed: run ./x setup (or set CLADE_CRIU)", cfg.criu.display()),
                }
            })?;
        if cfg.jail {
            jail::check_host().map_err(|detail| BackendError::Resource { resource: "jail".into(), detail })?;
        } else {
            let why = if std::env::var(jail::UNJAILED_ENV).as_deref() == Ok("1") {
                format!("{}=1", jail::UNJAILED_ENV)
            } else {
                "the jail is off in this backend's configuration".to_string()
            };
            eprintln!(
                "clade-ct: WARNING: {why}: ct sandboxes run UNJAILED; code in them is host root (docs/security.md)"
            );
        }
        if cfg.ksm {
            ksm_enable();
        }
        overcommit_for_criu();
        std::fs::create_dir_all(home.run_dir())
            .map_err(|e| BackendError::Failed(format!("create {}: {e}", home.run_dir().display())))?;
        let lazy_min = std::sync::atomic::AtomicU64::new(cfg.lazy_min_bytes.unwrap_or(u64::MAX));
        Ok(CtBackend { home, store, cfg, criu_version, fail_at: Mutex::new(None), lazy_min })
    }

    pub fn config(&self) -> &CtConfig {
        &self.cfg
    }

    pub fn store(&self) -> &clade_store::Store {
        &self.store
    }

    /// Restore lazily (CRIU lazy-pages over userfaultfd) when a mark's pages are at least this many bytes;
    /// `None`: always eager.
    pub fn set_lazy_threshold(&self, min_bytes: Option<u64>) {
        self.lazy_min.store(min_bytes.unwrap_or(u64::MAX), std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn lazy_threshold(&self) -> u64 {
        self.lazy_min.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Test hook: make the next starts and restores fail right after `at` (None: never).
    pub fn inject_failure(&self, at: Option<FailPoint>) {
        *self.fail_at.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    pub(crate) fn fail_at(&self) -> Option<FailPoint> {
        *self.fail_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn check_fail(&self, here: FailPoint) -> Result<(), BackendError> {
        fail_check(self.fail_at(), here)
    }

    /// The cgroup limits of a sandbox of this shape: its memory, [`CtConfig::pids_max`], and CPU time of
    /// `vcpus` cores; jailed, the device allow-list.
    pub(crate) fn limits(&self, shape: &clade_core::backend::Shape) -> resources::Limits {
        resources::Limits {
            memory_bytes: u64::from(shape.memory_mib) << 20,
            pids: if self.cfg.jail { self.cfg.pids_max } else { 0 },
            cpu_ms_per_100ms: if self.cfg.jail { 100 * u64::from(shape.vcpus.max(1)) } else { 0 },
            devices: self.cfg.jail.then_some(&resources::DEVICE_ALLOW[..]),
        }
    }

    /// The seccomp filters a jailed sandbox's init installs (built here, before any fork); `None` unjailed.
    pub(crate) fn jail_programs(&self) -> Result<Option<Vec<seccompiler::BpfProgram>>, BackendError> {
        if !self.cfg.jail {
            return Ok(None);
        }
        jail::programs().map(Some).map_err(|e| BackendError::Resource { resource: "seccomp".into(), detail: e })
    }

    pub(crate) fn run_dir(&self, id: &Identity) -> Result<PathBuf, BackendError> {
        let id = &id.sandbox_id;
        if id.is_empty() || id.len() > 64 || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(BackendError::Failed(format!("sandbox id {id:?}: use 1-64 letters, digits, '-' or '_'")));
        }
        Ok(self.home.run_dir().join(id))
    }

    /// Cold start, returning the concrete sandbox.
    pub fn cold_start_ct(&self, image: &TemplateImage, id: &Identity) -> Result<CtSandbox, BackendError> {
        sandbox::cold_start(self, image, id)
    }

    /// Everything of a restore but `criu restore` itself (a warm-pool member); `start_ct` finishes it.
    pub fn prepare_ct(&self, mark: &MarkState, id: &Identity) -> Result<CtPrepared, BackendError> {
        restore::prepare(self, mark, id)
    }

    /// Restore, returning the concrete sandbox: a disk-only mark boots cold ([`disk`]).
    pub fn restore_ct(&self, mark: &MarkState, id: &Identity) -> Result<CtSandbox, BackendError> {
        if mark.boots_cold() {
            return disk::boot_disk(self, mark, id);
        }
        restore::restore(self, mark, id)
    }
}

impl Backend for CtBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Ct
    }
    fn host_compat(&self) -> BTreeMap<String, String> {
        [
            ("criu".to_string(), self.criu_version.clone()),
            ("arch".to_string(), std::env::consts::ARCH.to_string()),
            ("jail".to_string(), if self.cfg.jail { jail::POLICY } else { "none" }.to_string()),
        ]
        .into()
    }
    fn cold_start(&self, image: &TemplateImage, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError> {
        Ok(Box::new(self.cold_start_ct(image, id)?))
    }
    fn restore(&self, mark: &MarkState, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError> {
        Ok(Box::new(self.restore_ct(mark, id)?))
    }
    fn fetch_ahead(&self, mark: &MarkState) -> Result<(), BackendError> {
        restore::fetch_ahead(self, mark)
    }
    fn prepare(
        &self,
        mark: &MarkState,
        id: &Identity,
    ) -> Result<Option<Box<dyn clade_core::backend::Prepared>>, BackendError> {
        // A disk-only mark has nothing to prepare ahead: it boots.
        if mark.boots_cold() {
            return Ok(None);
        }
        Ok(Some(Box::new(self.prepare_ct(mark, id)?)))
    }
}

pub(crate) fn fail_check(at: Option<FailPoint>, here: FailPoint) -> Result<(), BackendError> {
    if at == Some(here) {
        return Err(BackendError::Failed(format!("injected failure after {here:?}")));
    }
    Ok(())
}

/// Start ksmd if it is off, and let it scan fast enough to matter within seconds (the kernel default of 100
/// pages per 20 ms merges 100 MiB in about 5 s).
fn ksm_enable() {
    let ksm = Path::new("/sys/kernel/mm/ksm");
    if std::fs::read_to_string(ksm.join("run")).map(|s| s.trim() == "0").unwrap_or(false) {
        let _ = std::fs::write(ksm.join("run"), "1");
    }
    let pages: u64 =
        std::fs::read_to_string(ksm.join("pages_to_scan")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
    if pages < 1000 {
        let _ = std::fs::write(ksm.join("pages_to_scan"), "1000");
    }
}

fn ksm_counter(name: &str) -> u64 {
    std::fs::read_to_string(Path::new("/sys/kernel/mm/ksm").join(name))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Wait until KSM has merged what it can of the memory registered so far: at least two more full scans of
/// every mergeable area (the first pass only checksums a page, a later one merges it), then no change of
/// `pages_sharing` between two readings; at most `max`. Returns `pages_sharing`. For measurements (benches,
/// tests): a sandbox's memory is shared again only after this.
pub fn ksm_settle(max: Duration) -> u64 {
    let t0 = Instant::now();
    let scans = ksm_counter("full_scans");
    let mut last = ksm_counter("pages_sharing");
    while t0.elapsed() < max {
        std::thread::sleep(Duration::from_millis(500));
        let now = ksm_counter("pages_sharing");
        if ksm_counter("full_scans") >= scans + 2 && now == last {
            return now;
        }
        last = now;
    }
    last
}

/// CRIU 4.2 premaps every private mapping of a restored task writable before filling it, so a large
/// `PROT_NONE` reservation (Chromium's V8 and PartitionAlloc reserve tens of GiB to a TiB of address space) is
/// charged in full against the overcommit limit; the kernel's default heuristic (`vm.overcommit_memory = 0`)
/// refuses a single such mapping larger than RAM + swap and the restore fails with `Unable to map ANON_VMA:
/// Cannot allocate memory` (upstream CRIU issue 2364, fixed after 4.2). Mode 1 (always overcommit, what
/// Kubernetes' kubelet sets on every node) lets it through; the memory cgroup still bounds what is really
/// used. Strict accounting (mode 2) is an operator's choice and left alone.
fn overcommit_for_criu() {
    let path = Path::new("/proc/sys/vm/overcommit_memory");
    if std::fs::read_to_string(path).map(|s| s.trim() == "0").unwrap_or(false) {
        let _ = std::fs::write(path, "1");
    }
}

/// Connect to a sandbox's agent, its socket resolved inside the sandbox's root ([`inroot`]: a link the
/// sandbox put in its place leads nowhere outside), retrying until it answers `hello`.
pub(crate) fn connect_agent(pid: u32, timeout: Duration) -> Result<clade_agent::AgentClient, BackendError> {
    let path = format!("{} in sandbox init {pid}", clade_agent::CT_SOCKET);
    let t0 = Instant::now();
    let mut last = String::from("socket not there yet");
    while t0.elapsed() < timeout {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return Err(BackendError::Failed(format!("sandbox init {pid} died before its agent answered")));
        }
        let client = inroot::connect_unix(pid, clade_agent::CT_SOCKET)
            .map_err(clade_agent::ClientError::from)
            .and_then(clade_agent::AgentClient::from_unix);
        match client {
            Ok(c) => match c.hello() {
                Ok(_) => return Ok(c),
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Err(BackendError::NotReady { timeout, detail: format!("agent at {path}: {last}") })
}
