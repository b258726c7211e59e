//! Cold start: a forked child unshares PID/mount/net/IPC/UTS namespaces and forks the sandbox's init, which
//! makes its mounts private, mounts the overlay root (lower = template rootfs, upper and work on the sandbox's
//! tmpfs), proc, /dev with the host's null, zero, full, random, urandom and tty bound in, /dev/shm and /run,
//! sets the hostname, `pivot_root`s, detaches the old root, reopens stdio inside the new root, closes every
//! inherited fd and **execs** the agent with a clean environment. Each step is there because CRIU needs it
//! (each found with CRIU 4.2 on this project's hosts): without the exec it cannot look up the mount of the old binary; without `setsid` the session
//! leader is outside the PID namespace; with stdio pointing outside it cannot look up fd 1's mount.
//!
//! /dev, /dev/shm and /run are not tmpfs mounts but directories of the overlay's upper (itself on the
//! sandbox's tmpfs), /dev and /run marked opaque so that they start empty whatever the template's rootfs holds
//! there, each bound onto itself so it is a mount point (the agent, as init, mounts a tmpfs wherever one is
//! missing). CRIU dumps and restores every tmpfs by running `tar` (4-5 ms each, inside a mark's frozen window
//! and again on every restore); the upper is copied with each mark anyway.
//!
//! The middle child exits at once, so the init is adopted by the supervisor (`PR_SET_CHILD_SUBREAPER`), which
//! can then wait for it and notice it dying.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::unistd::{fork, ForkResult, Pid};

/// Where the agent lives inside the sandbox (copied into the upper at cold start).
pub const AGENT_PATH: &str = "/usr/lib/clade/clade-agent";
/// The agent's console (stdout and stderr) inside the sandbox.
pub const CONSOLE_PATH: &str = "/run/clade/console.log";

const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// What the init child needs, prepared before the fork.
pub struct InitSpec {
    /// overlayfs lowerdir list.
    pub lower: String,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// Mount point of the merged root (a directory in the run dir; mounted only inside the sandbox).
    pub root: PathBuf,
    pub hostname: String,
    /// `cgroup.procs` of each of the sandbox's cgroups (one on v2, one per controller on v1).
    pub cgroup_procs: Vec<PathBuf>,
    /// The jail's seccomp filters (crate::jail); `None` starts the sandbox unjailed (tests' controls, and
    /// `--unjailed-insecure`).
    pub jail: Option<Vec<seccompiler::BpfProgram>>,
    /// Join this network namespace (made by crate::net) instead of unsharing a new one.
    pub netns: Option<PathBuf>,
    /// Jailed: the sandbox runs in its own user namespace (crate::userns); the lower layers are mounted
    /// idmapped at these `(layer, mount point)` pairs, whose mount points `lower` then names.
    pub userns: Option<Vec<(PathBuf, PathBuf)>>,
    /// Jailed: set `no_new_privs` (off only where the template asks: crate::jail::enter).
    pub no_new_privs: bool,
}

