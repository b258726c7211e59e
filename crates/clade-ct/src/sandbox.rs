//! A running `ct` sandbox and its marks. Marking drops the host's agent connection first (CRIU cannot dump a
//! unix socket whose peer is outside the sandbox), dumps with the upper copied while frozen, stores both
//! directories as trees and reconnects.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clade_agent::AgentClient;
use clade_core::backend::{BackendError, BackendKind, Identity, MarkOptions, MarkState, Sandbox, Shape, TemplateImage};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::resources::{mount_tmpfs, Cgroup, Resources};
use crate::{connect_agent, dump, CtBackend, FailPoint};

/// Manifest roles of a ct mark: the CRIU image tree, the overlay upper tree, and the overlay's lowerdir list
/// (agent layer and template rootfs paths, `:`-separated).
pub const ROLE_CRIU: &str = "criu";
pub const ROLE_UPPER: &str = "upper";
pub const ROLE_ROOTFS: &str = "rootfs";
/// Whether the jail set `no_new_privs` in the marked sandbox (`1`/`0`; absent: `1`): a disk-only mark's boot
/// sets it as its template asked.
pub const ROLE_NO_NEW_PRIVS: &str = "no_new_privs";

/// What a mark records of `no_new_privs` ([`ROLE_NO_NEW_PRIVS`]).
pub(crate) fn no_new_privs_of(mark: &MarkState) -> bool {
    mark.manifests.get(ROLE_NO_NEW_PRIVS).map(String::as_str) != Some("0")
}

/// A running `ct` sandbox. Dropping it ends it and removes everything it held on the host.
pub struct CtSandbox {
    pub(crate) id: String,
    pub(crate) res: Resources,
    pub(crate) agent: AgentClient,
    pub(crate) criu: PathBuf,
    pub(crate) store: clade_store::Store,
    /// The overlay's lowerdir list (agent layer, template rootfs).
    pub(crate) lower: String,
    pub(crate) shape: Shape,
    pub(crate) compat: BTreeMap<String, String>,
    pub(crate) ready_timeout: Duration,
    pub(crate) dumps: u32,
    /// Marks pre-dump first (CtConfig::predump).
    pub(crate) predump: bool,
    pub(crate) last_dump: Option<crate::dump::DumpTimes>,
    /// The cgroup's CPU quota (ms per 100 ms; 0: none), lifted while CRIU dumps the sandbox.
    pub(crate) cpu_ms: u64,
    /// Whether the jail sets `no_new_privs` (recorded in a disk-only mark, whose boot sets it again). A
    /// restored sandbox keeps what its tasks were marked with.
    pub(crate) no_new_privs: bool,
    /// Time from the start call to the agent's first answer.
    pub startup: Duration,
    /// Time since the start call at the end of each phase (restore: verified, upper, files, criu, agent).
    pub phases: Vec<(&'static str, Duration)>,
}

fn failed(e: String) -> BackendError {
    BackendError::Failed(e)
}

/// Cold start of a template's rootfs.
pub(crate) fn cold_start(b: &CtBackend, image: &TemplateImage, id: &Identity) -> Result<CtSandbox, BackendError> {
    if !image.rootfs.join("bin").exists() && !image.rootfs.join("usr").exists() {
        return Err(BackendError::Failed(format!(
            "{} does not look like a root filesystem (no bin or usr): build the template first",
            image.rootfs.display()
        )));
    }
    let rootfs = image.rootfs.display().to_string();
    if rootfs.contains([':', ',']) {
        return Err(failed(format!("rootfs path {rootfs:?} contains ':' or ',', which overlayfs cannot take")));
    }
    let lower = format!("{}:{rootfs}", agent_layer(&b.home, &b.cfg.agent_bin)?.display());
    let spec =
        BootSpec { lower, upper: None, shape: &image.shape, egress: image.egress, no_new_privs: image.no_new_privs };
    boot(b, &spec, id)
}

/// What a cold boot mounts and runs: a template's image, or a disk-only mark's layers and upper (crate::disk).
pub(crate) struct BootSpec<'a> {
    /// The overlay's lower layers as a mark names them (directories, or store trees: crate::lower).
    pub lower: String,
    /// The upper to start from (a disk-only mark's); `None`: an empty one.
    pub upper: Option<clade_store::TreeId>,
    pub shape: &'a Shape,
    pub egress: bool,
    pub no_new_privs: bool,
}

