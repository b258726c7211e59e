//! The JSON bodies of control frames: requests, replies, events and the typed errors.
//!
//! These types are the contract between the agent and both backends (`clade-vm`, `clade-ct`); they are
//! declared here once and imported. Adding an optional field (with `#[serde(default)]`) keeps the wire
//! version; anything else bumps [`crate::WIRE_VERSION`].

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A request from the host. The frame id is the request id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Proves the sandbox is up: replies [`Reply::Hello`].
    Hello,
    /// Starts a process: replies [`Reply::Started`]; then `Data` frames on stdout/stderr (id = pid) and an
    /// [`Event::Exit`] once it exited and its output ended.
    Exec(ExecSpec),
    /// Closes a process's stdin pipe (or sends EOF on its PTY).
    CloseStdin {
        /// Process id.
        pid: u32,
    },
    /// Sends a signal to a process started by the agent.
    Signal {
        /// Process id.
        pid: u32,
        /// Signal number (e.g. 15).
        signal: i32,
    },
    /// Sends a signal to every process of the group `leader` leads: those whose process group or session is
    /// `leader`'s, and their descendants (`crate::procgroup`; a pod member's processes, docs/kubernetes.md).
    SignalGroup {
        /// The pid of a process the agent started.
        leader: u32,
        /// Signal number (19 SIGSTOP, 18 SIGCONT, 9 SIGKILL).
        signal: i32,
    },
    /// Resizes a process's PTY.
    Resize {
        /// Process id.
        pid: u32,
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
    /// Lists the processes the agent started (running, and recently exited).
    ListProcs,
    /// Replies [`Reply::Exited`] once the process has exited.
    Wait {
        /// Process id.
        pid: u32,
    },
    /// Streams a regular file as `Data` frames on [`crate::Chan::File`], then replies [`Reply::Bytes`].
    ReadFile {
        /// Absolute path.
        path: String,
    },
    /// Creates or replaces a file from the `Data` frames that follow on [`crate::Chan::File`] with the same
    /// id (the last one carries [`crate::FLAG_END`]); the file appears atomically (temp file + rename).
    WriteFile {
        /// Absolute path.
        path: String,
        /// Create missing parent directories.
        #[serde(default)]
        mkdirs: bool,
        /// Its mode, owner (also of the parents it creates; default the agent's own, root) and extended
        /// attributes (the `user.` namespace only; the file replaces the old one whole, so attributes the old
        /// one had are gone), as fields of the request itself.
        #[serde(flatten)]
        opts: WriteOptions,
    },
    /// Replies [`Reply::Stat`] (without following a final symlink).
    Stat {
        /// Absolute path.
        path: String,
    },
    /// Replies [`Reply::Dir`] with entries down to `depth` levels (1 = the directory's own entries).
    ListDir {
        /// Absolute path.
        path: String,
        /// Levels to descend (at least 1).
        #[serde(default = "one")]
        depth: u32,
    },
    /// `mkdir -p`.
    MkdirP {
        /// Absolute path.
        path: String,
        /// Permission bits of created directories (default 0o755).
        #[serde(default)]
        mode: Option<u32>,
        /// Owner of the directories it creates (default: the agent's own, root).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<FileOwner>,
    },
    /// Removes a file, a symlink, or (with `recursive`) a directory tree.
    Remove {
        /// Absolute path.
        path: String,
        /// Remove directories with their contents.
        #[serde(default)]
        recursive: bool,
    },
    /// `rename(2)`.
    Rename {
        /// Absolute source path.
        from: String,
        /// Absolute destination path.
        to: String,
    },
    /// `chmod(2)`.
    Chmod {
        /// Absolute path.
        path: String,
        /// Permission bits.
        mode: u32,
    },
    /// `symlink(2)`: a link at `path` pointing at `target` (a Kubernetes configMap volume is made of them).
    Symlink {
        /// What the link points at (as written, not checked).
        target: String,
        /// Absolute path of the new link.
        path: String,
    },
    /// Mounts `source` at `path` (an existing directory, or an existing file for a bind of a file), read-only when
    /// asked: a vm guest's copy of a Kubernetes volume (docs/kubernetes.md). It needs the right to mount, which
    /// a vm guest's agent has and a jailed ct sandbox's has not (that one answers with the error).
    Mount {
        /// Absolute path mounted on.
        path: String,
        /// What is mounted there.
        source: MountSource,
        /// Read-only.
        #[serde(default)]
        readonly: bool,
    },
    /// Detaches the mount at `path` and every mount below it (`umount2(MNT_DETACH)`), as
    /// [`Request::Mount`] needs the right to.
    Unmount {
        /// Absolute path of the mount.
        path: String,
    },
    /// Makes a restored sibling a distinct machine: replies [`Reply::Identity`].
    SetIdentity(Identity),
    /// Runs `/etc/clade/pre-mark.d/*` in name order, just before the sandbox is marked, with
    /// `CLADE_MARK_CLEAN` (1 or 0) in their environment: what a program wants done before its state is kept
    /// (the browser template opens the window its restore hygiene will load the page in). Replies
    /// [`Reply::Hooks`]. An agent older than this request answers with an error, and the mark goes on.
    PreMark {
        /// The mark is declared clean: its restores get hygiene.
        clean: bool,
    },
    /// Registers a process to be signalled by every `set_identity` (e.g. to reseed its RNG).
    RegisterRestoreSignal {
        /// Process id in the sandbox.
        pid: u32,
        /// Signal number.
        signal: i32,
    },
    /// Reads the clocks: replies [`Reply::Clock`].
    ClockRead,
    /// Moves CLOCK_REALTIME by `by_ns` against the agent's own reading: the step does
    /// not depend on when the request arrives.
    ClockShift {
        /// Nanoseconds to add (negative moves back).
        by_ns: i64,
    },
    /// Destroys established TCP connections (sock_diag SOCK_DESTROY, what `ss -K` does): replies
    /// [`Reply::NetReset`].
    NetReset {
        /// Only connections whose remote address is this IP; all non-loopback ones when absent.
        #[serde(default)]
        peer: Option<String>,
        /// Local ports whose connections are kept (the agent's own, when it serves over TCP).
        #[serde(default)]
        keep_local_ports: Vec<u16>,
    },
    /// Writes the env file and `/etc/profile.d/clade.sh` atomically.
    WriteEnv {
        /// Variables (names: `[A-Za-z_][A-Za-z0-9_]*`).
        vars: BTreeMap<String, String>,
    },
    /// Waits until a target is ready: replies [`Reply::Ready`] or [`AgentError::Timeout`].
    WaitReady {
        /// What to wait for.
        target: ReadyTarget,
        /// Give up after this many milliseconds.
        timeout_ms: u64,
    },
    /// Watches a directory (inotify): replies [`Reply::Watch`] with its id. Events queue in the agent until
    /// `watch_events` takes them.
    WatchStart {
        /// Absolute path of a directory.
        path: String,
        /// Its subdirectories too, those made later included.
        #[serde(default)]
        recursive: bool,
    },
    /// Takes a watch's queued events, waiting up to `wait_ms` for the first: replies [`Reply::WatchEvents`].
    WatchEvents {
        /// The watch's id.
        watch: u64,
        /// Milliseconds to wait when none are queued (0: answer at once).
        #[serde(default)]
        wait_ms: u64,
    },
    /// Ends a watch: replies [`Reply::Done`].
    WatchStop {
        /// The watch's id.
        watch: u64,
    },
}