/// Start the sandbox's init; returns its host pid once it has exec'd the agent.
pub fn spawn_init(spec: &InitSpec) -> Result<u32, String> {
    nix::sys::prctl::set_child_subreaper(true).map_err(|e| format!("PR_SET_CHILD_SUBREAPER: {e}"))?;
    let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let (pid_r, pid_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    seed_upper(&spec.upper, spec.userns.is_some())?;
    let (map_req_r, map_req_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let (map_done_r, map_done_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    // The mapping user namespace is made before the fork (it forks a child of its own).
    let mapping = match spec.userns {
        Some(_) => Some(crate::userns::mapping_namespace()?),
        None => None,
    };
    let overlay = format!("lowerdir={},upperdir={},workdir={}", spec.lower, spec.upper.display(), spec.work.display());
    let argv: Vec<CString> =
        [AGENT_PATH, "init", "--listen", &format!("unix:{}", clade_agent::CT_SOCKET), "--shared-kernel"]
            .iter()
            .map(|s| CString::new(*s).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
    let env: Vec<CString> =
        ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "TERM=linux"]
            .iter()
            .map(|s| CString::new(*s).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
    // SAFETY: the child only calls async-signal-safe system calls plus glibc's allocator (which glibc's fork
    // makes safe to use in the child) and never returns into the caller's code: it execs or `_exit`s.
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Child => {
            drop(err_r);
            drop(pid_r);
            drop(map_req_r);
            drop(map_done_w);
            let maps = MapPipes { req: map_req_w, done: map_done_r, mapping };
            let code = middle(spec, &overlay, &argv, &env, err_w, pid_w, maps);
            // SAFETY: `_exit` ends the forked child without running the parent's atexit handlers or destructors.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            drop(err_w);
            drop(pid_w);
            drop(map_req_w);
            drop(map_done_r);
            if spec.userns.is_some() {
                // The middle child asks for its maps once it has unshared its user namespace (EOF: it failed
                // before, and says why on err_r).
                let mut b = [0u8; 1];
                if read_all(&map_req_r, &mut b) == 1 {
                    let reply: &[u8] = match crate::userns::write_maps(child.as_raw()) {
                        Ok(()) => b"1",
                        Err(_) => b"0",
                    };
                    let _ = nix::unistd::write(&map_done_w, reply);
                }
                drop(map_done_w);
            }
            let _ = nix::sys::wait::waitpid(child, None);
            let mut pid_buf = [0u8; 4];
            let got = read_all(&pid_r, &mut pid_buf);
            let mut msg = [0u8; 1024];
            let n = read_all(&err_r, &mut msg);
            if got != 4 {
                let why = String::from_utf8_lossy(&msg[..n]).into_owned();
                return Err(format!(
                    "sandbox init did not start: {}",
                    if why.is_empty() { "no reason given" } else { &why }
                ));
            }
            let pid = u32::from_ne_bytes(pid_buf);
            if n > 0 {
                crate::resources::reap(Pid::from_raw(pid as i32), std::time::Duration::from_secs(2));
                return Err(format!("sandbox init failed: {}", String::from_utf8_lossy(&msg[..n])));
            }
            Ok(pid)
        }
    }
}

fn read_all(fd: &OwnedFd, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match nix::unistd::read(fd.as_raw_fd(), &mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    n
}

/// The middle child's side of the map handshake with the supervisor.
struct MapPipes {
    req: OwnedFd,
    done: OwnedFd,
    /// The mapping user namespace (crate::userns) for idmapped lower layers.
    mapping: Option<std::os::fd::BorrowedFd<'static>>,
}

/// Stage 1 of a jailed start, as host root: the network namespace (joined or made here, so it stays the
/// host's, crate::userns) with `lo` up; a private mount namespace with the idmapped lower layers, the overlay,
/// everything under /dev, /run and /tmp, and sysfs (which only a network namespace's owner may mount) mounted
/// (host paths need host root: `$CLADE_HOME` is 0700); the working directory in the new root; then the user
/// namespace, mapped by the supervisor, and root in it. The namespaces unshared after this belong to it.
fn enter_userns(spec: &InitSpec, overlay: &str, maps: &MapPipes, lowers: &[(PathBuf, PathBuf)]) -> Result<(), String> {
    join_or_make_netns(spec)?;
    clade_agent::netif::loopback_up().map_err(|e| format!("bring lo up: {e}"))?;
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare(CLONE_NEWNS): {e}"))?;
    m(None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;
    let ns = maps.mapping.ok_or("no mapping user namespace")?;
    for (src, target) in lowers {
        crate::userns::idmap_mount(src, target, ns).map_err(|e| {
            format!("idmapped mount of {} at {}: {e} (needs a kernel of 5.19 or newer and a file system that supports idmapped mounts: ext4, xfs, btrfs, tmpfs)", src.display(), target.display())
        })?;
    }
    host_mounts(spec, overlay, true)?;
    mount_sys(&spec.root)?;
    nix::unistd::chdir(&spec.root).map_err(|e| format!("chdir {}: {e}", spec.root.display()))?;
    unshare(CloneFlags::CLONE_NEWUSER).map_err(|e| format!("unshare(CLONE_NEWUSER): {e}"))?;
    nix::unistd::write(&maps.req, b"m").map_err(|e| format!("ask for the user namespace's maps: {e}"))?;
    let mut b = [0u8; 1];
    if read_all(&maps.done, &mut b) != 1 || b[0] != b'1' {
        return Err("the supervisor could not write the user namespace's maps".into());
    }
    nix::unistd::setgroups(&[]).map_err(|e| format!("setgroups: {e}"))?;
    let root_g = nix::unistd::Gid::from_raw(0);
    let root_u = nix::unistd::Uid::from_raw(0);
    nix::unistd::setresgid(root_g, root_g, root_g).map_err(|e| format!("setresgid(0): {e}"))?;
    nix::unistd::setresuid(root_u, root_u, root_u).map_err(|e| format!("setresuid(0): {e}"))?;
    Ok(())
}

/// Joins `spec.netns`, or unshares a new network namespace.
fn join_or_make_netns(spec: &InitSpec) -> Result<(), String> {
    match &spec.netns {
        None => unshare(CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare(CLONE_NEWNET): {e}")),
        Some(path) => std::fs::File::open(path)
            .map_err(|e| e.to_string())
            .and_then(|f| nix::sched::setns(f, CloneFlags::CLONE_NEWNET).map_err(|e| e.to_string()))
            .map_err(|e| format!("join network namespace {}: {e}", path.display())),
    }
}

/// The middle child: join the cgroup, unshare, fork the init, report its pid, exit.
fn middle(
    spec: &InitSpec,
    overlay: &str,
    argv: &[CString],
    env: &[CString],
    err_w: OwnedFd,
    pid_w: OwnedFd,
    maps: MapPipes,
) -> i32 {
    let fail = |msg: String| {
        let _ = nix::unistd::write(&err_w, msg.as_bytes());
        1
    };
    for procs in &spec.cgroup_procs {
        if let Err(e) = std::fs::write(procs, std::process::id().to_string()) {
            return fail(format!("join cgroup {}: {e}", procs.display()));
        }
    }
    let mut flags =
        CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC;
    if spec.jail.is_some() {
        // After joining the cgroups: the sandbox sees its own cgroup as the root of the hierarchy.
        flags |= CloneFlags::CLONE_NEWCGROUP;
    }
    if let Some(lowers) = &spec.userns {
        if let Err(e) = enter_userns(spec, overlay, &maps, lowers) {
            return fail(e);
        }
    }
    drop(maps);
    if spec.userns.is_none() {
        match &spec.netns {
            None => flags |= CloneFlags::CLONE_NEWNET,
            Some(_) => {
                if let Err(e) = join_or_make_netns(spec) {
                    return fail(e);
                }
            }
        }
    }
    if let Err(e) = unshare(flags) {
        return fail(format!("unshare: {e}"));
    }
    // SAFETY: as in `spawn_init`: the grandchild execs or `_exit`s.
    match unsafe { fork() } {
        Err(e) => fail(format!("fork init: {e}")),
        Ok(ForkResult::Child) => {
            drop(pid_w);
            let e = init_stage(spec, overlay, argv, env, &err_w);
            let _ = nix::unistd::write(&err_w, e.as_bytes());
            // SAFETY: see above.
            unsafe { libc::_exit(127) }
        }
        Ok(ForkResult::Parent { child }) => {
            let _ = nix::unistd::write(&pid_w, &(child.as_raw() as u32).to_ne_bytes());
            0
        }
    }
}

/// PID 1 of the new namespaces: returns only with the reason it could not exec.
fn init_stage(spec: &InitSpec, overlay: &str, argv: &[CString], env: &[CString], err_w: &OwnedFd) -> String {
    let jailed = prepare_root(spec, overlay, err_w).and_then(|()| match &spec.jail {
        Some(programs) => crate::jail::enter(programs, spec.no_new_privs),
        None => Ok(()),
    });
    match jailed {
        Err(e) => e,
        Ok(()) => match nix::unistd::execve(&argv[0], argv, env) {
            Err(e) => format!("exec {AGENT_PATH}: {e} (does the rootfs have the agent's libraries?)"),
            Ok(never) => match never {},
        },
    }
}

fn m(src: Option<&str>, target: &Path, fstype: Option<&str>, flags: MsFlags, data: Option<&str>) -> Result<(), String> {
    mount(src, target, fstype, flags, data).map_err(|e| format!("mount {} ({fstype:?}): {e}", target.display()))
}

/// Binds `dir` onto itself (making it a mount point of the overlay's own content), with `flags` added.
fn bind_self(dir: &Path, flags: MsFlags) -> Result<(), String> {
    m(Some(&dir.display().to_string()), dir, None, MsFlags::MS_BIND, None)?;
    if !flags.is_empty() {
        m(None, dir, None, MsFlags::MS_REMOUNT | MsFlags::MS_BIND | flags, None)?;
    }
    Ok(())
}

/// The sandbox's own directories in the still unmounted upper: /dev and /run opaque (empty whatever the
/// template's rootfs has there), /dev/shm world-writable with the sticky bit, as a tmpfs there would be.
fn seed_upper(upper: &Path, userns: bool) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    if userns {
        // The upper's root is the sandbox's `/`: root's inside.
        crate::userns::own(upper)?;
    }
    for (d, mode, opaque) in [("dev", 0o755, true), ("dev/shm", 0o1777, false), ("run", 0o755, true)] {
        let p = upper.join(d);
        std::fs::create_dir(&p).map_err(|e| format!("create {}: {e}", p.display()))?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("chmod {}: {e}", p.display()))?;
        if opaque {
            rustix::fs::setxattr(&p, OPAQUE_XATTR, b"y", rustix::fs::XattrFlags::empty()).map_err(|e| {
                format!(
                    "set {OPAQUE_XATTR} on {}: {e} (the upper must be on a filesystem with trusted xattrs)",
                    p.display()
                )
            })?;
        }
        if userns {
            crate::userns::own(&p)?;
        }
    }
    // This boot's id (docs/ct.md, "Boot id"): a fresh random UUID, read-only at /proc/sys/kernel/random/boot_id
    // inside, where the host kernel's own would otherwise show. A restore keeps the mark's (its processes go on
    // in the same boot, as a vm guest restored from memory does); a cold boot, a disk-only mark's included,
    // gets a new one.
    let dir = upper.join("run/clade");
    std::fs::create_dir(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let uuid = std::fs::read_to_string("/proc/sys/kernel/random/uuid").map_err(|e| format!("a fresh uuid: {e}"))?;
    let file = upper.join(BOOT_ID_FILE.trim_start_matches('/'));
    std::fs::write(&file, uuid.trim().to_string() + "\n").map_err(|e| format!("write {}: {e}", file.display()))?;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444))
        .map_err(|e| format!("chmod {}: {e}", file.display()))?;
    if userns {
        crate::userns::own(&dir)?;
        crate::userns::own(&file)?;
    }
    Ok(())
}

/// Where the sandbox's boot id is kept inside (bound read-only onto [`BOOT_ID_PROC`]).
pub const BOOT_ID_FILE: &str = "/run/clade/boot_id";
/// The kernel's boot id file, which the sandbox sees as its own.
pub const BOOT_ID_PROC: &str = "/proc/sys/kernel/random/boot_id";

/// overlayfs' mark of a directory that hides what the lower layers hold at its path.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// PID 1's mounts and the switch into the new root. In a user namespace the host-path mounts and sysfs were
/// made in stage 1 ([`enter_userns`]) and the working directory is the new root, so only proc (it needs the new
/// PID namespace) and the jail's paths are mounted here, by relative paths.
fn prepare_root(spec: &InitSpec, overlay: &str, err_w: &OwnedFd) -> Result<(), String> {
    nix::unistd::setsid().map_err(|e| format!("setsid: {e}"))?;
    nix::unistd::sethostname(&spec.hostname).map_err(|e| format!("sethostname: {e}"))?;
    let root = if spec.userns.is_some() {
        crate::userns::rebind_cwd().map_err(|e| format!("bind the new root onto itself: {e}"))?;
        PathBuf::from(".")
    } else {
        m(None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;
        host_mounts(spec, overlay, false)?;
        spec.root.clone()
    };
    let proc = root.join("proc");
    std::fs::create_dir_all(&proc).map_err(|e| format!("create {}: {e}", proc.display()))?;
    m(Some("proc"), &proc, Some("proc"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, None)?;
    if spec.jail.is_some() {
        if spec.userns.is_none() {
            mount_sys(&root)?;
        }
        jail_paths(&root)?;
    }
    // After the jail's read-only /proc/sys, which would cover it.
    let (boot_src, boot_proc) =
        (root.join(BOOT_ID_FILE.trim_start_matches('/')), root.join(BOOT_ID_PROC.trim_start_matches('/')));
    m(Some(&boot_src.display().to_string()), &boot_proc, None, MsFlags::MS_BIND, None)?;
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    m(None, &boot_proc, None, MsFlags::MS_REMOUNT | MsFlags::MS_BIND | ro, None)?;
    if spec.userns.is_none() {
        // The jail takes CAP_NET_ADMIN away: the loopback interface comes up here (the agent then finds it
        // up). In a user namespace stage 1 did it: the network namespace is the host's.
        clade_agent::netif::loopback_up().map_err(|e| format!("bring lo up: {e}"))?;
    }
    nix::unistd::chdir(&root).map_err(|e| format!("chdir {}: {e}", root.display()))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| format!("pivot_root: {e}"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| format!("detach the old root: {e}"))?;
    nix::unistd::chdir("/").map_err(|e| format!("chdir /: {e}"))?;
    reopen_stdio()?;
    close_inherited(err_w.as_raw_fd());
    Ok(())
}

/// A directory in the new root made by the host; in a user namespace it is chowned to the sandbox's root.
fn host_dir(d: &Path, userns: bool) -> Result<(), String> {
    if !d.exists() {
        std::fs::create_dir_all(d).map_err(|e| format!("create {}: {e}", d.display()))?;
        if userns {
            crate::userns::own(d)?;
        }
    }
    Ok(())
}

/// The mounts on host paths: the overlay root, /dev with the host's devices bound in, devpts, /dev/shm, /tmp
/// and /run bound onto themselves.
fn host_mounts(spec: &InitSpec, overlay: &str, userns: bool) -> Result<(), String> {
    let root = &spec.root;
    let jail = spec.jail.is_some();
    // Jailed, every mount the sandbox can write is nodev: a device node it makes cannot be opened.
    let nodev = if jail { MsFlags::MS_NODEV } else { MsFlags::empty() };
    m(Some("overlay"), root, Some("overlay"), nodev, Some(overlay))?;
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    let dir = |p: &str| {
        let d = root.join(p);
        host_dir(&d, userns)?;
        Ok::<PathBuf, String>(d)
    };
    let dev = root.join("dev");
    bind_self(&dev, MsFlags::MS_NOSUID | nodev)?;
    for d in DEVICES {
        let target = dev.join(d);
        std::fs::File::create(&target).map_err(|e| format!("create {}: {e}", target.display()))?;
        m(Some(&format!("/dev/{d}")), &target, None, MsFlags::MS_BIND, None)?;
    }
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let _ = std::os::unix::fs::symlink(to, dev.join(link));
    }
    dir("dev/pts")?;
    m(
        Some("devpts"),
        &dev.join("pts"),
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    bind_self(&dev.join("shm"), nosuid)?;
    // /tmp is the overlay's own /tmp, bound onto itself for the same reason as the others.
    bind_self(&dir("tmp")?, nodev)?;
    bind_self(&root.join("run"), nosuid)?;
    dir("run/clade")?;
    Ok(())
}

/// The jail's paths (crate::jail): the masked paths behind the agent layer's empty file and
/// directory (read-only binds), the read-only paths bound read-only onto themselves. A path this kernel does
/// not have is skipped.
fn jail_paths(root: &Path) -> Result<(), String> {
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let inside = |p: &str| root.join(p.trim_start_matches('/'));
    let masks = crate::jail::MASKED_FILES
        .iter()
        .map(|p| (p, EMPTY_FILE))
        .chain(crate::jail::MASKED_DIRS.iter().map(|p| (p, EMPTY_DIR)));
    for (path, empty) in masks {
        let target = inside(path);
        if target.exists() {
            m(Some(&inside(empty).display().to_string()), &target, None, MsFlags::MS_BIND, None)?;
            m(None, &target, None, MsFlags::MS_REMOUNT | MsFlags::MS_BIND | ro, None)?;
        }
    }
    for path in crate::jail::READ_ONLY {
        let target = inside(path);
        if target.exists() {
            bind_self(&target, ro)?;
        }
    }
    Ok(())
}

/// sysfs, read-only, of the caller's network namespace.
fn mount_sys(root: &Path) -> Result<(), String> {
    let sys = root.join("sys");
    std::fs::create_dir_all(&sys).map_err(|e| format!("create {}: {e}", sys.display()))?;
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    m(Some("sysfs"), &sys, Some("sysfs"), ro, None)
}

/// An empty file and an empty directory in the agent's read-only layer: what masked paths are covered with.
pub const EMPTY_FILE: &str = "/usr/lib/clade/empty";
pub const EMPTY_DIR: &str = "/usr/lib/clade/empty.d";

fn reopen_stdio() -> Result<(), String> {
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::Mode;
    let null = open("/dev/null", OFlag::O_RDONLY, Mode::empty()).map_err(|e| format!("open /dev/null: {e}"))?;
    let log = open(CONSOLE_PATH, OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_APPEND, Mode::from_bits_truncate(0o600))
        .map_err(|e| format!("open {CONSOLE_PATH}: {e}"))?;
    for (from, to) in [(null, 0), (log, 1), (log, 2)] {
        nix::unistd::dup2(from, to).map_err(|e| format!("dup2: {e}"))?;
    }
    for fd in [null, log] {
        if fd > 2 {
            let _ = nix::unistd::close(fd);
        }
    }
    Ok(())
}

fn close_inherited(keep: i32) {
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    for fd in fds {
        if fd > 2 && fd != keep {
            let _ = nix::unistd::close(fd);
        }
    }
}
