//! Restore of a mark into fresh namespaces: verify the mark's trees before anything starts, lay out a fresh
//! upper and the image directory on the new sandbox's tmpfs, then run `criu restore --root MERGED` from a child
//! that has its own private mount namespace with the overlay mounted, has joined the new memory cgroup and is
//! KSM-mergeable (`PR_SET_MEMORY_MERGE` survives fork and exec, so every restored task inherits it and
//! identical pages across siblings merge again). `--restore-detached` leaves the restored init to the
//! supervisor (subreaper). Established TCP connections come back closed (`--tcp-close`): two siblings cannot
//! both own one connection.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clade_core::backend::{check_compat, Backend, BackendError, Identity, MarkState};
use clade_store::TreeId;
use nix::mount::{mount, MsFlags};

use crate::resources::{mount_tmpfs, Cgroup, Resources};
use crate::sandbox::{with_console, CtSandbox, ROLE_CRIU, ROLE_ROOTFS, ROLE_UPPER};
use crate::{connect_agent, CtBackend, FailPoint};

const PR_SET_MEMORY_MERGE: libc::c_int = 67;

fn failed(e: String) -> BackendError {
    BackendError::Failed(e)
}

fn tree_of(mark: &MarkState, role: &str) -> Result<TreeId, BackendError> {
    let hex = mark
        .manifests
        .get(role)
        .ok_or_else(|| BackendError::Corrupt(format!("mark has no '{role}' entry; it is not a ct mark")))?;
    hex.parse().map_err(|_| BackendError::Corrupt(format!("mark's '{role}' tree id {hex:?} is not a tree id")))
}

pub(crate) fn restore(b: &CtBackend, mark: &MarkState, id: &Identity) -> Result<CtSandbox, BackendError> {
    prepare(b, mark, id)?.start_ct()
}

/// A ct restore made ready up to `criu restore` (a warm-pool member): run dir, tmpfs, fresh upper, hard-linked
/// images, cgroup and, for a lazy restore, the lazy-pages daemon are in place. Dropping it releases them all.
pub struct CtPrepared {
    id: String,
    res: Resources,
    lower: String,
    shape: clade_core::backend::Shape,
    compat: std::collections::BTreeMap<String, String>,
    criu: std::path::PathBuf,
    store: clade_store::Store,
    ready_timeout: std::time::Duration,
    predump: bool,
    ksm: bool,
    lazy: bool,
    img: std::path::PathBuf,
    root: std::path::PathBuf,
    overlay: String,
    procs: Vec<std::path::PathBuf>,
    /// Jailed: the restored root is mounted nodev, the sandbox gets its hostname from the host (below).
    jail: bool,
    hostname: Option<String>,
    cpu_ms: u64,
    /// What the mark records of the jail's `no_new_privs` (its tasks keep theirs; a disk-only mark of this
    /// sandbox records it again).
    no_new_privs: bool,
    kdat: std::path::PathBuf,
    fail_at: Option<FailPoint>,
    /// The fresh loopback-only network namespace a `loopback` mark is restored into (crate::net).
    loopback: Option<std::fs::File>,
    /// Jailed (crate::userns): the lower layers are mounted idmapped at these pairs.
    userns: Option<Vec<(PathBuf, PathBuf)>>,
    prepare_took: std::time::Duration,
    phases: Vec<(&'static str, std::time::Duration)>,
}

impl std::fmt::Debug for CtPrepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtPrepared").field("id", &self.id).field("lazy", &self.lazy).finish_non_exhaustive()
    }
}

impl clade_core::backend::Prepared for CtPrepared {
    fn start(self: Box<Self>) -> Result<Box<dyn clade_core::backend::Sandbox>, BackendError> {
        Ok(Box::new(self.start_ct()?))
    }
}

