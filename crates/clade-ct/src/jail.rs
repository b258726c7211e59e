//! The ct jail: what a sandbox's processes may do on the host's kernel, set up in the sandbox's init before it
//! execs the agent and then inherited by every process in the sandbox (the agent, its commands, services).
//! CRIU dumps and restores all of it per task (capability sets, `no_new_privs`, seccomp filters), so a restored
//! sibling carries the jail of the cold start its mark came from; [`POLICY`] names this policy in every mark,
//! and a restore refuses a mark taken under another one (a mark from before the jail would come back unjailed).
//!
//! The policy is the one Docker applies by default (docs/security.md compares them), stated here as rules:
//! * **Capabilities**: the bounding, permitted, effective and inheritable sets are [`KEEP_CAPS`] (Docker's 14),
//!   the ambient set empty. Without CAP_SYS_ADMIN nothing in the sandbox can mount (devtmpfs, cgroup, proc),
//!   unshare or setns; without CAP_SYS_MODULE, SYS_TIME, SYS_RAWIO, DAC_READ_SEARCH, BPF it cannot load
//!   modules, set the host's clock, poke I/O ports, open files by handle or load BPF.
//! * **`no_new_privs`**: no exec gains privileges (setuid binaries, file capabilities).
//! * **seccomp**: an allow-list ([`ALLOWED`]): everything else fails with EPERM, `clone` with namespace flags
//!   too; `clone3` fails with ENOSYS so that glibc falls back to `clone`, whose flags the filter can read.
//!   Refused among others: mount and friends, bpf, keyctl/add_key/request_key, perf_event_open, io_uring,
//!   userfaultfd, open_by_handle_at, clock setting, module loading, kexec, reboot, swap, quotactl, acct.
//!   The filter is built with `seccompiler` (Firecracker's crate): no hand-written BPF.
//! * **Paths** (set up by `crate::spawn`): [`MASKED`] hidden behind an empty read-only file or directory,
//!   [`READ_ONLY`] re-bound read-only, /sys mounted read-only, every writable mount `nodev` (a device node the
//!   sandbox makes cannot be opened), a cgroup namespace.
//! * **Limits** (set by `crate::resources`): memory, pids, CPU quota from the template's shape; on cgroup v1
//!   a devices cgroup with the [`crate::resources`] allow-list.

use std::collections::BTreeMap;

use caps::Capability;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// The jail policy's name, recorded in every ct mark (`compat["jail"]`) and checked on restore.
pub const POLICY: &str = "docker-default-2-userns";

/// The capabilities a sandbox keeps: Docker's default set.
pub const KEEP_CAPS: [Capability; 14] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_MKNOD,
    Capability::CAP_NET_RAW,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// The capability bit mask of [`KEEP_CAPS`] (what `/proc/PID/status` shows as CapBnd/CapEff in a sandbox).
pub fn keep_mask() -> u64 {
    KEEP_CAPS.iter().fold(0u64, |m, c| m | c.bitmask())
}

/// Files hidden behind an empty read-only file (runc's default masked paths that are files).
pub const MASKED_FILES: [&str; 5] =
    ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/latency_stats"];
/// Directories hidden behind an empty read-only directory.
pub const MASKED_DIRS: [&str; 3] = ["/proc/scsi", "/proc/acpi", "/sys/firmware"];
/// Every masked path (for the audit).
pub fn masked() -> impl Iterator<Item = &'static str> {
    MASKED_FILES.iter().chain(MASKED_DIRS.iter()).copied()
}
/// Bound read-only onto themselves (runc's default read-only paths); /sys is mounted read-only as a whole.
pub const READ_ONLY: [&str; 5] = ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs"];

/// Namespace flags `clone` may not carry (CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET).
const CLONE_NS_FLAGS: u64 = 0x7E02_0000;

