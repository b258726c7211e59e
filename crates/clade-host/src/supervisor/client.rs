//! Talking to a sandbox's supervisor.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clade_core::{CladeHome, ErrorKind, OpError};

use crate::error::kinded;

use super::protocol::{Request, Response, StreamEvent};

/// Send one request and wait for its response (long operations such as a mark or an exec may take a while).
pub fn call(home: &CladeHome, sandbox: &str, req: &Request) -> anyhow::Result<serde_json::Value> {
    let mut s = connect(home, sandbox)?;
    s.set_read_timeout(Some(Duration::from_secs(3600)))?;
    let out = send(&mut s, req).and_then(|()| read_response(&mut BufReader::new(s), sandbox));
    match out {
        // The connection broke without an answer and the supervisor no longer listens: it ended meanwhile (a
        // suspend or kill that ran concurrently, or it died). That is a conflict with the sandbox's state, not
        // a failure of this request's handling.
        Err(e) if e.downcast_ref::<OpError>().is_none() && supervisor_ends(home, sandbox) => Err(kinded(
            ErrorKind::Conflict,
            format!(
                "sandbox {sandbox}'s supervisor ended while answering ({e:#}): it was suspended or killed \
                         meanwhile, or died; see `clade ls`"
            ),
        )),
        other => other,
    }
}

/// Whether the supervisor stops listening within a second (it is ending).
fn supervisor_ends(home: &CladeHome, sandbox: &str) -> bool {
    (0..20).any(|i| {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
        connect(home, sandbox).is_err()
    })
}

fn connect(home: &CladeHome, sandbox: &str) -> anyhow::Result<UnixStream> {
    let sock = super::ctl_socket(home, sandbox);
    super::connect_unix(&sock).map_err(|e| {
        kinded(
            ErrorKind::NotFound,
            format!("sandbox {sandbox} has no live supervisor ({}: {e}); see `clade ls`", sock.display()),
        )
    })
}

fn send(s: &mut UnixStream, req: &Request) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    s.write_all(&line).context("send to supervisor")
}

fn read_response(r: &mut impl BufRead, sandbox: &str) -> anyhow::Result<serde_json::Value> {
    let mut buf = String::new();
    r.read_line(&mut buf).context("read from supervisor")?;
    if buf.is_empty() {
        return Err(anyhow!(
            "supervisor of {sandbox} closed the connection without answering (did it die? see `clade ls`)"
        ));
    }
    let resp: Response = serde_json::from_str(&buf).context("supervisor's answer")?;
    if resp.ok {
        Ok(resp.body)
    } else {
        Err(kinded(resp.kind.unwrap_or(ErrorKind::Internal), resp.error.unwrap_or_else(|| "failed".into())))
    }
}

/// A process's events as the supervisor streams them (`proc_start` with `stream`, or `proc_connect`).
/// Dropping it detaches; the process keeps running.
pub struct EventStream {
    r: BufReader<UnixStream>,
    done: bool,
}

impl Iterator for EventStream {
    type Item = anyhow::Result<StreamEvent>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let mut line = String::new();
        match self.r.read_line(&mut line) {
            Ok(0) => {
                self.done = true;
                Some(Err(anyhow!("the supervisor ended the process stream without an exit (did it die?)")))
            }
            Ok(_) => match serde_json::from_str::<StreamEvent>(&line) {
                Ok(ev) => {
                    self.done = matches!(ev, StreamEvent::Exit { .. } | StreamEvent::Error { .. });
                    Some(Ok(ev))
                }
                Err(e) => {
                    self.done = true;
                    Some(Err(anyhow!("bad process stream line from the supervisor ({e}): {line}")))
                }
            },
            Err(e) => {
                self.done = true;
                Some(Err(anyhow!("reading the process stream: {e}")))
            }
        }
    }
}

/// Open a process stream: `req` is `ProcStart` with `stream: true` or `ProcConnect`. The first event is
/// `Start` (a refusal comes as an error here, with the supervisor's code).
pub fn open_stream(home: &CladeHome, sandbox: &str, req: &Request) -> anyhow::Result<(u32, EventStream)> {
    let mut s = connect(home, sandbox)?;
    send(&mut s, req)?;
    let mut es = EventStream { r: BufReader::new(s), done: false };
    match es.next() {
        Some(Ok(StreamEvent::Start { pid })) => Ok((pid, es)),
        Some(Ok(StreamEvent::Error { kind, message })) => Err(kinded(kind, message)),
        Some(Ok(other)) => Err(anyhow!("the process stream began with {other:?} instead of start")),
        Some(Err(e)) => Err(e),
        None => Err(anyhow!("the process stream ended before it began")),
    }
}

/// Stream a file out of the sandbox: its size (at the start), and a reader of its bytes.
pub fn read_stream(home: &CladeHome, sandbox: &str, path: &str) -> anyhow::Result<(u64, BufReader<UnixStream>)> {
    let mut s = connect(home, sandbox)?;
    send(&mut s, &Request::ReadStream { path: path.into() })?;
    let mut r = BufReader::with_capacity(256 * 1024, s);
    let body = read_response(&mut r, sandbox)?;
    Ok((body.get("size").and_then(|v| v.as_u64()).unwrap_or(0), r))
}

/// Stream `src` into a file of the sandbox (created or replaced atomically, parents created); the bytes
/// written.
pub fn write_stream(
    home: &CladeHome,
    sandbox: &str,
    path: &str,
    opts: &clade_agent::WriteOptions,
    src: &mut dyn std::io::Read,
) -> anyhow::Result<u64> {
    let mut s = connect(home, sandbox)?;
    let req = Request::WriteStream { path: path.into(), opts: opts.clone() };
    send(&mut s, &req)?;
    let copied = {
        let mut w = std::io::BufWriter::with_capacity(256 * 1024, &s);
        std::io::copy(src, &mut w).and_then(|_| w.flush())
    };
    // A refused path is answered early and the supervisor stops reading: its answer says why.
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut r = BufReader::new(s);
    let answer = read_response(&mut r, sandbox);
    match (answer, copied) {
        (Ok(body), Ok(())) => Ok(body.get("bytes").and_then(|v| v.as_u64()).unwrap_or(0)),
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(anyhow!("sending the file to the supervisor: {e}")),
    }
}

/// Whether a supervisor pid is alive (and is a clade supervisor, not a reused pid).
pub fn supervisor_alive(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains("supervise"))
        .unwrap_or(false)
}