fn one() -> u32 {
    1
}

impl Request {
    /// Decodes a request body, telling an unknown op ([`AgentError::UnknownOp`]) from a malformed known
    /// one ([`AgentError::BadRequest`]).
    pub fn parse(body: &[u8]) -> Result<Request, AgentError> {
        match serde_json::from_slice::<Request>(body) {
            Ok(r) => Ok(r),
            Err(e) => {
                let op = serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .and_then(|v| v.get("op").and_then(|o| o.as_str()).map(str::to_owned));
                match op {
                    Some(op) if !Request::OPS.contains(&op.as_str()) => {
                        Err(AgentError::UnknownOp { op, supported: crate::WIRE_VERSION })
                    }
                    _ => Err(AgentError::BadRequest { detail: e.to_string() }),
                }
            }
        }
    }

    /// Every op name, for telling an unknown op from a malformed known one.
    pub const OPS: &'static [&'static str] = &[
        "hello",
        "exec",
        "close_stdin",
        "signal",
        "resize",
        "list_procs",
        "wait",
        "read_file",
        "write_file",
        "stat",
        "list_dir",
        "mkdir_p",
        "remove",
        "rename",
        "chmod",
        "set_identity",
        "pre_mark",
        "register_restore_signal",
        "clock_read",
        "clock_shift",
        "net_reset",
        "write_env",
        "wait_ready",
        "watch_start",
        "watch_events",
        "watch_stop",
    ];
}

