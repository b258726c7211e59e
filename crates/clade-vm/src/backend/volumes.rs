//! Host files in a vm guest, **copied in**: a Kubernetes volume (`Sandbox::bind`) and a pod member's image root
//! (`Sandbox::attach_root`).
//!
//! A guest sees none of the host's file systems. Sharing one live would need a virtio-fs or 9p device in the
//! machine from its base's first boot, and QEMU refuses to migrate (so clade could not mark) while a 9p
//! export is mounted. So the files are copied in when the container is created, as Kata Containers does with
//! `shared_fs = none` for volumes:
//!
//! 1. a new tmpfs in the guest gets the host tree through the agent: directories, regular files and symbolic
//!    links, with their permission bits and owners (anything else, a socket or a device, is left out);
//! 2. a volume's tmpfs at `/run/clade/volumes/<n>` (or the one file in it, for a volume that is a file) is
//!    bind-mounted at the container's path, read-only where the spec says so; a root's tmpfs at
//!    `/run/clade/roots/<name>` (`clade_core::backend::root_path`, as on ct) gets the guest's `/proc`, `/dev`
//!    and `/sys` bound in, and the agent starts the container's processes `chroot`ed there (`ExecSpec::root`).
//!
//! What the container writes there stays in the guest; what changes on the host afterwards is not seen (an
//! updated configMap). A mark keeps the copies with the rest of the guest, so a sibling has them too. A tree
//! over [`MAX_BYTES`] is refused with that limit in the message (it would live in the guest's memory); an agent
//! too old to mount answers with an unknown request, which is reported as unsupported (the shim then runs the
//! container without the volume).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use clade_agent::client::{AgentClient, ClientError};
use clade_agent::{AgentError, FileOwner, MountSource, WriteOptions};
use clade_core::backend::{root_path, BackendError, ROOT_SHARES};

/// Where the copies of volumes are mounted in the guest.
const VOLUMES: &str = "/run/clade/volumes";

/// The most a volume or an image root may hold to be copied into a guest's memory (tmpfs).
pub const MAX_BYTES: u64 = 64 << 20;

/// Copies of this process: a stage name is `<pid>-<n>`, distinct from a sibling's inherited ones.
static COPIES: AtomicU64 = AtomicU64::new(0);

/// Copy the host file or directory `host` into the guest and mount it at `inside` (see the module's doc). A copy
/// that fails midway takes its stage away again, so no tmpfs is left holding guest memory.
pub(super) fn copy_in(agent: &AgentClient, host: &Path, inside: &str, readonly: bool) -> Result<(), BackendError> {
    let top = check_size(host, "volume")?;
    let stage = format!("{VOLUMES}/{}-{}", std::process::id(), COPIES.fetch_add(1, Ordering::Relaxed));
    let copied =
        fill_tmpfs(agent, host, &top, &stage).and_then(|()| show_at(agent, host, &top, &stage, inside, readonly));
    if copied.is_err() {
        let _ = agent.unmount(&stage);
        let _ = agent.remove(&stage, false);
    }
    copied
}

/// Mount the filled stage (or, for a file volume, the copy of the file in it) at `inside`.
fn show_at(
    agent: &AgentClient,
    host: &Path,
    top: &std::fs::Metadata,
    stage: &str,
    inside: &str,
    readonly: bool,
) -> Result<(), BackendError> {
    let shown = if top.is_dir() {
        stage.to_string()
    } else {
        let file = format!("{stage}/file");
        copy_file(agent, host, &file, top)?;
        file
    };
    // The mount point: a directory, or for a file an empty file where none is.
    let target = |what: &str, e: ClientError| mount_error(what, inside, e);
    if top.is_dir() {
        agent.mkdir_p(inside, None).map_err(|e| target("mkdir", e))?;
    } else if agent.stat(inside).is_err() {
        let parent = Path::new(inside).parent().and_then(Path::to_str).unwrap_or("/");
        agent.mkdir_p(parent, None).map_err(|e| target("mkdir", e))?;
        agent.write_file_bytes(inside, b"", Some(0o644)).map_err(|e| target("create", e))?;
    }
    agent.mount(inside, MountSource::Bind { from: shown }, readonly).map_err(|e| target("bind", e))
}

/// Copy the image root `host` into the guest as the root `name` (see the module's doc): its path inside.
pub(super) fn attach_root(agent: &AgentClient, name: &str, host: &Path) -> Result<String, BackendError> {
    let root = root_path(name).map_err(BackendError::Unsupported)?.to_string_lossy().into_owned();
    let top = check_size(host, "image root")?;
    if let Err(e) = fill_tmpfs(agent, host, &top, &root) {
        let _ = agent.unmount(&root);
        return Err(e);
    }
    for shared in ROOT_SHARES {
        let at = format!("{root}/{shared}");
        let bound = agent
            .mkdir_p(&at, Some(0o555))
            .and_then(|()| agent.mount(&at, MountSource::Bind { from: format!("/{shared}") }, false));
        if let Err(e) = bound {
            let _ = agent.unmount(&root);
            return Err(mount_error("bind", &at, e));
        }
    }
    Ok(root)
}