/// Boot cold: a fresh init (the agent) on the layers `spec` names.
pub(crate) fn boot(b: &CtBackend, spec: &BootSpec<'_>, id: &Identity) -> Result<CtSandbox, BackendError> {
    let t0 = Instant::now();
    let run_dir = b.run_dir(id)?;
    std::fs::create_dir(&run_dir).map_err(|e| {
        failed(format!("create {}: {e} (a sandbox with this id exists; kill it or pick another id)", run_dir.display()))
    })?;
    let mut res = Resources::new(run_dir.clone());
    mount_tmpfs(&res.rw(), b.cfg.rw_bytes).map_err(failed)?;
    res.rw_mounted = true;
    b.check_fail(FailPoint::RunDir)?;
    // The cgroup before the upper, so the upper's pages copied onto the tmpfs are charged to the sandbox, as a
    // restore's are (crate::disk::copy_tree_charged), not to this process.
    let limits = b.limits(spec.shape);
    let cpu_ms = limits.cpu_ms_per_100ms;
    res.cgroup = Some(Cgroup::create(&id.sandbox_id, &limits).map_err(failed)?);
    let charge = res.cgroup.as_ref().map(Cgroup::procs_files).unwrap_or_default();
    let (upper, work, root) = (res.rw().join("upper"), res.rw().join("work"), run_dir.join("root"));
    let mut lower = spec.lower.clone();
    if let Some(tree) = &spec.upper {
        if crate::restore::upper_for(b, tree, &spec.lower, &upper, &charge)? {
            // Its large files this host lacks, read through the upper tree mounted lazily (crate::lazy_upper);
            // /dev and /run are made opaque again below (crate::spawn), hiding the lazy layer's too.
            lower = format!("{}{tree}:{lower}", crate::lower::UPPER_PREFIX);
        }
        // A boot starts with empty /dev and /run, as a tmpfs there would (crate::spawn seeds them again).
        for d in ["dev", "run"] {
            let p = upper.join(d);
            if p.exists() {
                std::fs::remove_dir_all(&p).map_err(|e| failed(format!("empty {}: {e}", p.display())))?;
            }
        }
    }
    for d in [&upper, &work, &root] {
        std::fs::create_dir_all(d).map_err(|e| failed(format!("create {}: {e}", d.display())))?;
    }
    b.check_fail(FailPoint::Files)?;
    b.check_fail(FailPoint::Cgroup)?;
    let programs = b.jail_programs()?;
    // Jailed means in a user namespace (crate::userns): the lower layers are then mounted idmapped.
    let userns = programs.is_some();
    if spec.egress {
        res.net = Some(crate::net::SandboxNet::create(&id.sandbox_id).map_err(failed)?);
    }
    b.check_fail(FailPoint::Network)?;
    // Lower layers named as store trees (a disk-only mark from another host) are mounted lazily, already
    // shifted for the user namespace; host directories are idmapped.
    let shift = if userns { crate::userns::BASE } else { 0 };
    let lowerdir = crate::lower::resolve(&b.store, &lower, &run_dir, &mut res.lowers, shift).map_err(failed)?;
    let (overlay_lower, idmapped) = if userns {
        let lazy = run_dir.join("lower");
        let (dirs, pairs) =
            crate::userns::plan_lowers(&lowerdir, &run_dir.join("idmap"), |l| Path::new(l).starts_with(&lazy))
                .map_err(failed)?;
        (dirs, Some(pairs))
    } else {
        (lowerdir, None)
    };
    let init = crate::spawn::InitSpec {
        lower: overlay_lower,
        upper,
        work,
        root,
        hostname: id.hostname.clone(),
        cgroup_procs: res.cgroup.as_ref().map(Cgroup::procs_files).unwrap_or_default(),
        netns: res.net.as_ref().map(crate::net::SandboxNet::netns_path),
        jail: programs,
        userns: idmapped,
        no_new_privs: spec.no_new_privs,
    };
    res.init = Some(crate::spawn::spawn_init(&init).map_err(failed)?);
    let pid = res.init.unwrap_or_default();
    b.check_fail(FailPoint::Processes)?;
    let agent = connect_agent(pid, b.cfg.ready_timeout).map_err(|e| with_console(e, &res))?;
    b.check_fail(FailPoint::Agent)?;
    Ok(CtSandbox {
        id: id.sandbox_id.clone(),
        res,
        agent,
        criu: b.cfg.criu.clone(),
        store: b.store.clone(),
        lower,
        shape: spec.shape.clone(),
        compat: clade_core::backend::Backend::host_compat(b),
        ready_timeout: b.cfg.ready_timeout,
        dumps: 0,
        predump: b.cfg.predump,
        last_dump: None,
        cpu_ms,
        no_new_privs: spec.no_new_privs,
        startup: t0.elapsed(),
        phases: Vec::new(),
    })
}