/// How to start a process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecSpec {
    /// Program and arguments; a program without `/` is searched in the resulting `PATH`.
    pub argv: Vec<String>,
    /// Variables to set (on top of the agent's environment unless `clear_env`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Start from an empty environment (plus `PATH`, `HOME`, `USER` defaults).
    #[serde(default)]
    pub clear_env: bool,
    /// Working directory (absolute).
    #[serde(default)]
    pub cwd: Option<String>,
    /// User name from the sandbox's /etc/passwd (sets uid, gid, HOME, USER).
    #[serde(default)]
    pub user: Option<String>,
    /// Numeric uid (overrides `user`'s).
    #[serde(default)]
    pub uid: Option<u32>,
    /// Numeric gid (overrides `user`'s).
    #[serde(default)]
    pub gid: Option<u32>,
    /// Run on a new PTY of this size (stdout carries the terminal output, stderr is unused).
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// Keep stdin open for [`crate::Chan::Stdin`] data; otherwise stdin is /dev/null.
    #[serde(default)]
    pub stdin: bool,
    /// A free-form label shown by `list_procs`.
    #[serde(default)]
    pub tag: Option<String>,
    /// Run with this directory (absolute, in the sandbox) as the process's root: a container of its own image
    /// in a pod's sandbox (docs/kubernetes.md). `user` is then looked up in that root's `/etc/passwd`, `cwd` and
    /// the program's `PATH` search are resolved inside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// The capabilities the process may hold, by name (`CAP_CHOWN`, ...; an OCI process's bounding set): every
    /// other is dropped from its bounding, inheritable and ambient sets before it starts, so not even root or
    /// a file capability gets it back. `None`: what the agent holds (the sandbox's jail). A process of another
    /// user than root holds none either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caps: Option<Vec<String>>,
    /// Start it with `no_new_privs` (setuid bits and file capabilities give nothing; an OCI process's
    /// `noNewPrivileges`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_new_privs: bool,
}

impl ExecSpec {
    /// A spec for `argv` with every other field defaulted.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(argv: I) -> ExecSpec {
        ExecSpec { argv: argv.into_iter().map(Into::into).collect(), ..ExecSpec::default() }
    }
}

/// A terminal size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// What `set_identity` does; every field is optional and done in the order listed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Sets the kernel hostname and writes /etc/hostname.
    #[serde(default)]
    pub hostname: Option<String>,
    /// Writes /etc/machine-id (32 lowercase hex digits).
    #[serde(default)]
    pub machine_id: Option<String>,
    /// Host-supplied random bytes for RNDADDENTROPY (credited), followed by RNDRESEEDCRNG.
    #[serde(default)]
    pub entropy: Vec<u8>,
    /// The restore generation the sandbox now is (reported by `hello`).
    #[serde(default)]
    pub generation: Option<u64>,
    /// Run `/etc/clade/on-restore.d/*` in name order.
    #[serde(default)]
    pub run_on_restore: bool,
    /// Signal the registered processes.
    #[serde(default)]
    pub signal_registered: bool,
    /// The sandbox continues its own line (resume, retake), not a new sibling: on-restore hooks get
    /// `CLADE_RESTORE=continue` instead of `sibling`.
    #[serde(default)]
    pub continues: bool,
}

