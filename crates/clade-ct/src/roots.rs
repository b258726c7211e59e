//! Roots of their own inside a running sandbox: a Kubernetes pod's containers of different images share the
//! pod's one sandbox (its network, IPC, hostname and memory limit), and each runs on its own image's root file
//! system (docs/kubernetes.md, "Pods of several images").
//!
//! The host attaches the image's root file system (the directory containerd mounted for the container) inside
//! the sandbox at `/run/clade/roots/<name>`, with the sandbox's own `/proc`, `/dev` and `/sys` bound inside it;
//! the agent then starts the container's processes `chroot`ed there (`ExecSpec::root`). The rules:
//! * The sandbox cannot mount (the jail takes CAP_SYS_ADMIN), so the host does it: a short-lived thread gives up
//!   its share of the process's root and working directory (`unshare(CLONE_FS)`, without which a thread of a
//!   threaded process cannot join a mount namespace), copies the image's mount tree (`open_tree`), joins the
//!   sandbox's mount namespace and attaches the copy there (`move_mount`). The supervisor's own mounts and its
//!   other threads are untouched.
//! * Jailed, the copy is idmapped first (crate::userns): the image's files, owned by host root on disk, are
//!   root's inside, and what a container writes lands on disk as host ids, as on runc.
//! * A root is a host mount CRIU knows nothing of, so a sandbox showing one is not marked (a mark or suspend
//!   says so); detaching the roots (deleting the containers) makes it markable again.
//! * Every path inside the sandbox is reached without following a symbolic link ([`mount_point`]): the
//!   sandbox's files are its own, and a host thread that followed them could be made to mount or create files
//!   wherever the sandbox chose.
//! * A `chroot` keeps a pod's containers apart in their files only: the boundary is the sandbox, as in Kata
//!   Containers, where a pod's containers share one guest kernel.

use std::os::fd::{AsFd, OwnedFd};

use crate::userns::{attach as attach_tree, clone_tree};
use std::path::{Path, PathBuf};

use clade_core::backend::{root_path, ROOTS_DIR, ROOT_SHARES};

/// Attaches the host directory `host` inside the sandbox whose init is `init` as the root `name` (idmapped
/// when `jail`); returns its path inside.
pub fn attach(init: u32, name: &str, host: &Path, jail: bool) -> Result<String, String> {
    let target = root_path(name)?;
    if !host.is_dir() {
        return Err(format!("{} is not a directory on the host: give the image's root file system", host.display()));
    }
    let mnt = open_ns(init)?;
    let idmap = if jail { Some(crate::userns::mapping_namespace()?) } else { None };
    let overlay = if jail { overlay_at(host) } else { None };
    // The overlay is taken over (see `idmapped_overlay`): this namespace's mount of it goes first, and the
    // new one is attached at `host` in its place.
    let home = match &overlay {
        Some(_) => {
            let ns =
                std::fs::File::open("/proc/thread-self/ns/mnt").map_err(|e| format!("open my mount namespace: {e}"))?;
            nix::mount::umount2(host, nix::mount::MntFlags::MNT_DETACH)
                .map_err(|e| format!("unmount {} to mount it again over idmapped layers: {e}", host.display()))?;
            Some(ns)
        }
        None => None,
    };
    // Where an idmapped overlay is put together (jailed, see `idmapped_overlay`): removed once attached.
    let scratch = std::env::temp_dir().join(format!("clade-root-{}-{name}", std::process::id()));
    let (name, host, scratch2) = (name.to_string(), host.to_path_buf(), scratch.clone());
    let done = in_thread(move || {
        let tree = match (&overlay, idmap, &home) {
            (Some(o), Some(ns), Some(home)) => {
                let tree = idmapped_overlay(o, &scratch2, ns)?;
                let again =
                    clone_tree(&scratch2.join("root"), true).map_err(|e| format!("copy the idmapped overlay: {e}"))?;
                join_ns(home)?;
                attach_tree(&again, &host)
                    .map_err(|e| format!("mount the idmapped overlay at {} again: {e}", host.display()))?;
                tree
            }
            (None, Some(ns), _) => {
                let tree =
                    clone_tree(&host, true).map_err(|e| format!("copy the mount tree of {}: {e}", host.display()))?;
                crate::userns::idmap_tree(&tree, ns, true)
                    .map_err(|e| format!("idmap {} for the jail's user namespace: {e}", host.display()))?;
                tree
            }
            _ => clone_tree(&host, true).map_err(|e| format!("copy the mount tree of {}: {e}", host.display()))?,
        };
        join_ns(&mnt)?;
        if std::fs::symlink_metadata(&target).is_ok() {
            return Err(format!("the sandbox already shows a root named {name:?}: detach it first"));
        }
        let at = mount_point(&target, true)?;
        attach_at(&tree, &at).map_err(|e| format!("attach the root at {}: {e}", target.display()))?;
        for d in ROOT_SHARES {
            let inside = target.join(d);
            // What the image has there, as a directory and without a symbolic link on the way.
            let Ok(at) = open_beneath(&inside) else { continue };
            let own = clone_tree(&Path::new("/").join(d), true).map_err(|e| format!("copy the sandbox's /{d}: {e}"))?;
            attach_at(&own, &at).map_err(|e| format!("bind the sandbox's /{d} at {}: {e}", inside.display()))?;
        }
        Ok(target.display().to_string())
    });
    let _ = std::fs::remove_dir_all(&scratch);
    done
}

