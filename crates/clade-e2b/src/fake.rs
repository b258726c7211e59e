//! An in-memory [`Host`] for the protocol layer's unit tests only (the real proof runs the SDKs against clade):
//! files in a map, `echo` as the only program, sandboxes as ids.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::sync::Mutex;

use crate::host::*;

/// Egress rules as set: (allow, deny).
pub type AllowDeny = (Vec<String>, Vec<String>);

#[derive(Default)]
pub struct Fake {
    pub sandboxes: Mutex<HashMap<String, Status>>,
    pub files: Mutex<BTreeMap<(String, String), Vec<u8>>>,
    /// The egress rules of each sandbox (allow, deny).
    pub egress: Mutex<BTreeMap<String, AllowDeny>>,
    /// What each upload asked for (owner, attributes), by file.
    pub uploads: Mutex<BTreeMap<(String, String), Upload>>,
    next: Mutex<u32>,
}

impl Fake {
    fn live(&self, id: &str) -> HostResult<()> {
        match self.sandboxes.lock().unwrap().get(id) {
            Some(Status::Running) => Ok(()),
            _ => Err(HostError::NotFound(format!("no sandbox {id}"))),
        }
    }
    fn started(&self) -> Started {
        let mut n = self.next.lock().unwrap();
        *n += 1;
        let id = format!("sb-{n}");
        self.sandboxes.lock().unwrap().insert(id.clone(), Status::Running);
        let mut f = self.files.lock().unwrap();
        f.insert((id.clone(), "/etc/passwd".into()), b"root:x:0:0:root:/root:/bin/sh\n".to_vec());
        f.insert((id.clone(), "/etc/group".into()), b"root:x:0:\n".to_vec());
        Started { id, template_id: "base".into(), cpu_count: 1, memory_mb: 256, disk_mb: 1024 }
    }
}

fn entry(path: &str, kind: Kind, size: u64) -> Entry {
    Entry {
        path: path.into(),
        kind,
        size,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime_ns: 0,
        link_target: None,
        xattrs: BTreeMap::new(),
    }
}

