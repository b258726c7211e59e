//! Talking to a sandbox's supervisor.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clade_core::{CladeHome, ExitCoded};

use super::protocol::{Request, Response};

/// Send one request and wait for its response (long operations such as a mark or an exec may take a while).
pub fn call(home: &CladeHome, sandbox: &str, req: &Request) -> anyhow::Result<serde_json::Value> {
    let sock = super::ctl_socket(home, sandbox);
    let mut s = UnixStream::connect(&sock).map_err(|e| {
        anyhow!(ExitCoded::new(
            3,
            format!("sandbox {sandbox} has no live supervisor ({}: {e}); see `clade ls`", sock.display())
        ))
    })?;
    s.set_read_timeout(Some(Duration::from_secs(3600)))?;
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    s.write_all(&line).context("send to supervisor")?;
    let mut r = BufReader::new(s);
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
        Err(anyhow!(ExitCoded::new(resp.code.unwrap_or(1), resp.error.unwrap_or_else(|| "failed".into()))))
    }
}