pub(crate) fn prepare(b: &CtBackend, mark: &MarkState, id: &Identity) -> Result<CtPrepared, BackendError> {
    let t0 = Instant::now();
    let mut phases: Vec<(&'static str, std::time::Duration)> = Vec::new();
    let lap = |name: &'static str, phases: &mut Vec<_>| phases.push((name, t0.elapsed()));
    if mark.backend != clade_core::backend::BackendKind::Ct {
        return Err(BackendError::Incompatible {
            key: "backend".into(),
            mark: mark.backend.as_str().into(),
            host: "ct".into(),
            hint: "restore it with the backend that took it".into(),
        });
    }
    if mark.boots_cold() {
        return Err(BackendError::Unsupported(
            "a disk-only mark has no processes to prepare: restore it (it boots cold)".into(),
        ));
    }
    let host = b.host_compat();
    check_compat(&mark.compat, &host)?;
    // check_compat judges the keys a mark has; a mark from before the jail has no `jail` key, and CRIU would
    // bring its tasks back as they were: unjailed.
    let want = host.get("jail").map(String::as_str).unwrap_or("none");
    if mark.compat.get("jail").map(String::as_str).unwrap_or("none") != want {
        return Err(BackendError::Incompatible {
            key: "jail".into(),
            mark: mark.compat.get("jail").cloned().unwrap_or_else(|| "(none: taken before the jail)".into()),
            host: want.into(),
            hint: "its tasks would come back with the jail they were marked with: rebuild the base (clade base build) and mark again".into(),
        });
    }
    let net = crate::net::mark_net(mark)?;
    let (img_id, upper_id) = (tree_of(mark, ROLE_CRIU)?, tree_of(mark, ROLE_UPPER)?);
    let lower =
        mark.manifests.get(ROLE_ROOTFS).cloned().ok_or_else(|| BackendError::Corrupt("mark names no rootfs".into()))?;
    if let Some(gone) = lower.split(':').find(|l| crate::lower::tree_of(l).is_none() && !Path::new(l).is_dir()) {
        return Err(BackendError::Failed(format!(
            "the mark's lower layer {gone} is gone: rebuild the template (or keep the agent build the mark was taken with)"
        )));
    }
    // Both trees are read (and hash-verified) before any process starts; at once, as on a host that resumes a
    // sandbox from another each is a GET from the blob tier.
    let read = |t: &TreeId| b.store.tree(t).map_err(|e| BackendError::Corrupt(format!("tree {t}: {e}")));
    let (img_tree, upper_tree) = std::thread::scope(|s| {
        let img = s.spawn(|| read(&img_id));
        let upper = read(&upper_id);
        (img.join().unwrap_or_else(|_| Err(failed("reading the images' tree panicked".into()))), upper)
    });
    let (img_tree, upper_tree) = (img_tree?, upper_tree?);
    lap("verified", &mut phases);
    let run_dir = b.run_dir(id)?;
    std::fs::create_dir(&run_dir).map_err(|e| {
        failed(format!("create {}: {e} (a sandbox with this id exists; kill it or pick another id)", run_dir.display()))
    })?;
    let mut res = Resources::new(run_dir.clone());
    mount_tmpfs(&res.rw(), b.cfg.rw_bytes).map_err(failed)?;
    res.rw_mounted = true;
    b.check_fail(FailPoint::RunDir)?;
    let (upper, work, img, root) =
        (res.rw().join("upper"), res.rw().join("work"), run_dir.join("img"), run_dir.join("root"));
    // The cgroup first: the upper's copy on the sandbox's tmpfs is charged to it (crate::disk::copy_tree_charged).
    // The CPU quota is set once the restore is done (Cgroup::set_cpu).
    let limits = b.limits(&mark.shape);
    let cpu_ms = limits.cpu_ms_per_100ms;
    let cg =
        Cgroup::create(&id.sandbox_id, &crate::resources::Limits { cpu_ms_per_100ms: 0, ..limits }).map_err(failed)?;
    let procs = cg.procs_files();
    res.cgroup = Some(cg);
    // The upper and the images are laid out while what CRIU will read of the sandbox's lazily mounted lower
    // files (a sandbox from another host: crate::images) is fetched, found from the images' tree without waiting
    // for their layout (which a pull's fetch-ahead may still be making): on such a host each is a set of GETs
    // whose round trips through the blob tier overlap (docs/roam.md).
    let lazy_upper = std::thread::scope(|s| {
        let up = s.spawn(|| upper_for(b, &upper_id, &lower, &upper, &procs));
        // The lower trees the prefetch and the lazy mounts read, fetched meanwhile into the store's tree cache.
        s.spawn(|| crate::lower::read_trees(&b.store, &lower));
        let pre = s.spawn(|| prefetch_mapped(b, &lower, &img_id, &img_tree, &upper_tree));
        images_for(b, &img_id, &img)?;
        match pre.join() {
            Ok(Err(e)) => eprintln!("clade: restore {}: prefetch of mapped files skipped: {e}", id.sandbox_id),
            Err(_) => eprintln!("clade: restore {}: prefetch of mapped files panicked", id.sandbox_id),
            Ok(Ok(_)) => {}
        }
        up.join().unwrap_or_else(|_| Err(failed("laying out the upper panicked".into())))
    })?;
    // Large files of the upper this host lacks are read through the mark's upper tree, mounted lazily right
    // below the sandbox's own upper (crate::lazy_upper); the sandbox keeps the layer, so its marks name it.
    let lower = if lazy_upper { format!("{}{upper_id}:{lower}", crate::lower::UPPER_PREFIX) } else { lower };
    lap("images", &mut phases);
    for d in [&work, &root] {
        std::fs::create_dir_all(d).map_err(|e| failed(format!("create {}: {e}", d.display())))?;
    }
    lap("files", &mut phases);
    b.check_fail(FailPoint::Files)?;
    b.check_fail(FailPoint::Cgroup)?;
    let mut loopback = None;
    match net {
        crate::net::MarkNet::Egress => {
            res.net = Some(crate::net::SandboxNet::create(&id.sandbox_id).map_err(failed)?);
        }
        crate::net::MarkNet::Loopback => loopback = Some(crate::net::loopback_netns().map_err(failed)?),
        crate::net::MarkNet::Saved => {}
    }
    b.check_fail(FailPoint::Network)?;
    // Lower layers named as store trees (a sandbox from another host) are mounted lazily (crate::lower).
    let shift = if b.cfg.jail { crate::userns::BASE } else { 0 };
    let mut lowerdir = crate::lower::resolve(&b.store, &lower, &run_dir, &mut res.lowers, shift).map_err(failed)?;
    let mut idmapped = None;
    if b.cfg.jail {
        // Store trees are shown shifted by their FUSE mount already; host directories are idmapped.
        let lazy = run_dir.join("lower");
        let (dirs, pairs) =
            crate::userns::plan_lowers(&lowerdir, &run_dir.join("idmap"), |l| Path::new(l).starts_with(&lazy))
                .map_err(failed)?;
        lowerdir = dirs;
        idmapped = Some(pairs);
    }
    let overlay = format!("lowerdir={lowerdir},upperdir={},workdir={}", upper.display(), work.display());
    let pages: u64 = std::fs::read_dir(&img)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
                .filter_map(|e| e.metadata().ok().map(|m| m.len()))
                .sum()
        })
        .unwrap_or(0);
    // A jailed restore's tasks open their userfaultfd inside the user namespace, which the kernel allows only
    // with vm.unprivileged_userfaultfd=1 (a host-wide switch clade leaves alone): otherwise pages are copied
    // up front.
    let lazy = pages >= b.lazy_threshold() && (!b.cfg.jail || crate::userns::userfaultfd_allowed());
    let kdat = crate::criu::kdat_dir().map_err(failed)?;
    if lazy {
        start_lazy_pages(b, &img, &run_dir, &mut res, &kdat)?;
    }
    Ok(CtPrepared {
        id: id.sandbox_id.clone(),
        res,
        lower,
        shape: mark.shape.clone(),
        compat: b.host_compat(),
        criu: b.cfg.criu.clone(),
        store: b.store.clone(),
        ready_timeout: b.cfg.ready_timeout,
        predump: b.cfg.predump,
        ksm: b.cfg.ksm,
        lazy,
        img,
        root,
        overlay,
        procs,
        jail: b.cfg.jail,
        cpu_ms,
        no_new_privs: crate::sandbox::no_new_privs_of(mark),
        // A clean mark's sibling gets its own hostname; a not-clean one keeps the mark's.
        hostname: mark.clean.then(|| id.hostname.clone()),
        kdat,
        fail_at: b.fail_at(),
        loopback,
        userns: idmapped,
        prepare_took: t0.elapsed(),
        phases,
    })
}