impl Host for Fake {
    fn check_key(&self, key: &str) -> bool {
        key == "e2b_good"
    }
    fn create(&self, template: &str, _envs: &BTreeMap<String, String>) -> HostResult<Started> {
        if template != "base" {
            return Err(HostError::NotFound(format!("template '{template}' not found")));
        }
        Ok(self.started())
    }
    fn template_exists(&self, name: &str) -> bool {
        name == "base"
    }
    fn status(&self, id: &str) -> Status {
        self.sandboxes.lock().unwrap().get(id).copied().unwrap_or(Status::Gone)
    }
    fn kill(&self, id: &str) -> HostResult<()> {
        self.sandboxes.lock().unwrap().insert(id.into(), Status::Gone);
        Ok(())
    }
    fn pause(&self, id: &str, _disk_only: bool) -> HostResult<()> {
        self.sandboxes.lock().unwrap().insert(id.into(), Status::Paused);
        Ok(())
    }
    fn resume(&self, id: &str, _reboot: bool) -> HostResult<()> {
        self.sandboxes.lock().unwrap().insert(id.into(), Status::Running);
        Ok(())
    }
    fn fork(&self, id: &str, count: u32) -> HostResult<Vec<Started>> {
        self.live(id)?;
        Ok((0..count).map(|_| self.started()).collect())
    }
    fn snapshot(&self, id: &str, _name: Option<&str>, _disk_only: bool) -> HostResult<Snapshot> {
        self.live(id)?;
        Ok(Snapshot { id: format!("mk-{id}") })
    }
    fn proc_start(&self, id: &str, spec: ProcSpec) -> HostResult<(u32, ProcStream)> {
        self.live(id)?;
        if spec.argv.first().map(String::as_str) != Some("echo") {
            return Err(HostError::NotFound(format!("{:?}: no such program in the fake", spec.argv)));
        }
        let out = format!("{}\n", spec.argv[1..].join(" ")).into_bytes();
        let evs = vec![ProcEvent::Stdout(out), ProcEvent::Exit { code: Some(0), signal: None }];
        Ok((42, Box::new(evs.into_iter())))
    }
    fn proc_connect(&self, id: &str, pid: u32) -> HostResult<ProcStream> {
        self.live(id)?;
        Err(HostError::NotFound(format!("process {pid} not found")))
    }
    fn proc_list(&self, id: &str) -> HostResult<Vec<ProcInfo>> {
        self.live(id)?;
        Ok(Vec::new())
    }
    fn proc_input(&self, id: &str, _pid: u32, _data: &[u8]) -> HostResult<()> {
        self.live(id)
    }
    fn proc_close_stdin(&self, id: &str, _pid: u32) -> HostResult<()> {
        self.live(id)
    }
    fn proc_signal(&self, id: &str, _pid: u32, _signal: i32) -> HostResult<()> {
        self.live(id)
    }
    fn proc_resize(&self, id: &str, _pid: u32, _rows: u16, _cols: u16) -> HostResult<()> {
        self.live(id)
    }
    fn set_egress(&self, id: &str, allow: &[String], deny: &[String]) -> HostResult<()> {
        self.live(id)?;
        if allow.iter().chain(deny).any(|a| a.parse::<std::net::Ipv4Addr>().is_err() && !a.contains('/')) {
            return Err(HostError::Invalid("not an IPv4 address or block".into()));
        }
        self.egress.lock().unwrap().insert(id.into(), (allow.to_vec(), deny.to_vec()));
        Ok(())
    }
    fn connect_port(&self, id: &str, port: u16) -> HostResult<std::net::TcpStream> {
        self.live(id)?;
        // The fake's sandboxes share the test's loopback.
        std::net::TcpStream::connect(("127.0.0.1", port))
            .map_err(|e| HostError::Conflict(format!("port is not open: {e}")))
    }
    fn usage(&self, id: &str) -> HostResult<Usage> {
        self.live(id)?;
        Ok(Usage { cpu_busy: 0.25, mem_used: 1 << 20, disk: Some((1 << 30, 4 << 30)) })
    }
    fn stat(&self, id: &str, path: &str) -> HostResult<Entry> {
        self.live(id)?;
        let f = self.files.lock().unwrap();
        if let Some(d) = f.get(&(id.to_string(), path.to_string())) {
            let up = self.uploads.lock().unwrap().get(&(id.to_string(), path.to_string())).cloned().unwrap_or_default();
            let (uid, gid) = up.owner.unwrap_or((0, 0));
            return Ok(Entry { uid, gid, xattrs: up.xattrs, ..entry(path, Kind::File, d.len() as u64) });
        }
        let prefix = format!("{}/", path.trim_end_matches('/'));
        if path == "/" || f.keys().any(|(s, p)| s == id && p.starts_with(&prefix)) {
            return Ok(entry(path, Kind::Dir, 0));
        }
        Err(HostError::NotFound(format!("{path}: no such file or directory")))
    }
    fn list_dir(&self, id: &str, path: &str, _depth: u32) -> HostResult<Vec<Entry>> {
        self.live(id)?;
        let prefix = format!("{}/", path.trim_end_matches('/'));
        let f = self.files.lock().unwrap();
        Ok(f.iter()
            .filter(|((s, p), _)| s == id && p.starts_with(&prefix) && !p[prefix.len()..].contains('/'))
            .map(|((_, p), d)| entry(p, Kind::File, d.len() as u64))
            .collect())
    }
    fn mkdir(&self, id: &str, _path: &str, _owner: Option<(u32, u32)>) -> HostResult<bool> {
        self.live(id)?;
        Ok(true)
    }
    fn rename(&self, id: &str, from: &str, to: &str) -> HostResult<()> {
        self.live(id)?;
        let mut f = self.files.lock().unwrap();
        let d = f.remove(&(id.into(), from.into())).ok_or_else(|| HostError::NotFound(from.into()))?;
        f.insert((id.into(), to.into()), d);
        Ok(())
    }
    fn remove(&self, id: &str, path: &str) -> HostResult<()> {
        self.live(id)?;
        self.files.lock().unwrap().remove(&(id.into(), path.into()));
        Ok(())
    }
    fn read_file(&self, id: &str, path: &str) -> HostResult<(u64, Box<dyn Read + Send>)> {
        self.live(id)?;
        let d = self
            .files
            .lock()
            .unwrap()
            .get(&(id.into(), path.into()))
            .cloned()
            .ok_or_else(|| HostError::NotFound(format!("{path}: no such file")))?;
        Ok((d.len() as u64, Box::new(std::io::Cursor::new(d))))
    }
    fn write_file(&self, id: &str, path: &str, up: &Upload, src: &mut dyn Read) -> HostResult<u64> {
        self.live(id)?;
        let mut d = Vec::new();
        src.read_to_end(&mut d).map_err(|e| HostError::Internal(e.to_string()))?;
        let n = d.len() as u64;
        self.uploads.lock().unwrap().insert((id.into(), path.into()), up.clone());
        self.files.lock().unwrap().insert((id.into(), path.into()), d);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use serde_json::{json, Value};
    use tower::ServiceExt;

    use super::*;
    use crate::{api, connect, envd, App, Config};

    async fn send(r: axum::Router, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
        let resp = r.oneshot(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        (parts.status, parts.headers, body.collect().await.unwrap().to_bytes().to_vec())
    }

    fn post(uri: &str, key: &str, body: Value) -> Request<Body> {
        Request::post(uri)
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap()
    }

    fn get(uri: &str) -> Request<Body> {
        Request::get(uri).header("x-api-key", "e2b_good").body(Body::empty()).unwrap()
    }

    /// What envd 0.6.4 and the newer control plane add, over the fake: list filters and their bad input, metrics,
    /// template aliases, network rules refused with why, upload metadata (checked, kept, answered) and owner,
    /// and signed URLs (no token needed; expired or wrong: 401).
    #[tokio::test]
    async fn newer_api_and_envd_behaviours_over_the_fake() {
        let host = Arc::new(Fake::default());
        let app = App::new(host.clone(), Config::default()).unwrap();
        let (a, e) = (api::router(app.clone()), envd::router(app.clone()));
        let (_, _, b) = send(a.clone(), post("/v2/sandboxes", "e2b_good", json!({"templateID": "base"}))).await;
        let sb: Value = serde_json::from_slice(&b).unwrap();
        let (id, token) = (sb["sandboxID"].as_str().unwrap().to_string(), sb["envdAccessToken"].as_str().unwrap());

        for (uri, want) in [
            ("/v2/sandboxes?order=asc", StatusCode::OK),
            ("/v2/sandboxes?order=sideways", StatusCode::BAD_REQUEST),
            ("/v2/sandboxes?startedAfter=2020-01-01T00%3A00%3A00%2B01%3A00", StatusCode::OK),
            ("/v2/sandboxes?startedAfter=yesterday", StatusCode::BAD_REQUEST),
            ("/templates/aliases/base", StatusCode::OK),
            ("/templates/aliases/nope", StatusCode::NOT_FOUND),
        ] {
            assert_eq!(send(a.clone(), get(uri)).await.0, want, "{uri}");
        }
        let (_, _, b) = send(a.clone(), get("/v2/sandboxes?startedAfter=2999-01-01T00%3A00%3A00Z")).await;
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap(), json!([]), "none started after the future");
        let (_, _, b) = send(a.clone(), get(&format!("/sandboxes/{id}/metrics"))).await;
        let m: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!((m[0]["cpuUsedPct"].as_f64(), m[0]["memUsed"].as_u64()), (Some(25.0), Some(1 << 20)), "{m}");
        let (_, _, b) = send(a.clone(), get(&format!("/sandboxes/{id}/metrics?start=1&end=2"))).await;
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap(), json!([]), "none in a window long past");
        let network = |body: &'static str| {
            Request::put(format!("/sandboxes/{id}/network"))
                .header("x-api-key", "e2b_good")
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap()
        };
        let (st, _, _) = send(a.clone(), network(r#"{"allowOut":["10.0.0.1"],"allowInternetAccess":false}"#)).await;
        assert_eq!(st, StatusCode::NO_CONTENT);
        let rules = host.egress.lock().unwrap().get(&id).cloned();
        assert_eq!(
            rules,
            Some((vec!["10.0.0.1".to_string()], vec!["0.0.0.0/0".to_string()])),
            "no internet = deny all"
        );
        assert_eq!(app.state.get(&id).unwrap().egress_deny, vec!["0.0.0.0/0"], "kept for the next resume");
        let (st, _, b) = send(a.clone(), network(r#"{"maskRequestHost":"x:${PORT}"}"#)).await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert!(String::from_utf8_lossy(&b).contains("maskRequestHost is not supported"), "says what");
        let (st, _, _) = send(a.clone(), network(r#"{"denyOut":["example.com"]}"#)).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "a name is not an address");

        let upload = |meta: &'static [u8]| {
            Request::post("/files?path=/root/m.txt")
                .header("e2b-sandbox-id", &id)
                .header("x-access-token", token)
                .header("content-type", "application/octet-stream")
                .header("x-metadata-Author", axum::http::HeaderValue::from_bytes(meta).unwrap())
                .body(Body::from("x"))
                .unwrap()
        };
        let (st, _, b) = send(e.clone(), upload(b"mish")).await;
        assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()[0]["metadata"], json!({"author": "mish"}));
        let up = host.uploads.lock().unwrap().get(&(id.clone(), "/root/m.txt".to_string())).cloned().unwrap();
        assert_eq!(up.xattrs.get("user.e2b.author").map(String::as_str), Some("mish"), "lowercased, prefixed");
        assert_eq!(up.owner, Some((0, 0)), "owned by the request's user (root here)");
        assert_eq!(send(e.clone(), upload(b"caf\xe9")).await.0, StatusCode::BAD_REQUEST, "not printable ASCII");

        let signed = |sig: &str, exp: Option<i64>| {
            let exp = exp.map(|x| format!("&signature_expiration={x}")).unwrap_or_default();
            let sig = sig.replace('+', "%2B").replace('/', "%2F");
            Request::get(format!("/files?path=%2Froot%2Fm.txt&signature={sig}{exp}")).body(Body::empty()).unwrap()
        };
        let good = envd::file_signature("/root/m.txt", "read", "", token, None);
        let (st, _, b) = send(e.clone(), signed(&good, None)).await;
        assert_eq!((st, b.as_slice()), (StatusCode::OK, &b"x"[..]), "a signed URL names no sandbox and no token");
        assert_eq!(send(e.clone(), signed("v1_AAAA", None)).await.0, StatusCode::UNAUTHORIZED, "wrong signature");
        let old = envd::file_signature("/root/m.txt", "read", "", token, Some(1));
        let (st, _, b) = send(e.clone(), signed(&old, Some(1))).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED);
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["message"], "signature is already expired");
    }

    #[tokio::test]
    async fn control_plane_and_envd_over_the_fake() {
        let app = App::new(Arc::new(Fake::default()), Config::default()).unwrap();
        let a = api::router(app.clone());
        let e = envd::router(app.clone());

        let (st, _, b) = send(a.clone(), post("/v2/sandboxes", "e2b_bad", json!({"templateID": "base"}))).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED);
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["code"], 401);