/// Add the agent's console to an error (why the agent did not come up).
pub(crate) fn with_console(e: BackendError, res: &Resources) -> BackendError {
    let console = res.init.map(console_of).unwrap_or_default();
    if console.is_empty() {
        e
    } else {
        BackendError::Failed(format!("{e}; agent console: {console}"))
    }
}

fn console_of(pid: u32) -> String {
    let text = crate::inroot::read_to_string(pid, crate::spawn::CONSOLE_PATH).unwrap_or_default();
    text.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// A read-only overlay layer holding only the agent at `AGENT_PATH`, shared by every sandbox of this agent
/// build (keyed by size and mtime): the agent is then neither in any upper nor in any mark, and CRIU sees it as
/// an ordinary file of the root mount, never as a bind mount from the host.
pub(crate) fn agent_layer(home: &clade_core::CladeHome, bin: &Path) -> Result<PathBuf, BackendError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let md = std::fs::metadata(bin).map_err(|e| failed(format!("the agent {}: {e}", bin.display())))?;
    // v2: the layer also holds the jail's empty file and directory (crate::spawn::EMPTY_FILE, EMPTY_DIR).
    let dir = home.cache_dir().join("ct-agent").join(format!("{}-{}-{}-v2", md.len(), md.mtime(), md.mtime_nsec()));
    if dir.exists() {
        return Ok(dir);
    }
    let tmp = clade_core::home::temp_beside(&dir);
    let dest = tmp.join(crate::spawn::AGENT_PATH.trim_start_matches('/'));
    let res = (|| {
        std::fs::create_dir_all(dest.parent().unwrap_or(&tmp))?;
        std::fs::copy(bin, &dest)?;
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))?;
        std::fs::write(tmp.join(crate::spawn::EMPTY_FILE.trim_start_matches('/')), b"")?;
        std::fs::create_dir(tmp.join(crate::spawn::EMPTY_DIR.trim_start_matches('/')))?;
        std::fs::rename(&tmp, &dir)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.exists() {
            return Err(failed(format!("lay out the agent layer {}: {e}", dir.display())));
        }
    }
    Ok(dir)
}

impl std::fmt::Debug for CtSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtSandbox").field("id", &self.id).field("init", &self.res.init).finish_non_exhaustive()
    }
}

impl CtSandbox {
    /// Host pid of the sandbox's init (PID 1 inside).
    pub fn init_pid(&self) -> u32 {
        self.res.init.unwrap_or_default()
    }

    /// The sandbox's run directory (CRIU logs: `restore.log`, `dump-N.log`).
    pub fn run_dir(&self) -> &Path {
        &self.res.run_dir
    }

    /// Whether its marks pre-dump first (on by default where the kernel tracks dirty pages: CtConfig::predump).
    /// Off or on for one sandbox, as the pre-dump figure compares them on the same sandbox.
    pub fn set_predump(&mut self, on: bool) {
        self.predump = on;
    }

    /// What its last mark or suspend froze it for, and whether it pre-dumped first.
    pub fn last_dump(&self) -> Option<crate::dump::DumpTimes> {
        self.last_dump
    }

    /// The sandbox's network (`network = "egress"`): namespace, veth pair, addresses.
    pub fn net(&self) -> Option<&crate::net::SandboxNet> {
        self.res.net.as_ref()
    }

    /// The agent's console output (last lines).
    pub fn console(&self) -> String {
        console_of(self.init_pid())
    }

    /// The overlay's lowerdir list (agent layer, template rootfs), `:`-separated.
    pub fn lower(&self) -> &str {
        &self.lower
    }

    /// Drop the host's agent connection and wait until the sandbox holds no socket of the host's network
    /// namespace, as a mark does first: the state in which an outside CRIU can dump it (the bench's peer arm).
    /// The agent is not reconnected.
    pub fn detach_agent(&mut self) -> Result<(), BackendError> {
        self.drop_agent(false)
    }

    fn set_frozen(&self, frozen: bool) -> Result<(), BackendError> {
        let cg =
            self.res.cgroup.as_ref().ok_or_else(|| BackendError::Unsupported("this sandbox has no cgroup".into()))?;
        cg.freeze(frozen).map_err(BackendError::Failed)
    }

