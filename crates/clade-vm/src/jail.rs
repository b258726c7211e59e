//! The jail every QEMU of the `vm` backend runs in: Firecracker's jailer model, with what QEMU 7.2 offers
//! itself (docs/vm.md, "The jail").
//!
//! - **One uid per sandbox**: `0x7A000000 + slot` (65536 slots, gid = uid), claimed by a lock file created with
//!   `O_EXCL` in `$CLADE_HOME/run/.vm-uids/<slot>` that names its owner (pid and start time) and is removed when
//!   the [`crate::machine::Vm`] is dropped, after its QEMU is dead. A slot whose owner is dead and whose uid no
//!   process runs as is taken over. A compromised QEMU thus cannot read another sandbox's RAM file (root's,
//!   0600) nor ptrace another QEMU (another uid).
//! - QEMU opens everything it needs (kernel, initrd, RAM file, sockets, console log, the NBD connection) as root
//!   at start, then `-chroot`s into an empty directory of its gid and `-runas`'s the sandbox's uid, under its own
//!   seccomp filter ([`SANDBOX_OPTS`]).
//! - Before exec (in the forked child): the QEMU gets its own mount namespace (every mount a slave of the
//!   host's, the other sandboxes' mounts detached), an empty network namespace unless its guest has egress
//!   (then the sandbox's own, joined first: [`join_netns`]; user-mode networking runs inside QEMU),
//!   `no_new_privs`, and a bounding set of only the three
//!   capabilities `-runas` and `-chroot` use ([`KEPT_CAPS`]). Right after exec it is moved into its cgroup
//!   ([`Jailed::enter_cgroup`]).
//!
//! The cgroup is `clade_core::cgroup::Cgroup`, the one the ct backend uses (`clade/<sandbox>` per controller,
//! so the audit finds leftovers of both).

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The first uid of the range sandbox QEMUs run as (no `/etc/passwd` entry: `-runas UID:GID`).
pub const UID_BASE: u32 = 0x7A00_0000;
/// How many sandbox uids there are (so at most this many jailed QEMUs at once on a host).
pub const UID_SLOTS: u32 = 65536;

/// QEMU's own seccomp filter. `elevateprivileges` is left at allow: QEMU 7.2 installs the filter *before*
/// `-runas` calls setgid/setuid, so `elevateprivileges=deny` kills it at start with SIGSYS (`Bad system call`,
/// exit 159, measured on QEMU 7.2.22). Nothing is lost: after the setuid QEMU is an unprivileged uid with no
/// capabilities (permitted, effective and ambient empty, a bounding set of three) and `no_new_privs`, so a
/// set*id call can only move between its own ids, and exec is refused (`spawn=deny`) in any case.
pub const SANDBOX_OPTS: &str = "on,obsolete=deny,spawn=deny,resourcecontrol=deny";

const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;
const CAP_SYS_CHROOT: u32 = 18;
/// The capability bounding set QEMU is exec'd with: what `-runas` (setgroups, setgid, setuid) and `-chroot`
/// need. Everything it opens at start it opens as uid 0, the owner of those files, with no other capability
/// (no DAC override); after the setuid it has none at all.
pub const KEPT_CAPS: [u32; 3] = [CAP_SETGID, CAP_SETUID, CAP_SYS_CHROOT];

/// The largest file clade takes out of a jail (device state is kilobytes; a compromised QEMU could write more).
const MAX_JAIL_FILE: u64 = 256 << 20;

/// How a QEMU is jailed (the policy; what one QEMU holds is [`Jailed`]).
#[derive(Debug, Clone)]
pub struct VmJail {
    /// Where uid slots are claimed (`$CLADE_HOME/run/.vm-uids`).
    pub uids_dir: PathBuf,
    /// The QEMU's own cgroup (`None`: it stays in its parent's).
    pub cgroup: Option<CgroupPlan>,
    /// Mounts at or below these directories are detached from the QEMU's mount namespace (other sandboxes'
    /// lazy RAM and tree mounts, ct overlays), except those holding a file it opens: a copy of the host's
    /// mounts would otherwise keep them (and their memory) alive for as long as the QEMU runs.
    pub detach_mounts_under: Vec<PathBuf>,
}