impl CtPrepared {
    /// Run `criu restore` and connect to the agent.
    pub fn start_ct(mut self) -> Result<CtSandbox, BackendError> {
        // Phase times continue from the end of prepare (a pool member's wait is not counted).
        let t0 = Instant::now().checked_sub(self.prepare_took).unwrap_or_else(Instant::now);
        let mut phases = std::mem::take(&mut self.phases);
        let lap = |name: &'static str, phases: &mut Vec<_>| phases.push((name, t0.elapsed()));
        let check = |here| crate::fail_check(self.fail_at, here);
        let (lazy, img, root, run_dir) = (self.lazy, self.img.clone(), self.root.clone(), self.res.run_dir.clone());
        let (overlay, procs, kdat) = (self.overlay.clone(), self.procs.clone(), self.kdat.clone());
        let mut res = std::mem::replace(&mut self.res, Resources::new(std::path::PathBuf::new()));
        nix::sys::prctl::set_child_subreaper(true).map_err(|e| failed(format!("PR_SET_CHILD_SUBREAPER: {e}")))?;
        let pidfile = run_dir.join("init.pid");
        let log = run_dir.join("restore.log");
        let mut cmd = Command::new(&self.criu);
        if lazy {
            cmd.arg("--lazy-pages");
        }
        cmd.arg("restore")
            .arg("-D")
            .arg(&img)
            .arg("-W")
            .arg(&run_dir)
            .arg("-o")
            .arg(&log)
            .arg("--root")
            .arg(&root)
            .args(["--ext-mount-map", "auto", "--restore-detached", "--manage-cgroups=ignore"])
            .args(["--tcp-close", "--file-locks", "--network-lock", "skip", "--pidfile"])
            .arg(&pidfile)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null());
        // What CRIU prints before it opens its log (an image or work directory it cannot open) is kept.
        let stderr_file = run_dir.join("restore.stderr");
        match std::fs::File::create(&stderr_file) {
            Ok(f) => cmd.stderr(f),
            Err(_) => cmd.stderr(std::process::Stdio::null()),
        };
        if std::env::var_os("CLADE_CRIU_VERBOSE").is_some() {
            cmd.arg("-v4");
        }
        if crate::lower::has_trees(&self.lower) {
            // Lower layers that are store trees are named by their content hash, so CRIU's default check of each
            // mapped ELF file's build-id proves nothing more, and it reads every such file's header through the
            // lazy mount, one ranged GET after another (~0.7 s of a roaming resume): the size is checked only.
            cmd.args(["--file-validation", "filesize"]);
        }
        let ksm = self.ksm;
        let jail = self.jail;
        let root2 = root.clone();
        let kdat2 = kdat.clone();
        // Egress: the fresh namespace made in prepare goes to CRIU as the mark's external one (crate::net).
        // Loopback: the namespace made in prepare, likewise.
        let netns = match &res.net {
            Some(net) => Some(
                std::fs::File::open(net.netns_path())
                    .map_err(|e| failed(format!("open {}: {e}", net.netns_path().display())))?,
            ),
            None => self.loopback.take(),
        };
        // Jailed (crate::userns), the namespace is not in the images: CRIU runs in it and the restored tasks
        // inherit it.
        let join_netns = self.jail;
        if netns.is_some() && !join_netns {
            cmd.arg("--inherit-fd").arg(format!("fd[{}]:{}", crate::net::INHERIT_FD, crate::net::EXT_KEY));
        }
        let netns_fd = netns.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
        let idmap = self.userns.clone();
        if join_netns {
            cmd.arg("--external").arg(format!("mnt[{}]:{SYSFS_DIR}", crate::dump::SYSFS_KEY));
        }
        let mapping = match &idmap {
            Some(_) => Some(crate::userns::mapping_namespace().map_err(failed)?),
            None => None,
        };
        // SAFETY: the closure runs in the forked child before exec and only makes system calls (setns, dup2,
        // unshare, mount, an open+write of the cgroup file, prctl) on data prepared before the fork; the
        // namespace's descriptor is held open by `netns` until the command has run.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(fd) = netns_fd {
                    // Jailed, CRIU joins the namespace; otherwise it inherits it on INHERIT_FD.
                    let r = if join_netns {
                        libc::setns(fd, libc::CLONE_NEWNET)
                    } else {
                        inherit_as(fd, crate::net::INHERIT_FD)
                    };
                    if r < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                child_setup(&root2, &overlay, &procs, ksm, jail, &kdat2, idmap.as_deref().zip(mapping))?;
                if join_netns {
                    sysfs_for_criu()?;
                }
                Ok(())
            });
        }
        let out = cmd.status().map_err(|e| failed(format!("run {}: {e}", self.criu.display())))?;
        drop(netns);
        let pid: Option<u32> = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok());
        res.init = pid;
        if !out.success() || pid.is_none() {
            let tail = crate::dump::log_tail_or(&log, &std::fs::read(&stderr_file).unwrap_or_default());
            let hint = if tail.contains("Unable to map ANON_VMA: Cannot allocate memory") {
                " (large PROT_NONE reservations are charged in full by CRIU 4.2: set vm.overcommit_memory=1)"
            } else {
                ""
            };
            return Err(failed(format!("criu restore failed ({out}): {tail}{hint}")));
        }
        lap("criu", &mut phases);
        if let (Some(name), Some(pid)) = (&self.hostname, pid) {
            // The jail leaves the sandbox no right to set its hostname: the host sets it in its namespace.
            set_hostname(pid, name).map_err(failed)?;
        }
        check(FailPoint::Processes)?;
        let agent = connect_agent(pid.unwrap_or_default(), self.ready_timeout).map_err(|e| with_console(e, &res))?;
        lap("agent", &mut phases);
        if let Some(cg) = &res.cgroup {
            cg.set_cpu(self.cpu_ms).map_err(failed)?;
        }
        check(FailPoint::Agent)?;
        if !lazy {
            let _ = std::fs::remove_dir_all(&img);
        }
        phases.push(("lazy", std::time::Duration::from_nanos(u64::from(lazy))));
        Ok(CtSandbox {
            id: self.id.clone(),
            res,
            agent,
            criu: self.criu.clone(),
            store: self.store.clone(),
            lower: self.lower.clone(),
            shape: self.shape.clone(),
            compat: self.compat.clone(),
            ready_timeout: self.ready_timeout,
            dumps: 0,
            predump: self.predump,
            last_dump: None,
            cpu_ms: self.cpu_ms,
            no_new_privs: self.no_new_privs,
            startup: t0.elapsed(),
            phases,
        })
    }
}

