//! The CLI through `clade serve`: when `CLADE_HOST` is set (`unix:PATH`, `HOST:PORT` or `http://HOST:PORT`), the
//! sandbox commands send their operation to the daemon instead of running it embedded. A small blocking
//! HTTP/1.1 client (one request per connection, `Content-Length` or chunked answers) is all this needs, and it
//! speaks over a unix socket, which the common HTTP client crates do not.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clade_core::{CladeHome, OpError};

pub struct Remote {
    target: Target,
    key: String,
    /// How long an answer may take (an exec runs as long as its command: an hour by default).
    timeout: Duration,
}

enum Target {
    Unix(std::path::PathBuf),
    Tcp(String),
}

trait Conn: Read + Write {}
impl<T: Read + Write> Conn for T {}

impl Remote {
    /// The daemon named by `CLADE_HOST`, if set; its key from `CLADE_API_KEY` or `$CLADE_HOME/api.key`.
    pub fn from_env() -> anyhow::Result<Option<Remote>> {
        let Ok(host) = std::env::var("CLADE_HOST") else { return Ok(None) };
        if host.is_empty() {
            return Ok(None);
        }
        let target = if let Some(p) = host.strip_prefix("unix:") {
            Target::Unix(p.into())
        } else {
            Target::Tcp(host.trim_start_matches("http://").trim_end_matches('/').to_string())
        };
        let key = match std::env::var("CLADE_API_KEY") {
            Ok(k) => k,
            Err(_) => {
                let path = CladeHome::from_env().root().join("api.key");
                std::fs::read_to_string(&path)
                    .with_context(|| {
                        format!("CLADE_HOST is set: read the API key from {} or set CLADE_API_KEY", path.display())
                    })?
                    .trim()
                    .to_string()
            }
        };
        Ok(Some(Remote { target, key, timeout: Duration::from_secs(3600) }))
    }

    /// A daemon on a unix socket, with its key (the bench's client).
    pub fn unix(path: impl Into<std::path::PathBuf>, key: impl Into<String>) -> Remote {
        Remote { target: Target::Unix(path.into()), key: key.into(), timeout: Duration::from_secs(3600) }
    }

    /// Give up on an answer after `t` (a read timeout: the error says so).
    pub fn with_timeout(mut self, t: Duration) -> Remote {
        self.timeout = t;
        self
    }

    fn connect(&self) -> anyhow::Result<(Box<dyn Conn>, String)> {
        match &self.target {
            Target::Unix(p) => {
                let s = UnixStream::connect(p)
                    .with_context(|| format!("connect to clade serve at unix:{} (is it running?)", p.display()))?;
                s.set_read_timeout(Some(self.timeout))?;
                Ok((Box::new(s), "localhost".into()))
            }
            Target::Tcp(a) => {
                let s =
                    TcpStream::connect(a).with_context(|| format!("connect to clade serve at {a} (is it running?)"))?;
                s.set_read_timeout(Some(self.timeout))?;
                s.set_nodelay(true)?;
                Ok((Box::new(s), a.clone()))
            }
        }
    }

    /// One request; a 2xx answer's body as JSON, any other status as an error with the CLI's exit code.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let bytes = body.map(serde_json::to_vec).transpose()?;
        let (status, resp) = self.raw(method, path, bytes.as_deref(), "application/json")?;
        let v: serde_json::Value =
            if resp.is_empty() { serde_json::Value::Null } else { serde_json::from_slice(&resp)? };
        if (200..300).contains(&status) {
            return Ok(v);
        }
        let msg = v["error"]["message"].as_str().unwrap_or("request failed").to_string();
        let kind = crate::status::kind_of_status(status);
        Err(anyhow!(OpError::new(kind, format!("clade serve ({status}): {msg}"))))
    }

    /// One request with a raw body; returns the status and the whole (de-chunked) answer.
    pub fn raw(&self, method: &str, path: &str, body: Option<&[u8]>, ctype: &str) -> anyhow::Result<(u16, Vec<u8>)> {
        let (mut conn, host) = self.connect()?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n",
            self.key
        );
        match body {
            Some(b) => head.push_str(&format!("Content-Type: {ctype}\r\nContent-Length: {}\r\n\r\n", b.len())),
            None => head.push_str("Content-Length: 0\r\n\r\n"),
        }
        conn.write_all(head.as_bytes())?;
        if let Some(b) = body {
            conn.write_all(b)?;
        }
        conn.flush()?;
        let mut r = BufReader::new(conn);
        let mut head = Vec::new();
        loop {
            let mut line = Vec::new();
            if r.read_until(b'\n', &mut line)? == 0 {
                return Err(anyhow!("clade serve closed the connection before answering"));
            }
            head.extend_from_slice(&line);
            if line == b"\r\n" {
                break;
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        resp.parse(&head).context("clade serve's answer")?;
        let status = resp.code.unwrap_or(0);
        let get = |name: &str| {
            resp.headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| String::from_utf8_lossy(h.value).to_string())
        };
        let chunked = get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
        let len = get("content-length").and_then(|v| v.parse::<usize>().ok());
        let mut out = Vec::new();
        if chunked {
            read_chunked(&mut r, &mut out)?;
        } else if let Some(n) = len {
            out.resize(n, 0);
            r.read_exact(&mut out)?;
        } else {
            r.read_to_end(&mut out)?;
        }
        Ok((status, out))
    }
}

fn read_chunked(r: &mut impl BufRead, out: &mut Vec<u8>) -> anyhow::Result<()> {
    loop {
        let mut line = String::new();
        r.read_line(&mut line)?;
        let n = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
            .with_context(|| format!("bad chunk size {line:?}"))?;
        if n == 0 {
            let mut end = String::new();
            let _ = r.read_line(&mut end);
            return Ok(());
        }
        let start = out.len();
        out.resize(start + n, 0);
        r.read_exact(&mut out[start..])?;
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf)?;
    }
}

/// Percent-encodes a query value.
pub fn encode(s: &str) -> String {
    let mut o = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            o.push(b as char);
        } else {
            o.push_str(&format!("%{b:02X}"));
        }
    }
    o
}
