//! Disk-only marks through the CLI on `ct` (docs/ct.md, "Disk-only marks"): `clade suspend --disk-only` ends
//! the processes and `resume` boots the disk cold (the files, a new boot id, no process of before);
//! `clade resume --reboot` does the same from a whole suspend; `clade mark --disk-only` leaves the sandbox
//! running and a fork of it boots cold; `clade marks` says which marks are disk-only.

mod common;
use common::clade;

struct KillOnDrop<'a>(&'a std::path::Path, Vec<String>);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        for id in &self.1 {
            let _ = clade(self.0, &["kill", id]);
        }
    }
}

fn sh(h: &std::path::Path, id: &str, script: &str) -> String {
    let (code, out, err) = clade(h, &["exec", id, "--", "sh", "-c", script]);
    assert_eq!(code, 0, "{script}: {err}");
    out.trim().to_string()
}

const BOOT_ID: &str = "cat /proc/sys/kernel/random/boot_id";
const TICKER: &str = "setsid sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 &";
const TICKING: &str = "ps -o args 2>/dev/null | grep -c '^sh -c while' || true";

/// A `--json` command that must succeed (common::ok_env without extra environment).
fn ok(h: &std::path::Path, args: &[&str]) -> serde_json::Value {
    common::ok_env(h, &Vec::new(), args)
}

#[test]
fn guest_disk_only_ct_suspend_reboot_and_mark() {
    let Some(t) = common::ct_home("clade-disk-ct") else { return };
    let h = t.path();
    common::ct_template_record(h);
    let v = ok(h, &["fork", "ctbox", "--backend", "ct", "--json"]);
    let id = v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let mut guard = KillOnDrop(h, vec![id.clone()]);
    let boot = sh(h, &id, BOOT_ID);
    sh(h, &id, "echo one > /root/f");
    sh(h, &id, TICKER);
    assert_eq!(sh(h, &id, TICKING), "1", "the control: the loop is seen running");

    // A whole suspend and a plain resume: the same boot, its processes.
    ok(h, &["suspend", &id, "--json"]);
    ok(h, &["resume", &id, "--json"]);
    assert_eq!(sh(h, &id, BOOT_ID), boot);
    assert_eq!(sh(h, &id, TICKING), "1");

    // A whole suspend resumed with --reboot: the files, a cold boot.
    ok(h, &["suspend", &id, "--json"]);
    ok(h, &["resume", &id, "--reboot", "--json"]);
    assert_eq!(sh(h, &id, "cat /root/f"), "one");
    let reboot = sh(h, &id, BOOT_ID);
    assert_ne!(reboot, boot, "a reboot is a new boot");
    assert_eq!(sh(h, &id, TICKING), "0", "no process of before");

    // A disk-only suspend: the resume boots cold too.
    sh(h, &id, "echo two > /root/f");
    sh(h, &id, TICKER);
    let m = ok(h, &["suspend", &id, "--disk-only", "--json"]);
    let (code, _, err) = clade(h, &["exec", &id, "--", "true"]);
    assert_ne!(code, 0, "a suspended sandbox runs nothing: {err}");
    ok(h, &["resume", &id, "--json"]);
    assert_eq!(sh(h, &id, "cat /root/f"), "two");
    let cold = sh(h, &id, BOOT_ID);
    assert!(cold != boot && cold != reboot);
    assert_eq!(sh(h, &id, TICKING), "0");
    let marks = ok(h, &["marks", &id, "--json"]);
    let row = marks.as_array().unwrap().iter().find(|r| r["id"] == m["id"]).expect("the suspend's mark is listed");
    assert_eq!(row["disk_only"], true, "{row}");

    // A disk-only mark of the running sandbox: it goes on; a fork of the mark boots cold.
    sh(h, &id, TICKER);
    let m = ok(h, &["mark", &id, "--disk-only", "--json"]);
    assert_eq!(sh(h, &id, TICKING), "1", "the marked sandbox goes on");
    let v = ok(h, &["fork", m["id"].as_str().unwrap(), "--json"]);
    let kid = v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    guard.1.push(kid.clone());
    assert_eq!(sh(h, &kid, "cat /root/f"), "two");
    assert_ne!(sh(h, &kid, BOOT_ID), cold, "the fork boots cold");
    assert_eq!(sh(h, &kid, TICKING), "0", "with none of the source's processes");
}
