//! What the E2B layer needs from whoever runs the sandboxes: [`Host`]. Every method blocks (the HTTP layer
//! calls them on tokio's blocking pool), so an implementation can use plain threads and sockets.

use std::collections::BTreeMap;
use std::io::Read;

/// A host-side failure, sorted by what the client should do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Permission(String),
    #[error("{0}")]
    NoSpace(String),
    #[error("{0}")]
    Internal(String),
}

pub type HostResult<T> = Result<T, HostError>;

/// Where a sandbox is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Running,
    Paused,
    /// Killed, never existed, or lost.
    Gone,
}

/// A sandbox the host started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    pub id: String,
    /// What the template name resolved to (shown as `templateID`): the name given, normalised.
    pub template_id: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
}

/// A process to start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcSpec {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    /// (rows, cols)
    pub pty: Option<(u16, u16)>,
    pub stdin: bool,
    pub tag: Option<String>,
}

/// Something a process did, as a stream delivers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The stream ended without an exit (sandbox gone, ...).
    Error(String),
}

/// The events of one process from now on; dropping it detaches (the process keeps running).
pub type ProcStream = Box<dyn Iterator<Item = ProcEvent> + Send>;

/// A running process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

/// A filesystem entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Absolute path.
    pub path: String,
    pub kind: Kind,
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_ns: i64,
    pub link_target: Option<String>,
    /// Extended attributes in the `user.` namespace (full names).
    pub xattrs: BTreeMap<String, String>,
}

/// What a watch saw happen to an entry (envd's event types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Create,
    Write,
    Chmod,
    Remove,
    Rename,
}

/// One event of a watch: the entry's path relative to the watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    pub name: String,
    pub change: Change,
}

/// How an upload is written: who owns the file (and the parents made for it), and its `user.` extended
/// attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Upload {
    /// (uid, gid)
    pub owner: Option<(u32, u32)>,
    pub xattrs: BTreeMap<String, String>,
}

/// What a sandbox uses now, as the host measures it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// vCPUs kept busy (CPU seconds over wall seconds since the last measure).
    pub cpu_busy: f64,
    /// Memory its processes hold (PSS), bytes.
    pub mem_used: u64,
    /// Its root filesystem: (used, total) bytes, as `df` inside it reports them.
    pub disk: Option<(u64, u64)>,
}

/// A snapshot the host took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub id: String,
}

/// Everything the E2B layer asks of a sandbox host.
pub trait Host: Send + Sync + 'static {
    /// Whether `key` (an `X-API-Key`) may use the API.
    fn check_key(&self, key: &str) -> bool;
    /// Start a sandbox from a template name, a base or a snapshot; `HostError::NotFound` when there is no such
    /// thing. `envs` are the sandbox's default environment for every process.
    fn create(&self, template: &str, envs: &BTreeMap<String, String>) -> HostResult<Started>;
    /// Whether `create` accepts this template name (E2B's alias check).
    fn template_exists(&self, name: &str) -> bool;
    fn status(&self, id: &str) -> Status;
    fn kill(&self, id: &str) -> HostResult<()>;
    /// Stop the sandbox keeping its state (E2B pause); `disk_only`: its filesystem alone (E2B's `memory:
    /// false`), and the resume boots it cold.
    fn pause(&self, id: &str, disk_only: bool) -> HostResult<()>;
    /// Bring a paused sandbox back, same id; `reboot`: boot its filesystem cold instead of restoring its
    /// memory (E2B's `memory: false` on connect and resume).
    fn resume(&self, id: &str, reboot: bool) -> HostResult<()>;
    /// `count` new sandboxes continuing from this one's present state.
    fn fork(&self, id: &str, count: u32) -> HostResult<Vec<Started>>;
    /// Keep this sandbox's present state under a new id that `create` accepts; it keeps running. `disk_only`:
    /// its filesystem alone, and sandboxes made from it boot cold.
    fn snapshot(&self, id: &str, name: Option<&str>, disk_only: bool) -> HostResult<Snapshot>;
    /// Forget a snapshot (`Ok(false)`: none such).
    fn delete_snapshot(&self, _snapshot: &str) -> HostResult<bool> {
        Ok(true)
    }

    /// Replace where the sandbox's outbound connections may go: IPv4 addresses or CIDR blocks, `allow` winning
    /// over `deny`; both empty: no rules. `Invalid` when the sandbox cannot honour them.
    fn set_egress(&self, id: &str, allow: &[String], deny: &[String]) -> HostResult<()>;
    /// A TCP connection to `port` on the sandbox's own loopback (E2B's `<port>-<id>.<domain>` hosts). `Invalid`
    /// when the backend cannot reach into the sandbox; `Conflict` when nothing listens there.
    fn connect_port(&self, id: &str, port: u16) -> HostResult<std::net::TcpStream>;
    /// What the sandbox uses now (E2B's metrics).
    fn usage(&self, id: &str) -> HostResult<Usage>;

    fn proc_start(&self, id: &str, spec: ProcSpec) -> HostResult<(u32, ProcStream)>;
    fn proc_connect(&self, id: &str, pid: u32) -> HostResult<ProcStream>;
    fn proc_list(&self, id: &str) -> HostResult<Vec<ProcInfo>>;
    fn proc_input(&self, id: &str, pid: u32, data: &[u8]) -> HostResult<()>;
    fn proc_close_stdin(&self, id: &str, pid: u32) -> HostResult<()>;
    fn proc_signal(&self, id: &str, pid: u32, signal: i32) -> HostResult<()>;
    fn proc_resize(&self, id: &str, pid: u32, rows: u16, cols: u16) -> HostResult<()>;

    /// Watch a directory inside the sandbox as it changes (inotify in the sandbox): the watch's id. `None`: this
    /// host or sandbox cannot (an agent older than watches), and the E2B face polls listings instead.
    fn watch_start(&self, _id: &str, _path: &str, _recursive: bool) -> HostResult<Option<u64>> {
        Ok(None)
    }
    /// A watch's events since the last call (waiting up to `wait_ms` for one), and whether some may be
    /// missing before them.
    fn watch_events(&self, _id: &str, watch: u64, _wait_ms: u64) -> HostResult<(Vec<Changed>, bool)> {
        Err(HostError::NotFound(format!("watch {watch}")))
    }
    fn watch_stop(&self, _id: &str, _watch: u64) -> HostResult<()> {
        Ok(())
    }

    fn stat(&self, id: &str, path: &str) -> HostResult<Entry>;
    /// Entries below `path` down to `depth` levels (1: its own entries).
    fn list_dir(&self, id: &str, path: &str, depth: u32) -> HostResult<Vec<Entry>>;
    /// `mkdir -p`, the directories made owned by `owner` (uid, gid); false when it already existed.
    fn mkdir(&self, id: &str, path: &str, owner: Option<(u32, u32)>) -> HostResult<bool>;
    fn rename(&self, id: &str, from: &str, to: &str) -> HostResult<()>;
    /// Removes a file or a whole tree.
    fn remove(&self, id: &str, path: &str) -> HostResult<()>;
    /// The file's size and its bytes.
    fn read_file(&self, id: &str, path: &str) -> HostResult<(u64, Box<dyn Read + Send>)>;
    /// Create or replace (atomically, parents created) from `src`; bytes written.
    fn write_file(&self, id: &str, path: &str, up: &Upload, src: &mut dyn Read) -> HostResult<u64>;
}