/// Binds the host file or directory `host` at the absolute path `inside` of the sandbox whose init is `init`
/// (a Kubernetes volume of a container: docs/kubernetes.md), read-only if asked, idmapped when `jail` so its
/// files' owners are the same inside as on the host (host root is root inside). Where the file system cannot be
/// idmapped the bind is made as it is (its files then belong to `nobody` inside). The mount point is made if
/// missing.
pub fn bind(init: u32, host: &Path, inside: &str, readonly: bool, jail: bool) -> Result<(), String> {
    let target = PathBuf::from(inside);
    let plain = inside.starts_with('/')
        && !inside.contains('\0')
        && !target.components().any(|c| c == std::path::Component::ParentDir)
        && target.parent().is_some();
    if !plain {
        return Err(format!("{inside:?} is no absolute path without '..' to mount a volume on"));
    }
    let meta = std::fs::metadata(host).map_err(|e| format!("the volume's source {}: {e}", host.display()))?;
    let mnt = open_ns(init)?;
    let tree = clone_tree(host, true).map_err(|e| format!("copy the mount tree of {}: {e}", host.display()))?;
    if jail {
        let ns = crate::userns::mapping_namespace()?;
        if let Err(e) = crate::userns::idmap_tree(&tree, ns, true) {
            eprintln!(
                "clade-ct: {} cannot be idmapped ({e}): bound as it is, its files owned by nobody inside",
                host.display()
            );
        }
    }
    if readonly {
        crate::userns::set_readonly(&tree).map_err(|e| format!("make the volume {} read-only: {e}", host.display()))?;
    }
    in_thread(move || {
        join_ns(&mnt)?;
        if jail {
            // The mount point may be in a root shown idmapped (crate::roots::attach), and is root's inside.
            as_jail_root()?;
        }
        let at = mount_point(&target, meta.is_dir())?;
        attach_at(&tree, &at).map_err(|e| format!("mount the volume at {}: {e}", target.display()))
    })
}

/// An overlay mount's layers (containerd's snapshotters mount a container's root file system so).
#[derive(Debug, PartialEq, Eq)]
struct Overlay {
    lower: Vec<PathBuf>,
    upper: Option<(PathBuf, PathBuf)>,
}

