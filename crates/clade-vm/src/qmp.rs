//! A small synchronous QMP client over a unix socket. clade drives QEMU 7.2 (bookworm) and 10.0
//! (bookworm-backports), whose schemas differ in enums (migration capabilities, run states); the `qapi` crate
//! pins one generated schema, so clade speaks QMP's JSON directly and checks only the fields it uses.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP socket {path}: {source}")]
    Connect { path: String, source: std::io::Error },
    #[error("QMP i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("QMP sent something that is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("QEMU refused `{command}`: {class}: {desc}")]
    Command { command: String, class: String, desc: String },
    #[error("QMP closed the connection (QEMU exited?)")]
    Closed,
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
}

/// One QMP connection, past the capabilities handshake.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events that arrived while waiting for a command's reply, oldest first.
    pub events: Vec<Value>,
    /// The greeting's QEMU version, e.g. (7, 2, 22).
    pub version: (u64, u64, u64),
}

impl Qmp {
    /// Connect, retrying until `timeout` while QEMU creates the socket.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let start = Instant::now();
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if start.elapsed() < timeout => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(QmpError::Connect { path: path.display().to_string(), source: e }),
            }
        };
        let writer = stream.try_clone()?;
        let mut q = Qmp { reader: BufReader::new(stream), writer, events: Vec::new(), version: (0, 0, 0) };
        let greeting = q.read_msg()?;
        let v = &greeting["QMP"]["version"]["qemu"];
        q.version =
            (v["major"].as_u64().unwrap_or(0), v["minor"].as_u64().unwrap_or(0), v["micro"].as_u64().unwrap_or(0));
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn read_msg(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(QmpError::Closed);
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// Run one command and return its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let msg = if arguments.as_object().is_some_and(|o| o.is_empty()) {
            json!({ "execute": command })
        } else {
            json!({ "execute": command, "arguments": arguments })
        };
        let mut bytes = serde_json::to_vec(&msg)?;
        bytes.push(b'\n');
        self.writer.write_all(&bytes)?;
        loop {
            let m = self.read_msg()?;
            if m.get("event").is_some() {
                self.events.push(m);
                continue;
            }
            if let Some(r) = m.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = m.get("error") {
                return Err(QmpError::Command {
                    command: command.into(),
                    class: e["class"].as_str().unwrap_or("").into(),
                    desc: e["desc"].as_str().unwrap_or("").into(),
                });
            }
        }
    }

    /// Send a file descriptor with `getfd` under `name` (for `fd:` migration URIs).
    pub fn send_fd(&mut self, name: &str, fd: std::os::fd::BorrowedFd<'_>) -> Result<(), QmpError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::os::fd::AsRawFd;
        let msg = serde_json::to_vec(&json!({"execute": "getfd", "arguments": {"fdname": name}}))?;
        let fds = [fd.as_raw_fd()];
        let cmsg = [ControlMessage::ScmRights(&fds)];
        let iov = [std::io::IoSlice::new(&msg)];
        sendmsg::<()>(self.writer.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
            .map_err(|e| QmpError::Io(e.into()))?;
        self.writer.write_all(b"\n")?;
        loop {
            let m = self.read_msg()?;
            if m.get("event").is_some() {
                self.events.push(m);
            } else if m.get("return").is_some() {
                return Ok(());
            } else if let Some(e) = m.get("error") {
                return Err(QmpError::Command {
                    command: "getfd".into(),
                    class: e["class"].as_str().unwrap_or("").into(),
                    desc: e["desc"].as_str().unwrap_or("").into(),
                });
            }
        }
    }

    /// The run state (`running`, `paused`, `inmigrate`, `postmigrate`, ...).
    pub fn status(&mut self) -> Result<String, QmpError> {
        Ok(self.execute("query-status", json!({}))?["status"].as_str().unwrap_or("").to_string())
    }

    /// Poll `query-migrate` until it completes or fails.
    pub fn wait_migration(&mut self, timeout: Duration) -> Result<Value, QmpError> {
        let start = Instant::now();
        loop {
            let m = self.execute("query-migrate", json!({}))?;
            match m["status"].as_str() {
                Some("completed") => return Ok(m),
                Some("failed") | Some("cancelled") => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        class: "MigrationFailed".into(),
                        desc: m["error-desc"].as_str().unwrap_or("migration failed").into(),
                    })
                }
                _ if start.elapsed() > timeout => return Err(QmpError::Timeout(timeout, "migration".into())),
                _ => std::thread::sleep(Duration::from_micros(500)),
            }
        }
    }

    /// Wait for the run state to become `want`.
    pub fn wait_status(&mut self, want: &str, timeout: Duration) -> Result<(), QmpError> {
        let start = Instant::now();
        loop {
            if self.status()? == want {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(QmpError::Timeout(timeout, format!("run state {want}")));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}
