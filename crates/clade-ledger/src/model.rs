//! The rows the ledger records, as plain serde structs: what callers read back and what the CLI
//! prints with `--json`. `New*` structs are what a caller fills in to create a row; the ledger adds
//! ids (when not given) and timestamps.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::clock::UnixMillis;
use crate::ids::{BranchId, LeaseId, ManifestId, MarkId, OpId, SandboxId, TemplateId};

/// Which backend a sandbox, base or mark belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// QEMU microVM.
    Vm,
    /// Namespace container checkpointed by CRIU.
    Ct,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vm => "vm",
            Backend::Ct => "ct",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "vm" => Some(Backend::Vm),
            "ct" => Some(Backend::Ct),
            _ => None,
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a sandbox is in its life. `dead` is final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Starting,
    Running,
    Suspended,
    Failed,
    Dead,
}

impl SandboxState {
    pub const ALL: [SandboxState; 5] = [
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Suspended,
        SandboxState::Failed,
        SandboxState::Dead,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Suspended => "suspended",
            SandboxState::Failed => "failed",
            SandboxState::Dead => "dead",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }
    /// Starting, running or suspended: the sandbox still needs what it was loaded from.
    pub fn is_live(self) -> bool {
        matches!(self, SandboxState::Starting | SandboxState::Running | SandboxState::Suspended)
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a branch's marks are let go (`retain` and `thin`: docs/ledger.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RetentionPolicy {
    /// Keep the newest `retain` marks (pins count among them); `None` keeps every mark.
    pub retain: Option<u32>,
    /// Past the newest `retain`, keep one mark per calendar hour for a day and one per UTC day for
    /// 30 days (each bucket's oldest) instead of cutting. Needs `retain`.
    pub thin: bool,
}

impl RetentionPolicy {
    /// Keep everything (the default).
    pub const KEEP_ALL: RetentionPolicy = RetentionPolicy { retain: None, thin: false };
    pub fn retain(n: u32) -> Self {
        Self { retain: Some(n), thin: false }
    }
    pub fn thin(n: u32) -> Self {
        Self { retain: Some(n), thin: true }
    }
}

/// How to make a root filesystem. `id` is the hash of everything that shapes it (the caller's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Template {
    pub id: TemplateId,
    pub name: String,
    /// The template's description, as the caller defines it.
    pub spec: serde_json::Value,
    pub created_ms: UnixMillis,
}

/// A template booted once, provisioned and marked, per backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Base {
    pub template: TemplateId,
    pub backend: Backend,
    pub mark: MarkId,
    pub created_ms: UnixMillis,
}

/// A running (or once running) instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: SandboxId,
    pub backend: Backend,
    pub branch: BranchId,
    /// The mark it was started or last restored from; kept while the sandbox is live.
    pub origin_mark: Option<MarkId>,
    pub state: SandboxState,
    pub supervisor_pid: Option<u32>,
    pub host: Option<String>,
    /// Why it failed, when `state` is `failed` (or the last error seen).
    pub error: Option<String>,
    pub created_ms: UnixMillis,
    pub last_active_ms: UnixMillis,
}

/// What a caller gives to record a new sandbox (state `starting`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewSandbox {
    /// `None`: the ledger generates one.
    pub id: Option<SandboxId>,
    pub backend: Backend,
    pub branch: BranchId,
    pub origin_mark: Option<MarkId>,
    pub supervisor_pid: Option<u32>,
    pub host: Option<String>,
}

/// A line of marks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Branch {
    pub id: BranchId,
    pub name: Option<String>,
    /// The mark this branch was forked at (`None` for a root branch).
    pub parent_mark: Option<MarkId>,
    /// The mark a restore of this branch takes: its newest mark, or the one a retake went back to;
    /// at first the fork mark.
    pub head_mark: Option<MarkId>,
    pub policy: RetentionPolicy,
    pub created_ms: UnixMillis,
    /// Set when the branch was deleted; its own marks go at the next collection.
    pub deleted_ms: Option<UnixMillis>,
}

/// What a caller gives to create a branch.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NewBranch {
    pub id: Option<BranchId>,
    pub name: Option<String>,
    pub parent_mark: Option<MarkId>,
    pub policy: RetentionPolicy,
}

