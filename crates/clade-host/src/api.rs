//! The sandbox operations as one typed interface, [`SandboxApi`], with the requests and answers every face shares.
//! [`crate::Ops`] implements it in-process; `clade_api::client::Remote` implements it over `clade serve`'s HTTP
//! API. The CLI holds one `&dyn SandboxApi` and cannot tell them apart, so the local and remote faces cannot
//! drift: the same operation, the same answer type, the same error kinds.
//!
//! The answer types are what the HTTP API's bodies are (`docs/openapi.json` is checked against them by
//! clade-api's tests) and what `--json` prints.

use std::collections::BTreeMap;

use clade_core::backend::{BackendKind, Shape};
use clade_ledger::{BranchId, MarkId, UnixMillis};
use serde::{Deserialize, Serialize};

pub use crate::audit::{AuditReport, Finding};
pub use crate::gc::GcOutcome;
pub use crate::roam::{Beat, HostRow, Owner, PullOutcome, PushOutcome, RoamRow};
pub use crate::siblings::{Control, SiblingAudit};
pub use crate::supervisor::protocol::{ProcListing, ProcSpec, Ready};
pub use clade_agent::proto::{DirEntry, FileOwner, FileStat, FileType, WriteOptions};
pub use clade_core::backend::EgressRules;
pub use clade_ledger::Mark;

/// A command to run in a sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Bytes for stdin (closed after), as UTF-8 text.
    #[serde(default)]
    pub stdin: Option<String>,
    /// The HTTP API streams output as it comes (NDJSON lines) instead of answering once at the end.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// The HTTP API kills a non-streamed command past this many milliseconds (at most the daemon's
    /// `--exec-timeout`, which applies when this is absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl ExecRequest {
    /// What the agent could not start is refused here, naming the field: an empty command, NUL bytes (a C string
    /// cannot carry them), an environment name that is empty or holds `=`.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.argv.first().is_none_or(|a| a.is_empty()) {
            return Err(crate::error::invalid("argv: exec needs a command (a non-empty argv[0])"));
        }
        if let Some(i) = self.argv.iter().position(|a| a.contains('\0')) {
            return Err(crate::error::invalid(format!("argv[{i}]: contains a NUL byte")));
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(crate::error::invalid(format!(
                    "env: the name {k:?} must be non-empty, without '=' or NUL"
                )));
            }
            if v.contains('\0') {
                return Err(crate::error::invalid(format!("env[{k:?}]: contains a NUL byte")));
            }
        }
        if self.cwd.as_deref().is_some_and(|c| c.contains('\0') || !c.starts_with('/')) {
            return Err(crate::error::invalid("cwd: must be an absolute path without NUL bytes"));
        }
        Ok(())
    }
}

/// How a command ended, with all its output.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecOutput {
    /// The exit code, or 128 + the signal that ended it.
    pub code: i32,
    pub signal: Option<i32>,
    #[serde(with = "lossy")]
    pub stdout: Vec<u8>,
    #[serde(with = "lossy")]
    pub stderr: Vec<u8>,
}

/// One thing a streamed command produced.
#[derive(Debug, Clone)]
pub enum ExecEvent {
    Pid(u32),
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit { code: i32, signal: Option<i32> },
}