/// A cgroup to create for one QEMU.
#[derive(Debug, Clone)]
pub struct CgroupPlan {
    /// `clade/<name>` in each controller (the sandbox id).
    pub name: String,
    pub limits: VmLimits,
}

/// A QEMU's cgroup limits (the cgroup type is clade-core's, shared with the ct backend).
pub type VmLimits = clade_core::cgroup::Limits;

/// The limits of a QEMU running a guest of `memory_mib` and `vcpus`: memory twice the guest's RAM plus 256 MiB
/// (QEMU itself, a cold guest's shared RAM file charged to it, a clone's private copies), plus the TCG
/// translation cache (QEMU 7.2's default bound is 1 GiB, touched as code is translated); 512 tasks (QEMU's
/// threads: vCPUs, main loop, RCU, its I/O worker pool); the vCPUs' time plus one CPU for the main loop (NBD,
/// agent, QMP).
pub fn limits_for_guest(memory_mib: u32, vcpus: u32, accel: crate::accel::Accel) -> VmLimits {
    let tb_mib = match accel {
        crate::accel::Accel::Kvm => 0,
        crate::accel::Accel::Tcg => match crate::accel::tb_size_mib() {
            0 => 1024,
            n => n as u64,
        },
    };
    VmLimits {
        memory_bytes: (2 * memory_mib as u64 + 256 + tb_mib) << 20,
        pids: 512,
        cpu_ms_per_100ms: (vcpus.max(1) as u64 + 1) * 100,
        devices: None,
    }
}

impl VmJail {
    /// A jail with its uid slots in `uids_dir`, no cgroup and no mounts detached.
    pub fn new(uids_dir: impl Into<PathBuf>) -> VmJail {
        VmJail { uids_dir: uids_dir.into(), cgroup: None, detach_mounts_under: Vec::new() }
    }
}

/// What one jailed QEMU holds: its chroot directory, its uid slot and its cgroup. Dropped after the QEMU is
/// dead (the cgroup is removed, the slot freed).
#[derive(Debug)]
pub struct Jailed {
    /// The chroot (`<run_dir>/jail`): root's, group the sandbox's gid, 0770.
    pub dir: PathBuf,
    pub cgroup: Option<clade_core::cgroup::Cgroup>,
    pub slot: UidSlot,
}

impl Jailed {
    pub fn uid(&self) -> u32 {
        self.slot.uid()
    }

    /// Move the just exec'd QEMU `pid` (all its threads) into its cgroup. Done from the parent while QEMU
    /// initializes rather than in the child before exec: on cgroup v1 a move waits for an RCU grace period
    /// (~3 ms per controller here), which in the child added ~10 ms to every start; from here it overlaps
    /// QEMU's own start-up. Every jailed guest runs only after QMP's `cont` (a boot starts with `-S`,
    /// crate::machine): what QEMU allocated before the move (its first milliseconds) stays charged to the
    /// parent's cgroup.
    pub fn enter_cgroup(&self, pid: u32) -> Result<(), String> {
        for procs in self.cgroup.iter().flat_map(|c| c.procs_files()) {
            std::fs::write(&procs, pid.to_string())
                .map_err(|e| format!("move QEMU {pid} into {}: {e}", procs.display()))?;
        }
        Ok(())
    }
}