/// A readiness target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ReadyTarget {
    /// A TCP socket listening on this port (any local address).
    Port {
        /// Port number.
        port: u16,
    },
    /// An `http://` URL answering a GET with 2xx.
    Url {
        /// The URL.
        url: String,
    },
    /// A path that exists.
    File {
        /// Absolute path.
        path: String,
    },
}

/// What [`Request::Mount`] mounts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MountSource {
    /// A new, empty tmpfs.
    Tmpfs,
    /// Another path of the same machine with the mounts below it (`mount --rbind`).
    Bind {
        /// Absolute path of what is shown.
        from: String,
    },
}

/// A successful reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// To `hello`.
    Hello(Hello),
    /// To `exec`.
    Started {
        /// Process id in the sandbox.
        pid: u32,
    },
    /// To `wait`.
    Exited(ExitStatus),
    /// To `list_procs`.
    Procs {
        /// The processes.
        procs: Vec<ProcInfo>,
    },
    /// To `read_file` / `write_file`.
    Bytes {
        /// Bytes transferred.
        n: u64,
    },
    /// To `stat`.
    Stat(FileStat),
    /// To `list_dir`.
    Dir {
        /// The entries, parents before children.
        entries: Vec<DirEntry>,
    },
    /// To `set_identity`.
    Identity(IdentityReport),
    /// To `pre_mark`.
    Hooks(HookReport),
    /// To `clock_read` / `clock_shift`.
    Clock(ClockReading),
    /// To `net_reset`.
    NetReset {
        /// Connections destroyed.
        destroyed: u32,
    },
    /// To `wait_ready`.
    Ready {
        /// Milliseconds waited.
        waited_ms: u64,
    },
    /// To `watch_start`.
    Watch {
        /// The watch's id (for `watch_events` and `watch_stop`).
        watch: u64,
    },
    /// To `watch_events`.
    WatchEvents {
        /// In the order they happened.
        events: Vec<WatchEvent>,
        /// Events may be missing before these: the kernel's queue overflowed, or the watch was re-armed after
        /// a mark of a ct sandbox (an inotify descriptor cannot be checkpointed).
        #[serde(default)]
        lost: bool,
    },
    /// To `signal_group`.
    Signalled {
        /// Processes signalled.
        processes: u32,
    },
    /// To operations with nothing to report.
    Done,
}

/// What happened to an entry of a watched directory (inotify's events, as E2B's envd names them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchKind {
    /// Made (`IN_CREATE`).
    Create,
    /// Written (`IN_MODIFY`).
    Write,
    /// Its mode, owner, times or extended attributes changed (`IN_ATTRIB`).
    Chmod,
    /// Removed (`IN_DELETE`).
    Remove,
    /// Renamed away or into place (`IN_MOVED_FROM`, `IN_MOVED_TO`).
    Rename,
}

/// One event of a watch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// The entry's path relative to the watched directory (`sub/file` in a recursive watch).
    pub name: String,
    pub kind: WatchKind,
}

/// The agent's answer to `hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The agent's wire version.
    pub wire_version: u8,
    /// The agent's crate version.
    pub agent_version: String,
    /// `init` or `serve`.
    pub role: String,
    /// /proc/sys/kernel/random/boot_id (same across a restore: the kernel did not boot again).
    pub boot_id: String,
    /// CLOCK_BOOTTIME in milliseconds.
    pub uptime_ms: u64,
    /// The restore generation last set by `set_identity` (0 before any).
    pub generation: u64,
    /// The agent's pid in its namespace (1 as init).
    pub pid: u32,
    /// Whether `/etc/clade/services.d/*` have all returned (always true in serve mode).
    pub services_ready: bool,
    /// A ct sandbox on the host's kernel: its clock and kernel random pool are the host's, which the sandbox
    /// may not set (docs/security.md); hygiene leaves both alone. Absent from older agents: false.
    #[serde(default)]
    pub shared_kernel: bool,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal number, if it was killed by one.
    pub signal: Option<i32>,
}