/// The system calls a sandbox may make (x86_64 names): Docker's default profile's unconditional list (moby's
/// `profiles/seccomp/default.json`, compared 2026-12-04) less adjtimex and clock_adjtime (the sandbox's clock is
/// the host's), io_uring (which CRIU cannot dump), memfd_secret (likewise) and modify_ldt; the calls Docker
/// allows only with a capability the sandbox lacks are left out. `socket`, `clone` and `personality` are allowed
/// with argument checks in [`programs`].
#[rustfmt::skip]
pub const ALLOWED: &[i64] = &[
    libc::SYS_accept, libc::SYS_accept4, libc::SYS_access, libc::SYS_alarm, libc::SYS_arch_prctl,
    libc::SYS_bind, libc::SYS_brk, libc::SYS_capget, libc::SYS_capset, libc::SYS_chdir, libc::SYS_chmod,
    libc::SYS_chown, libc::SYS_chroot, libc::SYS_clock_getres, libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep, libc::SYS_close, libc::SYS_close_range, libc::SYS_connect,
    libc::SYS_copy_file_range, libc::SYS_creat, libc::SYS_dup, libc::SYS_dup2, libc::SYS_dup3,
    libc::SYS_epoll_create, libc::SYS_epoll_create1, libc::SYS_epoll_ctl, libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2, libc::SYS_epoll_wait, libc::SYS_eventfd, libc::SYS_eventfd2, libc::SYS_execve,
    libc::SYS_execveat, libc::SYS_exit, libc::SYS_exit_group, libc::SYS_faccessat, libc::SYS_faccessat2,
    libc::SYS_fadvise64, libc::SYS_fallocate, libc::SYS_fanotify_mark, libc::SYS_fchdir, libc::SYS_fchmod,
    libc::SYS_fchmodat, libc::SYS_fchown, libc::SYS_fchownat, libc::SYS_fcntl, libc::SYS_fdatasync,
    libc::SYS_fgetxattr, libc::SYS_flistxattr, libc::SYS_flock, libc::SYS_fork, libc::SYS_fremovexattr,
    libc::SYS_fsetxattr, libc::SYS_fstat, libc::SYS_fstatfs, libc::SYS_fsync, libc::SYS_ftruncate,
    libc::SYS_futex, libc::SYS_futex_waitv, libc::SYS_futimesat, libc::SYS_get_robust_list,
    libc::SYS_get_thread_area, libc::SYS_getcpu, libc::SYS_getcwd, libc::SYS_getdents, libc::SYS_getdents64,
    libc::SYS_getegid, libc::SYS_geteuid, libc::SYS_getgid, libc::SYS_getgroups, libc::SYS_getitimer,
    libc::SYS_getpeername, libc::SYS_getpgid, libc::SYS_getpgrp, libc::SYS_getpid, libc::SYS_getppid,
    libc::SYS_getpriority, libc::SYS_getrandom, libc::SYS_getresgid, libc::SYS_getresuid, libc::SYS_getrlimit,
    libc::SYS_getrusage, libc::SYS_getsid, libc::SYS_getsockname, libc::SYS_getsockopt, libc::SYS_gettid,
    libc::SYS_gettimeofday, libc::SYS_getuid, libc::SYS_getxattr, libc::SYS_inotify_add_watch,
    libc::SYS_inotify_init, libc::SYS_inotify_init1, libc::SYS_inotify_rm_watch, libc::SYS_io_cancel,
    libc::SYS_io_destroy, libc::SYS_io_getevents, 333, // io_pgetevents (not named by libc)
    libc::SYS_io_setup,
    libc::SYS_io_submit, libc::SYS_ioctl, libc::SYS_ioprio_get, libc::SYS_ioprio_set, libc::SYS_kill,
    libc::SYS_landlock_add_rule, libc::SYS_landlock_create_ruleset, libc::SYS_landlock_restrict_self,
    libc::SYS_lchown, libc::SYS_lgetxattr, libc::SYS_link, libc::SYS_linkat, libc::SYS_listen,
    libc::SYS_listxattr, libc::SYS_llistxattr, libc::SYS_lremovexattr, libc::SYS_lseek, libc::SYS_lsetxattr,
    libc::SYS_lstat, libc::SYS_madvise, libc::SYS_membarrier, libc::SYS_memfd_create, libc::SYS_mincore,
    libc::SYS_mkdir, libc::SYS_mkdirat, libc::SYS_mknod, libc::SYS_mknodat, libc::SYS_mlock, libc::SYS_mlock2,
    libc::SYS_mlockall, libc::SYS_mmap, libc::SYS_mprotect, libc::SYS_mq_getsetattr, libc::SYS_mq_notify,
    libc::SYS_mq_open, libc::SYS_mq_timedreceive, libc::SYS_mq_timedsend, libc::SYS_mq_unlink,
    libc::SYS_mremap, libc::SYS_msgctl, libc::SYS_msgget, libc::SYS_msgrcv, libc::SYS_msgsnd, libc::SYS_msync,
    libc::SYS_munlock, libc::SYS_munlockall, libc::SYS_munmap, libc::SYS_name_to_handle_at, libc::SYS_nanosleep, libc::SYS_newfstatat,
    libc::SYS_open, libc::SYS_openat, libc::SYS_openat2, libc::SYS_pause, libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal, libc::SYS_pipe, libc::SYS_pipe2, libc::SYS_pkey_alloc, libc::SYS_pkey_free,
    libc::SYS_pkey_mprotect, libc::SYS_poll, libc::SYS_ppoll, libc::SYS_prctl, libc::SYS_pread64,
    libc::SYS_preadv, libc::SYS_preadv2, libc::SYS_prlimit64, libc::SYS_process_mrelease,
    libc::SYS_process_vm_readv, libc::SYS_process_vm_writev, libc::SYS_pselect6, libc::SYS_ptrace,
    libc::SYS_pwrite64, libc::SYS_pwritev, libc::SYS_pwritev2, libc::SYS_read, libc::SYS_readahead,
    libc::SYS_readlink, libc::SYS_readlinkat, libc::SYS_readv, libc::SYS_recvfrom, libc::SYS_recvmmsg,
    libc::SYS_recvmsg, libc::SYS_remap_file_pages, libc::SYS_removexattr, libc::SYS_rename, libc::SYS_renameat,
    libc::SYS_renameat2, libc::SYS_restart_syscall, libc::SYS_rseq, libc::SYS_rt_sigaction,
    libc::SYS_rt_sigpending, libc::SYS_rt_sigprocmask, libc::SYS_rt_sigqueueinfo, libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigsuspend, libc::SYS_rt_sigtimedwait, libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_sched_get_priority_max, libc::SYS_sched_get_priority_min, libc::SYS_sched_getaffinity,
    libc::SYS_sched_getattr, libc::SYS_sched_getparam, libc::SYS_sched_getscheduler,
    libc::SYS_sched_rr_get_interval, libc::SYS_sched_setaffinity, libc::SYS_sched_setattr,
    libc::SYS_sched_setparam, libc::SYS_sched_setscheduler, libc::SYS_sched_yield, libc::SYS_seccomp,
    libc::SYS_select, libc::SYS_semctl, libc::SYS_semget, libc::SYS_semop, libc::SYS_semtimedop,
    libc::SYS_sendfile, libc::SYS_sendmmsg, libc::SYS_sendmsg, libc::SYS_sendto, libc::SYS_set_robust_list,
    libc::SYS_set_thread_area, libc::SYS_set_tid_address, libc::SYS_setfsgid,
    libc::SYS_setfsuid, libc::SYS_setgid, libc::SYS_setgroups, libc::SYS_setitimer,
    libc::SYS_setpgid, libc::SYS_setpriority, libc::SYS_setregid, libc::SYS_setresgid, libc::SYS_setresuid,
    libc::SYS_setreuid, libc::SYS_setrlimit, libc::SYS_setsid, libc::SYS_setsockopt, libc::SYS_setuid,
    libc::SYS_setxattr, libc::SYS_shmat, libc::SYS_shmctl, libc::SYS_shmdt, libc::SYS_shmget,
    libc::SYS_shutdown, libc::SYS_sigaltstack, libc::SYS_signalfd, libc::SYS_signalfd4, 
    libc::SYS_socketpair, libc::SYS_splice, libc::SYS_stat, libc::SYS_statfs, libc::SYS_statx,
    libc::SYS_symlink, libc::SYS_symlinkat, libc::SYS_sync, libc::SYS_sync_file_range, libc::SYS_syncfs,
    libc::SYS_sysinfo, libc::SYS_tee, libc::SYS_tgkill, libc::SYS_time, libc::SYS_timer_create,
    libc::SYS_timer_delete, libc::SYS_timer_getoverrun, libc::SYS_timer_gettime, libc::SYS_timer_settime,
    libc::SYS_timerfd_create, libc::SYS_timerfd_gettime, libc::SYS_timerfd_settime, libc::SYS_times,
    libc::SYS_tkill, libc::SYS_truncate, libc::SYS_umask, libc::SYS_uname, libc::SYS_unlink, libc::SYS_unlinkat,
    libc::SYS_utime, libc::SYS_utimensat, libc::SYS_utimes, libc::SYS_vfork, libc::SYS_vmsplice,
    libc::SYS_wait4, libc::SYS_waitid, libc::SYS_write, libc::SYS_writev,
    // clone3 and the rest of NOT_IMPLEMENTED are allowed by the allow-list and answered ENOSYS by the first
    // filter (see `programs`).
    // Newer than Debian 12's glibc, used by newer ones (fchmodat2 by glibc 2.39's fchmodat): as harmless as
    // their older forms. Numbers, since libc does not name them all.
    451, // cachestat
    libc::SYS_fchmodat2,
    453, // map_shadow_stack
    454, 455, 456, // futex_wake, futex_wait, futex_requeue
    libc::SYS_mseal,
    463, 464, 465, 466, // setxattrat, getxattrat, listxattrat, removexattrat
];

