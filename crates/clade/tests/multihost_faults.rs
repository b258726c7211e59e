//! Faults between a clade host and the shared blob tier (a real 3-node Garage cluster), docs/roam.md
//! "Faults": a push whose process is SIGKILLed midway, a push whose network to the store is cut midway, a blob
//! tier that refuses the credentials, one that does not answer and one that is full (its quota reached). After
//! each, the blob tier holds the mark whole or not at all (never a root whose data is missing), host A still has
//! the sandbox, suspended, and the push retried completes; host B then resumes it with its files.

use std::io::BufRead;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::hostnet::{HostNet, Link, NETNS_VAR};
use common::{blob_check, ok_env as ok, run_env as run, sh_env as sh, Env};

fn state_on(home: &Path, sbx: &str) -> String {
    let (code, out, err) = common::clade(home, &["ls", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().cloned().unwrap_or_default();
    let row = rows.iter().find(|r| r["sandbox"] == sbx || r["id"] == sbx);
    row.map(|r| r["state"].as_str().unwrap_or("").to_string()).unwrap_or_else(|| "absent".into())
}

/// Start `clade roam push` on `a` (whose endpoint is `link`) and stop it (by `stop`) once `at` bytes went up
/// through the link: in the middle of its uploads, before it published the mark. Returns the push's stderr.
fn interrupt_push(
    a: &Path,
    env: &Env,
    sbx: &str,
    link: &Link,
    at: u64,
    stop: &dyn Fn(&mut std::process::Child),
) -> String {
    let before = link.up();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut child = common::clade_cmd(a, &env)
        .args(["roam", "push", sbx, "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while link.up() - before < at {
        assert!(child.try_wait().unwrap().is_none(), "the push ended before it could be interrupted");
        assert!(start.elapsed() < Duration::from_secs(60), "the push uploaded too little in 60 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop(&mut child);
    let status = child.wait().unwrap();
    assert!(!status.success(), "the interrupted push must not report success");
    let mut err = String::new();
    for l in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        err.push_str(&l.unwrap_or_default());
        err.push('\n');
    }
    err
}

#[test]
fn multihost_faults_push_killed_or_cut_midway_then_retried_ct() {
    let Some(g) = common::garage("clade-faults") else { return };
    let Some(a) = common::ct_home("clade-faults-a") else { return };
    let b = tempfile::Builder::new().prefix("clade-faults-b").tempdir_in("/var/tmp").unwrap();
    std::os::unix::fs::symlink(common::real_home().join("criu"), b.path().join("criu")).unwrap();
    let (a, b) = (a.path(), b.path());
    // Each host runs in a network namespace of its own and reaches the store through a relay; A's counts the
    // bytes going up (and can be cut).
    let (net, net_b) = (HostNet::new("faults-a", &g), HostNet::new("faults-b", &g));
    let link = &net.link;
    let env_b: Env = net_b.env(&g);
    let mut env_a = net.env(&g);
    env_a.push(("CLADE_BLOB_RETRY_S", "3".into()));
    let endpoint_a = format!("http://127.0.0.1:{}", link.port);
    // Host A works without the blob tier until it pushes, so the push has the whole mark to upload.
    let none: Env = vec![(NETNS_VAR, net.ns.name.clone())];
    let _end_a = common::KillAllOnDrop { home: a, env: none.clone() };
    let _end_b = common::KillAllOnDrop { home: b, env: env_b.clone() };
    let new_sandbox = |tag: &str| -> (String, String) {
        let r = ok(a, &none, &["run", "ctbox", "--backend", "ct", "--json"]);
        let sbx = r["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
        let sum = sh(a, &none, &sbx, &format!("mkdir -p /root && echo {tag} > /root/note && head -c 50331648 /dev/urandom > /root/big && md5sum < /root/big"));
        ok(a, &none, &["suspend", &sbx, "--json"]);
        (sbx, sum)
    };

    // 1. The pushing process is killed (SIGKILL) midway: once 44 MiB went up, the lower layers (~6 MiB) and one
    // of the mark's two packs (32 and 16 MiB) are up, the other is not.
    let (sbx, sum) = new_sandbox("killed");
    let err = interrupt_push(a, &env_a, &sbx, link, 44 << 20, &|c| {
        let _ = c.kill();
    });
    let rep = blob_check(&g);
    assert!(rep.whole(), "after a push killed midway: {rep:?}");
    assert_eq!(state_on(a, &sbx), "suspended", "host A still has it: {err}");
    let (code, _, e) = run(b, &env_b, &["resume", &sbx]);
    assert_ne!(code, 0, "B cannot resume a push that never finished: {e}");
    // B's blob gc, with no grace at all, keeps what A's push uploaded: A's lease (written as the upload starts)
    // names it, though no published root does yet.
    let packs = blob_check(&g).packs;
    let gc = ok(b, &env_b, &["store", "gc", "--include-blob", "--grace-secs", "0", "--json"]);
    assert!(gc["blob"]["packs_kept_leased"].as_u64().unwrap() > 0, "{gc}");
    assert_eq!(blob_check(&g).packs, packs, "{gc}");
    retried_and_resumed(a, &env_a, b, &env_b, &sbx, &sum, "killed");

    // 2. The network between A and the store is cut midway (20 MiB of the mark's 48 up).
    let (sbx, sum) = new_sandbox("cut");
    let t = Instant::now();
    let err = interrupt_push(a, &env_a, &sbx, link, 20 << 20, &|c| {
        link.cut();
        // The push notices by itself, within its retry time.
        let start = Instant::now();
        while c.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < Duration::from_secs(60), "the push did not give up on a cut network");
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    eprintln!("push over a cut network failed after {:.1} s: {}", t.elapsed().as_secs_f64(), err.trim());
    assert!(err.contains(&format!("127.0.0.1:{}", link.port)), "the error names the endpoint: {err}");
    let rep = blob_check(&g);
    assert!(rep.whole(), "after a push cut midway: {rep:?}");
    assert_eq!(state_on(a, &sbx), "suspended");
    link.restore();
    retried_and_resumed(a, &env_a, b, &env_b, &sbx, &sum, "cut");

    // 3. Wrong credentials, and a tier that does not answer: clear errors, nothing changed, retry works.
    let (sbx, sum) = new_sandbox("refused");
    let mut wrong = env_a.clone();
    wrong.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    wrong.push(("AWS_SECRET_ACCESS_KEY", "0".repeat(64)));
    let (code, _, err) = run(a, &wrong, &["roam", "push", &sbx]);
    assert_ne!(code, 0);
    assert!(err.contains(&endpoint_a) && err.contains("credentials"), "{err}");
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut away = env_a.clone();
    away.retain(|(k, _)| *k != "CLADE_BLOB_ENDPOINT" && *k != "CLADE_BLOB_RETRY_S");
    away.push(("CLADE_BLOB_ENDPOINT", format!("http://127.0.0.1:{dead}")));
    away.push(("CLADE_BLOB_RETRY_S", "2".into()));
    let (code, _, err) = run(a, &away, &["roam", "push", &sbx]);
    assert_ne!(code, 0);
    assert!(err.contains(&format!("127.0.0.1:{dead}")), "{err}");
    assert_eq!(state_on(a, &sbx), "suspended");
    // A full tier (the bucket's quota reached).
    g.cli(0, &["bucket", "set-quotas", &g.bucket, "--max-size", "1MiB"]).unwrap();
    let (code, _, err) = run(a, &env_a, &["roam", "push", &sbx]);
    assert_ne!(code, 0, "a push into a full tier fails");
    assert!(err.contains(&endpoint_a), "{err}");
    assert_eq!(state_on(a, &sbx), "suspended");
    assert!(blob_check(&g).whole());
    g.cli(0, &["bucket", "set-quotas", &g.bucket, "--max-size", "none"]).unwrap();
    retried_and_resumed(a, &env_a, b, &env_b, &sbx, &sum, "refused");
    assert!(blob_check(&g).whole());
}

/// The push retried on A completes; B resumes the sandbox with its files.
fn retried_and_resumed(a: &Path, env_a: &Env, b: &Path, env_b: &Env, sbx: &str, sum: &str, tag: &str) {
    let pushed = ok(a, env_a, &["roam", "push", sbx, "--json"]);
    eprintln!("{tag}: the retried push uploaded {} bytes", pushed["bytes_uploaded"]);
    assert_eq!(state_on(a, sbx), "absent", "A forgot it once pushed");
    ok(b, env_b, &["resume", sbx, "--json"]);
    assert_eq!(sh(b, env_b, sbx, "cat /root/note; md5sum < /root/big"), format!("{tag}\n{sum}"));
    ok(b, env_b, &["kill", sbx, "--json"]);
}

/// `clade hosts` over the blob tier: a host whose `clade serve` beats is live and leases; SIGKILLed, it is shown
/// as stopped after three missed beats, its lease is no longer honoured, and blob gc deletes the record.
#[test]
fn multihost_hosts_heartbeat_then_stopped() {
    let Some(g) = common::garage("clade-hosts") else { return };
    let (h, q) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut env = g.env();
    env.push(("CLADE_HEARTBEAT_S", "1".into()));
    let mut serve = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["serve", "--listen", &format!("unix:{}/api.sock", h.path().display())])
        .env("CLADE_HOME", h.path())
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let row = |want: &str| -> serde_json::Value {
        let start = Instant::now();
        loop {
            let id = std::fs::read_to_string(h.path().join("host-id")).unwrap_or_default();
            let rows = ok(q.path(), &env, &["hosts", "--json"]);
            let r = rows.as_array().unwrap().iter().find(|r| !id.is_empty() && r["host"] == id.trim()).cloned();
            if let Some(r) = r.filter(|r| r["state"] == want) {
                return r;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "host never shown {want}: {rows}");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let live = row("live");
    assert_eq!(live["lease_live"], true, "{live}");
    assert!(live["age_s"].as_f64().unwrap() < 3.0, "{live}");
    let _ = serve.kill();
    let _ = serve.wait();
    let stopped = row("stopped");
    assert_eq!(stopped["lease_live"], false, "{stopped}");
    let gc = ok(q.path(), &env, &["store", "gc", "--include-blob", "--json"]);
    assert_eq!(gc["blob"]["host_leases_expired"], 1, "{gc}");
}