impl ExecEvent {
    /// One NDJSON line of the HTTP API's streamed exec.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            ExecEvent::Pid(p) => serde_json::json!({"pid": p}),
            ExecEvent::Stdout(d) => serde_json::json!({"stdout": String::from_utf8_lossy(d)}),
            ExecEvent::Stderr(d) => serde_json::json!({"stderr": String::from_utf8_lossy(d)}),
            ExecEvent::Exit { code, signal } => serde_json::json!({"exit": {"code": code, "signal": signal}}),
        }
    }

    /// The event an NDJSON line of [`ExecEvent::to_json`] holds (`None` for anything else, e.g. an error line).
    pub fn from_json(v: &serde_json::Value) -> Option<ExecEvent> {
        let text = |k: &str| v[k].as_str().map(|s| s.as_bytes().to_vec());
        if let Some(p) = v["pid"].as_u64() {
            return Some(ExecEvent::Pid(p as u32));
        }
        if let Some(d) = text("stdout") {
            return Some(ExecEvent::Stdout(d));
        }
        if let Some(d) = text("stderr") {
            return Some(ExecEvent::Stderr(d));
        }
        let exit = v.get("exit")?;
        let signal = exit["signal"].as_i64().map(|s| s as i32);
        Some(ExecEvent::Exit { code: exit["code"].as_i64().map_or(128 + signal.unwrap_or(0), |c| c as i32), signal })
    }
}

/// Output bytes shown as text (invalid UTF-8 replaced) in JSON; scripts wanting bytes use the files routes.
mod lossy {
    pub fn serialize<S: serde::Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&String::from_utf8_lossy(b))
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s: String = serde::Deserialize::deserialize(d)?;
        Ok(s.into_bytes())
    }
}

/// A streamed command's events, as they come.
pub type ExecEvents = Box<dyn Iterator<Item = anyhow::Result<ExecEvent>> + Send>;

/// Start `count` siblings of a mark.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// A mark id or label, or a template name (its base on `backend`).
    pub from: String,
    #[serde(default)]
    pub backend: Option<BackendKind>,
    #[serde(default = "one")]
    pub count: u32,
    /// When the host lacks memory or CPU, suspend the idlest sandboxes to make room (else: refused).
    #[serde(default)]
    pub make_room: bool,
}

fn one() -> u32 {
    1
}

impl ForkRequest {
    pub fn new(from: impl Into<String>, backend: Option<BackendKind>, count: u32) -> ForkRequest {
        ForkRequest { from: from.into(), backend, count, make_room: false }
    }

    /// At least one sandbox, at most 256 in one fork.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.count == 0 {
            return Err(crate::error::invalid("count must be at least 1"));
        }
        if self.count > 256 {
            return Err(crate::error::invalid(format!("count {} is more than 256 sandboxes in one fork", self.count)));
        }
        Ok(())
    }
}

/// What a fork started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkOutcome {
    /// The mark the siblings were restored from.
    pub mark: MarkId,
    pub backend: BackendKind,
    /// The shape every sibling has (the mark's: memory, vCPUs, disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Shape>,
    pub total_ms: f64,
    pub sandboxes: Vec<Ready>,
    /// Sandboxes suspended to admit these (only with `make_room`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspended_to_make_room: Vec<String>,
}

impl ForkOutcome {
    /// The sandboxes that did not come up.
    pub fn failed(&self) -> usize {
        self.sandboxes.iter().filter(|r| !r.ok).count()
    }
}

/// One sandbox as `ls` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRow {
    pub id: String,
    pub backend: BackendKind,
    /// starting, running, suspended, failed, dead, or `lost` (running in the ledger, its supervisor gone).
    pub state: String,
    /// The mark it was restored from.
    pub origin: Option<MarkId>,
    pub branch: BranchId,
    pub supervisor_pid: Option<u32>,
    pub error: Option<String>,
    pub created_ms: UnixMillis,
    pub last_active_ms: UnixMillis,
}

/// One sandbox, with its live supervisor's facts while it runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxInfo {
    #[serde(flatten)]
    pub row: SandboxRow,
    #[serde(flatten)]
    pub live: Option<LiveFacts>,
}

