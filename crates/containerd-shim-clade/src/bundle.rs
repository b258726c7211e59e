//! An OCI bundle as the shim uses it: its `config.json` (the process to run, the annotations that choose where
//! the sandbox starts from), its root filesystem (mounted from the mounts containerd passes at create, unmounted
//! at delete), and the clade mark a sandbox for it is forked from.
//!
//! Where a sandbox starts from, first match wins (docs/kubernetes.md):
//! 1. the annotation `clade.dev/mark`: that mark (id or label), as it was marked;
//! 2. the annotation `clade.dev/template`: that template's base (built on first use);
//! 3. otherwise the image itself: its root filesystem becomes a clade template named by its content
//!    (`oci-<16 hex digits of its tree hash>`), booted cold once and marked as its base; every later container
//!    of the same image content is forked from that base instead of cold-started.
//!
//! The OCI spec's namespaces, capabilities and seccomp profile are not applied: the sandbox is clade's own jail
//! (docs/security.md), which is stricter than what an image asks for, and the same for every image. Its bind
//! mounts of host paths (volumes) are made inside the sandbox ([`Bundle::volumes`]).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use containerd_shim::protos::api::Mount;
use oci_spec::runtime::{Process, Spec};

/// The annotation naming a mark to fork.
pub const MARK_ANNOTATION: &str = "clade.dev/mark";
/// The annotation naming a template whose base to fork.
pub const TEMPLATE_ANNOTATION: &str = "clade.dev/template";
/// The annotation choosing the backend (`ct`, the default, or `vm`).
pub const BACKEND_ANNOTATION: &str = "clade.dev/backend";
/// Where the sandbox of a container is named, in its bundle: what `delete` (after the shim died) reads.
pub const SANDBOX_FILE: &str = "clade-sandbox";
/// What containerd's CRI plugin says a container is: `sandbox` (a pod's own container) or `container`.
pub const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// The pod a CRI container belongs to (its pod sandbox container's id).
pub const CRI_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

/// What a container is to the shim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// A container of its own (`ctr run`): one sandbox, taken down with the container.
    Single,
    /// A pod's sandbox container (CRI RunPodSandbox): it holds the pod's sandbox; its process is nominal.
    Pod,
    /// A container of the pod with this id: a process group in the pod's sandbox.
    Member(String),
}

/// Where a sandbox starts from: a mark, and the content hash of the image it was made from (none where an
/// annotation named the mark or template).
pub struct Origin {
    pub mark: String,
    pub content: Option<String>,
}

/// A bundle directory and its parsed `config.json`.
pub struct Bundle {
    pub dir: PathBuf,
    pub spec: Spec,
    /// What names the image's layers, when its rootfs is a fresh overlay of committed snapshots
    /// ([`layers_key`]): the image's content hash is then computed once per image, not once per container.
    pub layers: Option<String>,
}

impl Bundle {
    pub fn load(dir: &Path) -> anyhow::Result<Bundle> {
        let path = dir.join("config.json");
        let spec = Spec::load(&path)
            .map_err(|e| anyhow!("bundle {}: config.json is not an OCI runtime spec: {e}", dir.display()))?;
        Ok(Bundle { dir: dir.to_path_buf(), spec, layers: None })
    }

    /// The root filesystem: `root.path` of the spec, relative to the bundle (containerd's is `rootfs`).
    pub fn rootfs(&self) -> PathBuf {
        let rel = self.spec.root().as_ref().map(|r| r.path().clone()).unwrap_or_else(|| "rootfs".into());
        if rel.is_absolute() {
            rel
        } else {
            self.dir.join(rel)
        }
    }