/// System calls answered ENOSYS instead of EPERM: `clone3` (see [`programs`]), and ones newer than this list
/// that the policy leaves out, so that a C library that tries one falls back to an older call instead of
/// failing (runc returns ENOSYS for syscalls newer than its profile for the same reason).
pub const NOT_IMPLEMENTED: &[i64] = &[
    libc::SYS_clone3,
    457,
    458, // statmount, listmount
    459,
    460,
    461, // lsm_get_self_attr, lsm_set_self_attr, lsm_list_modules
    467,
    468,
    469, // open_tree_attr, file_getattr, file_setattr
];

/// `personality` values Docker allows (Linux default, and the 32-bit / ADDR_NO_RANDOMIZE variants; a query).
const PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

fn target() -> Result<seccompiler::TargetArch, String> {
    std::env::consts::ARCH.try_into().map_err(|e| format!("seccomp: this architecture has no filter: {e:?}"))
}

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, value).map_err(|e| format!("seccomp condition: {e}"))
}

/// The two filters every sandbox process carries, in install order: first [`NOT_IMPLEMENTED`] -> ENOSYS
/// (everything else allowed), then the allow-list (everything else EPERM). The kernel runs both and takes the stricter answer.
/// Built before the fork: the child only installs them.
pub fn programs() -> Result<Vec<BpfProgram>, String> {
    let arch = target()?;
    let to_prog = |f: SeccompFilter| -> Result<BpfProgram, String> {
        f.try_into().map_err(|e: seccompiler::BackendError| format!("seccomp: {e}"))
    };
    let enosys: BTreeMap<i64, Vec<SeccompRule>> = NOT_IMPLEMENTED.iter().map(|&nr| (nr, vec![])).collect();
    let first = SeccompFilter::new(enosys, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch)
        .map_err(|e| format!("seccomp: {e}"))?;
    // The kernel runs every filter and keeps the strictest action, and among equal ones the data of the filter
    // installed last: so what the first answers ENOSYS, the allow-list must allow, or its EPERM would win.
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().chain(NOT_IMPLEMENTED).map(|&nr| (nr, vec![])).collect();
    let rule = |c: Vec<SeccompCondition>| SeccompRule::new(c).map_err(|e| format!("seccomp rule: {e}"));
    rules.insert(libc::SYS_clone, vec![rule(vec![cond(0, SeccompCmpOp::MaskedEq(CLONE_NS_FLAGS), 0)?])?]);
    let personality =
        PERSONALITIES.iter().map(|&p| rule(vec![cond(0, SeccompCmpOp::Eq, p)?])).collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_personality, personality);
    // Every address family but AF_VSOCK (the host's vsock services), as Docker's profile.
    rules.insert(libc::SYS_socket, vec![rule(vec![cond(0, SeccompCmpOp::Ne, libc::AF_VSOCK as u64)?])?]);
    let second = SeccompFilter::new(rules, SeccompAction::Errno(libc::EPERM as u32), SeccompAction::Allow, arch)
        .map_err(|e| format!("seccomp: {e}"))?;
    Ok(vec![to_prog(first)?, to_prog(second)?])
}

