//! Admission on the `ct` backend with real CRIU restores: with the host's memory capacity set (by environment)
//! just above what two running sandboxes hold, a third fork is refused with exit code 5 naming memory; with
//! `--make-room` it is admitted after the idlest sandbox is suspended, which can be resumed later.

use std::path::Path;

mod common;

fn ok(home: &Path, env: &[(&str, &str)], args: &[&str]) -> serde_json::Value {
    let (code, out, err) = common::clade_with(home, env, args);
    assert_eq!(code, 0, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

/// Bytes charged to a ct sandbox's memory cgroup.
fn charge(id: &str) -> u64 {
    let v2 = format!("/sys/fs/cgroup/clade/{id}/memory.current");
    let v1 = format!("/sys/fs/cgroup/memory/clade/{id}/memory.usage_in_bytes");
    [v2, v1]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no memory cgroup for {id}"))
}

#[test]
fn guest_admission_ct_refuses_past_capacity_and_makes_room() {
    let Some(t) = common::ct_home("clade-admit-ct") else { return };
    let h = t.path();
    let fork1 = |env: &[(&str, &str)]| -> String {
        let v = ok(h, env, &["fork", "ctbox", "--backend", "ct", "--json"]);
        v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string()
    };
    let a = fork1(&[]);
    let b = fork1(&[]);
    // Each holds 16 MiB more (its tmpfs upper is charged to its cgroup), so the sizes dwarf any noise;
    // `b` is used last: `a` is the idlest.
    for id in [&a, &b] {
        std::thread::sleep(std::time::Duration::from_millis(20));
        ok(h, &[], &["exec", id, "--json", "--", "dd", "if=/dev/zero", "of=/tmp/fill", "bs=1M", "count=16"]);
    }
    let held = charge(&a) + charge(&b);
    // Room for what the two hold and a quarter more: a third sibling (estimated as its siblings' median)
    // does not fit, but does once the idlest is suspended.
    let cap = ((held + held / 4) >> 20).max(1).to_string();
    eprintln!("charges: {} + {} bytes; capacity {cap} MiB", charge(&a), charge(&b));
    let env = [("CLADE_CAPACITY_MEMORY_MIB", cap.as_str()), ("CLADE_ADMIT_RESERVE_MIB", "0")];
    let (code, out, err) = common::clade_with(h, &env, &["fork", "ctbox", "--backend", "ct", "--json"]);
    assert_eq!(code, 5, "a fork past capacity must be refused with exit 5: {err}{out}");
    assert!(err.contains("memory: needs") && err.contains("free of"), "the refusal names the resource: {err}");
    assert!(err.contains("could be suspended"), "the refusal says suspension would help: {err}");
    let rows = ok(h, &[], &["ls", "--json"]);
    assert_eq!(rows.as_array().unwrap().len(), 2, "a refused fork started nothing: {rows}");

    // With --make-room, the idlest (a) is suspended and the new one starts.
    let v = ok(h, &env, &["fork", "ctbox", "--backend", "ct", "--make-room", "--json"]);
    assert_eq!(v["suspended_to_make_room"], serde_json::json!([a]), "{v}");
    let c = v["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let state = |id: &str| -> String {
        let rows = ok(h, &[], &["ls", "--json"]);
        rows.as_array().unwrap().iter().find(|r| r["id"] == id).unwrap()["state"].as_str().unwrap().to_string()
    };
    assert_eq!(state(&a), "suspended");
    assert_eq!(state(&b), "running");
    assert_eq!(state(&c), "running");
    ok(h, &[], &["exec", &c, "--json", "--", "true"]);

    // Without the capacity override there is room again: `a` comes back with its identity.
    ok(h, &[], &["resume", &a, "--json"]);
    ok(h, &[], &["exec", &a, "--json", "--", "true"]);
    for id in [&a, &b, &c] {
        ok(h, &[], &["kill", id, "--json"]);
    }
}

/// Warm-pool members hold memory before any fork claims them: admission counts them among what runs (a fork
/// from another mark is refused while they wait, admitted once the pool is drained), and `clade pool fill`
/// asks admission for the members it adds.
#[test]
fn guest_admission_ct_counts_pool_members() {
    let Some(t) = common::ct_home("clade-admit-pool") else { return };
    let h = t.path();
    let fork1 = |env: &[(&str, &str)]| -> (i32, String, String) {
        common::clade_with(h, env, &["fork", "ctbox", "--backend", "ct", "--json"])
    };
    // A mark whose sandboxes hold ~24 MiB: a detached pipeline keeping dd's buffer.
    let (_, out, _) = fork1(&[]);
    let s = serde_json::from_str::<serde_json::Value>(&out).unwrap()["sandboxes"][0]["sandbox"]
        .as_str()
        .unwrap()
        .to_string();
    let hold = "(dd if=/dev/zero bs=24M count=1 | sleep 100000) >/dev/null 2>&1 </dev/null &";
    ok(h, &[], &["exec", &s, "--json", "--", "sh", "-c", hold]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let big = ok(h, &[], &["mark", &s, "--label", "big", "--json"]);
    let big = big["id"].as_str().or(big["mark"].as_str()).unwrap().to_string();
    ok(h, &[], &["kill", &s, "--json"]);
    let fill = ok(h, &[], &["pool", "fill", "big", "--size", "2", "--backend", "ct", "--json"]);
    assert_eq!(fill["ready"], 2, "{fill}");
    let members: Vec<String> = std::fs::read_dir(h.join("run/pool").join(&big))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".sock").map(str::to_string))
        .collect();
    assert_eq!(members.len(), 2, "{members:?}");
    let pooled: u64 = members.iter().map(|m| charge(m)).sum();
    // One small sibling of ctbox running: what a new one is estimated at.
    let (code, out, err) = fork1(&[]);
    assert_eq!(code, 0, "{err}");
    let x = serde_json::from_str::<serde_json::Value>(&out).unwrap()["sandboxes"][0]["sandbox"]
        .as_str()
        .unwrap()
        .to_string();
    let cap = ((charge(&x) + pooled / 2) >> 20).to_string();
    eprintln!("pool members charged {pooled} bytes, the sibling {}; capacity {cap} MiB", charge(&x));
    assert!(pooled > 40 << 20, "the members hold what their mark held: {pooled}");
    let env = [("CLADE_CAPACITY_MEMORY_MIB", cap.as_str()), ("CLADE_ADMIT_RESERVE_MIB", "0")];
    let (code, out, err) = fork1(&env);
    assert_eq!(code, 5, "the waiting members fill the host: a fork must be refused: {err}{out}");
    assert!(err.contains("memory: needs"), "{err}");
    let (code, _, err) = common::clade_with(h, &env, &["pool", "fill", "big", "--size", "4", "--backend", "ct"]);
    assert_eq!(code, 5, "a pool fill past capacity is refused: {err}");
    // Control: the pool drained, the same fork fits.
    ok(h, &[], &["pool", "drain", "big", "--backend", "ct", "--json"]);
    let (code, out, err) = fork1(&env);
    assert_eq!(code, 0, "without the pool's members it fits: {err}{out}");
    let y = serde_json::from_str::<serde_json::Value>(&out).unwrap()["sandboxes"][0]["sandbox"]
        .as_str()
        .unwrap()
        .to_string();
    for id in [&x, &y] {
        ok(h, &[], &["kill", id, "--json"]);
    }
}