    pub fn process(&self) -> anyhow::Result<&Process> {
        self.spec.process().as_ref().ok_or_else(|| anyhow!("bundle {}: config.json has no process", self.dir.display()))
    }

    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.spec.annotations().as_ref()?.get(key).map(String::as_str).filter(|v| !v.is_empty())
    }

    /// The container's role, from the CRI plugin's annotations.
    pub fn role(&self) -> Role {
        match (self.annotation(CRI_CONTAINER_TYPE), self.annotation(CRI_SANDBOX_ID)) {
            (Some("sandbox"), _) => Role::Pod,
            (Some("container"), Some(pod)) => Role::Member(pod.to_string()),
            _ => Role::Single,
        }
    }

    /// Whether an annotation names the mark or template to start from (else the image does).
    pub fn names_origin(&self) -> bool {
        self.annotation(MARK_ANNOTATION).is_some() || self.annotation(TEMPLATE_ANNOTATION).is_some()
    }

    /// The backend the annotation asks for, else `default` (the shim's `CLADE_SHIM_BACKEND`, else ct).
    pub fn backend(&self, default: BackendKind) -> anyhow::Result<BackendKind> {
        match self.annotation(BACKEND_ANNOTATION) {
            None => Ok(default),
            Some("ct") => Ok(BackendKind::Ct),
            Some("vm") => Ok(BackendKind::Vm),
            Some(other) => bail!("annotation {BACKEND_ANNOTATION}={other:?}: clade's backends are ct and vm"),
        }
    }
}

/// A bind mount of the OCI spec the shim makes inside the sandbox: a Kubernetes volume (emptyDir, configMap,
/// secret, hostPath, a projected token), or `ctr run --mount`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub source: PathBuf,
    pub destination: String,
    pub readonly: bool,
}

