//! Schemathesis (PyPI, pinned in `$CLADE_HOME/py` by `./x setup`) fuzzes every route of the OpenAPI document a
//! real `clade serve` serves, with real `ct` sandboxes and marks behind it: generated ids and bodies, and (half the
//! time) the ids of live sandboxes and marks, so exec, files, mark, retake, suspend, resume, kill and fork run for
//! real. The bar: no 5xx on any route. Forks are bounded by the admission policy (a small memory capacity set by
//! environment: a fork past it is a 429, not a host full of sandboxes). A fixed seed and 25 examples per operation
//! keep it to about a minute and a half; `CLADE_FUZZ_SEED` and `CLADE_FUZZ_EXAMPLES` run it wider by hand.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

fn ok(home: &Path, args: &[&str]) -> serde_json::Value {
    let (code, out, err) = common::clade(home, args);
    assert_eq!(code, 0, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

#[test]
fn guest_schemathesis_ct_no_server_errors() {
    let st = common::real_home().join("py/bin/schemathesis");
    if !st.exists() {
        // ./x setup installs it; a machine where setup ran has it, so this only skips before setup.
        eprintln!("skip: no schemathesis at {} (run ./x setup)", st.display());
        return;
    }
    let Some(t) = common::ct_home("clade-schemathesis") else { return };
    let h = t.path();
    let forked = ok(h, &["fork", "ctbox", "--backend", "ct", "--count", "2", "--json"]);
    let ids: Vec<String> =
        forked["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox"].as_str().unwrap().to_string()).collect();
    let base = forked["mark"].as_str().unwrap().to_string();
    let m = ok(h, &["mark", &ids[0], "--label", "fuzzed", "--json"]);
    let mark = m["id"].as_str().unwrap().to_string();

    let mut daemon = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["serve", "--listen", "127.0.0.1:0", "--max-upload-mib", "1"])
        .env("CLADE_HOME", h)
        .env("CLADE_CAPACITY_MEMORY_MIB", "24")
        .env("CLADE_ADMIT_RESERVE_MIB", "0")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(daemon.stderr.take().unwrap());
    let mut addr = String::new();
    let mut line = String::new();
    while err.read_line(&mut line).unwrap() > 0 {
        if let Some(a) = line.trim().strip_prefix("clade serve: listening on http://") {
            addr = a.to_string();
        }
        if line.contains("ready") {
            break;
        }
        line.clear();
    }
    assert!(!addr.is_empty(), "clade serve printed no address");
    // The daemon's stderr, kept for the failure message (a panic would show here).
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            log2.lock().unwrap().push_str(&(l + "\n"));
        }
    });
    let key = std::fs::read_to_string(h.join("api.key")).unwrap().trim().to_string();

    let list = |v: &[&str]| v.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
    let sandboxes: Vec<&str> = ids.iter().map(String::as_str).collect();
    let config = format!(
        r#"headers = {{ Authorization = "Bearer {key}" }}
request-timeout = 120
workers = 1
seed = {seed}
generation.max-examples = {examples}
generation.database = "none"

[checks]
enabled = false
not_a_server_error.enabled = true

[phases.stateful]
max-steps = 20

[dictionaries.sandboxes]
values = [{sandboxes}]

[dictionaries.marks]
values = [{marks}]

[[operations]]
include-path-regex = "^/v1/sandboxes/\\{{id\\}}"
parameters = {{ "path.id" = {{ dictionary = "sandboxes", probability = 0.5 }} }}

[[operations]]
include-path-regex = "^/v1/marks/\\{{id\\}}"
parameters = {{ "path.id" = {{ dictionary = "marks", probability = 0.5 }} }}

[[operations]]
include-path = "/v1/sandboxes"
include-method = "POST"
parameters = {{ "body.from" = {{ dictionary = "marks", probability = 0.5 }} }}
"#,
        sandboxes = list(&sandboxes),
        seed = std::env::var("CLADE_FUZZ_SEED").unwrap_or_else(|_| "9".into()),
        examples = std::env::var("CLADE_FUZZ_EXAMPLES").unwrap_or_else(|_| "25".into()),
        marks = list(&[&base, &mark, "fuzzed", "ctbox"]),
    );
    let cfg = h.join("schemathesis.toml");
    std::fs::write(&cfg, config).unwrap();
    let start = Instant::now();
    let out = Command::new(&st)
        .arg("--config-file")
        .arg(&cfg)
        .args(["run", &format!("http://{addr}/openapi.json"), "--url", &format!("http://{addr}"), "--no-color"])
        .args(["-H", &format!("Authorization: Bearer {key}")])
        .current_dir(h)
        .output()
        .unwrap();
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("schemathesis took {took:?}");
    let _ = daemon.kill();
    let _ = daemon.wait();
    // Whatever the fuzzing started goes; the temp home goes with `t`.
    let rows = ok(h, &["ls", "--json"]);
    for r in rows.as_array().unwrap() {
        let _ = common::clade(h, &["kill", r["id"].as_str().unwrap()]);
    }
    assert!(
        out.status.success(),
        "schemathesis found server errors (exit {:?}); the daemon said:\n{}",
        out.status.code(),
        log.lock().unwrap()
    );
    assert!(stdout.contains("Tested:"), "schemathesis tested nothing: {stdout}");
    assert!(took < Duration::from_secs(600), "the fuzz run took {took:?}");
}
