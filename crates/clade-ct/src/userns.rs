//! The jail's user namespace (docs/security.md, "User namespace").
//!
//! A jailed ct sandbox's root is uid 0 only inside its user namespace: on the host its ids are the block
//! [`BASE`]..[`BASE`]+[`SIZE`], which no host account owns. Every ct sandbox shares that one block, as Docker's
//! `userns-remap` does, because CRIU restores a sibling's namespace with the map its mark was dumped with; the
//! siblings are kept apart by their own PID, mount, network and IPC namespaces and their own uppers (0700
//! directories of host root), not by their ids.
//!
//! The rules this module keeps:
//! * The namespaces CRIU dumps (PID, mount, IPC, UTS) are made *inside* the user namespace (CRIU refuses to
//!   dump a task whose namespaces belong to another user namespace), so host-path work (overlay, /dev, sysfs,
//!   the upper) is done first, as host root, in a private mount namespace, and the user namespace comes after
//!   (crate::spawn). The network namespace stays the host's; CRIU runs inside it and so leaves it out of the
//!   images (crate::dump, crate::restore).
//! * A template's files stay owned by host root on disk; the sandbox sees them through **idmapped** mounts
//!   ([`idmap_mount`]): on-disk uid 0 appears as `BASE`, i.e. root inside. What the sandbox writes lands in its
//!   upper owned by `BASE + uid`, which marks store as they are.
//! * Directories the host makes in a sandbox's upper are chowned to [`BASE`] ([`own`]), so they are root's inside.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// First host uid (and gid) of the sandboxes' block: above the vm jail's per-sandbox uids (0x7A000000 + slot).
pub const BASE: u32 = 0x7C00_0000;
/// Ids mapped: 0..65535 inside, as a distribution's users and `nobody` need.
pub const SIZE: u32 = 65_536;

/// The `uid_map`/`gid_map` line of every jailed sandbox.
pub fn map_line() -> String {
    format!("0 {BASE} {SIZE}\n")
}

/// Writes the maps of `pid`, a process that has just unshared its user namespace (the writer must be in the
/// parent namespace with CAP_SETUID/CAP_SETGID: the supervisor is).
pub fn write_maps(pid: i32) -> Result<(), String> {
    for f in ["uid_map", "gid_map"] {
        let p = format!("/proc/{pid}/{f}");
        std::fs::write(&p, map_line()).map_err(|e| format!("write {p}: {e}"))?;
    }
    Ok(())
}

/// Whether a process in a user namespace may open a userfaultfd (lazy restores need it).
pub fn userfaultfd_allowed() -> bool {
    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").map(|s| s.trim() == "1").unwrap_or(false)
}

/// Chowns a path the host made to the sandbox's root (`BASE`), not following a symlink.
pub fn own(path: &Path) -> Result<(), String> {
    std::os::unix::fs::lchown(path, Some(BASE), Some(BASE)).map_err(|e| format!("chown {}: {e}", path.display()))
}

/// A user namespace with the sandboxes' map, for idmapped mounts: made once per process by a short-lived child
/// (a thread cannot unshare a user namespace in a threaded process), kept open for the process's life.
pub fn mapping_namespace() -> Result<BorrowedFd<'static>, String> {
    static NS: std::sync::OnceLock<Result<OwnedFd, String>> = std::sync::OnceLock::new();
    match NS.get_or_init(make_mapping_namespace) {
        Ok(fd) => Ok(std::os::fd::AsFd::as_fd(fd)),
        Err(e) => Err(e.clone()),
    }
}

fn make_mapping_namespace() -> Result<OwnedFd, String> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: the child only makes system calls (unshare, write, pause) and `_exit`s; it never returns.
    match unsafe { nix::unistd::fork() }.map_err(|e| format!("fork: {e}"))? {
        nix::unistd::ForkResult::Child => {
            drop(r);
            let ok = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER).is_ok();
            let _ = nix::unistd::write(&w, &[u8::from(ok)]);
            // SAFETY: pause() only waits for the parent's SIGKILL; `_exit` if it ever returns.
            unsafe {
                libc::pause();
                libc::_exit(0)
            }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(w);
            let mut b = [0u8; 1];
            let got = nix::unistd::read(r.as_raw_fd(), &mut b);
            let out = match got {
                Ok(1) if b[0] == 1 => write_maps(child.as_raw()).and_then(|()| {
                    std::fs::File::open(format!("/proc/{child}/ns/user"))
                        .map(OwnedFd::from)
                        .map_err(|e| format!("open the mapping user namespace: {e}"))
                }),
                _ => Err("unshare(CLONE_NEWUSER) failed: this kernel or host forbids user namespaces".into()),
            };
            let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(child, None);
            out
        }
    }
}