/// Claim a uid, make the chroot, create the cgroup, and set `cmd` up to exec QEMU jailed. `needs` are the host
/// paths QEMU opens at start (no mount above them is detached). Without `egress` QEMU also gets an empty
/// network namespace: it cannot reach the host's TCP services (clade's API on loopback) or abstract unix
/// sockets; its own sockets (QMP, agent, NBD) are paths, which work across network namespaces.
pub(crate) fn prepare(
    jail: &VmJail,
    run_dir: &Path,
    needs: &[&Path],
    egress: bool,
    cmd: &mut std::process::Command,
) -> Result<Jailed, String> {
    let slot =
        UidSlot::claim(&jail.uids_dir).map_err(|e| format!("claim a uid in {}: {e}", jail.uids_dir.display()))?;
    let uid = slot.uid();
    let dir = run_dir.join("jail");
    make_chroot(&dir, uid, egress).map_err(|e| format!("jail {}: {e}", dir.display()))?;
    let cgroup = match &jail.cgroup {
        Some(plan) => Some(clade_core::cgroup::Cgroup::create(&plan.name, &plan.limits)?),
        None => None,
    };
    let setup = ChildSetup {
        root: CString::new("/").expect("no NUL"),
        new_net: !egress,
        detach: mounts_to_detach(&jail.detach_mounts_under, needs).iter().map(|p| cstr(p)).collect(),
        drop_caps: (0..=cap_last_cap()).filter(|c| !KEPT_CAPS.contains(c)).collect(),
    };
    cmd.args(["-sandbox", SANDBOX_OPTS]);
    cmd.args(["-runas".to_string(), format!("{uid}:{uid}")]);
    cmd.arg("-chroot").arg(&dir);
    // SAFETY: the closure runs in the forked child before exec; `ChildSetup::enter` makes only
    // async-signal-safe system calls (unshare, mount, umount2, prctl) on data built before the fork, and
    // allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || setup.enter());
    }
    Ok(Jailed { dir, cgroup, slot })
}

/// Make `cmd`'s process join the network namespace `ns` before exec (and before the jail's own setup, when
/// this is called first): a guest with egress, whose slirp then opens its sockets there.
pub(crate) fn join_netns(cmd: &mut std::process::Command, ns: std::fs::File) {
    use std::os::fd::AsRawFd;
    let fd = ns.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec: one setns on a descriptor opened before the
    // fork and kept open by the closure itself (`ns` moves into it); setns is async-signal-safe and allocates
    // nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            let _keep = &ns;
            if nix::libc::setns(fd, nix::libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The chroot: empty, mode 0770, owner root, group the sandbox's gid. The QEMU enters it as uid 0 without
/// CAP_DAC_OVERRIDE (so it must be the owner's to be searched: a 0700 directory of the sandbox uid makes
/// `chroot` fail with EACCES) and then writes there as the sandbox's gid. No other uid may enter. With egress
/// networking it holds `etc/resolv.conf` (root's, read only): QEMU's user-mode network reads it when the guest
/// asks its DNS address, after the chroot.
fn make_chroot(dir: &Path, uid: u32, resolv_conf: bool) -> std::io::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::DirBuilder::new().mode(0o700).create(dir)?;
    if resolv_conf {
        let etc = dir.join("etc");
        std::fs::DirBuilder::new().mode(0o755).create(&etc)?;
        let text = std::fs::read("/etc/resolv.conf").unwrap_or_default();
        let mut f =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(etc.join("resolv.conf"))?;
        f.write_all(&text)?;
    }
    std::os::unix::fs::chown(dir, Some(0), Some(uid))?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o770))
}

