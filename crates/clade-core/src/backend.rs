//! The one model both backends implement. A backend knows how to bring a sandbox up (cold from a template's
//! image, or from a mark's stored state) and how to turn a running sandbox back into stored state (mark, leave it
//! running; suspend, release it). Everything that is the same on both backends lives above this trait in
//! clade-core: the ledger records, branches, retake, fork-as-N-restores, and hygiene through the agent.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Which backend a sandbox, base or mark belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Vm,
    Ct,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Vm => "vm",
            BackendKind::Ct => "ct",
        }
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vm" => Ok(BackendKind::Vm),
            "ct" => Ok(BackendKind::Ct),
            other => Err(format!("unknown backend '{other}': use vm or ct")),
        }
    }
}

/// The resources a template asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub memory_mib: u32,
    pub vcpus: u32,
    pub disk_gib: u32,
}

/// What a backend stored for one mark: store manifests by role (`ram`, `disk`, `devstate`, `criu`, `upper`),
/// the facts a restore must match (QEMU version, machine type, CPU model; CRIU version), sizes and the pause.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MarkState {
    pub backend: BackendKind,
    pub manifests: BTreeMap<String, String>,
    /// Must equal what the restoring host offers, or the restore is refused before any process starts.
    pub compat: BTreeMap<String, String>,
    pub shape: Shape,
    /// Bytes the mark describes / bytes it added to the store.
    pub logical_bytes: u64,
    pub stored_bytes: u64,
    /// How long the sandbox did not run while being marked.
    pub pause: Duration,
    /// False when the mark keeps state that hygiene would disturb (a logged-in browser): restores then skip the
    /// identity and connection resets.
    pub clean: bool,
}

/// A restore refused or failed: always with the reason, never half-done (the backend cleans up before returning).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("mark was taken under {key}={mark}, this host has {host}: {hint}")]
    Incompatible { key: String, mark: String, host: String, hint: String },
    #[error("mark state failed verification: {0}")]
    Corrupt(String),
    #[error("sandbox did not become ready within {timeout:?}: {detail}")]
    NotReady { timeout: Duration, detail: String },
    #[error("not enough {resource}: {detail}")]
    Resource { resource: String, detail: String },
    #[error("{0}")]
    Failed(String),
    /// The backend or this sandbox cannot do what was asked; the text says why and what to do instead.
    #[error("{0}")]
    Unsupported(String),
}

/// What to do to one group of a sandbox's processes ([`Sandbox::proc_group`]): a pod member's, in a sandbox
/// its pod's other containers share (docs/kubernetes.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupOp {
    /// Stop them where they stand (containerd's Pause of the one container).
    Freeze,
    /// Continue them.
    Thaw,
    /// SIGKILL them (the container ended: what its processes left behind goes too, as a pid namespace's end
    /// takes them on runc).
    Kill,
}

/// Where [`Sandbox::attach_root`] shows roots inside a sandbox, on every backend.
pub const ROOTS_DIR: &str = "/run/clade/roots";

/// What of the sandbox's own tree each root gets, bound recursively.
pub const ROOT_SHARES: [&str; 3] = ["proc", "dev", "sys"];

/// The path inside the sandbox of the root named `name`; refused unless `name` is a plain file name.
pub fn root_path(name: &str) -> Result<std::path::PathBuf, String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !ok {
        return Err(format!(
            "{name:?} cannot name a root: use 1-128 letters, digits, '-', '_' or '.' (a container id is one)"
        ));
    }
    Ok(std::path::Path::new(ROOTS_DIR).join(name))
}

/// Where a sandbox's outbound connections may go, enforced by the host (the sandbox cannot change it): IPv4
/// addresses or CIDR blocks. An address in `allow` is reachable even when `deny` covers it (E2B's rule);
/// empty lists: every destination its network allows. Loopback is never filtered.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRules {
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
}