/// An immutable checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mark {
    pub id: MarkId,
    pub branch: BranchId,
    pub label: Option<String>,
    pub parent: Option<MarkId>,
    pub backend: Backend,
    /// Role ("ram", "disk", "devstate", "criu", "upper", ...) -> store manifest or tree id.
    pub manifests: BTreeMap<String, ManifestId>,
    /// Bytes the mark describes (guest RAM + disk size, image dir size).
    pub logical_bytes: u64,
    /// Bytes the store newly wrote for it (what deleting it may give back).
    pub stored_bytes: u64,
    /// How long the sandbox was paused to take it.
    pub pause_ms: Option<u64>,
    /// Other timings (e.g. `{"dump_ms": 40, "store_ms": 90}`), as the caller names them.
    pub timings: serde_json::Value,
    pub created_ms: UnixMillis,
    /// Pinned by the agent (`keep`): never thinned (the newest 20 pins of a branch).
    pub pinned: bool,
    /// The caller vouches the mark is consistent (e.g. guest filesystems were synced or frozen while
    /// it was taken); `false` means crash-consistent only.
    pub clean: bool,
}

/// What a caller gives to record a mark. It becomes the branch's head.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewMark {
    pub id: Option<MarkId>,
    pub branch: BranchId,
    pub label: Option<String>,
    /// `None`: the branch's current head.
    pub parent: Option<MarkId>,
    pub backend: Backend,
    pub manifests: BTreeMap<String, ManifestId>,
    pub logical_bytes: u64,
    pub stored_bytes: u64,
    pub pause_ms: Option<u64>,
    pub timings: serde_json::Value,
    pub pinned: bool,
    pub clean: bool,
}

impl NewMark {
    /// A mark on `branch` with no manifests, sizes or timings yet; fill the fields you have.
    pub fn on(branch: BranchId, backend: Backend) -> Self {
        Self {
            id: None,
            branch,
            label: None,
            parent: None,
            backend,
            manifests: BTreeMap::new(),
            logical_bytes: 0,
            stored_bytes: 0,
            pause_ms: None,
            timings: serde_json::Value::Object(Default::default()),
            pinned: false,
            clean: false,
        }
    }
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
    pub fn manifest(mut self, role: impl Into<String>, id: impl Into<ManifestId>) -> Self {
        self.manifests.insert(role.into(), id.into());
        self
    }
    pub fn sizes(mut self, logical_bytes: u64, stored_bytes: u64) -> Self {
        self.logical_bytes = logical_bytes;
        self.stored_bytes = stored_bytes;
        self
    }
    pub fn pinned(mut self, pinned: bool) -> Self {
        self.pinned = pinned;
        self
    }
}

/// What a lease holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseTarget {
    /// A mark (and so all its manifests), e.g. one being restored.
    Mark(MarkId),
    /// One store object no mark names yet, e.g. a manifest being written.
    Manifest(ManifestId),
}

/// Something holding a mark or manifest alive until it is released or expires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub id: LeaseId,
    /// Who holds it (e.g. "restore sb-…", "daemon pid 123").
    pub holder: String,
    pub target: LeaseTarget,
    pub created_ms: UnixMillis,
    /// `None`: held until released.
    pub expires_ms: Option<UnixMillis>,
}

/// One entry of the operations log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    pub id: OpId,
    pub op: String,
    pub sandbox: Option<SandboxId>,
    pub mark: Option<MarkId>,
    pub started_ms: UnixMillis,
    pub duration_ms: u64,
    pub ok: bool,
    pub error: Option<String>,
    /// Phase timings and other facts, as the caller names them.
    pub details: serde_json::Value,
}

/// What a caller gives to log an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewOp {
    pub op: String,
    pub sandbox: Option<SandboxId>,
    pub mark: Option<MarkId>,
    /// `None`: now minus `duration_ms`.
    pub started_ms: Option<UnixMillis>,
    pub duration_ms: u64,
    /// `None` for success, the error's text otherwise.
    pub error: Option<String>,
    pub details: serde_json::Value,
}

impl NewOp {
    /// A successful operation that took `duration_ms`.
    pub fn ok(op: impl Into<String>, duration_ms: u64) -> Self {
        Self {
            op: op.into(),
            sandbox: None,
            mark: None,
            started_ms: None,
            duration_ms,
            error: None,
            details: serde_json::Value::Object(Default::default()),
        }
    }
    /// A failed operation.
    pub fn failed(op: impl Into<String>, duration_ms: u64, error: impl Into<String>) -> Self {
        Self { error: Some(error.into()), ..Self::ok(op, duration_ms) }
    }
    pub fn sandbox(mut self, id: SandboxId) -> Self {
        self.sandbox = Some(id);
        self
    }
    pub fn mark(mut self, id: MarkId) -> Self {
        self.mark = Some(id);
        self
    }
    pub fn details(mut self, details: serde_json::Value) -> Self {
        self.details = details;
        self
    }
}
