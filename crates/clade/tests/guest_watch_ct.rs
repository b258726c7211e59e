//! `clade watch` on a ct sandbox (docs/agent.md, "Watches"): what a command inside does to a directory comes out
//! as it happens, one JSON line an event, until `--count` is reached.

mod common;
use common::clade;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

#[test]
fn guest_watch_ct_reports_a_commands_changes() {
    let Some(t) = common::ct_home("clade-watch-ct") else { return };
    let h = t.path();
    common::ct_template_record(h);
    let (code, out, err) = clade(h, &["fork", "ctbox", "--backend", "ct", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let mut watcher = common::clade_cmd(h, &[])
        .args(["watch", &id, "/root", "--json", "--count", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The watch is in place once the CLI has started it: retry the change until its events come.
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let stdout = watcher.stdout.take().unwrap();
    let l2 = lines.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            l2.lock().unwrap().push(line);
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (code, _, err) = clade(h, &["exec", &id, "--", "sh", "-c", "echo x > /root/a && rm /root/a"]);
    assert_eq!(code, 0, "{err}");
    let status = watcher.wait().unwrap();
    reader.join().unwrap();
    let _ = clade(h, &["kill", &id]);
    assert!(status.success(), "clade watch: {status:?}");
    let got: Vec<(String, String)> = lines
        .lock()
        .unwrap()
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["name"].as_str().unwrap_or("").to_string(), v["kind"].as_str().unwrap_or("").to_string())
        })
        .collect();
    let want = [("a", "create"), ("a", "write"), ("a", "remove")].map(|(n, k)| (n.to_string(), k.to_string()));
    assert_eq!(got, want, "the events of `echo x > /root/a && rm /root/a`");
}