impl ExitStatus {
    /// True for exit code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// A process the agent started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcInfo {
    /// Process id.
    pub pid: u32,
    /// Its argv.
    pub argv: Vec<String>,
    /// Its tag.
    pub tag: Option<String>,
    /// Whether it has a PTY.
    pub pty: bool,
    /// Its exit status, once exited.
    pub exit: Option<ExitStatus>,
}

/// File type in a stat or dir entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (device, fifo, socket).
    Other,
}

/// `stat` of a path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// Type.
    pub file_type: FileType,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, ns since the epoch.
    pub mtime_ns: i64,
    /// Symlink target.
    pub link_target: Option<String>,
    /// Extended attributes in the `user.` namespace (full names; values read as UTF-8, lossily).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
}

/// Who owns what a write or a `mkdir -p` creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileOwner {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// How a file is written: its mode, owner and extended attributes (each optional).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteOptions {
    /// Permission bits (default 0o644).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// Owner of the file and of parents created for it (default: root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<FileOwner>,
    /// Extended attributes, full names in the `user.` namespace.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
}

impl WriteOptions {
    /// Only a mode.
    pub fn mode(mode: Option<u32>) -> WriteOptions {
        WriteOptions { mode, ..WriteOptions::default() }
    }
}

/// One `list_dir` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// Absolute path.
    pub path: String,
    /// Depth below the listed directory (1 = its own entries).
    pub depth: u32,
    /// Its stat.
    pub stat: FileStat,
}

/// What `set_identity` did. Steps that failed are listed in `errors`; the others still ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityReport {
    /// The hostname was set and written.
    pub hostname_set: bool,
    /// /etc/machine-id was written.
    pub machine_id_set: bool,
    /// Entropy bytes added to the kernel pool.
    pub entropy_added: u32,
    /// RNDRESEEDCRNG succeeded.
    pub crng_reseeded: bool,
    /// `on-restore.d` scripts run, in order.
    pub scripts: Vec<ScriptRun>,
    /// Registered processes signalled.
    pub signalled: u32,
    /// One line per failed step, saying what failed and why.
    pub errors: Vec<String>,
}

/// What `pre_mark` ran. Failed scripts are listed in `errors`; the others still ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookReport {
    /// `pre-mark.d` scripts run, in order.
    pub scripts: Vec<ScriptRun>,
    /// One line per failed script, saying what failed and why.
    pub errors: Vec<String>,
}

/// One hook script's result (`on-restore.d`, `pre-mark.d`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScriptRun {
    /// File name.
    pub name: String,
    /// Its exit status (None if it could not start or timed out).
    pub status: Option<ExitStatus>,
    /// Milliseconds it took.
    pub ms: u64,
}

/// The sandbox's clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockReading {
    /// CLOCK_REALTIME, ns since the epoch.
    pub realtime_ns: i64,
    /// CLOCK_MONOTONIC, ns.
    pub monotonic_ns: i64,
    /// CLOCK_BOOTTIME, ns.
    pub boottime_ns: i64,
}

/// An unsolicited message from the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A process exited and its output streams ended (or stayed open 2 s after the exit).
    Exit {
        /// Process id.
        pid: u32,
        /// How it ended.
        status: ExitStatus,
    },
}