/// In the sandbox's init, after its mounts and just before exec: reduce the capability sets to
/// [`KEEP_CAPS`], set `no_new_privs` and install `programs` (built before the fork).
///
/// Without `no_new_privs` (a template's `[jail] no_new_privs = false`, for `sudo`), the filters go in first,
/// while the init still holds CAP_SYS_ADMIN in the sandbox's user namespace (the kernel's condition for a
/// filter without the flag), then the capabilities are cut as always. A setuid program then gains at most
/// [`KEEP_CAPS`] (the bounding set) in that namespace: what the sandbox's root has anyway.
pub fn enter(programs: &[BpfProgram], no_new_privs: bool) -> Result<(), String> {
    if !no_new_privs {
        for p in programs {
            install_without_no_new_privs(p)?;
        }
    }
    let keep: caps::CapsHashSet = KEEP_CAPS.iter().copied().collect();
    for c in caps::all() {
        if !keep.contains(&c) {
            caps::drop(None, caps::CapSet::Bounding, c).map_err(|e| format!("drop {c} from the bounding set: {e}"))?;
        }
    }
    caps::clear(None, caps::CapSet::Ambient).map_err(|e| format!("clear ambient capabilities: {e}"))?;
    for set in [caps::CapSet::Inheritable, caps::CapSet::Effective, caps::CapSet::Permitted] {
        caps::set(None, set, &keep).map_err(|e| format!("set {set:?} capabilities: {e}"))?;
    }
    if no_new_privs {
        for p in programs {
            // Sets no_new_privs first, then seccomp(SECCOMP_SET_MODE_FILTER).
            seccompiler::apply_filter(p).map_err(|e| format!("install the seccomp filter: {e}"))?;
        }
    }
    Ok(())
}