/// What the sandbox provides itself, so the spec's mounts there are left out: its own `/proc`, `/dev` and `/sys`,
/// and the files its network and identity write (the CRI plugin's `/etc/hosts`, `/etc/hostname` and
/// `/etc/resolv.conf` describe the node's network namespace, not the sandbox's: docs/kubernetes.md).
const SANDBOX_OWN: [&str; 6] = ["/proc", "/dev", "/sys", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"];

impl Bundle {
    /// The spec's bind mounts of host paths, less those the sandbox provides itself.
    pub fn volumes(&self) -> Vec<Volume> {
        let mounts = self.spec.mounts().clone().unwrap_or_default();
        mounts
            .iter()
            .filter_map(|m| {
                let opts = m.options().clone().unwrap_or_default();
                let bind = m.typ().as_deref() == Some("bind") || opts.iter().any(|o| o == "bind" || o == "rbind");
                let source = m.source().clone()?;
                let destination = m.destination().display().to_string();
                let own = SANDBOX_OWN.iter().any(|o| Path::new(&destination).starts_with(o));
                (bind && source.is_absolute() && !own).then(|| Volume {
                    source,
                    destination,
                    readonly: opts.iter().any(|o| o == "ro"),
                })
            })
            .collect()
    }
}

/// Mounts what containerd passed for the root filesystem (a snapshotter's overlay or bind mount) on `target`.
/// Returns whether anything was mounted (nothing: the bundle already holds its rootfs, as `ctr run --rootfs`).
/// The crate's own `mount_rootfs` forks and waits through its reaper, which this shim does not run (see main).
pub fn mount_rootfs(mounts: &[Mount], target: &Path) -> anyhow::Result<bool> {
    for m in mounts {
        std::fs::create_dir_all(target).with_context(|| format!("create {}", target.display()))?;
        mount_one(&m.type_, &m.source, &m.options, target).map_err(|e| {
            anyhow!("mount the image's root filesystem ({} {}) on {}: {e}", m.type_, m.source, target.display())
        })?;
    }
    Ok(!mounts.is_empty())
}

/// One mount(2) of a containerd mount: its options split into mount flags and the filesystem's data string.
fn mount_one(fstype: &str, source: &str, options: &[String], target: &Path) -> anyhow::Result<()> {
    use nix::mount::{mount, MsFlags};
    let (mut flags, data) = split_options(options);
    if fstype == "bind" {
        flags |= MsFlags::MS_BIND;
    }
    let data = data.join(",");
    if data.len() >= 4096 {
        bail!(
            "its options are {} bytes, over the kernel's page for mount data (an image of very many layers)",
            data.len()
        );
    }
    let fstype = (!flags.contains(MsFlags::MS_BIND)).then_some(fstype);
    let data = (!data.is_empty()).then_some(data.as_str());
    mount(Some(source), target, fstype, flags & !MsFlags::MS_RDONLY, data)?;
    // A read-only bind takes a second pass (the kernel ignores MS_RDONLY on the first bind).
    if flags.contains(MsFlags::MS_RDONLY) {
        let again =
            if flags.contains(MsFlags::MS_BIND) { MsFlags::MS_BIND | MsFlags::MS_REMOUNT } else { MsFlags::MS_REMOUNT };
        mount(None::<&str>, target, None::<&str>, flags | again, data)?;
    }
    Ok(())
}

/// Splits mount(8)-style options into mount flags and what is left for the filesystem (overlay's
/// `lowerdir=`, `upperdir=`, `workdir=`, `index=off` ...).
fn split_options(options: &[String]) -> (nix::mount::MsFlags, Vec<String>) {
    use nix::mount::MsFlags;
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for o in options {
        let (set, clear) = match o.as_str() {
            "ro" => (MsFlags::MS_RDONLY, MsFlags::empty()),
            "rw" => (MsFlags::empty(), MsFlags::MS_RDONLY),
            "bind" => (MsFlags::MS_BIND, MsFlags::empty()),
            "rbind" => (MsFlags::MS_BIND | MsFlags::MS_REC, MsFlags::empty()),
            "nosuid" => (MsFlags::MS_NOSUID, MsFlags::empty()),
            "nodev" => (MsFlags::MS_NODEV, MsFlags::empty()),
            "noexec" => (MsFlags::MS_NOEXEC, MsFlags::empty()),
            "noatime" => (MsFlags::MS_NOATIME, MsFlags::empty()),
            "relatime" => (MsFlags::MS_RELATIME, MsFlags::empty()),
            "suid" | "dev" | "exec" | "defaults" => (MsFlags::empty(), MsFlags::empty()),
            _ => {
                data.push(o.clone());
                continue;
            }
        };
        flags = (flags | set) & !clear;
    }
    (flags, data)
}

/// Unmounts the root filesystem mounted by [`mount_rootfs`]; nothing mounted there is not an error.
pub fn unmount_rootfs(target: &Path) {
    use nix::mount::{umount2, MntFlags};
    while umount2(target, MntFlags::MNT_DETACH).is_ok() {}
}

/// The mark a sandbox for `bundle` starts from (see the module doc), building the image's base when it has none;
/// `say` gets the build's progress lines.
pub fn origin(home: &CladeHome, bundle: &Bundle, backend: BackendKind, say: &dyn Fn(String)) -> anyhow::Result<Origin> {
    if let Some(mark) = bundle.annotation(MARK_ANNOTATION) {
        return Ok(Origin { mark: mark.to_string(), content: None });
    }
    let (key, content) = match bundle.annotation(TEMPLATE_ANNOTATION) {
        Some(t) => (t.to_string(), None),
        None => {
            let rootfs = bundle.rootfs();
            let content = bundle.content(home)?;
            match template_of_content(home, &content) {
                Some(hash) => (hash, Some(content)),
                None => (image_template(home, &rootfs, &content)?.display().to_string(), Some(content)),
            }
        }
    };
    let base = clade_host::base::build(home, &key, backend, false, say)
        .with_context(|| format!("the base of {key} on {}", backend.as_str()))?;
    Ok(Origin { mark: base.mark, content })
}

impl Bundle {
    /// The content hash of the container's image: from the cache of its layers where they name it (see
    /// [`Bundle::layers`]), else computed over the mounted rootfs (and cached for the layers).
    pub fn content(&self, home: &CladeHome) -> anyhow::Result<String> {
        use sha2::Digest;
        let Some(layers) = &self.layers else { return content_of(&self.rootfs()) };
        let key = format!("layers-{:x}", sha2::Sha256::digest(layers.as_bytes()));
        cached_content(home, &key, &self.rootfs())
    }
}

/// The content hash of `rootfs` kept under `$CLADE_HOME/shim/content/<key>`: read when there, else computed
/// and written (a temp name renamed into place; a failed write only costs the next caller the hash again).
fn cached_content(home: &CladeHome, key: &str, rootfs: &Path) -> anyhow::Result<String> {
    let dir = home.root().join("shim/content");
    let file = dir.join(key);
    if let Ok(c) = std::fs::read_to_string(&file) {
        return Ok(c.trim().to_string());
    }
    let c = content_of(rootfs)?;
    if write_atomic(&file, c.as_bytes()).is_err() {
        log::warn!("could not cache a content hash in {}", dir.display());
    }
    Ok(c)
}

/// Writes `data` to `path` under a temp name renamed into place (parents created).
fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

/// The key of an image's layers: the `lowerdir=` of a snapshotter's overlay whose upper directory is still
/// empty (a container's fresh snapshot over committed, immutable layers). None for anything else (a bind mount,
/// a rootfs already written to), whose content is hashed each time.
pub fn layers_key(mounts: &[Mount]) -> Option<String> {
    let [m] = mounts else { return None };
    if m.type_ != "overlay" {
        return None;
    }
    let opt = |k: &str| m.options.iter().find_map(|o| o.strip_prefix(k)).map(str::to_string);
    let (lower, upper) = (opt("lowerdir=")?, opt("upperdir=")?);
    let empty = std::fs::read_dir(&upper).ok()?.next().is_none();
    empty.then_some(lower)
}

/// The content hash of an image's root filesystem (what names its template).
pub fn content_of(rootfs: &Path) -> anyhow::Result<String> {
    clade_template::identity::tree_hash(rootfs, true)
        .map_err(|e| anyhow!("read the image's root filesystem {}: {e}", rootfs.display()))
}

/// The built template (its hash) whose root filesystem has exactly `content`: an image exported from a clade
/// template (or one built from the same files) starts from that template's base, services and warm-up
/// included. Each template's content hash is computed once and kept in `$CLADE_HOME/shim/content/<hash>`
/// (a template's files never change under its hash).
pub fn template_of_content(home: &CladeHome, content: &str) -> Option<String> {
    let templates = clade_template::catalog::list(home).ok()?;
    templates.into_iter().find(|t| cached_content(home, &t.hash, &t.rootfs).is_ok_and(|c| c == content)).map(|t| t.hash)
}

/// A clade template spec whose source is `rootfs` (of content hash `content`), named by that content, written
/// under `$CLADE_HOME/shim/templates/`. Returns the spec's directory.
pub fn image_template(home: &CladeHome, rootfs: &Path, content: &str) -> anyhow::Result<PathBuf> {
    if !rootfs.join("bin").exists() && !rootfs.join("usr").exists() && !rootfs.join("etc").exists() {
        bail!(
            "the image's root filesystem at {} has no /bin, /usr or /etc: clade starts sandboxes from Linux \
             root filesystems, and an image of a single static binary is not one (add a base layer such as busybox)",
            rootfs.display()
        );
    }
    let name = format!("oci-{}", &content[..16]);
    let dir = home.root().join("shim/templates").join(&name);
    let rootfs = rootfs.to_str().ok_or_else(|| anyhow!("the rootfs path {} is not UTF-8", rootfs.display()))?;
    // serde_json's string quoting is a valid TOML basic string for any path.
    let text = format!(
        "# Written by containerd-shim-clade-v2: an OCI image's root filesystem, named by its content.\n\
         name = {}\nfrom = {}\n",
        serde_json::to_string(&name)?,
        serde_json::to_string(&format!("dir:{rootfs}"))?
    );
    let spec = dir.join("template.toml");
    write_atomic(&spec, text.as_bytes()).with_context(|| format!("write {}", spec.display()))?;
    Ok(dir)
}

/// The user of the image's `/etc/passwd` with `uid` (clade's agent runs processes as users by name); uid 0 is
/// the agent's default, root.
pub fn user_name(rootfs: &Path, uid: u32) -> anyhow::Result<Option<String>> {
    if uid == 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string(rootfs.join("etc/passwd")).unwrap_or_default();
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && f[2].parse() == Ok(uid))
        .map(|f| Some(f[0].to_string()))
        .ok_or_else(|| {
            anyhow!("uid {uid} has no line in the image's /etc/passwd: clade runs a container's process as a user of its image")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_by_uid_from_the_images_passwd() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
        )
        .unwrap();
        assert_eq!(user_name(d.path(), 0).unwrap(), None);
        assert_eq!(user_name(d.path(), 1000).unwrap().as_deref(), Some("user"));
        let err = user_name(d.path(), 4242).unwrap_err().to_string();
        assert!(err.contains("uid 4242"), "{err}");
    }

    #[test]
    fn an_image_template_is_named_by_content_and_a_bad_rootfs_is_refused() {
        let home = tempfile::tempdir().unwrap();
        let home = CladeHome::at(home.path());
        let a = tempfile::tempdir().unwrap();
        std::fs::create_dir(a.path().join("bin")).unwrap();
        std::fs::write(a.path().join("bin/x"), "one").unwrap();
        let t = |p: &Path| image_template(&home, p, &content_of(p).unwrap());
        let t1 = t(a.path()).unwrap();
        let spec = clade_template::TemplateSpec::load(&t1.join("template.toml")).unwrap();
        assert!(spec.name.starts_with("oci-") && spec.name.len() == 20, "{}", spec.name);
        assert_eq!(t1, t(a.path()).unwrap(), "the same content, the same template");
        std::fs::write(a.path().join("bin/x"), "two").unwrap();
        assert_ne!(t1, t(a.path()).unwrap(), "other content, another template");
        let empty = tempfile::tempdir().unwrap();
        let err = t(empty.path()).unwrap_err().to_string();
        assert!(err.contains("no /bin, /usr or /etc"), "{err}");
    }

    #[test]
    fn volumes_are_the_specs_bind_mounts_less_what_the_sandbox_provides() {
        let d = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["sh"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "root": {"path": "rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev/shm", "type": "bind", "source": "/run/shm", "options": ["rbind"]},
                {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/x/hosts", "options": ["rbind", "ro"]},
                {"destination": "/data", "type": "bind", "source": "/var/lib/kubelet/pods/p/volumes/d", "options": ["rbind", "rw"]},
                {"destination": "/conf/app.conf", "source": "/srv/app.conf", "options": ["rbind", "ro"]},
                {"destination": "/rel", "type": "bind", "source": "relative", "options": ["bind"]},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}
            ]
        });
        std::fs::write(d.path().join("config.json"), config.to_string()).unwrap();
        let b = Bundle::load(d.path()).unwrap();
        let v = |s: &str, d: &str, readonly| Volume { source: s.into(), destination: d.into(), readonly };
        assert_eq!(
            b.volumes(),
            vec![v("/var/lib/kubelet/pods/p/volumes/d", "/data", false), v("/srv/app.conf", "/conf/app.conf", true)]
        );
    }

    #[test]
    fn mount_options_split_into_flags_and_data() {
        use nix::mount::MsFlags;
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (f, d) = split_options(&o(&["index=off", "lowerdir=/a:/b", "upperdir=/u", "workdir=/w", "nosuid"]));
        assert_eq!(f, MsFlags::MS_NOSUID);
        assert_eq!(d, o(&["index=off", "lowerdir=/a:/b", "upperdir=/u", "workdir=/w"]));
        let (f, d) = split_options(&o(&["rbind", "ro"]));
        assert_eq!(f, MsFlags::MS_BIND | MsFlags::MS_REC | MsFlags::MS_RDONLY);
        assert!(d.is_empty());
        assert_eq!(split_options(&o(&["ro", "rw"])).0, MsFlags::empty(), "the last of ro/rw wins");
    }
}