/// Take away a root [`attach_root`] made, its binds with it; one not there is not an error.
pub(super) fn detach_root(agent: &AgentClient, name: &str) -> Result<(), BackendError> {
    let Ok(root) = root_path(name).map(|p| p.to_string_lossy().into_owned()) else { return Ok(()) };
    if agent.stat(&root).is_err() {
        return Ok(());
    }
    agent.unmount(&root).map_err(|e| mount_error("unmount", &root, e))?;
    let _ = agent.remove(&root, false);
    Ok(())
}

/// The host tree's metadata, once its size is checked against [`MAX_BYTES`] (`what`: "volume", "image root").
fn check_size(host: &Path, what: &str) -> Result<std::fs::Metadata, BackendError> {
    let top = std::fs::metadata(host).map_err(|e| {
        BackendError::Unsupported(format!("the {what} {} cannot be read on the host: {e}", host.display()))
    })?;
    let bytes =
        tree_bytes(host).map_err(|e| BackendError::Failed(format!("read the {what} {}: {e}", host.display())))?;
    if bytes > MAX_BYTES {
        return Err(BackendError::Failed(format!(
            "the {what} {} holds {} MiB; a vm guest gets it as a copy in its memory, at most {} MiB: use the ct \
             backend for it (annotation clade.dev/backend: ct)",
            host.display(),
            bytes >> 20,
            MAX_BYTES >> 20
        )));
    }
    Ok(top)
}

/// A new tmpfs at `at` in the guest, holding a copy of the host directory `host` (a file's copy is made by the
/// caller).
fn fill_tmpfs(agent: &AgentClient, host: &Path, top: &std::fs::Metadata, at: &str) -> Result<(), BackendError> {
    let guest = |what: &str, e: ClientError| mount_error(what, at, e);
    agent.mkdir_p(at, Some(0o755)).map_err(|e| guest("mkdir", e))?;
    agent.mount(at, MountSource::Tmpfs, false).map_err(|e| guest("mount a tmpfs", e))?;
    if top.is_dir() {
        copy_tree(agent, host, at)?;
        agent.chmod(at, top_mode(top)).map_err(|e| guest("chmod", e))?;
    }
    Ok(())
}

/// A refusal of the guest's agent: unsupported where the agent does not know the request (a base built before
/// it could mount), else a failure naming the step.
fn mount_error(what: &str, path: &str, e: ClientError) -> BackendError {
    match e {
        ClientError::Agent(AgentError::UnknownOp { .. }) => BackendError::Unsupported(format!(
            "the guest's agent cannot mount a copy (a base built before it could: build the base again): {e}"
        )),
        e => BackendError::Failed(format!("copy into the guest: {what} {path}: {e}")),
    }
}

fn top_mode(m: &std::fs::Metadata) -> u32 {
    std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777
}

/// The owner of a copy: the host file's, where it is not root's (the default).
fn owner(m: &std::fs::Metadata) -> Option<FileOwner> {
    use std::os::unix::fs::MetadataExt;
    (m.uid() != 0 || m.gid() != 0).then(|| FileOwner { uid: m.uid(), gid: m.gid() })
}

/// The bytes of the regular files under `p` (symbolic links not followed below the top).
fn tree_bytes(p: &Path) -> std::io::Result<u64> {
    let m = std::fs::metadata(p)?;
    if !m.is_dir() {
        return Ok(m.len());
    }
    let mut total = 0;
    for e in std::fs::read_dir(p)? {
        let e = e?;
        let t = e.file_type()?;
        if t.is_dir() {
            total += tree_bytes(&e.path())?;
        } else if t.is_file() {
            total += e.metadata()?.len();
        }
    }
    Ok(total)
}

fn copy_tree(agent: &AgentClient, host: &Path, guest: &str) -> Result<(), BackendError> {
    let read = |e: std::io::Error| BackendError::Failed(format!("read {}: {e}", host.display()));
    for e in std::fs::read_dir(host).map_err(read)? {
        let e = e.map_err(read)?;
        let (from, name) = (e.path(), e.file_name());
        let Some(name) = name.to_str() else {
            return Err(BackendError::Failed(format!("{}: a name that is not UTF-8", from.display())));
        };
        let to = format!("{guest}/{name}");
        let m = std::fs::symlink_metadata(&from).map_err(read)?;
        let fail = |what: &str, e: ClientError| mount_error(what, &to, e);
        if m.file_type().is_symlink() {
            let target = std::fs::read_link(&from).map_err(read)?;
            agent.symlink(&target.to_string_lossy(), &to).map_err(|e| fail("symlink", e))?;
        } else if m.is_dir() {
            agent.mkdir_p_owned(&to, Some(top_mode(&m)), owner(&m)).map_err(|e| fail("mkdir", e))?;
            copy_tree(agent, &from, &to)?;
            agent.chmod(&to, top_mode(&m)).map_err(|e| fail("chmod", e))?;
        } else if m.is_file() {
            copy_file(agent, &from, &to, &m)?;
        }
    }
    Ok(())
}

fn copy_file(agent: &AgentClient, from: &Path, to: &str, m: &std::fs::Metadata) -> Result<(), BackendError> {
    let mut f = std::fs::File::open(from)
        .map_err(|e| BackendError::Failed(format!("read the file {}: {e}", from.display())))?;
    let opts = WriteOptions { mode: Some(top_mode(m)), owner: owner(m), ..WriteOptions::default() };
    agent.write_file_with(to, &mut f, &opts, false).map_err(|e| mount_error("write", to, e))?;
    Ok(())
}
