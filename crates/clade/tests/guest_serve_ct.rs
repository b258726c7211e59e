//! `clade serve` end to end on the `ct` backend, with real supervisors and CRIU restores: the CLI through the
//! daemon (`CLADE_HOST`), streamed exec, file upload and download, the doors, metrics, idle suspend with the
//! next request resuming, a daemon restart finding every sandbox again, and nothing left behind.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

struct Serve {
    child: Child,
    addr: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(home: &Path) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["serve", "--listen", "127.0.0.1:0", "--idle-tick", "1"])
        .env("CLADE_HOME", home)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut addr = None;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            break;
        }
        eprint!("serve: {line}");
        if let Some(a) = line.trim().strip_prefix("clade serve: listening on http://") {
            addr = Some(a.to_string());
        }
        if line.contains("ready") {
            break;
        }
    }
    // Keep draining its stderr so it never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut l = String::new();
        while err.read_line(&mut l).map(|n| n > 0).unwrap_or(false) {
            eprint!("serve: {l}");
            l.clear();
        }
    });
    Serve { child, addr: addr.expect("clade serve printed its address") }
}

/// The CLI through the daemon.
fn clade(home: &Path, host: Option<&str>, args: &[&str]) -> (i32, String, String) {
    match host {
        Some(h) => common::clade_with(home, &[("CLADE_HOST", h)], args),
        None => common::clade(home, args),
    }
}

fn ok(home: &Path, host: &str, args: &[&str]) -> serde_json::Value {
    let (code, out, err) = clade(home, Some(host), args);
    assert_eq!(code, 0, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

/// One raw HTTP/1.1 request; the status and the (de-chunked) body.
fn http(addr: &str, key: &str, method: &str, path: &str, ctype: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nContent-Type: {ctype}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let split = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&all[..split]).to_string();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut rest = &all[split + 4..];
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (status, rest.to_vec());
    }
    let mut out = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
        let n = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return (status, out);
        }
        out.extend_from_slice(&rest[eol + 2..eol + 2 + n]);
        rest = &rest[eol + 2 + n + 2..];
    }
}

fn left_behind(home: &Path) -> Vec<String> {
    let needle = home.join("run").display().to_string();
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if let Ok(c) = std::fs::read(format!("/proc/{pid}/cmdline")) {
            let c = String::from_utf8_lossy(&c).replace('\0', " ");
            if c.contains(&needle) || (c.contains("supervise") && c.contains("--sandbox")) && c.contains("serve-ct") {
                v.push(format!("{pid}: {c}"));
            }
        }
    }
    v
}