/// A typed error on one request. The agent keeps serving after every one of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum AgentError {
    /// The frame could not be decoded.
    #[error("bad frame: {detail}")]
    BadFrame {
        /// What was wrong.
        detail: String,
    },
    /// The host speaks a newer wire version.
    #[error(
        "the host speaks wire version {got}, this agent speaks {supported}: put a newer clade-agent in the template"
    )]
    UnsupportedVersion {
        /// The host's version.
        got: u8,
        /// The agent's version.
        supported: u8,
    },
    /// The op is not one this agent knows.
    #[error("unknown op {op:?}: this agent (wire version {supported}) does not implement it")]
    UnknownOp {
        /// The op name.
        op: String,
        /// The agent's wire version.
        supported: u8,
    },
    /// The request's JSON did not match its op.
    #[error("malformed request: {detail}")]
    BadRequest {
        /// The decoder's message.
        detail: String,
    },
    /// A path was refused before touching the filesystem.
    #[error("path {path:?} refused: {reason}")]
    BadPath {
        /// The path (NULs shown escaped).
        path: String,
        /// Why.
        reason: String,
    },
    /// The path does not exist.
    #[error("{path}: no such file or directory")]
    NotFound {
        /// The path.
        path: String,
    },
    /// A file operation was given a directory.
    #[error("{path} is a directory: use list_dir, or remove with recursive")]
    IsADirectory {
        /// The path.
        path: String,
    },
    /// The process is not one the agent started, or it is gone.
    #[error("no process {pid} started by this agent: list_procs shows the known ones")]
    NoSuchProcess {
        /// The pid.
        pid: u32,
    },
    /// The watch is not one of this agent's, or it was stopped.
    #[error("no watch {watch} in this sandbox (stopped, or never started): start another")]
    NoSuchWatch {
        /// The watch's id.
        watch: u64,
    },
    /// A wait ran out of time.
    #[error("{what} not ready after {waited_ms} ms")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        waited_ms: u64,
    },
    /// A system call failed.
    #[error("{context}: {message} (errno {errno})")]
    Os {
        /// What the agent was doing.
        context: String,
        /// errno.
        errno: i32,
        /// strerror.
        message: String,
    },
    /// Anything else.
    #[error("{detail}")]
    Failed {
        /// What failed.
        detail: String,
    },
}

impl AgentError {
    /// An [`AgentError::Os`] from an I/O error, with what the agent was doing.
    pub fn os(context: impl Into<String>, e: &std::io::Error) -> AgentError {
        AgentError::Os { context: context.into(), errno: e.raw_os_error().unwrap_or(0), message: e.to_string() }
    }
}

/// The body of a `Reply` frame.
pub type Response = Result<Reply, AgentError>;

#[cfg(test)]
mod tests {
    use super::*;

    /// `write_file`'s options travel as fields of the request itself, as before they were gathered in
    /// [`WriteOptions`]: an older host's request decodes, and a new one carries the same names.
    #[test]
    fn write_file_keeps_its_flat_wire_shape() {
        let old = r#"{"op":"write_file","path":"/a","mode":420,"mkdirs":true}"#;
        let r: Request = serde_json::from_str(old).unwrap();
        assert_eq!(r, Request::WriteFile { path: "/a".into(), mkdirs: true, opts: WriteOptions::mode(Some(0o644)) });
        let opts = WriteOptions {
            mode: None,
            owner: Some(FileOwner { uid: 1000, gid: 1000 }),
            xattrs: [("user.k".to_string(), "v".to_string())].into(),
        };
        let v = serde_json::to_value(Request::WriteFile { path: "/b".into(), mkdirs: false, opts }).unwrap();
        assert_eq!(v["owner"]["uid"], 1000);
        assert_eq!(v["xattrs"]["user.k"], "v");
        assert!(v.get("opts").is_none());
    }

    #[test]
    fn mount_requests_have_the_documented_shape() {
        // docs/agent.md: `source` is "tmpfs" or {"bind": {"from"}}; `readonly` defaults to false.
        let bind = r#"{"op":"mount","path":"/v","source":{"bind":{"from":"/run/clade/volumes/1-0"}},"readonly":true}"#;
        let r: Request = serde_json::from_str(bind).unwrap();
        let want = MountSource::Bind { from: "/run/clade/volumes/1-0".into() };
        assert_eq!(r, Request::Mount { path: "/v".into(), source: want, readonly: true });
        let r: Request = serde_json::from_str(r#"{"op":"mount","path":"/v","source":"tmpfs"}"#).unwrap();
        assert_eq!(r, Request::Mount { path: "/v".into(), source: MountSource::Tmpfs, readonly: false });
        let r: Request = serde_json::from_str(r#"{"op":"unmount","path":"/v"}"#).unwrap();
        assert_eq!(r, Request::Unmount { path: "/v".into() });
    }
}