/// seccomp(SECCOMP_SET_MODE_FILTER) of one program without setting `no_new_privs` first (seccompiler's
/// `apply_filter` always sets it). The kernel accepts it only from a task with CAP_SYS_ADMIN in its user
/// namespace.
fn install_without_no_new_privs(p: &BpfProgram) -> Result<(), String> {
    if p.is_empty() || p.len() > u16::MAX as usize {
        return Err(format!("seccomp: a program of {} instructions", p.len()));
    }
    let prog = libc::sock_fprog { len: p.len() as u16, filter: p.as_ptr() as *mut libc::sock_filter };
    // SAFETY: `prog` points at `p`'s instructions, which outlive the call; `BpfProgram` is a Vec of
    // `sock_filter`-layout instructions (seccompiler's own `apply_filter` passes it the same way). The
    // kernel copies the program and keeps no pointer into it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0 as libc::c_ulong,
            &prog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(format!("install the seccomp filter (without no_new_privs): {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The environment variable that turns the jail off, named so that nobody sets it by accident: a sandbox
/// started with it is host root (docs/security.md). Only `1` counts.
pub const UNJAILED_ENV: &str = "CLADE_CT_UNJAILED_INSECURE";

/// One thing the jail needs from this host: `Ok(what was found)` or `Err((what is missing, how to get it))`.
pub type Support = (&'static str, Result<String, (String, String)>);

/// What this host offers the jail: seccomp filters, the cgroup controllers for the limits (and v1's devices
/// controller), cgroup namespaces, `openat2` for resolving paths inside a sandbox.
pub fn host_support() -> Vec<Support> {
    let mut out: Vec<Support> = Vec::new();
    let actions = std::fs::read_to_string("/proc/sys/kernel/seccomp/actions_avail").unwrap_or_default();
    out.push((
        "seccomp",
        if actions.split_whitespace().any(|a| a == "errno") {
            Ok("seccomp filters (errno action)".into())
        } else {
            Err(("no seccomp filters in this kernel".into(), "a kernel with CONFIG_SECCOMP_FILTER".into()))
        },
    ));
    let v2 = clade_core::host::cgroup_version() == Some("v2");
    let missing: Vec<&str> = if v2 {
        let have = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").unwrap_or_default();
        ["memory", "pids", "cpu"].into_iter().filter(|c| !have.split_whitespace().any(|h| h == *c)).collect()
    } else {
        ["memory", "pids", "cpu", "devices"]
            .into_iter()
            .filter(|c| !std::path::Path::new("/sys/fs/cgroup").join(c).join("cgroup.procs").exists())
            .collect()
    };
    out.push((
        "cgroup-controllers",
        if missing.is_empty() {
            Ok(format!("{} memory, pids, cpu{}", if v2 { "v2" } else { "v1" }, if v2 { "" } else { ", devices" }))
        } else {
            Err((
                format!("cgroup controllers missing: {}", missing.join(", ")),
                if v2 {
                    "enable them in /sys/fs/cgroup/cgroup.subtree_control (or boot with them)".into()
                } else {
                    format!("mount them under /sys/fs/cgroup ({})", missing.join(", "))
                },
            ))
        },
    ));
    out.push((
        "cgroup-ns",
        if std::path::Path::new("/proc/self/ns/cgroup").exists() {
            Ok("cgroup namespaces".into())
        } else {
            Err(("no cgroup namespaces".into(), "a kernel with CONFIG_CGROUPS and namespaces (4.6 or newer)".into()))
        },
    ));
    let openat2 = rustix::fs::openat2(
        rustix::fs::CWD,
        "/",
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
        rustix::fs::ResolveFlags::IN_ROOT,
    );
    out.push((
        "openat2",
        match openat2 {
            Ok(_) => Ok("openat2 with RESOLVE_IN_ROOT".into()),
            Err(e) => Err((format!("openat2: {e}"), "a kernel of 5.6 or newer".into())),
        },
    ));
    out.push((
        "user namespace",
        match crate::userns::mapping_namespace() {
            Ok(_) => Ok(format!("sandbox root is host uid {} (crate::userns)", crate::userns::BASE)),
            Err(e) => Err((
                e,
                "a kernel with CONFIG_USER_NS and user.max_user_namespaces above 0 (and no LSM policy denying them)"
                    .into(),
            )),
        },
    ));
    out
}

/// Refuse to run without the jail: names every missing part, how to get it, and the way around it.
pub fn check_host() -> Result<(), String> {
    refusal(host_support())
}

fn refusal(support: Vec<Support>) -> Result<(), String> {
    let missing: Vec<String> = support
        .into_iter()
        .filter_map(|(name, r)| r.err().map(|(what, fix)| format!("{name}: {what} (fix: {fix})")))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "this host cannot jail ct sandboxes: {}. Fix that, or set {UNJAILED_ENV}=1 to run sandboxes that are \
         NOT a security boundary (their root is host root)",
        missing.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_mask_is_dockers_default() {
        // CHOWN 0, DAC_OVERRIDE 1, FOWNER 3, FSETID 4, KILL 5, SETGID 6, SETUID 7, SETPCAP 8,
        // NET_BIND_SERVICE 10, NET_RAW 13, SYS_CHROOT 18, MKNOD 27, AUDIT_WRITE 29, SETFCAP 31.
        assert_eq!(keep_mask(), 0x0000_0000_a804_25fb);
    }

    #[test]
    fn dangerous_syscalls_are_not_allowed() {
        for nr in [
            libc::SYS_mount,
            libc::SYS_umount2,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_bpf,
            libc::SYS_keyctl,
            libc::SYS_add_key,
            libc::SYS_request_key,
            libc::SYS_perf_event_open,
            libc::SYS_io_uring_setup,
            libc::SYS_userfaultfd,
            libc::SYS_open_by_handle_at,
            libc::SYS_clock_settime,
            libc::SYS_settimeofday,
            libc::SYS_adjtimex,
            libc::SYS_clock_adjtime,
            libc::SYS_init_module,
            libc::SYS_finit_module,
            libc::SYS_delete_module,
            libc::SYS_kexec_load,
            libc::SYS_reboot,
            libc::SYS_swapon,
            libc::SYS_pivot_root,
            libc::SYS_fsopen,
            libc::SYS_move_mount,
            libc::SYS_open_tree,
            libc::SYS_sethostname,
            libc::SYS_setdomainname,
            libc::SYS_memfd_secret,
            libc::SYS_modify_ldt,
        ] {
            assert!(!ALLOWED.contains(&nr), "syscall {nr} must not be on the allow-list");
        }
    }

    #[test]
    fn a_host_that_cannot_jail_is_refused_naming_what_and_how() {
        let support: Vec<Support> = vec![
            ("seccomp", Ok("seccomp filters".into())),
            ("cgroup-controllers", Err(("cgroup controllers missing: pids".into(), "mount them".into()))),
        ];
        let e = refusal(support).unwrap_err();
        assert!(e.contains("cgroup controllers missing: pids") && e.contains("fix: mount them"), "{e}");
        assert!(e.contains(UNJAILED_ENV) && e.contains("NOT a security boundary"), "{e}");
        assert!(!e.contains("seccomp"), "only what is missing is named: {e}");
    }

    #[test]
    fn this_host_can_jail() {
        // The project's own machines can (./x setup needs nothing more); a failure names what is missing.
        check_host().expect("jail support");
    }

    #[test]
    fn newer_calls_are_allowed_or_not_implemented_never_eperm_by_default() {
        // A newer glibc's fchmodat uses fchmodat2: EPERM there would fail chmod instead of falling back.
        assert!(ALLOWED.contains(&libc::SYS_fchmodat2));
        for nr in NOT_IMPLEMENTED {
            assert!(!ALLOWED.contains(nr), "{nr} is on both lists");
        }
        // open_tree_attr belongs to the mount API: refused either way, never allowed.
        assert!(!ALLOWED.contains(&467));
    }

    #[test]
    fn filters_build() {
        let p = programs().expect("filters");
        assert_eq!(p.len(), 2);
        // The BPF program limit is 4096 instructions.
        assert!(p.iter().all(|p| !p.is_empty() && p.len() < 4096), "{:?}", p.iter().map(Vec::len).collect::<Vec<_>>());
    }
}
