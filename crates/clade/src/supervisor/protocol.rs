//! The supervisor's wire format: one JSON request line, one JSON response line, per connection.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The sandbox's record, pids, memory and the agent's hello.
    Info,
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
    },
    /// Take the sandbox back to `mark` (one of its branch's marks, or the mark it was forked from).
    Retake {
        mark: String,
    },
    Suspend,
    Kill,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// For errors: the exit code the CLI should use (3 not found, 4 conflict, 5 resource, 1 other).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    #[serde(default)]
    pub body: serde_json::Value,
}

impl Response {
    pub fn ok(body: serde_json::Value) -> Self {
        Response { ok: true, error: None, code: None, body }
    }
    pub fn err(code: i32, error: impl Into<String>) -> Self {
        Response { ok: false, error: Some(error.into()), code: Some(code), body: serde_json::Value::Null }
    }
}

/// What a supervisor writes to `ready.json` once its sandbox runs (or could not be started).
#[derive(Debug, Clone, Serialize, Deserialize)]
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
}