/// The layers of the overlay mounted at `path` in this process's mount namespace, if one is.
fn overlay_at(path: &Path) -> Option<Overlay> {
    let path = path.canonicalize().ok()?;
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // The last entry for the path is the mount on top.
    let path = path.to_str()?;
    let line = table.lines().rev().find(|l| l.split(' ').nth(4).map(unescape).as_deref() == Some(path))?;
    let (_, after) = line.split_once(" - ")?;
    let mut f = after.splitn(3, ' ');
    if f.next()? != "overlay" {
        return None;
    }
    parse_overlay(f.nth(1)?)
}

/// Parses overlay's super options (`lowerdir=a:b,upperdir=u,workdir=w,...`).
fn parse_overlay(opts: &str) -> Option<Overlay> {
    let (mut lower, mut upper, mut work) = (Vec::new(), None, None);
    for o in opts.split(',') {
        if let Some(v) = o.strip_prefix("lowerdir=") {
            lower.extend(v.split(':').filter(|l| !l.is_empty()).map(|l| PathBuf::from(unescape(l))));
        } else if let Some(v) = o.strip_prefix("lowerdir+=") {
            lower.push(PathBuf::from(unescape(v)));
        } else if let Some(v) = o.strip_prefix("upperdir=") {
            upper = Some(PathBuf::from(unescape(v)));
        } else if let Some(v) = o.strip_prefix("workdir=") {
            work = Some(PathBuf::from(unescape(v)));
        }
    }
    if lower.is_empty() {
        return None;
    }
    Some(Overlay { lower, upper: upper.zip(work) })
}

