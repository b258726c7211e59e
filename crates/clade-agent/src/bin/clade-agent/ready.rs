//! Readiness waits: a listening TCP port (read from /proc/net/tcp{,6}, so the service sees no probe
//! connection), an `http://` URL answering 2xx (a minimal HTTP/1.0 GET: no TLS, no redirects), or a path.

use clade_agent::{AgentError, ReadyTarget, Reply, Response};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(10);
/// The longest a ready answer's remainder is read for (see [`drain`]).
const DRAIN_MAX: Duration = Duration::from_secs(2);

fn port_listens(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|s| {
            s.lines().skip(1).any(|l| {
                let mut cols = l.split_whitespace();
                let local = cols.nth(1).unwrap_or("");
                let state = cols.nth(1).unwrap_or("");
                state == "0A" && local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) == Some(port)
            })
        })
    })
}

/// Splits `http://host[:port][/path]`.
fn parse_url(url: &str) -> Result<(String, String), AgentError> {
    let rest = url.strip_prefix("http://").ok_or_else(|| AgentError::BadRequest {
        detail: format!("{url:?}: only http:// URLs are supported (use a port target for TLS services)"),
    })?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if hostport.is_empty() {
        return Err(AgentError::BadRequest { detail: format!("{url:?} has no host") });
    }
    let hostport = if hostport.contains(':') && !hostport.ends_with(']') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    Ok((hostport, path.to_string()))
}

/// A readiness URL may do real work before it answers (the browser template's takes a screenshot and compares
/// it, seconds under TCG): the answer is awaited until the wait's own deadline, never less than 1 s. Not ready:
/// what it answered (status line and the start of the body), for the timeout's message.
fn url_ok(hostport: &str, path: &str, deadline: Instant) -> Result<(), String> {
    let addr = hostport
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| format!("{hostport} does not resolve"))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).map_err(|e| format!("connect: {e}"))?;
    let _ = s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1))));
    let host = hostport.rsplit_once(':').map(|h| h.0).unwrap_or(hostport);
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut head = [0u8; 16];
    let mut got = 0;
    while got < 12 {
        match s.read(&mut head[got..]) {
            Ok(0) => break,
            Err(e) => return Err(format!("read: {e}")),
            Ok(n) => got += n,
        }
    }
    let line = String::from_utf8_lossy(&head[..got]).into_owned();
    if line.starts_with("HTTP/") && line.split_whitespace().nth(1).is_some_and(|c| c.starts_with('2') && c.len() == 3) {
        drain(&mut s, deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(50), DRAIN_MAX));
        return Ok(());
    }
    // Only on failure: the rest of a short answer, so the error says why (e.g. the template's reason).
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut rest = Vec::with_capacity(512);
    let _ = Read::by_ref(&mut s).take(512).read_to_end(&mut rest);
    drain(&mut s, Duration::from_millis(200));
    let text = format!("{line}{}", String::from_utf8_lossy(&rest));
    let body = text.split_once("\r\n\r\n").map(|(h, b)| (h.lines().next().unwrap_or(""), b));
    Err(match body {
        Some((status, b)) => format!("{status}: {}", b.trim().chars().take(300).collect::<String>()),
        None => text.lines().next().unwrap_or("no answer").chars().take(300).collect(),
    })
}

/// Reads the rest of a ready answer before closing. Closing a socket with unread data sends a reset, and the
/// service's handler, still writing its answer, fails: Python's http.server then prints a traceback (3.11
/// re-parses the source for it), which in a base marked right after its readiness happened again after every
/// restore, in every sibling: under TCG ~400 KB of Python's code translated anew per sibling, ~14 MB of each
/// QEMU's translation cache. Bounded (1 MiB, and `wait` for each read; at most [`DRAIN_MAX`] after a ready
/// answer, within the wait's deadline): a service that keeps the connection open is not waited for.
fn drain(s: &mut TcpStream, wait: Duration) {
    let _ = s.set_read_timeout(Some(wait));
    let _ = std::io::copy(&mut Read::by_ref(s).take(1 << 20), &mut std::io::sink());
}

pub fn wait(target: &ReadyTarget, timeout_ms: u64) -> Response {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(timeout_ms);
    let (what, check): (String, Box<dyn Fn() -> Result<(), String>>) = match target {
        ReadyTarget::Port { port } => {
            let p = *port;
            (
                format!("tcp port {p}"),
                Box::new(move || if port_listens(p) { Ok(()) } else { Err("not listening".into()) }),
            )
        }
        ReadyTarget::Url { url } => {
            let (hp, path) = parse_url(url)?;
            (url.clone(), Box::new(move || url_ok(&hp, &path, deadline)))
        }
        ReadyTarget::File { path } => {
            let p = crate::fsops::check_path(path)?;
            (path.clone(), Box::new(move || if p.exists() { Ok(()) } else { Err("does not exist".into()) }))
        }
    };
    loop {
        let last = match check() {
            Ok(()) => return Ok(Reply::Ready { waited_ms: t0.elapsed().as_millis() as u64 }),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            let what =
                if matches!(target, ReadyTarget::Url { .. }) { format!("{what} (last answer: {last})") } else { what };
            return Err(AgentError::Timeout { what, waited_ms: t0.elapsed().as_millis() as u64 });
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        assert_eq!(parse_url("http://127.0.0.1:8080/x").unwrap(), ("127.0.0.1:8080".into(), "/x".into()));
        assert_eq!(parse_url("http://h").unwrap(), ("h:80".into(), "/".into()));
        assert!(parse_url("https://h").is_err());
        assert!(parse_url("http:///x").is_err());
    }

    /// The ready check reads the whole answer: the service finishes writing it and sees an orderly close, not
    /// a reset in the middle (which made Python's http.server print a traceback after every restore).
    #[test]
    fn a_ready_url_is_read_to_the_end_so_the_service_sees_no_reset() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf);
            // More than a socket buffer, in pieces, after a pause: the client has the status line long before.
            c.write_all(b"HTTP/1.0 200 OK\r\n\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(50));
            let body = vec![b'x'; 64 * 1024];
            let wrote: std::io::Result<()> = (0..8).try_for_each(|_| c.write_all(&body));
            let _ = c.shutdown(std::net::Shutdown::Write);
            let mut rest = Vec::new();
            let closed = c.read_to_end(&mut rest).map(|_| rest.len());
            (wrote.map_err(|e| e.to_string()), closed.map_err(|e| e.to_string()))
        });
        wait(&ReadyTarget::Url { url: format!("http://127.0.0.1:{port}/") }, 5_000).unwrap();
        let (wrote, closed) = server.join().unwrap();
        assert_eq!(wrote, Ok(()), "the service's answer was cut off by the ready check");
        assert_eq!(closed, Ok(0), "the ready check did not close the connection in order");
    }

    #[test]
    fn a_url_timeout_says_what_the_url_answered() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { break };
                let mut buf = [0u8; 1024];
                let _ = c.read(&mut buf);
                let _ = c.write_all(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 27\r\n\r\n{\"hygiene\": \"pending\", \"x\":1}");
            }
        });
        let err = wait(&ReadyTarget::Url { url: format!("http://127.0.0.1:{port}/ready") }, 150).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("not ready after"), "{msg}");
        assert!(msg.contains("last answer: HTTP/1.0 503 Service Unavailable: {\"hygiene\": \"pending\""), "{msg}");
    }
}