impl EgressRules {
    /// Every entry an IPv4 address or CIDR block (`a.b.c.d` or `a.b.c.d/n`); the first that is not, named.
    pub fn check(&self) -> Result<(), String> {
        for e in self.allow.iter().chain(&self.deny) {
            let (addr, len) = e.split_once('/').unwrap_or((e.as_str(), "32"));
            let ok = addr.parse::<std::net::Ipv4Addr>().is_ok() && len.parse::<u8>().is_ok_and(|n| n <= 32);
            if !ok {
                return Err(format!("{e:?} is not an IPv4 address or CIDR block (a.b.c.d or a.b.c.d/n)"));
            }
        }
        Ok(())
    }
    pub fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty()
    }

    /// What sandbox `id`, which has no network beyond loopback, makes of these rules: denials hold already
    /// (nothing leaves), an allowance cannot be given.
    pub fn without_network(&self, id: &str) -> Result<(), BackendError> {
        if self.allow.is_empty() {
            return Ok(());
        }
        Err(BackendError::Unsupported(format!(
            "sandbox {id} has no egress (its template's [network] egress is off): there is nothing to allow"
        )))
    }
}

/// Check a mark's recorded facts against the host's before anything starts.
pub fn check_compat(mark: &BTreeMap<String, String>, host: &BTreeMap<String, String>) -> Result<(), BackendError> {
    for (key, want) in mark {
        let have = host.get(key).map(String::as_str).unwrap_or("(none)");
        if have != want {
            return Err(BackendError::Incompatible {
                key: key.clone(),
                mark: want.clone(),
                host: have.to_string(),
                hint: format!("restore it on a host with the same {key}, or take a new base here"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn egress_rules_take_ipv4_addresses_and_blocks_only() {
        let ok = EgressRules { allow: vec!["10.0.0.1".into()], deny: vec!["0.0.0.0/0".into()] };
        assert!(ok.check().is_ok());
        for bad in ["example.com", "10.0.0.1/33", "::1", "10.0.0/8", ""] {
            let r = EgressRules { allow: vec![], deny: vec![bad.into()] };
            assert!(r.check().unwrap_err().contains("IPv4"), "{bad}");
        }
    }

    #[test]
    fn a_root_is_named_by_a_plain_file_name() {
        assert_eq!(root_path("abc-1_2.3").unwrap().to_str(), Some("/run/clade/roots/abc-1_2.3"));
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(129)] {
            assert!(root_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn compat_refuses_other_versions() {
        let mark: BTreeMap<String, String> = [("qemu".to_string(), "7.2.22".to_string())].into();
        let same = mark.clone();
        assert!(check_compat(&mark, &same).is_ok());
        let other: BTreeMap<String, String> = [("qemu".to_string(), "10.0.2".to_string())].into();
        let err = check_compat(&mark, &other).unwrap_err().to_string();
        assert!(err.contains("qemu=7.2.22") && err.contains("10.0.2"), "{err}");
        assert!(check_compat(&mark, &BTreeMap::new()).is_err());
        assert_eq!("vm".parse::<BackendKind>().unwrap(), BackendKind::Vm);
        assert!("xx".parse::<BackendKind>().is_err());
    }
}

/// What a sandbox starts from when it boots cold: the template's built artifacts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateImage {
    /// Template name and identity hash.
    pub name: String,
    pub hash: String,
    /// The root filesystem directory (the `ct` overlay's lower layer; read-only once built).
    pub rootfs: std::path::PathBuf,
    /// The ext4 disk image as a store manifest (the `vm` root disk).
    pub disk_manifest: Option<String>,
    pub shape: Shape,
    /// Whether the sandbox gets a route out (NAT egress); loopback only when false.
    pub egress: bool,
    /// ct: the jail sets `no_new_privs` (the default). A template that needs setuid programs (`sudo`) turns
    /// it off: such a program then gains at most the sandbox root's own bounded capabilities in the sandbox's
    /// user namespace (docs/security.md, "no_new_privs").
    #[serde(default = "yes")]
    pub no_new_privs: bool,
}

fn yes() -> bool {
    true
}

/// Who the new sandbox is: every sibling gets its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Identity {
    /// clade's id of the sandbox (also its run dir name under `$CLADE_HOME/run`).
    pub sandbox_id: String,
    pub hostname: String,
    /// 32 lowercase hex digits.
    pub machine_id: String,
    /// Host-supplied entropy for the guest kernel's pool.
    pub entropy: Vec<u8>,
    /// How many restores led to this sandbox (0 for a cold start).
    pub generation: u64,
    /// The sandbox continues its own line (a resume of its suspend, a retake of one of its marks) rather than
    /// starting as a new sibling: on-restore hooks see `CLADE_RESTORE=continue` and may keep what they would
    /// reset in a sibling (the browser template keeps its page and cookies).
    #[serde(default)]
    pub continues: bool,
}

/// Options of one mark.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MarkOptions {
    pub label: Option<String>,
    /// Keep state hygiene would disturb (see [`MarkState::clean`]).
    pub not_clean: bool,
    /// Keep the sandbox's disk only, not its memory or processes (E2B's filesystem-only pause): a restore of
    /// such a mark boots the disk cold ([`MarkState::boots_cold`]). A suspend ends the processes first, so the
    /// disk is taken as a clean shutdown leaves it; a mark of a running sandbox stops it only to copy its disk.
    #[serde(default)]
    pub disk_only: bool,
}

/// The manifest role that says how a mark comes back; [`BOOT_COLD`] for a disk-only mark.
pub const ROLE_BOOT: &str = "boot";
/// A disk-only mark ([`MarkOptions::disk_only`]): its restore boots the disk cold.
pub const BOOT_COLD: &str = "cold";

impl MarkState {
    /// A disk-only mark: restoring it boots its disk cold (new processes, a new boot id), as E2B's
    /// filesystem-only snapshots do.
    pub fn boots_cold(&self) -> bool {
        self.manifests.get(ROLE_BOOT).map(String::as_str) == Some(BOOT_COLD)
    }
}

/// A running sandbox, owned by whoever started it (a supervisor process, or the CLI in `clade demo`). Dropping it
/// without `kill` also ends it: nothing is left behind.
pub trait Sandbox: Send {
    fn kind(&self) -> BackendKind;
    fn id(&self) -> &str;
    /// The connected agent inside.
    fn agent(&self) -> &clade_agent::client::AgentClient;
    /// Host processes whose memory is this sandbox's (QEMU; the restored tree), for PSS/RSS accounting.
    fn pids(&self) -> Vec<u32>;
    /// Store the sandbox's state as a mark; it keeps running.
    fn mark(&mut self, opts: &MarkOptions) -> Result<MarkState, BackendError>;
    /// Mark, then stop and release CPU and memory.
    fn suspend(self: Box<Self>, opts: &MarkOptions) -> Result<MarkState, BackendError>;
    /// End the sandbox and remove everything it held on the host.
    fn kill(self: Box<Self>) -> Result<(), BackendError>;
    /// Stop running the sandbox without releasing it (a warm-pool member waits restored, hygiene done,
    /// paused). Default: the backend cannot pause; the sandbox keeps running.
    fn pause(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Continue after [`Sandbox::pause`].
    fn resume(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Stop every process of the sandbox where it stands, keeping it whole (a task paused by containerd): no CPU,
    /// memory kept, nothing answers until [`Sandbox::thaw`]. Default: the backend cannot.
    fn freeze(&mut self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported(format!("{:?} sandboxes cannot be frozen yet", self.kind())))
    }
    /// Continue after [`Sandbox::freeze`].
    fn thaw(&mut self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported(format!("{:?} sandboxes cannot be frozen yet", self.kind())))
    }
    /// Show the host directory `host` (a container image's root file system) inside the sandbox as the root
    /// `name`, for processes started with it as their root (`ExecSpec::root`): a pod's containers of different
    /// images in one sandbox (docs/kubernetes.md). Returns its path inside. Default: the backend cannot.
    fn attach_root(&mut self, _name: &str, _host: &std::path::Path) -> Result<String, BackendError> {
        Err(BackendError::Unsupported(format!(
            "{:?} sandboxes cannot show a root file system of the host (a pod's containers share the pod's image there)",
            self.kind()
        )))
    }
    /// Bind the host file or directory `host` at the absolute path `inside` of the sandbox (a Kubernetes
    /// volume: docs/kubernetes.md), read-only if asked. Default: the backend cannot.
    fn bind(&mut self, _host: &std::path::Path, _inside: &str, _readonly: bool) -> Result<(), BackendError> {
        Err(BackendError::Unsupported(format!(
            "{:?} sandboxes cannot mount a host directory (a volume) inside",
            self.kind()
        )))
    }
    /// Take away a root [`Sandbox::attach_root`] showed; one not shown is not an error.
    fn detach_root(&mut self, _name: &str) -> Result<(), BackendError> {
        Ok(())
    }
    /// Freeze, thaw or kill the group of the sandbox's processes led by `leader` (a pid inside the sandbox):
    /// those whose process group or session inside is `leader`'s, and their descendants. Answers how many
    /// processes it touched. Default: the backend cannot.
    fn proc_group(&mut self, _leader: u32, _op: GroupOp) -> Result<usize, BackendError> {
        Err(BackendError::Unsupported(format!(
            "{:?} sandboxes cannot stop a part of their processes (a pod's container pauses with its pod)",
            self.kind()
        )))
    }
    /// Why the sandbox ended on its own (its QEMU exited: its status and error text), once it has; `None` while
    /// it runs. Supervisors poll it and record the sandbox as failed with this text. Default: never.
    fn exited(&mut self) -> Option<String> {
        None
    }
    /// Replace where the sandbox's outbound connections may go ([`EgressRules`]). Default: the backend cannot.
    fn set_egress_rules(&mut self, _rules: &EgressRules) -> Result<(), BackendError> {
        Err(BackendError::Unsupported(format!("{:?} sandboxes have no egress rules yet", self.kind())))
    }
}

/// A backend: brings sandboxes up, cold or from a mark. Fork is N restores of one mark (clade-core decides
/// identities and applies hygiene through the agent; a backend adds what only it can, like vmgenid).
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// The facts of this host that a mark must match to be restored here ([`check_compat`]).
    fn host_compat(&self) -> BTreeMap<String, String>;
    /// Boot a template's image cold, with the agent answering.
    fn cold_start(&self, image: &TemplateImage, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError>;
    /// Start a sandbox from a mark (refused before anything starts when `check_compat` fails or the mark's
    /// state does not verify), with the agent answering. Hygiene is the caller's next step.
    fn restore(&self, mark: &MarkState, id: &Identity) -> Result<Box<dyn Sandbox>, BackendError>;
    /// Do everything of a restore except letting the sandbox run (a warm-pool member waits in this state):
    /// `Prepared::start` then only loads what is left and continues. `None`: this backend has no such split;
    /// call `restore`.
    fn prepare(&self, _mark: &MarkState, _id: &Identity) -> Result<Option<Box<dyn Prepared>>, BackendError> {
        Ok(None)
    }
    /// Bring into this host's caches what a restore of `mark` reads first, from the blob tier when the host
    /// lacks it (a sandbox taken from another host: it runs while the take's round trips do). Another process
    /// may restore the mark meanwhile; it finds the caches laid out or waits for them. Default: nothing.
    fn fetch_ahead(&self, _mark: &MarkState) -> Result<(), BackendError> {
        Ok(())
    }
}

/// A restore made ready up to the moment the sandbox would run; dropping it releases everything it holds.
pub trait Prepared: Send {
    fn start(self: Box<Self>) -> Result<Box<dyn Sandbox>, BackendError>;
}
