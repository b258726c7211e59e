//! The supervisor's wire format. Most ops are one JSON request line and one JSON response line per connection.
//! Three kinds of op continue past their first line on the same connection:
//!
//! - process streams (`proc_start` with `stream: true`, `proc_connect`): after the request, the supervisor sends
//!   JSON lines of [`StreamEvent`] (`start`, then `stdout`/`stderr` chunks, then `exit` or `error`) and closes.
//!   Closing the connection early detaches only: the process keeps running and `proc_connect` reattaches
//!   (output produced while nobody listened is not replayed).
//! - `read_stream`: one [`Response`] line (body `{"size": n}`), then the file's raw bytes, then the connection
//!   closes (fewer than `size` bytes means the read failed part way).
//! - `write_stream`: after the request line the client sends the file's raw bytes and shuts down its write half;
//!   the supervisor answers one [`Response`] line (body `{"bytes": n}`).
//!
//! Connections are served concurrently; `mark`, `retake`, `suspend` and `kill` wait for the other short ops
//! to finish and hold the sandbox alone while they run.

use std::collections::BTreeMap;

use clade_core::ErrorKind;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The sandbox's record, pids, memory, the agent's hello and `last_activity_ms`.
    Info,
    /// Run a command to its end and answer with all of its output (base64).
    Exec {
        argv: Vec<String>,
        #[serde(default)]
        env: BTreeMap<String, String>,
        #[serde(default)]
        cwd: Option<String>,
        /// Bytes for the process's stdin (base64), closed after.
        #[serde(default)]
        stdin_b64: Option<String>,
    },
    WriteFile {
        path: String,
        data_b64: String,
        #[serde(default)]
        mode: Option<u32>,
    },
    ReadFile {
        path: String,
    },
    Mark {
        #[serde(default)]
        label: Option<String>,
        #[serde(default)]
        keep: bool,
        #[serde(default)]
        not_clean: bool,
        /// The disk alone (clade_core::backend::MarkOptions::disk_only).
        #[serde(default)]
        disk_only: bool,
    },
    /// Take the sandbox back to `mark` (one of its branch's marks, or the mark it was forked from).
    Retake {
        mark: String,
    },
    Suspend {
        /// Keep the disk alone: the resume boots it cold (clade_core::backend::MarkOptions::disk_only).
        #[serde(default)]
        disk_only: bool,
    },
    Kill,
    /// Start a process. Without `stream` the answer is `{"pid": n}` and its output is only seen by a later
    /// `proc_connect`; with `stream` the connection carries [`StreamEvent`] lines.
    ProcStart(ProcSpec),
    /// Attach to a running process started by `proc_start`: a [`StreamEvent`] stream from now on.
    ProcConnect {
        pid: u32,
    },
    /// The running processes started by `proc_start`: `{"procs": [ProcListing]}`.
    ProcList,
    ProcInput {
        pid: u32,
        data_b64: String,
    },
    ProcCloseStdin {
        pid: u32,
    },
    ProcSignal {
        pid: u32,
        signal: i32,
    },
    ProcResize {
        pid: u32,
        rows: u16,
        cols: u16,
    },
    /// Watch a directory: `{"watch": id}` (clade_agent's `watch_start`).
    WatchStart {
        path: String,
        #[serde(default)]
        recursive: bool,
    },
    /// `{"events": [clade_agent::proto::WatchEvent], "lost": bool}`, waiting up to `wait_ms` for one.
    WatchEvents {
        watch: u64,
        #[serde(default)]
        wait_ms: u64,
    },
    WatchStop {
        watch: u64,
    },
    /// `clade_agent::proto::FileStat` of a path (not following a final symlink).
    Stat {
        path: String,
    },
    /// `{"entries": [clade_agent::proto::DirEntry]}` down to `depth` levels (1: the directory's own entries).
    ListDir {
        path: String,
        #[serde(default = "one")]
        depth: u32,
    },
    /// `mkdir -p`; `{"created": false}` when the directory already existed.
    Mkdir {
        path: String,
        /// Owner of the directories created (default root).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<clade_agent::FileOwner>,
    },
    /// `rename(2)`.
    Move {
        from: String,
        to: String,
    },
    /// Removes a file, a symlink or a whole directory tree.
    Remove {
        path: String,
    },
    /// Stream a file out: see the module doc.
    ReadStream {
        path: String,
    },
    /// Stop every process of the sandbox where it stands (containerd's Pause); until `Thaw` the supervisor
    /// refuses what would need the sandbox to answer (a suspend thaws it first).
    Freeze,
    /// Continue after `Freeze`.
    Thaw,
    /// Show the host directory `host` inside the sandbox as the root `name` (a pod member's image,
    /// `clade_core::backend::Sandbox::attach_root`); answers `{"path": inside}`.
    AttachRoot {
        name: String,
        host: std::path::PathBuf,
    },
    /// Bind the host file or directory `host` at `inside` (a volume, `clade_core::backend::Sandbox::bind`).
    Bind {
        host: std::path::PathBuf,
        inside: String,
        #[serde(default)]
        readonly: bool,
    },
    /// Take the root `name` away again.
    DetachRoot {
        name: String,
    },
    /// Freeze, thaw or kill the processes led by `leader` (`clade_core::backend::Sandbox::proc_group`);
    /// answers `{"processes": n}`.
    ProcGroup {
        leader: u32,
        group_op: clade_core::backend::GroupOp,
    },
    /// Replace the sandbox's egress rules (`clade_core::backend::EgressRules`); kept for later retakes.
    SetEgress {
        rules: clade_core::backend::EgressRules,
    },
    /// Stream a file in (created or replaced atomically, parents created): see the module doc.
    WriteStream {
        path: String,
        /// Mode, owner (also of the parents created for it; default root) and `user.` extended attributes.
        #[serde(flatten)]
        opts: clade_agent::WriteOptions,
    },
}

