//! The typed client of `clade serve`: [`Remote`] implements `clade_host::SandboxApi` over the HTTP API, so the CLI
//! runs the same operations through the daemon when `CLADE_HOST` is set (`unix:PATH`, `HOST:PORT` or
//! `http://HOST:PORT`) as it does embedded. A small blocking
//! HTTP/1.1 client (one request per connection, `Content-Length` or chunked answers) is all this needs, and it
//! speaks over a unix socket, which the common HTTP client crates do not.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clade_core::backend::BackendKind;
use clade_core::{CladeHome, ErrorKind, OpError};
use clade_host::api::*;
use serde::de::DeserializeOwned;
use serde::Serialize;

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
        let resp = self.raw_ok(method, path, bytes.as_deref(), "application/json")?;
        Ok(if resp.is_empty() { serde_json::Value::Null } else { serde_json::from_slice(&resp)? })
    }

    /// [`Remote::raw`], a non-2xx status as an error of the kind it means.
    fn raw_ok(&self, method: &str, path: &str, body: Option<&[u8]>, ctype: &str) -> anyhow::Result<Vec<u8>> {
        let (status, resp) = self.raw(method, path, body, ctype)?;
        if !(200..300).contains(&status) {
            return Err(http_error(status, &resp));
        }
        Ok(resp)
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

/// A path segment (a sandbox, mark or branch id) percent-encoded.
fn seg(s: &str) -> String {
    encode(s).replace('/', "%2F")
}

impl Remote {
    /// One JSON request whose 2xx answer is `T`.
    fn typed<T: DeserializeOwned>(&self, method: &str, path: &str, body: Option<&impl Serialize>) -> anyhow::Result<T> {
        let body = body.map(serde_json::to_value).transpose()?;
        let v = self.call(method, path, body.as_ref())?;
        serde_json::from_value(v)
            .with_context(|| format!("clade serve's answer to {method} {path} has an unexpected shape"))
    }
}

const NO_BODY: Option<&()> = None;

/// The daemon's operations, one route each (docs/openapi.json): the same answers, the same error kinds as the
/// library's (`clade_host::Ops`), so the CLI cannot tell the faces apart.
impl SandboxApi for Remote {
    fn fork(&self, req: &ForkRequest) -> anyhow::Result<ForkOutcome> {
        self.typed("POST", "/v1/sandboxes", Some(req))
    }

    fn get(&self, sandbox: &str) -> anyhow::Result<SandboxInfo> {
        self.typed("GET", &format!("/v1/sandboxes/{}", seg(sandbox)), NO_BODY)
    }

    fn list(&self) -> anyhow::Result<Vec<SandboxRow>> {
        self.typed("GET", "/v1/sandboxes", NO_BODY)
    }

    fn exec(&self, sandbox: &str, req: ExecRequest) -> anyhow::Result<ExecOutput> {
        self.typed("POST", &format!("/v1/sandboxes/{}/exec", seg(sandbox)), Some(&req))
    }

    /// Through HTTP the events arrive as NDJSON lines; this client reads the answer whole, then yields them.
    fn exec_stream(&self, sandbox: &str, mut req: ExecRequest) -> anyhow::Result<ExecEvents> {
        req.stream = true;
        self.events("POST", &format!("/v1/sandboxes/{}/exec", seg(sandbox)), Some(&req))
    }

    fn open_file(&self, sandbox: &str, path: &str) -> anyhow::Result<(u64, Box<dyn Read + Send>)> {
        let route = format!("/v1/sandboxes/{}/files?path={}", seg(sandbox), encode(path));
        let data = self.raw_ok("GET", &route, None, "application/octet-stream")?;
        Ok((data.len() as u64, Box::new(std::io::Cursor::new(data))))
    }

    fn write_file_from(
        &self,
        sandbox: &str,
        path: &str,
        opts: &WriteOptions,
        src: &mut dyn Read,
    ) -> anyhow::Result<u64> {
        let mut data = Vec::new();
        src.read_to_end(&mut data)?;
        let mut route = format!("/v1/sandboxes/{}/files?path={}", seg(sandbox), encode(path));
        if let Some(m) = opts.mode {
            route.push_str(&format!("&mode={m:o}"));
        }
        if let Some(o) = opts.owner {
            route.push_str(&format!("&uid={}&gid={}", o.uid, o.gid));
        }
        if !opts.xattrs.is_empty() {
            route.push_str(&format!("&xattrs={}", encode(&serde_json::to_string(&opts.xattrs)?)));
        }
        let resp = self.raw_ok("PUT", &route, Some(&data), "application/octet-stream")?;
        let v: serde_json::Value = serde_json::from_slice(&resp)?;
        v["bytes"].as_u64().ok_or_else(|| anyhow!("clade serve's answer to a file write has no byte count"))
    }

    fn mark(&self, sandbox: &str, req: &MarkRequest) -> anyhow::Result<Mark> {
        self.typed("POST", &format!("/v1/sandboxes/{}/marks", seg(sandbox)), Some(req))
    }

    fn retake(&self, sandbox: &str, to: &str) -> anyhow::Result<RetakeOutcome> {
        let body = serde_json::json!({"to": to});
        self.typed("POST", &format!("/v1/sandboxes/{}/retake", seg(sandbox)), Some(&body))
    }

    fn suspend_with(&self, sandbox: &str, req: &SuspendRequest) -> anyhow::Result<Mark> {
        self.typed("POST", &format!("/v1/sandboxes/{}/suspend", seg(sandbox)), Some(req))
    }

    fn freeze(&self, sandbox: &str) -> anyhow::Result<()> {
        self.typed::<serde_json::Value>("POST", &format!("/v1/sandboxes/{}/freeze", seg(sandbox)), NO_BODY).map(|_| ())
    }

    fn thaw(&self, sandbox: &str) -> anyhow::Result<()> {
        self.typed::<serde_json::Value>("POST", &format!("/v1/sandboxes/{}/thaw", seg(sandbox)), NO_BODY).map(|_| ())
    }

    fn resume_with(&self, sandbox: &str, req: &ResumeRequest) -> anyhow::Result<ResumeOutcome> {
        self.typed("POST", &format!("/v1/sandboxes/{}/resume", seg(sandbox)), Some(req))
    }

    fn kill(&self, sandbox: &str) -> anyhow::Result<KillOutcome> {
        self.typed("DELETE", &format!("/v1/sandboxes/{}", seg(sandbox)), NO_BODY)
    }

    fn marks(&self, sandbox: Option<&str>) -> anyhow::Result<Vec<MarkRow>> {
        match sandbox {
            Some(s) => self.typed("GET", &format!("/v1/sandboxes/{}/marks", seg(s)), NO_BODY),
            None => self.typed("GET", "/v1/marks", NO_BODY),
        }
    }

    fn mark_info(&self, spec: &str, backend: Option<BackendKind>) -> anyhow::Result<MarkRow> {
        let q = backend.map(|b| format!("?backend={}", b.as_str())).unwrap_or_default();
        self.typed("GET", &format!("/v1/marks/{}{q}", seg(spec)), NO_BODY)
    }

    fn branches(&self) -> anyhow::Result<Vec<BranchRow>> {
        self.typed("GET", "/v1/branches", NO_BODY)
    }

    fn delete_branch(&self, branch: &str) -> anyhow::Result<Deleted> {
        self.typed("DELETE", &format!("/v1/branches/{}", seg(branch)), NO_BODY)
    }

    fn gc(&self, dry_run: bool) -> anyhow::Result<GcOutcome> {
        self.typed("POST", "/v1/gc", Some(&serde_json::json!({"dry_run": dry_run})))
    }

    fn audit(&self, fix: bool) -> anyhow::Result<AuditReport> {
        self.typed("POST", "/v1/audit", Some(&serde_json::json!({"fix": fix})))
    }

    fn audit_siblings(&self, a: &str, b: &str, control: Control) -> anyhow::Result<SiblingAudit> {
        let (control, no_control) = match control {
            Control::Cold => (None, false),
            Control::Given(c, d) => (Some(vec![c, d]), false),
            Control::Skip => (None, true),
        };
        let body = serde_json::json!({"siblings": [a, b], "control": control, "no_control": no_control});
        self.typed("POST", "/v1/audit", Some(&body))
    }

    /// The daemon reports no progress lines over HTTP; the answer comes when the push is done.
    fn push(&self, sandbox: &str, _progress: &mut dyn FnMut(&str)) -> anyhow::Result<PushOutcome> {
        self.typed("POST", &format!("/v1/sandboxes/{}/push", seg(sandbox)), NO_BODY)
    }

    fn pull(&self, sandbox: &str, _progress: &mut dyn FnMut(&str)) -> anyhow::Result<PullOutcome> {
        self.typed("POST", &format!("/v1/sandboxes/{}/pull", seg(sandbox)), NO_BODY)
    }

    fn roaming(&self) -> anyhow::Result<Vec<RoamRow>> {
        self.typed("GET", "/v1/roam", NO_BODY)
    }

    fn hosts(&self) -> anyhow::Result<Vec<HostRow>> {
        self.typed("GET", "/v1/hosts", NO_BODY)
    }

    fn proc_start(&self, sandbox: &str, spec: ProcSpec) -> anyhow::Result<(u32, ExecEvents)> {
        let body = serde_json::json!({
            "argv": spec.argv, "env": spec.env, "cwd": spec.cwd, "user": spec.user, "pty": spec.pty,
            "stdin": spec.stdin, "tag": spec.tag,
        });
        let mut events = self.events("POST", &format!("/v1/sandboxes/{}/processes", seg(sandbox)), Some(&body))?;
        match events.next() {
            Some(Ok(ExecEvent::Pid(pid))) => Ok((pid, events)),
            Some(Err(e)) => Err(e),
            _ => Err(anyhow!("clade serve started a process but did not say its pid")),
        }
    }

    fn proc_connect(&self, sandbox: &str, pid: u32) -> anyhow::Result<ExecEvents> {
        self.events("GET", &format!("/v1/sandboxes/{}/processes/{pid}/events", seg(sandbox)), NO_BODY)
    }

    fn proc_list(&self, sandbox: &str) -> anyhow::Result<Vec<ProcListing>> {
        let v: serde_json::Value = self.typed("GET", &format!("/v1/sandboxes/{}/processes", seg(sandbox)), NO_BODY)?;
        Ok(serde_json::from_value(v["processes"].clone())?)
    }

    fn proc_input(&self, sandbox: &str, pid: u32, data: &[u8]) -> anyhow::Result<()> {
        use base64::Engine as _;
        let body = serde_json::json!({"data_b64": base64::engine::general_purpose::STANDARD.encode(data)});
        self.proc_post(sandbox, pid, "input", &body)
    }

    fn proc_close_stdin(&self, sandbox: &str, pid: u32) -> anyhow::Result<()> {
        self.proc_post(sandbox, pid, "close_stdin", &serde_json::json!({}))
    }

    fn proc_signal(&self, sandbox: &str, pid: u32, signal: i32) -> anyhow::Result<()> {
        self.proc_post(sandbox, pid, "signal", &serde_json::json!({"signal": signal}))
    }

    fn proc_resize(&self, sandbox: &str, pid: u32, rows: u16, cols: u16) -> anyhow::Result<()> {
        self.proc_post(sandbox, pid, "resize", &serde_json::json!({"rows": rows, "cols": cols}))
    }

    fn watch_start(&self, sandbox: &str, path: &str, recursive: bool) -> anyhow::Result<u64> {
        let req = WatchRequest { path: path.into(), recursive };
        let v: serde_json::Value =
            self.typed("POST", &format!("/v1/sandboxes/{}/watches", seg(sandbox)), Some(&req))?;
        v["watch"].as_u64().ok_or_else(|| anyhow!("clade serve's answer to a watch has no id"))
    }

    fn watch_events(&self, sandbox: &str, watch: u64, wait_ms: u64) -> anyhow::Result<WatchBatch> {
        self.typed("GET", &format!("/v1/sandboxes/{}/watches/{watch}?wait_ms={wait_ms}", seg(sandbox)), NO_BODY)
    }

    fn watch_stop(&self, sandbox: &str, watch: u64) -> anyhow::Result<()> {
        let route = format!("/v1/sandboxes/{}/watches/{watch}", seg(sandbox));
        self.typed::<serde_json::Value>("DELETE", &route, NO_BODY).map(|_| ())
    }

    fn stat(&self, sandbox: &str, path: &str) -> anyhow::Result<FileStat> {
        self.typed("GET", &format!("/v1/sandboxes/{}/fs/stat?path={}", seg(sandbox), encode(path)), NO_BODY)
    }

    fn list_dir(&self, sandbox: &str, path: &str, depth: u32) -> anyhow::Result<Vec<DirEntry>> {
        let route = format!("/v1/sandboxes/{}/fs/list?path={}&depth={depth}", seg(sandbox), encode(path));
        let v: serde_json::Value = self.typed("GET", &route, NO_BODY)?;
        Ok(serde_json::from_value(v["entries"].clone())?)
    }

    fn make_dir(&self, sandbox: &str, path: &str, owner: Option<FileOwner>) -> anyhow::Result<bool> {
        let mut body = serde_json::json!({"path": path});
        if let Some(o) = owner {
            body["uid"] = o.uid.into();
            body["gid"] = o.gid.into();
        }
        let v: serde_json::Value =
            self.typed("POST", &format!("/v1/sandboxes/{}/fs/mkdir", seg(sandbox)), Some(&body))?;
        Ok(v["created"].as_bool().unwrap_or(true))
    }

    fn set_egress(&self, sandbox: &str, rules: &EgressRules) -> anyhow::Result<()> {
        self.typed::<serde_json::Value>("PUT", &format!("/v1/sandboxes/{}/egress", seg(sandbox)), Some(rules))
            .map(|_| ())
    }

    fn rename(&self, sandbox: &str, from: &str, to: &str) -> anyhow::Result<()> {
        let body = serde_json::json!({"from": from, "to": to});
        self.typed::<serde_json::Value>("POST", &format!("/v1/sandboxes/{}/fs/rename", seg(sandbox)), Some(&body))
            .map(|_| ())
    }

    fn remove(&self, sandbox: &str, path: &str) -> anyhow::Result<()> {
        let route = format!("/v1/sandboxes/{}/files?path={}", seg(sandbox), encode(path));
        self.typed::<serde_json::Value>("DELETE", &route, NO_BODY).map(|_| ())
    }
}

impl Remote {
    /// An NDJSON answer's events (read whole, then yielded); an `{"error"}` line is an error of its kind.
    fn events(&self, method: &str, path: &str, body: Option<&impl Serialize>) -> anyhow::Result<ExecEvents> {
        let body = body.map(serde_json::to_vec).transpose()?;
        let resp = self.raw_ok(method, path, body.as_deref(), "application/json")?;
        let events: Vec<anyhow::Result<ExecEvent>> = resp
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_slice(l)?;
                ExecEvent::from_json(&v).ok_or_else(|| {
                    let kind = v["error"]["code"].as_str().map_or(ErrorKind::Internal, crate::status::kind_of_code);
                    anyhow!(OpError::new(
                        kind,
                        v["error"]["message"].as_str().unwrap_or("the process failed").to_string()
                    ))
                })
            })
            .collect();
        Ok(Box::new(events.into_iter()))
    }

    fn proc_post(&self, sandbox: &str, pid: u32, what: &str, body: &serde_json::Value) -> anyhow::Result<()> {
        let route = format!("/v1/sandboxes/{}/processes/{pid}/{what}", seg(sandbox));
        self.typed::<serde_json::Value>("POST", &route, Some(body)).map(|_| ())
    }
}

/// A non-2xx answer as an error of the kind its status means, with the daemon's message.
fn http_error(status: u16, body: &[u8]) -> anyhow::Error {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let msg = v["error"]["message"].as_str().unwrap_or("request failed");
    anyhow!(OpError::new(crate::status::kind_of_status(status), format!("clade serve ({status}): {msg}")))
}