/// What a running sandbox's supervisor reports.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LiveFacts {
    /// Host pids of the sandbox (a vm's QEMU; a ct sandbox's processes).
    pub pids: Vec<u32>,
    /// Summed over those pids, bytes.
    pub pss: u64,
    pub rss: u64,
    /// vCPUs its processes kept busy since the last measure (CPU seconds over wall seconds).
    #[serde(default)]
    pub cpu_busy: f64,
    /// The agent's hello (its version and the guest's facts).
    #[serde(default)]
    pub hello: serde_json::Value,
    /// How many restores this sandbox has had (a retake starts the next).
    pub generation: u64,
    pub last_activity_ms: u64,
    /// Bytes and reads this sandbox fetched from the blob tier.
    #[serde(default)]
    pub blob_fetched: serde_json::Value,
    /// Frozen ([`SandboxApi::freeze`]): its processes stand still until a thaw.
    #[serde(default)]
    pub frozen: bool,
}

/// Take a mark of a running sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MarkRequest {
    #[serde(default)]
    pub label: Option<String>,
    /// Never thinned away (a pin).
    #[serde(default)]
    pub keep: bool,
    /// State hygiene would disturb is kept: restores skip identity and connection resets.
    #[serde(default)]
    pub not_clean: bool,
    /// Keep the disk alone, not memory or processes: a sandbox from this mark boots its disk cold (E2B's
    /// filesystem-only snapshot). The sandbox stops only while its disk is copied.
    #[serde(default)]
    pub disk_only: bool,
}

/// Events of a directory watch ([`SandboxApi::watch_events`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WatchBatch {
    /// In the order they happened; names relative to the watched directory.
    pub events: Vec<clade_agent::proto::WatchEvent>,
    /// Some may be missing before these (the kernel's queue overflowed, or a ct mark re-armed the watch).
    #[serde(default)]
    pub lost: bool,
}

/// Start a directory watch.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchRequest {
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
}

/// Resume a suspended sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// Boot its disk cold instead of restoring its memory (E2B's `on_resume="reboot"`): its files as suspended,
    /// new processes, a new boot id. A disk-only suspend boots cold either way.
    #[serde(default)]
    pub reboot: bool,
}

/// Suspend a running sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SuspendRequest {
    /// Keep the disk alone: its processes end now and the resume boots the disk cold, with a new boot id (E2B's
    /// filesystem-only pause). Default: the whole sandbox, memory and processes included.
    #[serde(default)]
    pub disk_only: bool,
}

/// One mark as `marks` lists it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MarkRow {
    pub id: MarkId,
    pub branch: BranchId,
    pub label: Option<String>,
    pub parent: Option<MarkId>,
    pub backend: BackendKind,
    pub pause_ms: Option<u64>,
    pub logical_bytes: u64,
    pub stored_bytes: u64,
    pub created_ms: UnixMillis,
    pub pinned: bool,
    pub clean: bool,
    /// A disk-only mark: a sandbox from it boots its disk cold.
    #[serde(default)]
    pub disk_only: bool,
}

impl From<&Mark> for MarkRow {
    fn from(m: &Mark) -> MarkRow {
        MarkRow {
            id: m.id.clone(),
            branch: m.branch.clone(),
            label: m.label.clone(),
            parent: m.parent.clone(),
            backend: clade_core::engine::from_ledger(m.backend),
            pause_ms: m.pause_ms,
            logical_bytes: m.logical_bytes,
            stored_bytes: m.stored_bytes,
            created_ms: m.created_ms,
            pinned: m.pinned,
            clean: m.clean,
            disk_only: m.manifests.get(clade_core::backend::ROLE_BOOT).map(|v| v.as_str())
                == Some(clade_core::backend::BOOT_COLD),
        }
    }
}

/// A retake: the sandbox is back at `mark`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RetakeOutcome {
    pub mark: MarkId,
    pub retake_ms: f64,
}

/// A resume of a suspended sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResumeOutcome {
    pub sandbox: String,
    pub mark: MarkId,
    pub ok: bool,
    pub error: Option<String>,
    pub resume_ms: f64,
    /// Bytes fetched from the blob tier up to ready.
    pub blob_bytes: u64,
    /// The pull that brought it to this host first, when another host had pushed it.
    #[serde(default)]
    pub pulled: Option<PullOutcome>,
}