/// Makes `fd` open as `target` across exec; 0, or -1 with errno set. dup2 clears close-on-exec on the new
/// descriptor but does nothing at all when `fd` already is `target` (seen in CI as CRIU's `Can't fstat inherit fd
/// 10`), so then the flag is cleared by hand. Only system calls: it runs between fork and exec.
fn inherit_as(fd: libc::c_int, target: libc::c_int) -> libc::c_int {
    // SAFETY: fcntl and dup2 on plain integers touch no memory of this process.
    unsafe {
        if fd == target {
            libc::fcntl(fd, libc::F_SETFD, 0).min(0)
        } else {
            libc::dup2(fd, target).min(0)
        }
    }
}

/// Where a jailed restore's CRIU finds the sysfs it binds at the sandbox's /sys (crate::dump::SYSFS_KEY): on
/// a tmpfs over /tmp in CRIU's private mount namespace, as the restored tasks (already in their user
/// namespace when CRIU binds it) cannot traverse `$CLADE_HOME`.
const SYSFS_DIR: &str = "/tmp/clade-sys";

/// In the CRIU child, after it joined the sandbox's network namespace and made its mount namespace private:
/// a fresh tmpfs on /tmp (CRIU also keeps its mount staging there) holding sysfs of that network namespace.
fn sysfs_for_criu() -> std::io::Result<()> {
    let io = |e: nix::errno::Errno| std::io::Error::from_raw_os_error(e as i32);
    mount(Some("tmpfs"), "/tmp", Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777,size=1m"))
        .map_err(io)?;
    std::fs::create_dir(SYSFS_DIR)?;
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("sysfs"), SYSFS_DIR, Some("sysfs"), ro, None::<&str>).map_err(io)
}