/// A path of the mount table with its octal escapes (`\040` for a space ...) undone.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct =
            b.get(i + 1..i + 4).and_then(|d| std::str::from_utf8(d).ok()).and_then(|d| u8::from_str_radix(d, 8).ok());
        match oct {
            Some(c) if b[i] == b'\\' => {
                out.push(c);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The overlay `o` mounted again over idmapped copies of its layers, as a detached tree. overlayfs cannot be
/// idmapped itself but takes idmapped layers (Linux 5.19), and it mounts a second overlay on an upper
/// directory in use by another only read-only: so the caller unmounts the original first, and mounts this one
/// where it was (the host then sees the files' owners shifted, their contents the same). This thread takes a
/// mount namespace of its own,
/// mounts each layer idmapped under `scratch` (the upper and work directories through their common parent,
/// since overlayfs wants both on one mount), mounts the overlay there and copies it; the namespace, with those
/// mounts, ends when the thread leaves it (the overlay keeps its own references to its layers).
fn idmapped_overlay(o: &Overlay, scratch: &Path, ns: std::os::fd::BorrowedFd<'_>) -> Result<OwnedFd, String> {
    use nix::mount::{mount, MsFlags};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare a mount namespace: {e}"))?;
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .map_err(|e| format!("make the thread's mounts private: {e}"))?;
    let dir = |p: PathBuf| match std::fs::create_dir_all(&p) {
        Ok(()) => Ok(p),
        Err(e) => Err(format!("create {}: {e}", p.display())),
    };
    let idmapped = |src: &Path, at: PathBuf| {
        crate::userns::idmap_mount(src, &at, ns)
            .map(|()| at)
            .map_err(|e| format!("idmap the image layer {} for the jail's user namespace: {e}", src.display()))
    };
    let mut lowers = Vec::new();
    for (n, l) in o.lower.iter().enumerate() {
        lowers.push(idmapped(l, dir(scratch.join(format!("l{n}")))?)?.display().to_string());
    }
    let mut data = format!("lowerdir={}", lowers.join(":"));
    if let Some((upper, work)) = &o.upper {
        let parent = upper.parent().filter(|p| work.starts_with(p)).ok_or_else(|| {
            format!("the overlay's upper {} and work {} have no common parent", upper.display(), work.display())
        })?;
        let base = idmapped(parent, dir(scratch.join("u"))?)?;
        let under = |p: &Path| base.join(p.strip_prefix(parent).unwrap_or(p)).display().to_string();
        data.push_str(&format!(",upperdir={},workdir={}", under(upper), under(work)));
    }
    let root = dir(scratch.join("root"))?;
    // overlayfs works its upper directory with its mounter's credentials, which an idmapped upper must map.
    as_jail_root()?;
    mount(Some("overlay"), &root, Some("overlay"), MsFlags::empty(), Some(data.as_str()))
        .map_err(|e| format!("mount the image's overlay over idmapped layers ({data}): {e}"))?;
    clone_tree(&root, true).map_err(|e| format!("copy the idmapped overlay: {e}"))
}

/// Detaches the root `name` from the sandbox whose init is `init` (its processes still running keep it until
/// they end); a root not attached is not an error.
pub fn detach(init: u32, name: &str) -> Result<(), String> {
    let target = root_path(name)?;
    let mnt = open_ns(init)?;
    in_thread(move || {
        join_ns(&mnt)?;
        if std::fs::symlink_metadata(&target).is_err() {
            return Ok(());
        }
        // A lazy unmount takes the whole tree (the bound /proc, /dev and /sys with it).
        let flags = nix::mount::MntFlags::MNT_DETACH | nix::mount::MntFlags::UMOUNT_NOFOLLOW;
        match nix::mount::umount2(&target, flags) {
            Ok(()) | Err(nix::errno::Errno::EINVAL) => {}
            Err(e) => return Err(format!("unmount {} in the sandbox: {e}", target.display())),
        }
        let _ = std::fs::remove_dir(&target);
        Ok(())
    })
}

/// The roots attached in the sandbox whose init is `init`, from its mount table.
pub fn attached(init: u32) -> Vec<String> {
    let table = std::fs::read_to_string(format!("/proc/{init}/mountinfo")).unwrap_or_default();
    let prefix = format!("{ROOTS_DIR}/");
    let mut names: Vec<String> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter_map(|p| p.strip_prefix(&prefix))
        .filter(|rest| !rest.contains('/'))
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

fn open_ns(init: u32) -> Result<std::fs::File, String> {
    std::fs::File::open(format!("/proc/{init}/ns/mnt"))
        .map_err(|e| format!("open the mount namespace of the sandbox's init {init}: {e}"))
}

/// Makes this thread's file system ids the jail's root (fsuid and fsgid BASE), as files made through an idmapped
/// mount must be (host root has no id there); the file capabilities a change of fsuid drops are raised again,
/// from the permitted set. For an [`in_thread`] thread only: credentials are a thread's own.
fn as_jail_root() -> Result<(), String> {
    nix::unistd::setfsuid(nix::unistd::Uid::from_raw(crate::userns::BASE));
    nix::unistd::setfsgid(nix::unistd::Gid::from_raw(crate::userns::BASE));
    for c in caps::read(None, caps::CapSet::Permitted).map_err(|e| format!("read my capabilities: {e}"))? {
        caps::raise(None, caps::CapSet::Effective, c).map_err(|e| format!("raise {c}: {e}"))?;
    }
    Ok(())
}

/// Runs `f` on a short-lived thread whose root and working directory are its own (`unshare(CLONE_FS)`): it may
/// then take or join mount namespaces (see the module doc) without touching the process's other threads.
fn in_thread<T: Send + 'static>(f: impl FnOnce() -> Result<T, String> + Send + 'static) -> Result<T, String> {
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)
            .map_err(|e| format!("unshare(CLONE_FS) before joining the sandbox: {e}"))?;
        f()
    })
    .join()
    .map_err(|_| "the thread joining the sandbox panicked".to_string())?
}

/// Joins the sandbox's mount namespace (on an [`in_thread`] thread).
fn join_ns(mnt: &std::fs::File) -> Result<(), String> {
    nix::sched::setns(mnt.as_fd(), nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| format!("join the sandbox's mount namespace: {e}"))
}

/// The resolution every path inside a sandbox gets here: no symbolic link, magic (`/proc/PID/root`) or not.
/// The sandbox's own files could otherwise steer a host thread, which may mount and create files anywhere in
/// the sandbox's mount namespace, to a place the sandbox chose (a volume's mount point in an image made a link).
fn no_links() -> rustix::fs::ResolveFlags {
    rustix::fs::ResolveFlags::NO_SYMLINKS | rustix::fs::ResolveFlags::NO_MAGICLINKS
}

