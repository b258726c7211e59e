//! The doors every HTTP face of clade shares: a request carrying `Origin` is refused (a browser
//! page never gets to drive sandboxes, whatever it was tricked into), and so is one whose `Host` does not
//! name the listener (DNS rebinding: a hostile name resolving to 127.0.0.1 is refused). Each face renders
//! the [`Refusal`] in its own error shape.

use std::net::SocketAddr;

use axum::http::{header, HeaderMap};

/// Why a request was refused at the door.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Origin,
    Host { got: String, allowed: String },
}

impl Refusal {
    /// A short machine-readable name.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Origin => "origin",
            Refusal::Host { .. } => "host",
        }
    }

    pub fn message(&self) -> String {
        match self {
            Refusal::Origin => "requests carrying Origin are refused (no browser access)".into(),
            Refusal::Host { got, allowed } => format!("Host {got:?} is not this listener ({allowed})"),
        }
    }
}

/// The `Host` values a TCP listener on `addr` answers to: its address, `localhost:PORT`, the loopback
/// addresses when it listens on them (or on all), and the machine's name when it listens on all.
pub fn tcp_hosts(addr: SocketAddr) -> Vec<String> {
    let port = addr.port();
    let mut h = vec![addr.to_string(), format!("localhost:{port}")];
    if addr.ip().is_unspecified() || addr.ip().is_loopback() {
        h.push(format!("127.0.0.1:{port}"));
        h.push(format!("[::1]:{port}"));
    }
    if addr.ip().is_unspecified() {
        if let Ok(n) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            h.push(format!("{}:{port}", n.trim()));
        }
    }
    h
}

/// Whether `host` names the listener: one of `hosts` (ASCII case aside), or a name under `localhost` with a
/// listed `localhost:PORT` (`49983-<sandbox>.localhost:PORT`, as E2B names sandboxes: such names resolve to
/// loopback only, so no rebinding). No `Host` at all is accepted only on a unix socket (`hosts` holds
/// `localhost`).
pub fn host_ok(hosts: &[String], host: Option<&str>) -> bool {
    let Some(h) = host else { return hosts.iter().any(|x| x == "localhost") };
    if hosts.iter().any(|ok| ok.eq_ignore_ascii_case(h)) {
        return true;
    }
    let lower = h.to_ascii_lowercase();
    match lower.split_once(".localhost") {
        Some((label, rest)) if !label.is_empty() && !label.contains(':') => {
            let base = format!("localhost{rest}");
            hosts.iter().any(|ok| ok.eq_ignore_ascii_case(&base))
        }
        _ => false,
    }
}

/// The Origin and Host doors over a request's headers.
pub fn check(hosts: &[String], headers: &HeaderMap) -> Result<(), Refusal> {
    if headers.contains_key(header::ORIGIN) {
        return Err(Refusal::Origin);
    }
    let host = headers.get(header::HOST).map(|v| v.to_str().unwrap_or("(not text)"));
    if !host_ok(hosts, host) {
        return Err(Refusal::Host { got: host.unwrap_or("").to_string(), allowed: hosts.join(", ") });
    }
    Ok(())
}