/// A kill.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KillOutcome {
    pub killed: String,
    /// Processes a dead supervisor had left behind, ended now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reaped: Option<usize>,
    /// Everything of a dead supervisor's sandbox taken down (processes, mounts, network, run dirs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_down: Option<usize>,
}

/// One branch with its head.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BranchRow {
    pub id: BranchId,
    pub name: Option<String>,
    pub parent_mark: Option<MarkId>,
    pub head_mark: Option<MarkId>,
    pub marks: usize,
    pub created_ms: UnixMillis,
}

/// What `kill_all` ended, and what it could not.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct KillAllOutcome {
    pub killed: Vec<String>,
    pub failed: Vec<KillFailure>,
    pub took_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KillFailure {
    pub sandbox: String,
    pub error: String,
}

/// A deleted branch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Deleted {
    pub deleted: String,
}

/// The operations on sandboxes, marks and branches, local or remote (see the module doc). Every error carries a
/// `clade_core::ErrorKind` ([`crate::error::kind`]).
pub trait SandboxApi: Send + Sync {
    /// Start `count` siblings of a mark (or of a template's base).
    fn fork(&self, req: &ForkRequest) -> anyhow::Result<ForkOutcome>;
    /// One sandbox, with its supervisor's facts while it runs.
    fn get(&self, sandbox: &str) -> anyhow::Result<SandboxInfo>;
    /// One sandbox's record, without asking its supervisor (cheaper than [`SandboxApi::get`]).
    fn state(&self, sandbox: &str) -> anyhow::Result<SandboxRow> {
        self.get(sandbox).map(|i| i.row)
    }
    /// Every sandbox not dead.
    fn list(&self) -> anyhow::Result<Vec<SandboxRow>>;
    /// Run a command to its end.
    fn exec(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecOutput>;
    /// Start a command and stream its events as they come: `Pid`, output chunks, then `Exit`. Dropping the
    /// iterator detaches; the process keeps running.
    fn exec_stream(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecEvents>;
    /// A file of the sandbox as a stream: its size, and a reader of its bytes.
    fn open_file(&self, sandbox: &str, path: &str) -> anyhow::Result<(u64, Box<dyn std::io::Read + Send>)>;
    /// Write a file of the sandbox from a stream (created or replaced whole: a failed upload leaves the old
    /// file, and attributes of the old file do not carry over); the bytes written. `opts`: its mode, owner
    /// (also of the parents created for it) and `user.` extended attributes.
    fn write_file_from(
        &self,
        sandbox: &str,
        path: &str,
        opts: &WriteOptions,
        src: &mut dyn std::io::Read,
    ) -> anyhow::Result<u64>;
    /// Checkpoint a running sandbox; it keeps running.
    fn mark(&self, sandbox: &str, req: &MarkRequest) -> anyhow::Result<Mark>;
    /// Take a sandbox back to an earlier mark of its branch.
    fn retake(&self, sandbox: &str, to: &str) -> anyhow::Result<RetakeOutcome>;
    /// Mark a sandbox and release its CPU and memory; the mark it can resume from.
    fn suspend(&self, sandbox: &str) -> anyhow::Result<Mark> {
        self.suspend_with(sandbox, &SuspendRequest::default())
    }
    /// [`SandboxApi::suspend`] with options (a disk-only suspend).
    fn suspend_with(&self, sandbox: &str, req: &SuspendRequest) -> anyhow::Result<Mark>;
    /// Bring a suspended sandbox back from its branch's head.
    fn resume(&self, sandbox: &str) -> anyhow::Result<ResumeOutcome> {
        self.resume_with(sandbox, &ResumeRequest::default())
    }
    /// [`SandboxApi::resume`] with options (a reboot from the disk).
    fn resume_with(&self, sandbox: &str, req: &ResumeRequest) -> anyhow::Result<ResumeOutcome>;
    /// End a sandbox.
    fn kill(&self, sandbox: &str) -> anyhow::Result<KillOutcome>;
    /// End every sandbox not dead, several at once (each kill mostly waits on its supervisor's teardown).
    fn kill_all(&self) -> anyhow::Result<KillAllOutcome> {
        let start = std::time::Instant::now();
        let ids: Vec<String> = self.list()?.into_iter().map(|r| r.id).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let out = parking_lot::Mutex::new(KillAllOutcome::default());
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        let workers = ids.len().min((cores * 4).clamp(4, 32));
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(id) = ids.get(i) else { return };
                    match self.kill(id) {
                        Ok(_) => out.lock().killed.push(id.clone()),
                        // Ended meanwhile by someone else: not a failure of this call.
                        Err(e) if crate::error::kind(&e) == clade_core::ErrorKind::NotFound => {}
                        Err(e) => out.lock().failed.push(KillFailure { sandbox: id.clone(), error: format!("{e:#}") }),
                    }
                });
            }
        });
        let mut out = out.into_inner();
        out.killed.sort();
        out.took_ms = start.elapsed().as_secs_f64() * 1e3;
        Ok(out)
    }
    /// The marks of one sandbox's branch, or of every branch.
    fn marks(&self, sandbox: Option<&str>) -> anyhow::Result<Vec<MarkRow>>;
    /// One mark, by id or label (or a template's base on `backend`).
    fn mark_info(&self, spec: &str, backend: Option<BackendKind>) -> anyhow::Result<MarkRow>;
    /// Every branch with its head.
    fn branches(&self) -> anyhow::Result<Vec<BranchRow>>;
    /// Delete a branch (refused while a sandbox lives on it).
    fn delete_branch(&self, branch: &str) -> anyhow::Result<Deleted>;
    /// Retention, then the store.
    fn gc(&self, dry_run: bool) -> anyhow::Result<GcOutcome>;
    /// The ledger against the host; with `fix`, leftovers taken down.
    fn audit(&self, fix: bool) -> anyhow::Result<AuditReport>;
    /// The sibling audit of two running ct sandboxes.
    fn audit_siblings(&self, a: &str, b: &str, control: Control) -> anyhow::Result<SiblingAudit>;
    /// Send a suspended sandbox to the blob tier; `progress` gets step lines where the face can report them.
    fn push(&self, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<PushOutcome>;
    /// Take a pushed sandbox into this host, suspended.
    fn pull(&self, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<PullOutcome>;
    /// The sandboxes in the blob tier and who has them.
    fn roaming(&self) -> anyhow::Result<Vec<RoamRow>>;
    /// The hosts sharing the blob tier, from their heartbeat records.
    fn hosts(&self) -> anyhow::Result<Vec<HostRow>>;

    // Processes inside a sandbox, started through its supervisor (they outlive the caller's connection).

    /// Start a process; its pid and its events (output chunks, then `Exit`). Dropping the events detaches.
    fn proc_start(&self, sandbox: &str, spec: ProcSpec) -> anyhow::Result<(u32, ExecEvents)>;
    /// The events of a running process started through the supervisor (from now on).
    fn proc_connect(&self, sandbox: &str, pid: u32) -> anyhow::Result<ExecEvents>;
    /// The processes started through the supervisor that still run.
    fn proc_list(&self, sandbox: &str) -> anyhow::Result<Vec<ProcListing>>;
    /// Bytes to a process's stdin (started with `stdin`) or PTY.
    fn proc_input(&self, sandbox: &str, pid: u32, data: &[u8]) -> anyhow::Result<()>;
    fn proc_close_stdin(&self, sandbox: &str, pid: u32) -> anyhow::Result<()>;
    fn proc_signal(&self, sandbox: &str, pid: u32, signal: i32) -> anyhow::Result<()>;
    fn proc_resize(&self, sandbox: &str, pid: u32, rows: u16, cols: u16) -> anyhow::Result<()>;

    // The sandbox's filesystem, as its agent sees it.

    fn stat(&self, sandbox: &str, path: &str) -> anyhow::Result<FileStat>;
    /// Entries under `path`, down to `depth` levels (1: its own entries).
    fn list_dir(&self, sandbox: &str, path: &str, depth: u32) -> anyhow::Result<Vec<DirEntry>>;
    /// Make a directory and its parents (those created owned by `owner`, default root); whether it was
    /// created (false: it existed).
    fn make_dir(&self, sandbox: &str, path: &str, owner: Option<FileOwner>) -> anyhow::Result<bool>;
    fn rename(&self, sandbox: &str, from: &str, to: &str) -> anyhow::Result<()>;
    /// Remove a file or a directory tree.
    fn remove(&self, sandbox: &str, path: &str) -> anyhow::Result<()>;

    /// Replace where the sandbox's outbound connections may go (enforced on the host; kept across retakes by
    /// its supervisor, not across suspend: whoever resumes it sets them again). A sandbox without egress takes
    /// denials (they hold already) and refuses allowances.
    fn set_egress(&self, sandbox: &str, rules: &EgressRules) -> anyhow::Result<()>;

    /// Stop every process of a running sandbox where it stands (ct: the cgroup freezer; vm: the vCPUs), memory
    /// kept (containerd's Pause); until [`SandboxApi::thaw`] only `get`, attaching to a process's events, `thaw`,
    /// `kill` and `suspend` (which thaws it first) are served, the rest refused as a conflict.
    fn freeze(&self, sandbox: &str) -> anyhow::Result<()>;
    /// Watch a directory of the sandbox (inotify inside; its subdirectories too when `recursive`): the watch's
    /// id. Its events queue inside the sandbox until [`SandboxApi::watch_events`] takes them.
    fn watch_start(&self, sandbox: &str, path: &str, recursive: bool) -> anyhow::Result<u64>;
    /// The watch's events since the last call, waiting up to `wait_ms` (at most 60 s) for one.
    fn watch_events(&self, sandbox: &str, watch: u64, wait_ms: u64) -> anyhow::Result<WatchBatch>;
    fn watch_stop(&self, sandbox: &str, watch: u64) -> anyhow::Result<()>;

    /// Continue a sandbox after [`SandboxApi::freeze`].
    fn thaw(&self, sandbox: &str) -> anyhow::Result<()>;

    /// Show the host directory `host` (a container image's root file system) inside a running sandbox as the
    /// root `name`; returns its path inside, for [`ProcSpec::root`]. A Kubernetes pod's containers of different
    /// images share the pod's sandbox this way (docs/kubernetes.md); ct only. Only a caller on the sandbox's host
    /// can name a host directory: the default refuses.
    fn attach_root(&self, _sandbox: &str, _name: &str, _host: &std::path::Path) -> anyhow::Result<String> {
        Err(crate::error::invalid("roots of host directories are attached only on the sandbox's own host"))
    }
    /// Freeze, thaw or kill the group of processes led by `leader`, a process started in the sandbox (its
    /// process group and session, and their descendants): a pod's container paused, resumed or ended while its
    /// pod's other containers go on (docs/kubernetes.md). Answers how many processes it touched; ct only.
    fn proc_group(&self, _sandbox: &str, _leader: u32, _op: clade_core::backend::GroupOp) -> anyhow::Result<usize> {
        Err(crate::error::invalid("this API cannot stop a part of a sandbox's processes"))
    }
    /// Bind the host file or directory `host` at the absolute path `inside` of a running sandbox, read-only if
    /// asked: a Kubernetes volume (docs/kubernetes.md); ct only, and only from the sandbox's own host.
    fn bind(&self, _sandbox: &str, _host: &std::path::Path, _inside: &str, _readonly: bool) -> anyhow::Result<()> {
        Err(crate::error::invalid("host directories are mounted only on the sandbox's own host"))
    }
    /// Take away a root [`SandboxApi::attach_root`] showed (one not shown: nothing to do).
    fn detach_root(&self, _sandbox: &str, _name: &str) -> anyhow::Result<()> {
        Err(crate::error::invalid("roots of host directories are attached only on the sandbox's own host"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clade_core::ErrorKind;

    fn kind_of(r: anyhow::Result<()>) -> Option<ErrorKind> {
        r.err().map(|e| crate::error::kind(&e))
    }

    #[test]
    fn a_fork_asks_for_one_to_256_sandboxes() {
        assert_eq!(kind_of(ForkRequest::new("m", None, 0).check()), Some(ErrorKind::Invalid));
        assert_eq!(kind_of(ForkRequest::new("m", None, 257).check()), Some(ErrorKind::Invalid));
        assert_eq!(kind_of(ForkRequest::new("m", None, 1).check()), None);
        assert_eq!(kind_of(ForkRequest::new("m", None, 256).check()), None);
        let defaulted: ForkRequest = serde_json::from_str(r#"{"from": "m"}"#).unwrap();
        assert_eq!((defaulted.count, defaulted.make_room, defaulted.backend), (1, false, None));
        assert!(serde_json::from_str::<ForkRequest>(r#"{"from": "m", "colour": 1}"#).is_err());
    }

    #[test]
    fn an_exec_the_agent_could_not_start_is_refused_naming_the_field() {
        let req =
            |argv: &[&str]| ExecRequest { argv: argv.iter().map(|s| s.to_string()).collect(), ..Default::default() };
        let msg = |r: ExecRequest| r.check().unwrap_err().to_string();
        assert!(msg(req(&[])).starts_with("argv:"));
        assert!(msg(req(&[""])).starts_with("argv:"));
        assert!(msg(req(&["sh", "a\0b"])).starts_with("argv[1]:"));
        let mut bad_env = req(&["sh"]);
        bad_env.env.insert("A=B".into(), "x".into());
        assert!(msg(bad_env).starts_with("env:"));
        let mut bad_cwd = req(&["sh"]);
        bad_cwd.cwd = Some("relative".into());
        assert!(msg(bad_cwd).starts_with("cwd:"));
        assert_eq!(kind_of(req(&["sh"]).check()), None);
    }

    #[test]
    fn stream_lines_read_back_as_the_events_they_were() {
        for ev in [
            ExecEvent::Pid(4),
            ExecEvent::Stdout(b"out".to_vec()),
            ExecEvent::Stderr(b"err".to_vec()),
            ExecEvent::Exit { code: 3, signal: None },
            ExecEvent::Exit { code: 137, signal: Some(9) },
        ] {
            let back = ExecEvent::from_json(&ev.to_json()).unwrap();
            assert_eq!(format!("{back:?}"), format!("{ev:?}"));
        }
        assert!(ExecEvent::from_json(&serde_json::json!({"error": {"code": "x"}})).is_none());
    }

    #[test]
    fn a_sandbox_info_reads_back_with_and_without_live_facts() {
        let row: SandboxRow = serde_json::from_value(serde_json::json!({
            "id": "s", "backend": "ct", "state": "suspended", "origin": null, "branch": "b",
            "supervisor_pid": null, "error": null, "created_ms": 1, "last_active_ms": 2,
        }))
        .unwrap();
        let cold: SandboxInfo = serde_json::from_value(serde_json::to_value(&row).unwrap()).unwrap();
        assert!(cold.live.is_none());
        let live = SandboxInfo { row, live: Some(LiveFacts { pids: vec![3], ..Default::default() }) };
        let back: SandboxInfo = serde_json::from_value(serde_json::to_value(&live).unwrap()).unwrap();
        assert_eq!(back.live.map(|l| l.pids), Some(vec![3]));
    }
}