        let (st, _, b) = send(a.clone(), post("/v2/sandboxes", "e2b_good", json!({"templateID": "nope"}))).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["code"], 404);
        assert!(v["message"].as_str().unwrap().contains("nope"));

        let meta = json!({"templateID": "base", "metadata": {"team": "a b"}, "timeout": 60});
        let (st, _, b) = send(a.clone(), post("/v2/sandboxes", "e2b_good", meta)).await;
        assert_eq!(st, StatusCode::CREATED);
        let sb: Value = serde_json::from_slice(&b).unwrap();
        let id = sb["sandboxID"].as_str().unwrap().to_string();
        let token = sb["envdAccessToken"].as_str().unwrap().to_string();
        send(a.clone(), post("/v2/sandboxes", "e2b_good", json!({"templateID": "base"}))).await;

        // List with a metadata filter the way the SDK encodes it (a query string inside the parameter).
        let req = Request::get("/v2/sandboxes?metadata=team%3Da%2520b&limit=1")
            .header("x-api-key", "e2b_good")
            .body(Body::empty())
            .unwrap();
        let (st, h, b) = send(a.clone(), req).await;
        assert_eq!(st, StatusCode::OK);
        let l: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(l.as_array().unwrap().len(), 1, "{l}");
        assert_eq!(l[0]["sandboxID"], id.as_str());
        assert!(h.get("x-next-token").is_none());
        let req = Request::get("/v2/sandboxes?limit=1").header("x-api-key", "e2b_good").body(Body::empty()).unwrap();
        let (_, h, _) = send(a.clone(), req).await;
        assert!(h.get("x-next-token").is_some(), "two sandboxes, pages of one");

        // envd: a streamed Start.
        let start = json!({"process": {"cmd": "echo", "args": ["hi"]}});
        let req = Request::post("/process.Process/Start")
            .header("content-type", "application/connect+json")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .body(Body::from(connect::envelope(0, start.to_string().as_bytes())))
            .unwrap();
        let (st, _, b) = send(e.clone(), req).await;
        assert_eq!(st, StatusCode::OK);
        let mut buf = bytes::BytesMut::from(&b[..]);
        let msgs = connect::take_envelopes(&mut buf).unwrap();
        let vals: Vec<Value> = msgs.iter().map(|(_, m)| serde_json::from_slice(m).unwrap()).collect();
        assert_eq!(vals[0]["event"]["start"]["pid"], 42);
        assert_eq!(vals[1]["event"]["data"]["stdout"], "aGkK");
        assert_eq!(vals[2]["event"]["end"]["exitCode"], 0);
        assert_eq!(msgs.last().unwrap().0, connect::FLAG_END);

        // A wrong token, a missing sandbox.
        let req = Request::get("/files?path=/etc/passwd")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", "x")
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(e.clone(), req).await.0, StatusCode::UNAUTHORIZED);
        let req = Request::get("/files?path=/x").header("e2b-sandbox-id", "sb-none").body(Body::empty()).unwrap();
        let (st, _, b) = send(e.clone(), req).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        assert!(String::from_utf8_lossy(&b).contains("was not found"));

        // Files: octet-stream up, down; a relative path lands in the user's home.
        let req = Request::post("/files?path=notes.txt")
            .header("content-type", "application/octet-stream")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .body(Body::from("hello"))
            .unwrap();
        let (st, _, b) = send(e.clone(), req).await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()[0]["path"], "/root/notes.txt");
        let req = Request::get("/files?path=/root/notes.txt")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .body(Body::empty())
            .unwrap();
        let (st, _, b) = send(e.clone(), req).await;
        assert_eq!((st, b.as_slice()), (StatusCode::OK, &b"hello"[..]));

        // Unary ListDir and a NotFound Stat.
        let req = Request::post("/filesystem.Filesystem/ListDir")
            .header("content-type", "application/json")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .body(Body::from(r#"{"path":"/root","depth":1}"#))
            .unwrap();
        let (st, _, b) = send(e.clone(), req).await;
        assert_eq!(st, StatusCode::OK);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["entries"][0]["name"], "notes.txt");
        assert_eq!(v["entries"][0]["type"], "FILE_TYPE_FILE");
        let req = Request::post("/filesystem.Filesystem/Stat")
            .header("content-type", "application/json")
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .body(Body::from(r#"{"path":"/nope"}"#))
            .unwrap();
        let (st, _, b) = send(e.clone(), req).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["code"], "not_found");

        // Pause twice: 204 then 409; envd of a paused sandbox is refused.
        let (st, _, _) = send(a.clone(), post(&format!("/sandboxes/{id}/pause"), "e2b_good", json!({}))).await;
        assert_eq!(st, StatusCode::NO_CONTENT);
        let (st, _, _) = send(a.clone(), post(&format!("/sandboxes/{id}/pause"), "e2b_good", json!({}))).await;
        assert_eq!(st, StatusCode::CONFLICT);
        let (st, _, b) =
            send(a.clone(), post(&format!("/v2/sandboxes/{id}/connect"), "e2b_good", json!({"timeout": 30}))).await;
        assert_eq!(st, StatusCode::CREATED, "{}", String::from_utf8_lossy(&b));

        // Fork and snapshot.
        let (st, _, b) = send(a.clone(), post(&format!("/sandboxes/{id}/fork"), "e2b_good", json!({"count": 2}))).await;
        assert_eq!(st, StatusCode::CREATED);
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap().as_array().unwrap().len(), 2);
        let (st, _, b) =
            send(a.clone(), post(&format!("/sandboxes/{id}/snapshots"), "e2b_good", json!({"name": "s1"}))).await;
        assert_eq!(st, StatusCode::CREATED);
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["names"][0], "s1");

        // Kill, then everything about it is 404.
        let req =
            Request::delete(format!("/sandboxes/{id}")).header("x-api-key", "e2b_good").body(Body::empty()).unwrap();
        assert_eq!(send(a.clone(), req).await.0, StatusCode::NO_CONTENT);
        let req = Request::get(format!("/sandboxes/{id}")).header("x-api-key", "e2b_good").body(Body::empty()).unwrap();
        assert_eq!(send(a.clone(), req).await.0, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn the_doors_refuse_origin_and_foreign_hosts_and_a_huge_body_is_413() {
        let app = App::new(Arc::new(Fake::default()), Config::default()).unwrap();
        let hosts = vec!["127.0.0.1:3000".to_string(), "localhost:3000".to_string()];
        let a = crate::with_doors(api::router(app.clone()), hosts.clone());
        let e = crate::with_doors(envd::router(app.clone()), hosts);
        let get = |uri: &str, host: &str| Request::get(uri).header("host", host).header("x-api-key", "e2b_good");
        let (st, _, b) = send(a.clone(), get("/v2/sandboxes", "127.0.0.1:3000").body(Body::empty()).unwrap()).await;
        assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
        let origin = get("/v2/sandboxes", "127.0.0.1:3000").header("origin", "http://evil.example");
        let (st, _, b) = send(a.clone(), origin.body(Body::empty()).unwrap()).await;
        assert_eq!(st, StatusCode::FORBIDDEN);
        assert!(String::from_utf8_lossy(&b).contains("Origin"));
        let (st, _, b) = send(a.clone(), get("/v2/sandboxes", "evil.example:3000").body(Body::empty()).unwrap()).await;
        assert_eq!(st, StatusCode::FORBIDDEN);
        assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["code"], 403);
        for (host, origin, refused) in [
            ("evil.example:3000", None, true),
            ("localhost:3000", Some("http://x"), true),
            ("localhost:3000", None, false),
        ] {
            let mut rq = Request::get("/health").header("host", host);
            if let Some(o) = origin {
                rq = rq.header("origin", o);
            }
            let (st, _, _) = send(e.clone(), rq.body(Body::empty()).unwrap()).await;
            assert_eq!(st == StatusCode::FORBIDDEN, refused, "envd {host} {origin:?}: {st}");
        }
        let huge = format!(r#"{{"templateID":"base","metadata":{{"k":"{}"}}}}"#, "x".repeat(3 << 20));
        let rq = Request::post("/v2/sandboxes")
            .header("host", "localhost:3000")
            .header("x-api-key", "e2b_good")
            .header("content-type", "application/json")
            .body(Body::from(huge))
            .unwrap();
        assert_eq!(send(a, rq).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn timeouts_are_reaped() {
        let host = Arc::new(Fake::default());
        let app = App::new(host.clone(), Config::default()).unwrap();
        let a = api::router(app.clone());
        let (_, _, b) =
            send(a.clone(), post("/sandboxes", "e2b_good", json!({"templateID": "base", "timeout": 0}))).await;
        let id = serde_json::from_slice::<Value>(&b).unwrap()["sandboxID"].as_str().unwrap().to_string();
        let (_, _, b) = send(
            a.clone(),
            post("/sandboxes", "e2b_good", json!({"templateID": "base", "timeout": 0, "autoPause": true})),
        )
        .await;
        let id2 = serde_json::from_slice::<Value>(&b).unwrap()["sandboxID"].as_str().unwrap().to_string();
        api::reap(&app).await;
        assert_eq!(host.status(&id), Status::Gone);
        assert_eq!(host.status(&id2), Status::Paused);
    }
}