#[test]
fn guest_serve_ct_cli_through_daemon_stream_files_idle_restart() {
    let Some(t) = common::ct_home("clade-serve-ct") else { return };
    let h = t.path();

    let srv = serve(h);
    let host = srv.addr.clone();
    let key = std::fs::read_to_string(h.join("api.key")).unwrap().trim().to_string();

    // The CLI through the daemon: fork two, distinct machines, exit codes carried through.
    let forked = ok(h, &host, &["fork", "ctbox", "--backend", "ct", "--count", "2", "--json"]);
    let ids: Vec<String> =
        forked["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 2, "{forked}");
    let names: Vec<String> = ids
        .iter()
        .map(|id| ok(h, &host, &["exec", id, "--json", "--", "hostname"])["stdout"].as_str().unwrap().to_string())
        .collect();
    assert_ne!(names[0], names[1]);
    let (code, _, _) = clade(h, Some(&host), &["exec", &ids[0], "--", "sh", "-c", "exit 7"]);
    assert_eq!(code, 7);
    let (code, _, err) = clade(h, Some(&host), &["exec", "sbx-nope", "--", "true"]);
    assert_eq!(code, 3, "{err}");

    // The sibling audit through the daemon (`POST /v1/audit` with `siblings`); no template is catalogued in
    // this home, so the cold control is refused as not found and the literal rule runs on request.
    let (code, _, err) = clade(h, Some(&host), &["audit", &ids[0], &ids[1]]);
    assert_eq!(code, 3, "no cold pair without a catalogued template: {err}");
    assert!(err.contains("--control"), "the refusal says what to do instead: {err}");
    let (code, out, err) = clade(h, Some(&host), &["audit", &ids[0], &ids[1], "--no-control", "--json"]);
    let lit: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    assert_eq!(lit["shared_besides_char_devices"], 0, "{lit}");
    assert_eq!(code, if lit["pass"] == true { 0 } else { 1 }, "{lit}");

    // Streamed exec: events in order, the second line after the sleep.
    let body = br#"{"argv":["sh","-c","echo one; sleep 0.3; echo two >&2; exit 3"],"stream":true}"#;
    let (s, out) = http(&host, &key, "POST", &format!("/v1/sandboxes/{}/exec", ids[0]), "application/json", body);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines[0]["pid"].as_u64().is_some(), "{lines:?}");
    let text: String = lines.iter().filter_map(|l| l["stdout"].as_str()).collect();
    let errs: String = lines.iter().filter_map(|l| l["stderr"].as_str()).collect();
    assert_eq!((text.as_str(), errs.as_str()), ("one\n", "two\n"));
    assert_eq!(lines.last().unwrap()["exit"]["code"], 3);

    // Files: 3 MiB up and back, byte for byte; a missing file is a 404.
    let data: Vec<u8> = (0..3u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let p = format!("/v1/sandboxes/{}/files?path=/tmp/blob", ids[1]);
    let (s, out) = http(&host, &key, "PUT", &p, "application/octet-stream", &data);
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
    let (s, back) = http(&host, &key, "GET", &p, "", b"");
    assert_eq!(s, 200);
    assert!(back == data, "downloaded {} bytes differ from the {} uploaded", back.len(), data.len());
    let (s, _) = http(&host, &key, "GET", &format!("/v1/sandboxes/{}/files?path=/nope", ids[1]), "", b"");
    assert_eq!(s, 404);

    // The doors on a real listener.
    let (s, _) = http(&host, "wrong", "GET", "/v1/sandboxes", "", b"");
    assert_eq!(s, 401);

    // Mark and retake through the daemon: the file written after the mark disappears. An on-restore hook
    // hears that the retake continues the sandbox's own line, and a fork of the same mark starts a sibling.
    let hook = "mkdir -p /etc/clade/on-restore.d && printf '#!/bin/sh\\necho $CLADE_RESTORE > /root/restore-kind\\n' \
                > /etc/clade/on-restore.d/10-kind && chmod +x /etc/clade/on-restore.d/10-kind";
    ok(h, &host, &["exec", &ids[1], "--json", "--", "sh", "-c", hook]);
    let m = ok(h, &host, &["mark", &ids[1], "--label", "m1", "--json"]);
    let mark = m["id"].as_str().unwrap().to_string();
    ok(h, &host, &["exec", &ids[1], "--json", "--", "sh", "-c", "echo x > /tmp/after"]);
    ok(h, &host, &["retake", &ids[1], "--to", &mark, "--json"]);
    let (code, _, _) = clade(h, Some(&host), &["exec", &ids[1], "--", "test", "-e", "/tmp/after"]);
    assert_eq!(code, 1, "the retake kept a file written after the mark");
    let kind = ok(h, &host, &["exec", &ids[1], "--json", "--", "cat", "/root/restore-kind"]);
    assert_eq!(kind["stdout"].as_str().unwrap().trim(), "continue", "{kind}");
    let sib = ok(h, &host, &["fork", &mark, "--backend", "ct", "--json"]);
    let sib = sib["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let kind = ok(h, &host, &["exec", &sib, "--json", "--", "cat", "/root/restore-kind"]);
    assert_eq!(kind["stdout"].as_str().unwrap().trim(), "sibling", "{kind}");
    ok(h, &host, &["kill", &sib, "--json"]);

    // Idle suspend: the sandbox goes to sleep, the next request wakes it, transparently.
    let (s, out) = http(
        &host,
        &key,
        "POST",
        &format!("/v1/sandboxes/{}/timeout", ids[0]),
        "application/json",
        br#"{"idle_timeout_s":2}"#,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&out));
    let start = Instant::now();
    loop {
        let rows = ok(h, &host, &["ls", "--json"]);
        let st = rows.as_array().unwrap().iter().find(|r| r["id"] == ids[0].as_str()).unwrap()["state"].clone();
        if st == "suspended" {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "not suspended after 60 s idle: {st}");
        std::thread::sleep(Duration::from_millis(500));
    }
    let woke = ok(h, &host, &["exec", &ids[0], "--json", "--", "hostname"]);
    assert_eq!(woke["stdout"].as_str().unwrap(), names[0], "an idle-resumed sandbox keeps its identity");

    let (s, metrics) = http(&host, &key, "GET", "/metrics", "", b"");
    let metrics = String::from_utf8_lossy(&metrics).to_string();
    assert_eq!(s, 200);
    assert!(metrics.contains("clade_sandboxes{state=\"running\"} 2"), "{metrics}");
    assert!(metrics.contains("clade_idle_suspends_total 1"), "{metrics}");
    assert!(metrics.contains("clade_operation_duration_seconds_bucket{"), "{metrics}");

    // The daemon restarts: every sandbox is found again and answers.
    drop(srv);
    let srv = serve(h);
    let host = srv.addr.clone();
    let rows = ok(h, &host, &["ls", "--json"]);
    let running = rows.as_array().unwrap().iter().filter(|r| r["state"] == "running").count();
    assert_eq!(running, 2, "{rows}");
    for id in &ids {
        ok(h, &host, &["exec", id, "--json", "--", "true"]);
        ok(h, &host, &["kill", id, "--json"]);
    }
    let rows = ok(h, &host, &["ls", "--json"]);
    assert_eq!(rows.as_array().unwrap().len(), 0, "{rows}");
    drop(srv);
    std::thread::sleep(Duration::from_millis(500));
    let left = left_behind(h);
    assert!(left.is_empty(), "left behind: {left:?}");
}
