//! `clade audit SBX_A SBX_B` on the `ct` backend with real CRIU restores and real cold starts: two forked
//! siblings pass the control rule (shared character devices only as the control pair shares them) against a cold
//! pair the audit starts (and ends) itself; without a control the strict rule (nothing shared) judges them; a
//! named control pair works, and a device both siblings open that the control pair does not fails the control
//! rule; bad input is refused with its exit code.

use std::path::Path;

mod common;
use common::clade;

fn json_of(home: &Path, args: &[&str], want: i32) -> serde_json::Value {
    let (code, out, err) = clade(home, args);
    assert_eq!(code, want, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

/// Run dirs of sandboxes under the home, other than supervisors' and pools'.
fn run_dirs(home: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(home.join("run"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.ends_with(".sup") && n != "pool")
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn guest_audit_ct_siblings_against_a_cold_pair() {
    let Some(t) = common::ct_home("clade-audit-ct") else { return };
    let h = t.path();
    common::ct_template_record(h);

    let fork = json_of(h, &["fork", "ctbox", "--backend", "ct", "--count", "4", "--json"], 0);
    let ids: Vec<String> =
        fork["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 4);
    let (a, b) = (ids[0].as_str(), ids[1].as_str());
    let before = run_dirs(h);

    // The default: a cold pair of the siblings' template as the control, ended before the answer.
    let v = json_of(h, &["audit", a, b, "--json"], 0);
    assert_eq!(v["pass"], true, "{v}");
    assert_eq!(v["pass_control_rule"], true, "{v}");
    assert_eq!(v["control"]["kind"], "cold pair", "{v}");
    assert_eq!(v["control"]["template"], "ctbox", "{v}");
    assert_eq!(v["shared_besides_char_devices"], 0, "{v}");
    assert!(v["processes"][0].as_u64().unwrap() >= 1 && v["processes"][1].as_u64().unwrap() >= 1, "{v}");
    assert!(v["shared_namespaces"].as_array().unwrap().is_empty() && v["shared_pids"].as_array().unwrap().is_empty());
    assert_eq!(run_dirs(h), before, "the control sandboxes were ended and their run dirs removed");

    // Without a control, the literal rule: pass only if not even a character device is shared; the exit code
    // follows the verdict.
    let (code, out, err) = clade(h, &["audit", a, b, "--no-control", "--json"]);
    let lit: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    let chars = lit["shared_char_devices"].as_array().unwrap().len();
    assert_eq!(lit["pass"], chars == 0, "{lit}");
    assert_eq!(code, if chars == 0 { 0 } else { 1 }, "{lit}");
    assert_eq!(lit["control"]["kind"], "none");
    assert!(lit.get("pass_control_rule").is_none(), "{lit}");

    // A control pair named by the caller (two more restored siblings).
    let g = json_of(h, &["audit", a, b, "--control", &ids[2], &ids[3], "--json"], 0);
    assert_eq!(g["control"]["kind"], "given");
    assert_eq!(g["pass_control_rule"], true, "{g}");

    // Both siblings open a device the control pair does not (a process holding /dev/zero): the control rule fails,
    // naming it, and the exit code says so.
    for id in [a, b] {
        let (code, _, err) = clade(h, &["exec", id, "--", "sh", "-c", "sleep 600 </dev/zero >/dev/null 2>&1 &"]);
        assert_eq!(code, 0, "{err}");
    }
    let f = json_of(h, &["audit", a, b, "--control", &ids[2], &ids[3], "--json"], 1);
    assert_eq!(f["pass"], false, "{f}");
    let shared: Vec<&str> = f["shared_char_devices"].as_array().unwrap().iter().filter_map(|d| d.as_str()).collect();
    assert!(shared.iter().any(|d| d.ends_with("/dev/zero")), "{f}");

    // A sandbox audited against itself shares everything: refused as a usage error, not judged.
    assert_eq!(clade(h, &["audit", a, a]).0, 2);
    assert_eq!(clade(h, &["audit", a, b, "--control", a, &ids[2]]).0, 2, "the control overlaps the pair");
    assert_eq!(clade(h, &["audit", a]).0, 2, "one sandbox");
    assert_eq!(clade(h, &["audit", a, b, "--fix"]).0, 2, "--fix belongs to the ledger audit");
    assert_eq!(clade(h, &["audit", a, "sb-none"]).0, 3, "unknown sandbox");
    json_of(h, &["kill", b, "--json"], 0);
    let (code, _, err) = clade(h, &["audit", a, b]);
    assert_eq!(code, 4, "a dead sandbox is a conflict: {err}");
    assert!(err.contains("not running"), "{err}");

    for id in [a, &ids[2], &ids[3]] {
        json_of(h, &["kill", id, "--json"], 0);
    }
}

/// `clade audit --security`: forked ct siblings conform to the jail policy (exit 0, every field named); a
/// sandbox that is not running is a deviation (exit 1). That the audit reports an unjailed sandbox is shown
/// in clade-ct's guest_jail control, which starts one.
#[test]
fn guest_audit_ct_security_of_forked_siblings() {
    let Some(t) = common::ct_home("clade-audit-sec") else { return };
    let h = t.path();
    common::ct_template_record(h);
    let fork = json_of(h, &["fork", "ctbox", "--backend", "ct", "--count", "2", "--json"], 0);
    let ids: Vec<String> =
        fork["sandboxes"].as_array().unwrap().iter().map(|s| s["sandbox"].as_str().unwrap().to_string()).collect();
    let v = json_of(h, &["audit", "--security", "--json"], 0);
    assert_eq!(v["ok"], true, "{v}");
    let rows = v["sandboxes"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "every running sandbox by default: {v}");
    for r in rows {
        assert_eq!(r["backend"], "ct");
        assert!(r["deviations"].as_array().unwrap().is_empty(), "{r}");
        assert_eq!(r["status"]["Seccomp"][0], "2", "{r}");
        assert_eq!(r["status"]["NoNewPrivs"][0], "1", "{r}");
        assert_eq!(r["own_cgroup_namespace"], true, "{r}");
        assert!(r["limits"]["pids.max"].as_str().unwrap().parse::<u64>().is_ok(), "{r}");
    }
    let (code, out, err) = clade(h, &["audit", "--security", &ids[0]]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("conforms to the jail policy") && out.contains("/proc/sys ro"), "{out}");
    json_of(h, &["kill", &ids[1], "--json"], 0);
    let (code, out, _) = clade(h, &["audit", "--security", &ids[1]]);
    assert_eq!(code, 1, "a sandbox that is not running cannot be shown jailed: {out}");
    assert!(out.contains("DEVIATION"), "{out}");
    json_of(h, &["kill", &ids[0], "--json"], 0);
}