/// An `O_PATH` handle on the directory `path` (absolute, in this thread's mount namespace), refused where a
/// component is a symbolic link or missing.
fn open_beneath(path: &Path) -> Result<OwnedFd, String> {
    use rustix::fs::{openat2, Mode, OFlags, CWD};
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    openat2(CWD, path, flags, Mode::empty(), no_links()).map_err(|e| format!("{}: {e}", path.display()))
}

/// An `O_PATH` handle on `path` (absolute, in this thread's mount namespace) to mount on, made where missing: its
/// parents as directories, itself a directory or (`dir` false) an empty file. No symbolic link is followed
/// anywhere on the way: one is refused, naming it.
fn mount_point(path: &Path, dir: bool) -> Result<OwnedFd, String> {
    use rustix::fs::{mkdirat, openat2, Mode, OFlags, CWD};
    let named = |e: rustix::io::Errno, what: &str| match e {
        rustix::io::Errno::LOOP | rustix::io::Errno::XDEV => format!(
            "{} in the sandbox: a symbolic link on the way ({what}); mount points are not reached through links",
            path.display()
        ),
        e => format!("{} in the sandbox ({what}): {e}", path.display()),
    };
    let opath = OFlags::PATH | OFlags::CLOEXEC;
    let mut cur = openat2(CWD, "/", opath | OFlags::DIRECTORY, Mode::empty(), no_links()).map_err(|e| named(e, "/"))?;
    let parts: Vec<&std::ffi::OsStr> = path
        .components()
        .filter_map(|c| match c {
            std::path::Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    for (i, part) in parts.iter().enumerate() {
        let what = part.to_string_lossy();
        if i + 1 == parts.len() && !dir {
            let made = openat2(
                &cur,
                *part,
                OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
                no_links(),
            );
            drop(made.map_err(|e| named(e, &what))?);
            return openat2(&cur, *part, opath, Mode::empty(), no_links()).map_err(|e| named(e, &what));
        }
        let next = match openat2(&cur, *part, opath | OFlags::DIRECTORY, Mode::empty(), no_links()) {
            Err(rustix::io::Errno::NOENT) => {
                mkdirat(&cur, *part, Mode::from_raw_mode(0o755)).map_err(|e| named(e, &what))?;
                openat2(&cur, *part, opath | OFlags::DIRECTORY, Mode::empty(), no_links())
            }
            other => other,
        };
        cur = next.map_err(|e| named(e, &what))?;
    }
    Ok(cur)
}

/// Attaches a detached tree on the mount point `at` (an `O_PATH` handle).
fn attach_at(tree: &OwnedFd, at: &OwnedFd) -> std::io::Result<()> {
    use rustix::mount::MoveMountFlags as F;
    Ok(rustix::mount::move_mount(tree, c"", at, c"", F::MOVE_MOUNT_F_EMPTY_PATH | F::MOVE_MOUNT_T_EMPTY_PATH)?)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    #[test]
    fn overlay_layers_from_the_mount_table() {
        let o =
            super::parse_overlay("rw,lowerdir=/s/2/fs:/s/1/fs,upperdir=/s/3/fs,workdir=/s/3/work,index=off").unwrap();
        assert_eq!(o.lower, vec![PathBuf::from("/s/2/fs"), PathBuf::from("/s/1/fs")]);
        assert_eq!(o.upper, Some((PathBuf::from("/s/3/fs"), PathBuf::from("/s/3/work"))));
        let ro = super::parse_overlay("ro,lowerdir+=/a\\040b,lowerdir+=/c").unwrap();
        assert_eq!(ro.lower, vec![PathBuf::from("/a b"), PathBuf::from("/c")]);
        assert_eq!(ro.upper, None);
        assert!(super::parse_overlay("rw,upperdir=/u,workdir=/w").is_none(), "no lower layer: not usable");
    }
}