const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` of mount_setattr(2) (rustix has open_tree and move_mount, not mount_setattr).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A detached copy of the mount tree at `path` (open_tree with OPEN_TREE_CLONE), recursive or not.
pub(crate) fn clone_tree(path: &Path, recursive: bool) -> std::io::Result<OwnedFd> {
    use rustix::mount::OpenTreeFlags as F;
    let mut flags = F::OPEN_TREE_CLONE | F::OPEN_TREE_CLOEXEC;
    if recursive {
        flags |= F::AT_RECURSIVE;
    }
    Ok(rustix::mount::open_tree(rustix::fs::CWD, path, flags)?)
}

/// Attaches a detached tree at `target`.
pub(crate) fn attach(tree: &OwnedFd, target: &Path) -> std::io::Result<()> {
    let flags = rustix::mount::MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH;
    Ok(rustix::mount::move_mount(tree, c"", rustix::fs::CWD, target, flags)?)
}

/// Mounts `src` at `target` (an existing directory) idmapped through `userns`: on-disk ids appear shifted by
/// that namespace's map. Only in the caller's mount namespace (callers are in a private one).
pub fn idmap_mount(src: &Path, target: &Path, userns: BorrowedFd<'_>) -> std::io::Result<()> {
    let tree = clone_tree(src, false)?;
    idmap_tree(&tree, userns, false)?;
    attach(&tree, target)
}

/// Idmaps a detached mount tree (from `open_tree`) through `userns` (its mounts below too when `recursive`).
pub fn idmap_tree(tree: &OwnedFd, userns: BorrowedFd<'_>, recursive: bool) -> std::io::Result<()> {
    let attr =
        MountAttr { attr_set: MOUNT_ATTR_IDMAP, attr_clr: 0, propagation: 0, userns_fd: userns.as_raw_fd() as u64 };
    set_attr(tree, &attr, recursive)
}

/// Makes a detached mount tree read-only, its mounts below too.
pub fn set_readonly(tree: &OwnedFd) -> std::io::Result<()> {
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    set_attr(tree, &MountAttr { attr_set: MOUNT_ATTR_RDONLY, attr_clr: 0, propagation: 0, userns_fd: 0 }, true)
}

fn set_attr(tree: &OwnedFd, attr: &MountAttr, recursive: bool) -> std::io::Result<()> {
    let flags = libc::AT_EMPTY_PATH | if recursive { libc::AT_RECURSIVE } else { 0 };
    // SAFETY: mount_setattr(2) on the detached tree (an fd the caller owns), an empty C string, and an attribute
    // struct with its size; all live for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            flags,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Binds the working directory's tree onto itself and moves into the copy. Mounts copied into a user
/// namespace's mount namespace are locked, and `pivot_root` refuses a locked new root (EINVAL); a bind made
/// inside the namespace is not locked. The new root is reached through the detached tree's descriptor: the
/// host path above it is not traversable from inside the user namespace.
pub fn rebind_cwd() -> std::io::Result<()> {
    let tree = clone_tree(Path::new("."), true)?;
    attach(&tree, Path::new("."))?;
    nix::unistd::fchdir(tree.as_raw_fd()).map_err(|e| std::io::Error::from_raw_os_error(e as i32))
}

/// The overlay `lowerdir=` list of a jailed sandbox and the idmapped mounts it needs: each layer of `lowers`
/// (a `:` list) for which `shown_shifted` is false is mounted idmapped at `base/<n>` (made here, before a fork)
/// and named by that mount point; a layer already shown shifted (a lazy store tree) is named as it is.
pub fn plan_lowers(
    lowers: &str,
    base: &Path,
    shown_shifted: impl Fn(&str) -> bool,
) -> Result<(String, Vec<(std::path::PathBuf, std::path::PathBuf)>), String> {
    let (mut dirs, mut pairs) = (Vec::new(), Vec::new());
    for (n, l) in lowers.split(':').filter(|l| !l.is_empty()).enumerate() {
        if shown_shifted(l) {
            dirs.push(l.to_string());
            continue;
        }
        let t = base.join(n.to_string());
        std::fs::create_dir_all(&t).map_err(|e| format!("create {}: {e}", t.display()))?;
        dirs.push(t.display().to_string());
        pairs.push((std::path::PathBuf::from(l), t));
    }
    Ok((dirs.join(":"), pairs))
}

/// Mounts each `(layer, target)` idmapped (in a forked child, after its mount namespace went private).
pub fn mount_lowers(pairs: &[(std::path::PathBuf, std::path::PathBuf)], userns: BorrowedFd<'_>) -> std::io::Result<()> {
    for (src, target) in pairs {
        idmap_mount(src, target, userns)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn lowerdir_names_one_mount_per_host_layer() {
        let base = tempfile::tempdir().unwrap();
        let (got, pairs) =
            super::plan_lowers("/a:/run/lower/1::/c", base.path(), |l| l.starts_with("/run/lower")).unwrap();
        let b = base.path().display();
        assert_eq!(got, format!("{b}/0:/run/lower/1:{b}/2"));
        assert_eq!(pairs.len(), 2);
        assert!(base.path().join("2").is_dir());
        assert_eq!(super::map_line(), format!("0 {} 65536\n", 0x7C00_0000u32));
    }
}