    /// Bytes charged to the sandbox's memory cgroup.
    pub fn cgroup_memory(&self) -> Option<u64> {
        self.res.cgroup.as_ref()?.memory_usage()
    }

    /// The live overlay upper on the host (read-only use: tests, audit).
    pub fn upper_dir(&self) -> PathBuf {
        self.res.rw().join("upper")
    }

    /// `Some(reason)` once the sandbox's init has ended (the supervisor is its parent and reaps it).
    pub fn exited(&mut self) -> Option<String> {
        let pid = self.res.init?;
        match waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => None,
            Ok(s) => {
                self.res.init = None;
                Some(format!("{s:?}"))
            }
            Err(e) => {
                self.res.init = None;
                Some(format!("not our child any more: {e}"))
            }
        }
    }

    /// Drop the host's agent connection and wait until every connection inside is gone: CRIU cannot dump a
    /// unix socket whose peer is outside the sandbox. A process started through `exec` that still runs keeps
    /// its connection open in the agent (its output streams through it); such a mark is refused with that
    /// reason, unless `hang_up` (a suspend, which ends those streams anyway): then the connection is ended
    /// for every holder, the agent closes its side, and the processes go on unwatched.
    fn drop_agent(&mut self, hang_up: bool) -> Result<(), BackendError> {
        if hang_up {
            self.agent.hang_up();
        }
        self.agent = AgentClient::from_parts(std::io::empty(), std::io::sink());
        let t0 = Instant::now();
        loop {
            let open = self.foreign_sockets();
            if open == 0 {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(1) {
                return Err(failed(format!(
                    "{open} agent connection(s) stay open inside the sandbox: a process started through exec is \
                     still running and holds one; start long-lived processes detached (setsid CMD >/dev/null 2>&1 &) \
                     or as a service, then mark again (the sandbox keeps running)"
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Unix sockets held inside the sandbox that live in the host's network namespace: the agent's accepted
    /// connections (the kernel creates an accepted socket in the connecting side's namespace).
    fn foreign_sockets(&self) -> usize {
        let inodes = |text: String| -> std::collections::HashSet<String> {
            text.lines().skip(1).filter_map(|l| l.split_whitespace().nth(6).map(str::to_string)).collect()
        };
        let host = inodes(std::fs::read_to_string("/proc/self/net/unix").unwrap_or_default());
        let mut n = 0;
        for pid in Sandbox::pids(self) {
            let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
            for e in rd.flatten() {
                let Ok(t) = std::fs::read_link(e.path()) else { continue };
                let t = t.to_string_lossy();
                if let Some(ino) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                    n += usize::from(host.contains(ino));
                }
            }
        }
        n
    }

    /// Whether the sandbox runs in a user namespace (its jail policy, crate::userns).
    pub(crate) fn userns(&self) -> bool {
        self.compat.get("jail").map(String::as_str) == Some(crate::jail::POLICY)
    }

    /// Refuses a mark while the sandbox shows roots of a pod's containers or volumes (crate::roots): they are
    /// host mounts CRIU cannot take, and a disk-only mark would keep none of them either.
    fn check_no_roots(&self) -> Result<(), BackendError> {
        let roots = self.res.init.map(crate::roots::attached).unwrap_or_default();
        let binds = std::fs::read_to_string(self.res.run_dir.join("binds")).unwrap_or_default();
        let mut what = Vec::new();
        if !roots.is_empty() {
            what.push(format!("the root file systems of other images, for containers {}", roots.join(", ")));
        }
        if !binds.trim().is_empty() {
            what.push(format!("volumes at {}", binds.lines().collect::<Vec<_>>().join(", ")));
        }
        if what.is_empty() {
            return Ok(());
        }
        Err(BackendError::Unsupported(format!(
            "this sandbox has mounts of the host inside ({}), which a mark cannot keep: remove those containers, \
             or mark a pod whose containers share its image and have no volumes",
            what.join("; ")
        )))
    }

    /// A mark of this sandbox naming `manifests`, plus what any mark records beside its trees: the network
    /// mode and `no_new_privs`.
    pub(crate) fn mark_state(
        &self,
        mut manifests: BTreeMap<String, String>,
        logical_bytes: u64,
        stored_bytes: u64,
        pause: Duration,
        opts: &MarkOptions,
    ) -> MarkState {
        let mode = if self.res.net.is_some() { crate::net::EGRESS } else { crate::net::LOOPBACK };
        manifests.insert(crate::net::ROLE_NETWORK.to_string(), mode.to_string());
        manifests.insert(ROLE_NO_NEW_PRIVS.to_string(), if self.no_new_privs { "1" } else { "0" }.to_string());
        MarkState {
            backend: BackendKind::Ct,
            manifests,
            compat: self.compat.clone(),
            shape: self.shape.clone(),
            logical_bytes,
            stored_bytes,
            pause,
            clean: !opts.not_clean,
        }
    }

    pub(crate) fn reconnect(&mut self) -> Result<(), BackendError> {
        self.agent = connect_agent(self.init_pid(), self.ready_timeout)?;
        Ok(())
    }

    fn dump_and_store(&mut self, opts: &MarkOptions, leave_running: bool) -> Result<MarkState, BackendError> {
        // The sandbox's own preparations first (pre-mark.d hooks), while its agent is still connected.
        for warning in clade_core::hygiene::pre_mark(&self.agent, !opts.not_clean) {
            eprintln!("clade-ct: {}: mark goes on: {warning}", self.id);
        }
        self.dumps += 1;
        let stage = self.res.rw().join(format!("dump-{}", self.dumps));
        std::fs::create_dir_all(&stage).map_err(|e| failed(format!("create {}: {e}", stage.display())))?;
        if let Err(e) = self.drop_agent(!leave_running) {
            let _ = self.reconnect();
            let _ = std::fs::remove_dir_all(&stage);
            return Err(e);
        }
        let criu = self.criu.clone();
        // The namespace is never in the images (crate::net): egress or loopback, a restore brings a fresh one.
        // Unjailed, CRIU is told it is external. Jailed, it is the host's, not the user namespace's, which
        // CRIU refuses to dump, even as external: CRIU runs inside it instead and leaves out what it shares.
        let userns = self.userns();
        let external_net = if userns { None } else { Some(crate::net::netns_inode(self.init_pid()).map_err(failed)?) };
        let spec = dump::DumpSpec {
            criu: &criu,
            pid: self.init_pid(),
            images: stage.join("img"),
            upper: self.upper_dir(),
            upper_copy: stage.join("upper"),
            leave_running,
            log: self.res.run_dir.join(format!("dump-{}.log", self.dumps)),
            external_net,
            join_netns: userns.then(|| self.init_pid()),
            // Only for a mark: a suspend stops the sandbox anyway, and two passes would only add to its time.
            predump: leave_running && self.predump,
        };
        // CRIU's parasite runs in the frozen tasks' cgroup: no quota while it works (Cgroup::set_cpu).
        let cg = self.res.cgroup.as_ref();
        if let (Some(cg), true) = (cg, self.cpu_ms > 0) {
            cg.set_cpu(0).map_err(failed)?;
        }
        let dumped = dump::dump(&spec);
        if let (Some(cg), true) = (cg, self.cpu_ms > 0) {
            if let Err(e) = cg.set_cpu(self.cpu_ms) {
                eprintln!("clade-ct: {}: could not set the CPU quota back: {e}", self.id);
            }
        }
        if leave_running || dumped.is_err() {
            // On failure CRIU resumes the tasks: the sandbox keeps running either way.
            let reconnected = self.reconnect();
            if let (Ok(_), Err(e)) = (&dumped, reconnected) {
                // The agent that was dumped does not answer again (a sandbox that moved or replaced its socket,
                // or an agent that died): what was dumped is not a sandbox anyone could use. No mark.
                let _ = std::fs::remove_dir_all(&stage);
                return Err(failed(format!(
                    "the sandbox's agent did not answer after the dump, so no mark was taken: {e}"
                )));
            }
        }
        let times = dumped.map_err(|e| {
            let _ = std::fs::remove_dir_all(&stage);
            failed(format!("{e}; the sandbox keeps running"))
        })?;
        self.last_dump = Some(times);
        let stored = (|| {
            let img = self.store.put_dir(&spec.images)?;
            let upper = self.store.put_dir(&spec.upper_copy)?;
            Ok::<_, clade_store::StoreError>((img, upper))
        })();
        let _ = std::fs::remove_dir_all(&stage);
        let (img, upper) = stored.map_err(|e| failed(format!("store the mark: {e}")))?;
        let manifests: BTreeMap<String, String> = [
            (ROLE_CRIU.to_string(), img.id.to_hex()),
            (ROLE_UPPER.to_string(), upper.id.to_hex()),
            (ROLE_ROOTFS.to_string(), self.lower.clone()),
        ]
        .into();
        let logical = img.data.size + upper.data.size;
        let stored = img.data.bytes_stored + upper.data.bytes_stored + img.tree_bytes + upper.tree_bytes;
        Ok(self.mark_state(manifests, logical, stored, times.frozen, opts))
    }
}

impl Sandbox for CtSandbox {
    fn kind(&self) -> BackendKind {
        BackendKind::Ct
    }
    fn set_egress_rules(&mut self, rules: &clade_core::backend::EgressRules) -> Result<(), BackendError> {
        rules.check().map_err(BackendError::Unsupported)?;
        match &self.res.net {
            Some(net) => net.set_rules(rules).map_err(BackendError::Failed),
            None => rules.without_network(&self.id),
        }
    }
    fn id(&self) -> &str {
        &self.id
    }
    fn agent(&self) -> &AgentClient {
        &self.agent
    }
    fn pids(&self) -> Vec<u32> {
        self.res.cgroup.as_ref().map(Cgroup::pids).unwrap_or_default()
    }
    /// The cgroup freezer: every process of the sandbox, the agent included, stops where it stands.
    fn freeze(&mut self) -> Result<(), BackendError> {
        self.set_frozen(true)
    }
    fn thaw(&mut self) -> Result<(), BackendError> {
        self.set_frozen(false)
    }
    fn attach_root(&mut self, name: &str, host: &std::path::Path) -> Result<String, BackendError> {
        let init = self.res.init.ok_or_else(|| failed("the sandbox has no init process".into()))?;
        crate::roots::attach(init, name, host, self.userns()).map_err(failed)
    }
    fn bind(&mut self, host: &std::path::Path, inside: &str, readonly: bool) -> Result<(), BackendError> {
        let init = self.res.init.ok_or_else(|| failed("the sandbox has no init process".into()))?;
        crate::roots::bind(init, host, inside, readonly, self.userns()).map_err(failed)?;
        // Remembered for check_no_roots (a mark cannot hold a host mount).
        let list = self.res.run_dir.join("binds");
        let mut all = std::fs::read_to_string(&list).unwrap_or_default();
        all.push_str(&format!("{inside}\n"));
        std::fs::write(&list, all).map_err(|e| failed(format!("write {}: {e}", list.display())))
    }
    fn detach_root(&mut self, name: &str) -> Result<(), BackendError> {
        let init = self.res.init.ok_or_else(|| failed("the sandbox has no init process".into()))?;
        crate::roots::detach(init, name).map_err(failed)
    }
    fn proc_group(&mut self, leader: u32, op: clade_core::backend::GroupOp) -> Result<usize, BackendError> {
        use clade_core::backend::GroupOp;
        if leader <= 1 {
            return Err(BackendError::Unsupported(format!(
                "{leader} leads no group of processes: give a pid the agent started"
            )));
        }
        let cg =
            self.res.cgroup.as_ref().ok_or_else(|| BackendError::Unsupported("this sandbox has no cgroup".into()))?;
        let name = format!("g{leader}");
        match op {
            GroupOp::Freeze => {
                // Twice: what a member forked while the first ones were moved is caught the second time (a
                // child of a frozen process is born frozen).
                let mut n = 0;
                for _ in 0..2 {
                    let members = clade_core::procgroup::members(&cg.pids(), leader);
                    n = members.len();
                    cg.freeze_group(&name, &members, true).map_err(failed)?;
                }
                Ok(n)
            }
            GroupOp::Thaw => {
                cg.freeze_group(&name, &[], false).map_err(failed)?;
                Ok(clade_core::procgroup::members(&cg.pids(), leader).len())
            }
            GroupOp::Kill => {
                let members = clade_core::procgroup::members(&cg.pids(), leader);
                for p in &members {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p as i32), nix::sys::signal::SIGKILL);
                }
                // A frozen group holds its SIGKILLs until it thaws (v1).
                let _ = cg.freeze_group(&name, &[], false);
                Ok(members.len())
            }
        }
    }
    fn mark(&mut self, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        self.check_no_roots()?;
        if opts.disk_only {
            return self.disk_mark(opts);
        }
        self.dump_and_store(opts, true)
    }
    fn suspend(mut self: Box<Self>, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        self.check_no_roots()?;
        if opts.disk_only {
            return self.disk_suspend(opts);
        }
        let state = self.dump_and_store(opts, false)?;
        self.res.release().map_err(failed)?;
        Ok(state)
    }
    fn kill(mut self: Box<Self>) -> Result<(), BackendError> {
        self.res.release().map_err(failed)
    }
}