/// Sets the hostname of a sandbox whose init is `pid` from a short-lived thread that joins its UTS namespace
/// (a thread's namespaces are its own; the supervisor's other threads keep the host's).
pub(crate) fn set_hostname(pid: u32, name: &str) -> Result<(), String> {
    let ns =
        std::fs::File::open(format!("/proc/{pid}/ns/uts")).map_err(|e| format!("open uts namespace of {pid}: {e}"))?;
    let name = name.to_string();
    std::thread::spawn(move || {
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWUTS).map_err(|e| format!("join uts namespace: {e}"))?;
        nix::unistd::sethostname(&name).map_err(|e| format!("sethostname {name}: {e}"))
    })
    .join()
    .map_err(|_| "the hostname thread panicked".to_string())?
}

fn child_setup(
    root: &Path,
    overlay: &str,
    procs: &[PathBuf],
    ksm: bool,
    jail: bool,
    kdat: &Path,
    idmap: Option<(&[(PathBuf, PathBuf)], std::os::fd::BorrowedFd<'static>)>,
) -> std::io::Result<()> {
    let io = |e: nix::errno::Errno| std::io::Error::from_raw_os_error(e as i32);
    for p in procs {
        std::fs::write(p, std::process::id().to_string())?;
    }
    crate::criu::private_run(kdat)?;
    if let Some((pairs, ns)) = idmap {
        crate::userns::mount_lowers(pairs, ns)?;
    }
    if jail {
        // After joining the cgroups: CRIU (told to leave cgroups alone) restores the tasks into its own cgroup
        // namespace, which is then rooted at the sandbox's cgroup, as a cold start's is.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWCGROUP).map_err(io)?;
    }
    let flags = if jail { MsFlags::MS_NODEV } else { MsFlags::empty() };
    mount(Some("overlay"), root, Some("overlay"), flags, Some(overlay)).map_err(io)?;
    if ksm {
        // SAFETY: prctl with integer arguments only; an old kernel answers EINVAL, which is fine (no KSM).
        unsafe {
            libc::prctl(
                PR_SET_MEMORY_MERGE,
                1 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            );
        }
    }
    Ok(())
}

/// A store tree laid out once per host under `$CLADE_HOME/cache/<kind>/<tree id>` (read from the store,
/// hash-verified, written to a temp name and renamed; a racing restore that lost the rename drops its copy),
/// without the entries `leave_out` names (asked only when this call lays it out: crate::lazy_upper), which are
/// noted beside it first ([`crate::lazy_upper::marker_of`]).
fn cached_tree(
    b: &CtBackend,
    kind: &str,
    id: &TreeId,
    what: &str,
    leave_out: impl FnOnce() -> std::collections::BTreeSet<Vec<u8>>,
) -> Result<PathBuf, BackendError> {
    let cache = b.home.cache_dir().join(kind).join(id.to_hex());
    if cache.exists() {
        return Ok(cache);
    }
    // One process lays a tree out at a time, the others wait and find it (siblings forked at once; a pull's
    // fetch-ahead and the restore that follows it). The lock only saves work: a layout is a temp directory
    // renamed into place, so two at once still leave one whole copy.
    let _one = lock_layout(b, kind, id);
    if !cache.exists() {
        let parent = cache.parent().unwrap_or(&cache);
        std::fs::create_dir_all(parent).map_err(|e| failed(format!("create {}: {e}", parent.display())))?;
        let tmp = clade_core::home::temp_beside(&cache);
        let _ = std::fs::remove_dir_all(&tmp);
        let left = leave_out();
        b.store
            .get_dir_except(id, &tmp, |e| left.contains(&e.path))
            .map_err(|e| failed(format!("lay out {what}: {e}")))?;
        if !left.is_empty() {
            // Before the layout is in place: whoever finds the layout finds the note. A note beside a whole
            // layout (a racing restore's) only adds a lazy layer whose files the upper hides.
            let marker = crate::lazy_upper::marker_of(&cache);
            let note: Vec<u8> = left.iter().flat_map(|p| p.iter().copied().chain(std::iter::once(b'\n'))).collect();
            let tmp_note = clade_core::home::temp_beside(&marker);
            std::fs::write(&tmp_note, note)
                .and_then(|()| std::fs::rename(&tmp_note, &marker))
                .map_err(|e| failed(format!("note the lazy files of {what} at {}: {e}", marker.display())))?;
        }
        if std::fs::rename(&tmp, &cache).is_err() {
            // Another restore laid it out first.
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    Ok(cache)
}

/// The file ranges CRIU will read because it writes dumped pages over private mappings of them
/// (crate::images::mapped_ranges), from the mark's images: their layout in the host's cache when it is there,
/// else the few image files that say it (`files.img`, `mm-*`, `pagemap-*`) read from the store.
fn mapped_of(
    b: &CtBackend,
    img_id: &TreeId,
    tree: &clade_store::Tree,
) -> std::collections::BTreeMap<String, Vec<std::ops::Range<u64>>> {
    let cache = b.home.cache_dir().join(IMAGES).join(img_id.to_hex());
    if cache.is_dir() {
        return crate::images::mapped_ranges(&cache);
    }
    let files: std::collections::BTreeMap<String, &clade_store::Manifest> = tree
        .entries
        .iter()
        .filter_map(|e| match &e.kind {
            clade_store::EntryKind::File(m) => Some((String::from_utf8_lossy(&e.path).into_owned(), m)),
            _ => None,
        })
        .collect();
    let needed: Vec<(&clade_store::Manifest, Vec<std::ops::Range<u64>>)> = files
        .iter()
        .filter(|(n, _)| *n == "files.img" || n.starts_with("mm-") || n.starts_with("pagemap-"))
        .map(|(_, m)| (*m, std::iter::once(0..m.size).collect()))
        .collect();
    // One round of GETs for all of them, rather than one per file.
    let _ = b.store.prefetch_ranges(&needed);
    let names: Vec<String> = files.keys().cloned().collect();
    crate::images::mapped_ranges_of(&names, |name| {
        let m = files.get(name)?;
        let mut buf = vec![0u8; usize::try_from(m.size).ok()?];
        b.store.image_of((*m).clone()).read_at(0, &mut buf).ok()?;
        Some(buf)
    })
}

/// Held while `kind`'s layout of tree `id` is made: `$CLADE_HOME/cache/.locks/<kind>-<tree>` (gc removes it with
/// the layout). `None` where the lock file cannot be made: the layout goes on unlocked.
fn lock_layout(b: &CtBackend, kind: &str, id: &TreeId) -> Option<nix::fcntl::Flock<std::fs::File>> {
    let dir = b.home.cache_dir().join(".locks");
    std::fs::create_dir_all(&dir).ok()?;
    let f =
        std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{kind}-{}", id.to_hex()))).ok()?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).ok()
}

/// [`clade_core::backend::Backend::fetch_ahead`]: the mark's images and upper laid out in this host's caches at
/// once, as the restore would, and what CRIU will read of its lazily mounted lower files fetched onto this
/// host's disk (docs/roam.md: on a host that takes the sandbox from another, this overlaps the take and the
/// start of the supervisor, which then finds all three here).
pub(crate) fn fetch_ahead(b: &CtBackend, mark: &MarkState) -> Result<(), BackendError> {
    if mark.backend != clade_core::backend::BackendKind::Ct || mark.boots_cold() {
        return Ok(());
    }
    let (img_id, upper_id) = (tree_of(mark, ROLE_CRIU)?, tree_of(mark, ROLE_UPPER)?);
    let lower = mark.manifests.get(ROLE_ROOTFS).cloned().unwrap_or_default();
    std::thread::scope(|s| {
        let up = s.spawn(|| upper_cache(b, &upper_id, &lower));
        s.spawn(|| crate::lower::read_trees(&b.store, &lower));
        // What CRIU will read of the lazily mounted lower files, kept on disk for the supervisor's restore.
        s.spawn(|| {
            let trees = b.store.tree(&img_id).and_then(|i| Ok((i, b.store.tree(&upper_id)?)));
            if let Ok((img_tree, upper_tree)) = trees {
                let _ = prefetch_mapped(b, &lower, &img_id, &img_tree, &upper_tree);
            }
        });
        images_cache(b, &img_id)?;
        up.join().unwrap_or_else(|_| Err(failed("laying out the upper panicked".into())))
    })
    .map(|_| ())
}

/// [`crate::lower::prefetch_mapped`] of a mark, under the per-images lock `ct-mapped` ([`lock_layout`]): a
/// pull's fetch-ahead and the restore that follows it both ask; whichever comes first fetches them onto this
/// host's disk, and the other waits for it, then finds them there instead of fetching them again.
fn prefetch_mapped(
    b: &CtBackend,
    lower: &str,
    img_id: &TreeId,
    img_tree: &clade_store::Tree,
    upper_tree: &clade_store::Tree,
) -> Result<(usize, usize), String> {
    if !crate::lower::has_trees(lower) {
        return Ok((0, 0));
    }
    let _one = lock_layout(b, MAPPED, img_id);
    crate::lower::prefetch_mapped(&b.store, lower, upper_tree, || mapped_of(b, img_id, img_tree))
}

/// The host's caches of marks' trees, under `$CLADE_HOME/cache/` (crate::footprint names them to gc).
pub(crate) const UPPERS: &str = "ct-uppers";
pub(crate) const IMAGES: &str = "ct-images";
/// The lock ([`lock_layout`]) of the prefetch of what CRIU reads of a mark's lower files (nothing laid out).
const MAPPED: &str = "ct-mapped";

/// The mark's upper laid out in the host's cache ([`cached_tree`]), its large files that this host lacks left
/// out (crate::lazy_upper) for a mark with lower layers `lowers`. Returns the layout and whether files were
/// left out: then the restore mounts the upper tree as a lazy lower layer.
fn upper_cache(b: &CtBackend, id: &TreeId, lowers: &str) -> Result<(PathBuf, bool), BackendError> {
    let cache = cached_tree(b, UPPERS, id, "the upper", || match b.store.tree(id) {
        Ok(t) => crate::lazy_upper::lazy_files(&b.store, &t, lowers),
        // The layout's own read reports it.
        Err(_) => Default::default(),
    })?;
    let lazy = crate::lazy_upper::marker_of(&cache).exists();
    Ok((cache, lazy))
}

/// The mark's CRIU images laid out in the host's cache ([`cached_tree`]).
fn images_cache(b: &CtBackend, id: &TreeId) -> Result<PathBuf, BackendError> {
    cached_tree(b, IMAGES, id, "the images", Default::default)
}

/// A mark's upper is laid out (and hash-verified) once per host under `$CLADE_HOME/cache/ct-uppers/<tree id>`,
/// read-only; each restore gets its own copy (`cp -a`: whiteouts, `trusted.overlay.*` xattrs and owners kept),
/// which the sandbox then writes. A kernel copy of the few MB a browser's upper holds is ~10 ms where the
/// store's read (decompress, verify, write) took 100-300 ms on this host. Returns whether the layout left
/// large files to a lazy layer (crate::lazy_upper): the caller then mounts `upper=<id>` below the copy.
pub(crate) fn upper_for(
    b: &CtBackend,
    id: &TreeId,
    lowers: &str,
    dest: &Path,
    charge: &[PathBuf],
) -> Result<bool, BackendError> {
    let (cache, lazy) = upper_cache(b, id, lowers)?;
    crate::disk::copy_tree_charged(&cache, dest, charge)?;
    Ok(lazy)
}

/// The images of a mark are laid out once per host under `$CLADE_HOME/cache/ct-images/<tree id>` (read-only);
/// each restore gets a directory of hard links to them, as CRIU writes `stats-restore` into its image dir.
/// Siblings after the first skip the store read and the copy.
fn images_for(b: &CtBackend, id: &TreeId, dest: &Path) -> Result<(), BackendError> {
    let cache = images_cache(b, id)?;
    link_images(&cache, dest)
}

/// `dest` made of hard links to the files of `from` (copies where a link fails), and likewise for an incremental
/// mark's `parent` directory (crate::dump). CRIU resolves `parent` in its own mount namespace, where a symbolic
/// link to the cache need not resolve.
fn link_images(from: &Path, dest: &Path) -> Result<(), BackendError> {
    std::fs::create_dir(dest).map_err(|e| failed(format!("create {}: {e}", dest.display())))?;
    let rd = std::fs::read_dir(from).map_err(|e| failed(format!("read {}: {e}", from.display())))?;
    for e in rd.flatten() {
        let to = dest.join(e.file_name());
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            link_images(&e.path(), &to)?;
            continue;
        }
        if std::fs::hard_link(e.path(), &to).is_err() {
            std::fs::copy(e.path(), &to).map_err(|er| failed(format!("copy {}: {er}", e.path().display())))?;
        }
    }
    Ok(())
}

/// `criu lazy-pages`: serves the restored tasks' page faults (userfaultfd) from the images and copies the rest
/// in the background, then exits. It rides in the sandbox's guard, so a failed restore or a kill ends it.
fn start_lazy_pages(
    b: &CtBackend,
    img: &Path,
    work: &Path,
    res: &mut Resources,
    kdat: &Path,
) -> Result<(), BackendError> {
    let mut cmd = Command::new(&b.cfg.criu);
    let kdat = kdat.to_path_buf();
    // SAFETY: the closure only makes system calls (unshare, mount) on data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || crate::criu::private_run(&kdat));
    }
    let child = cmd
        .arg("lazy-pages")
        .arg("-D")
        .arg(img)
        .arg("-W")
        .arg(work)
        .arg("-o")
        .arg(work.join("lazy-pages.log"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| failed(format!("run criu lazy-pages: {e}")))?;
    res.helper = Some(child);
    let sock = work.join("lazy-pages.socket");
    let t0 = Instant::now();
    while !sock.exists() {
        if t0.elapsed() > std::time::Duration::from_secs(5) {
            return Err(failed(format!(
                "criu lazy-pages did not listen: {}",
                crate::dump::log_tail(&work.join("lazy-pages.log"))
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;

    /// Whether a child made with `setup` between fork and exec sees `target` open.
    fn child_sees(target: i32, setup: fn(i32, i32) -> i32, fd: i32) -> bool {
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c").arg(format!("test -e /proc/self/fd/{target}"));
        // SAFETY: the hook only makes the fcntl/dup2 system calls of `setup` on plain integers.
        unsafe {
            cmd.pre_exec(move || if setup(fd, target) < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) });
        }
        cmd.status().expect("run sh").success()
    }

    #[test]
    fn a_descriptor_already_on_the_inherited_number_stays_open_across_exec() {
        // A close-on-exec file on exactly the number the child must inherit (as File::open gives), made with
        // dup3 on a number no other test uses.
        let file = std::fs::File::open("/dev/null").unwrap();
        let target = 777;
        // SAFETY: dup3 onto a number this test owns; the OwnedFd closes it at the end.
        let on_target = unsafe { libc::dup3(file.as_raw_fd(), target, libc::O_CLOEXEC) };
        assert_eq!(on_target, target);
        // SAFETY: on_target was just made by dup3 and nothing else owns it.
        let _owned = unsafe { OwnedFd::from_raw_fd(on_target) };
        assert!(child_sees(target, super::inherit_as, target), "inherit_as keeps it open");
        // Control: dup2 alone leaves it close-on-exec, so the child does not have it (the CI failure).
        fn dup2_only(fd: i32, target: i32) -> i32 {
            // SAFETY: dup2 on plain integers.
            unsafe { libc::dup2(fd, target).min(0) }
        }
        assert!(!child_sees(target, dup2_only, target), "the control must see the descriptor lost");
        // From another number, inherit_as moves it.
        assert!(child_sees(778, super::inherit_as, file.as_raw_fd()));
    }
}