/// Take a file QEMU wrote in its chroot (`name`, at the chroot's top) out to `dest` (root's, written through
/// `dest.tmp`). The chroot is the QEMU's: the file is opened without following a link and must be a regular
/// file of the sandbox's uid with one link and a sane size; it is copied, never moved.
pub fn take_out(jailed: &Jailed, name: &str, dest: &Path) -> std::io::Result<u64> {
    let src = jailed.dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&src)?;
    let m = f.metadata()?;
    if !m.file_type().is_file() || m.uid() != jailed.uid() || m.nlink() != 1 || m.len() > MAX_JAIL_FILE {
        return Err(std::io::Error::other(format!(
            "{} is not a plain file of uid {} below {} MiB (type {:?}, uid {}, {} links, {} bytes): refused",
            src.display(),
            jailed.uid(),
            MAX_JAIL_FILE >> 20,
            m.file_type(),
            m.uid(),
            m.nlink(),
            m.len()
        )));
    }
    let tmp = dest.with_extension("tmp");
    let mut out = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    let n = std::io::copy(&mut (&mut f).take(MAX_JAIL_FILE), &mut out)?;
    out.sync_all()?;
    std::fs::rename(&tmp, dest)?;
    let _ = std::fs::remove_file(&src);
    Ok(n)
}

/// Remove `name` from the chroot's top if it is there (a file the QEMU may have left).
pub fn clear(jailed: &Jailed, name: &str) -> std::io::Result<()> {
    match std::fs::remove_file(jailed.dir.join(name)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap_or_else(|_| CString::new("/nonexistent").expect("no NUL"))
}

fn cap_last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(40)
}

/// What the forked child does before exec, all of it computed before the fork.
struct ChildSetup {
    /// An empty network namespace (a guest without egress: QEMU needs no network; its sockets are paths).
    new_net: bool,
    root: CString,
    detach: Vec<CString>,
    drop_caps: Vec<u32>,
}

impl ChildSetup {
    /// Runs between fork and exec: async-signal-safe system calls only, no allocation.
    fn enter(&self) -> std::io::Result<()> {
        use nix::libc;
        let err = std::io::Error::last_os_error;
        // SAFETY: plain system calls on NUL-terminated strings owned by `self`; none of them allocates or takes
        // a lock (all are async-signal-safe).
        unsafe {
            // An own mount namespace. Slave, not private: where the host's mounts are shared, the host's
            // unmounts still reach this copy (a private copy would keep them alive while QEMU runs); nothing
            // mounted here reaches the host (QEMU cannot mount anyway).
            let net = if self.new_net { libc::CLONE_NEWNET } else { 0 };
            if libc::unshare(libc::CLONE_NEWNS | net) != 0 {
                return Err(err());
            }
            if libc::mount(
                std::ptr::null(),
                self.root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            ) != 0
            {
                return Err(err());
            }
            // Other sandboxes' mounts (deepest first); one gone meanwhile is no error.
            for m in &self.detach {
                libc::umount2(m.as_ptr(), libc::MNT_DETACH);
            }
            for &cap in &self.drop_caps {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(err());
                }
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(err());
            }
        }
        Ok(())
    }
}

/// Mount points at or below one of `under`, except those at or above a path in `needs`; deepest first.
fn mounts_to_detach(under: &[PathBuf], needs: &[&Path]) -> Vec<PathBuf> {
    if under.is_empty() {
        return Vec::new();
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut out: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mount(m)))
        .filter(|m| under.iter().any(|u| m.starts_with(u)))
        .filter(|m| !needs.iter().any(|n| n.starts_with(m)))
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    out.dedup();
    out
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One claimed uid slot: the file `<dir>/<slot>` names its owner; removed on drop.
#[derive(Debug)]
pub struct UidSlot {
    slot: u32,
    path: PathBuf,
}

