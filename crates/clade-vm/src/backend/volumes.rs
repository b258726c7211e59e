//! A Kubernetes volume in a vm guest (`Sandbox::bind`), **copied in**.
//!
//! A guest sees none of the host's file systems. Sharing one live would need a virtio-fs or 9p device in the
//! machine from its base's first boot, and QEMU refuses to migrate (so clade could not mark) while a 9p
//! export is mounted. So the volume's files are copied in when its container is created, as Kata Containers
//! does with `shared_fs = none`:
//!
//! 1. a new tmpfs at `/run/clade/volumes/<n>` in the guest gets the host tree through the agent: directories,
//!    regular files and symbolic links, with their permission bits (anything else, a socket or a device, is
//!    left out);
//! 2. that tmpfs (or the one file in it, for a volume that is a file) is bind-mounted at the container's path,
//!    read-only where the spec says so.
//!
//! What the container writes there stays in the guest; what changes on the host afterwards is not seen (an
//! updated configMap). A mark keeps the copies with the rest of the guest, so a sibling has them too. A volume
//! over [`MAX_BYTES`] is refused with that limit in the message; an agent too old to mount answers with an
//! unknown request, which is reported as unsupported (the shim then runs the container without the volume).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use clade_agent::client::{AgentClient, ClientError};
use clade_agent::{AgentError, MountSource};
use clade_core::backend::BackendError;

/// Where the copies are mounted in the guest.
const VOLUMES: &str = "/run/clade/volumes";

/// The most a volume may hold to be copied into a guest's memory (tmpfs).
pub const MAX_BYTES: u64 = 64 << 20;

/// Copies of this process: a stage name is `<pid>-<n>`, distinct from a sibling's inherited ones.
static COPIES: AtomicU64 = AtomicU64::new(0);

/// Copy the host file or directory `host` into the guest and mount it at `inside` (see the module's doc).
pub(super) fn copy_in(agent: &AgentClient, host: &Path, inside: &str, readonly: bool) -> Result<(), BackendError> {
    let top = std::fs::metadata(host).map_err(|e| {
        BackendError::Unsupported(format!("the volume {} cannot be read on the host: {e}", host.display()))
    })?;
    let bytes =
        tree_bytes(host).map_err(|e| BackendError::Failed(format!("read the volume {}: {e}", host.display())))?;
    if bytes > MAX_BYTES {
        return Err(BackendError::Failed(format!(
            "the volume {} holds {} MiB; a vm guest gets a volume as a copy in its memory, at most {} MiB: use \
             the ct backend for it (annotation clade.dev/backend: ct)",
            host.display(),
            bytes >> 20,
            MAX_BYTES >> 20
        )));
    }
    let stage = format!("{VOLUMES}/{}-{}", std::process::id(), COPIES.fetch_add(1, Ordering::Relaxed));
    let guest = |what: &str, e: ClientError| mount_error(what, &stage, e);
    agent.mkdir_p(&stage, Some(0o755)).map_err(|e| guest("mkdir", e))?;
    agent.mount(&stage, MountSource::Tmpfs, false).map_err(|e| guest("mount a tmpfs", e))?;
    let shown = if top.is_dir() {
        copy_tree(agent, host, &stage)?;
        agent.chmod(&stage, top_mode(&top)).map_err(|e| guest("chmod", e))?;
        stage.clone()
    } else {
        let file = format!("{stage}/file");
        copy_file(agent, host, &file, top_mode(&top))?;
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

/// A refusal of the guest's agent: unsupported where the agent does not know the request (a base built before
/// it could mount), else a failure naming the step.
fn mount_error(what: &str, path: &str, e: ClientError) -> BackendError {
    match e {
        ClientError::Agent(AgentError::UnknownOp { .. }) => BackendError::Unsupported(format!(
            "the guest's agent cannot mount a volume (a base built before it could: build the base again): {e}"
        )),
        e => BackendError::Failed(format!("copy a volume into the guest: {what} {path}: {e}")),
    }
}

fn top_mode(m: &std::fs::Metadata) -> u32 {
    std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777
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
    let read = |e: std::io::Error| BackendError::Failed(format!("read the volume {}: {e}", host.display()));
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
            agent.mkdir_p(&to, Some(top_mode(&m))).map_err(|e| fail("mkdir", e))?;
            copy_tree(agent, &from, &to)?;
            agent.chmod(&to, top_mode(&m)).map_err(|e| fail("chmod", e))?;
        } else if m.is_file() {
            copy_file(agent, &from, &to, top_mode(&m))?;
        }
    }
    Ok(())
}

fn copy_file(agent: &AgentClient, from: &Path, to: &str, mode: u32) -> Result<(), BackendError> {
    let mut f = std::fs::File::open(from)
        .map_err(|e| BackendError::Failed(format!("read the volume's file {}: {e}", from.display())))?;
    agent.write_file(to, &mut f, Some(mode), false).map_err(|e| mount_error("write", to, e))?;
    Ok(())
}
