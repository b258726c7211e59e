//! The daemon's doors (docs/api.md, "Doors"): what every request must pass before a route sees it.
//!
//! - `Authorization: Bearer <key>`, the key read from `$CLADE_HOME/api.key` (written once, mode 0600);
//! - no `Origin` header (a browser page never gets to drive sandboxes, whatever it was tricked into);
//! - a `Host` naming the listener itself (DNS rebinding: a hostile name resolving to 127.0.0.1 is refused);
//! - a POST/PUT body is `application/json`, except the upload route, which takes bytes.
//!
//! Each refusal is a 401 or 403 with a JSON body saying which door, so a script's author knows what to fix.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::error_body;

/// What the doors check against.
pub struct Doors {
    pub key: String,
    /// `Host` values accepted: the listener's own names (`127.0.0.1:8080`, `localhost:8080`, ...); for a unix
    /// socket, `localhost` (and a missing Host).
    pub hosts: Vec<String>,
}

impl Doors {
    #[cfg(test)]
    fn host_ok(&self, host: Option<&str>) -> bool {
        clade_http::doors::host_ok(&self.hosts, host)
    }
}

/// Compares in constant time (subtle's), so the time taken says nothing about how much of a guessed key was
/// right.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    clade_e2b::state::same_secret(a, b)
}

fn refuse(status: StatusCode, code: &str, msg: &str) -> Response {
    (status, axum::Json(error_body(code, msg))).into_response()
}

/// True for the routes whose body is raw bytes (file upload).
fn takes_bytes(path: &str) -> bool {
    path.starts_with("/v1/sandboxes/") && path.ends_with("/files")
}

pub async fn check(State(doors): State<Arc<Doors>>, req: Request, next: Next) -> Response {
    let h = req.headers();
    // The same Origin and Host doors as the E2B faces (clade_http::doors), in this API's error shape.
    if let Err(r) = clade_http::doors::check(&doors.hosts, h) {
        return refuse(StatusCode::FORBIDDEN, r.code(), &r.message());
    }
    let auth = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
    let given = auth.strip_prefix("Bearer ").unwrap_or("");
    if !same_key(given.trim().as_bytes(), doors.key.as_bytes()) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer key: send `Authorization: Bearer <key>` with the key in $CLADE_HOME/api.key",
        );
    }
    if matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH) && !takes_bytes(req.uri().path()) {
        let ct = h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        let json = ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
        let empty = h.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()) == Some("0");
        if !json && !empty {
            return refuse(
                StatusCode::FORBIDDEN,
                "content_type",
                &format!("a request body must be application/json (got {ct:?})"),
            );
        }
    }
    next.run(req).await
}

/// The API key: read `$CLADE_HOME/api.key`, or write a new random one (mode 0600, temp name then rename).
pub fn load_or_create_key(home: &clade_core::CladeHome) -> anyhow::Result<String> {
    use anyhow::Context;
    use std::io::Read;
    let path = home.root().join("api.key");
    if let Ok(k) = std::fs::read_to_string(&path) {
        let k = k.trim().to_string();
        if !k.is_empty() {
            return Ok(k);
        }
    }
    std::fs::create_dir_all(home.root())?;
    let mut raw = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
    let key: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = home.root().join(format!(".api.key.{}", std::process::id()));
    clade_core::home::write_new_private(&tmp, key.as_bytes()).with_context(|| format!("write {}", tmp.display()))?;
    // Another process may have won the race: keep whichever key landed first.
    match std::fs::hard_link(&tmp, &path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("publish {}", path.display())),
    }
    let _ = std::fs::remove_file(&tmp);
    Ok(std::fs::read_to_string(&path)?.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_whole() {
        assert!(same_key(b"abc", b"abc"));
        assert!(!same_key(b"abc", b"abd"));
        assert!(!same_key(b"abc", b"ab"));
        assert!(!same_key(b"", b"a"));
    }

    #[test]
    fn host_door() {
        let d = Doors { key: "k".into(), hosts: vec!["127.0.0.1:9".into(), "localhost:9".into()] };
        assert!(d.host_ok(Some("127.0.0.1:9")));
        assert!(d.host_ok(Some("LOCALHOST:9")));
        assert!(!d.host_ok(Some("evil.example:9")));
        assert!(!d.host_ok(None));
        let u = Doors { key: "k".into(), hosts: vec!["localhost".into()] };
        assert!(u.host_ok(None));
        assert!(u.host_ok(Some("localhost")));
    }

    #[test]
    fn key_is_written_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let home = clade_core::CladeHome::at(dir.path());
        let a = load_or_create_key(&home).unwrap();
        let b = load_or_create_key(&home).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 64);
        let mode = std::fs::metadata(dir.path().join("api.key")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