impl UidSlot {
    /// Claim the lowest free slot in `dir` (created 0700). Claims are serialized by `dir/.lock` (flock), so a
    /// stale slot (owner dead, no process of its uid) is taken over by exactly one claimer.
    pub fn claim(dir: &Path) -> std::io::Result<UidSlot> {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let lockf = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(dir.join(".lock"))?;
        let _lock = nix::fcntl::Flock::lock(lockf, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| std::io::Error::from(e))?;
        let me = owner_tag(std::process::id()).unwrap_or_else(|| format!("{}\n", std::process::id()));
        for slot in 0..UID_SLOTS {
            let path = dir.join(slot.to_string());
            match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path) {
                Ok(mut f) => {
                    f.write_all(me.as_bytes())?;
                    return Ok(UidSlot { slot, path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if is_stale(&path, UID_BASE + slot) {
                        std::fs::write(&path, me.as_bytes())?;
                        return Ok(UidSlot { slot, path });
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other(format!("all {UID_SLOTS} sandbox uids are taken")))
    }

    pub fn uid(&self) -> u32 {
        UID_BASE + self.slot
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for UidSlot {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `pid starttime`: a pid alone could be reused by another process.
fn owner_tag(pid: u32) -> Option<String> {
    Some(format!("{pid} {}\n", start_time(pid)?))
}

/// Field 22 of /proc/PID/stat (after the parenthesized command, which may hold spaces).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// A slot is stale when the process that claimed it is gone and no process runs with its uid (a QEMU outliving
/// its supervisor keeps its uid).
fn is_stale(path: &Path, uid: u32) -> bool {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => return e.kind() == std::io::ErrorKind::NotFound,
    };
    let mut f = text.split_whitespace();
    let pid: Option<u32> = f.next().and_then(|p| p.parse().ok());
    let started: Option<u64> = f.next().and_then(|s| s.parse().ok());
    if let Some(pid) = pid {
        let alive = match (start_time(pid), started) {
            (Some(now), Some(then)) => now == then,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if alive {
            return false;
        }
    }
    !uid_in_use(uid)
}

/// Whether any process has `uid` as its real, effective, saved or filesystem uid.
pub fn uid_in_use(uid: u32) -> bool {
    let Ok(rd) = std::fs::read_dir("/proc") else { return true };
    rd.flatten().filter(|e| e.file_name().as_bytes().iter().all(u8::is_ascii_digit)).any(|e| {
        std::fs::read_to_string(e.path().join("status")).ok().is_some_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .is_some_and(|ids| ids.split_whitespace().any(|i| i.parse() == Ok(uid)))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mount("/a\\040b\\134c"), "/a b\\c");
        assert_eq!(unescape_mount("/plain"), "/plain");
        assert_eq!(unescape_mount("/end\\04"), "/end\\04");
    }

    #[test]
    fn limits_scale_with_the_guest() {
        let l = limits_for_guest(256, 2, crate::accel::Accel::Kvm);
        assert_eq!(l.memory_bytes, (512 + 256) << 20);
        assert_eq!(l.pids, 512);
        assert_eq!(l.cpu_ms_per_100ms, 300);
    }

    #[test]
    fn slots_are_distinct_released_on_drop_and_stale_ones_taken_over() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("vm-uids");
        let t = t.as_path();
        let a = UidSlot::claim(t).unwrap();
        let b = UidSlot::claim(t).unwrap();
        assert_ne!(a.uid(), b.uid());
        assert!(a.uid() >= UID_BASE && b.uid() >= UID_BASE);
        assert_eq!(std::fs::metadata(t).unwrap().mode() & 0o777, 0o700);
        let (sa, sb) = (a.slot(), b.slot());
        drop(a);
        assert!(!t.join(sa.to_string()).exists());
        let c = UidSlot::claim(t).unwrap();
        assert_eq!(c.slot(), sa, "a freed slot is reused");
        // A slot whose owner is dead (pid 2^22 + 1 is above pid_max's usual bound) and whose uid runs nothing.
        std::mem::forget(c);
        std::fs::write(t.join(sa.to_string()), "4194305 1\n").unwrap();
        let d = UidSlot::claim(t).unwrap();
        if uid_in_use(UID_BASE + sa) {
            // A vm sandbox of this host runs as that uid (its slot in the real `$CLADE_HOME`): not stale.
            assert_ne!(d.slot(), sa, "a slot whose uid runs something is never taken over");
            return;
        }
        assert_eq!(d.slot(), sa, "a stale slot is taken over");
        let e = UidSlot::claim(t).unwrap();
        assert!(e.slot() != sa && e.slot() != sb);
    }
}