fn one() -> u32 {
    1
}

/// How to start a process through the supervisor.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProcSpec {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// A user of the sandbox's /etc/passwd (default: the agent's, root).
    #[serde(default)]
    pub user: Option<String>,
    /// Run on a PTY of this size (rows, cols); its output comes as `stdout`.
    #[serde(default)]
    pub pty: Option<(u16, u16)>,
    /// Keep stdin open for `proc_input` (else it is /dev/null).
    #[serde(default)]
    pub stdin: bool,
    /// A free-form name (E2B's tag), shown by `proc_list`.
    #[serde(default)]
    pub tag: Option<String>,
    /// Answer with a [`StreamEvent`] stream instead of `{"pid": n}`.
    #[serde(default)]
    pub stream: bool,
    /// A root of its own inside the sandbox (a pod member's image, attached with `AttachRoot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// The only capabilities it may hold, by name (`clade_agent::ExecSpec::caps`; default: the sandbox's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caps: Option<Vec<String>>,
    /// Start it with `no_new_privs`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_new_privs: bool,
}

/// One line of a process stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum StreamEvent {
    Start {
        pid: u32,
    },
    Stdout {
        data_b64: String,
    },
    Stderr {
        data_b64: String,
    },
    Exit {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The stream ends without an exit (the sandbox ended or was retaken, or the request failed).
    Error {
        kind: ErrorKind,
        message: String,
    },
}

/// A process in `proc_list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcListing {
    pub pid: u32,
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub tag: Option<String>,
    pub pty: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// For errors: what kind of failure (the faces above say it as an exit code or an HTTP status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ErrorKind>,
    #[serde(default)]
    pub body: serde_json::Value,
}

impl Response {
    pub fn ok(body: serde_json::Value) -> Self {
        Response { ok: true, error: None, kind: None, body }
    }
    pub fn err(kind: ErrorKind, error: impl Into<String>) -> Self {
        Response { ok: false, error: Some(error.into()), kind: Some(kind), body: serde_json::Value::Null }
    }
}

/// What a supervisor writes to `ready.json` once its sandbox runs (or could not be started).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Ready {
    pub ok: bool,
    pub sandbox: String,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub pid: u32,
    /// Backend restore to agent hello, and with hygiene.
    #[serde(default)]
    pub restore_ms: f64,
    #[serde(default)]
    pub ready_ms: f64,
    #[serde(default)]
    pub hygiene: serde_json::Value,
    /// Bytes this supervisor read from the blob tier up to ready (a resume on another host fetches here).
    #[serde(default)]
    pub blob_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_with_defaults() {
        let r: Request = serde_json::from_str(r#"{"op":"proc_start","argv":["sh"],"stream":true}"#).unwrap();
        match r {
            Request::ProcStart(s) => {
                assert!(s.stream && !s.stdin && s.pty.is_none());
                assert_eq!(s.argv, ["sh"]);
            }
            other => panic!("{other:?}"),
        }
        let r: Request = serde_json::from_str(r#"{"op":"list_dir","path":"/"}"#).unwrap();
        assert!(matches!(r, Request::ListDir { depth: 1, .. }));
        assert!(serde_json::from_str::<Request>(r#"{"op":"proc_signal","pid":1}"#).is_err());
        let line = serde_json::to_string(&StreamEvent::Exit { code: Some(3), signal: None }).unwrap();
        assert_eq!(line, r#"{"event":"exit","code":3,"signal":null}"#);
    }
}
