//! `clade audit --security [SBX...]`: for each running sandbox, what the host's kernel says about its jail,
//! checked against the policy (docs/security.md). ct: every process's capability sets, seccomp mode and
//! `no_new_privs`, its id map, cgroup namespace, masked and read-only paths and cgroup limits
//! (`clade_ct::jail_audit`). vm: the QEMU process's uid, capabilities, seccomp mode, `-sandbox` flags, root
//! directory and mount namespace. Any deviation makes the command exit 1.

use serde_json::{json, Value};

use crate::api::SandboxApi;
use crate::ops::Ops;

/// The security audit of `ids` (every running sandbox when empty).
pub fn audit(ops: &Ops, ids: &[String]) -> anyhow::Result<Value> {
    let ids: Vec<String> = if ids.is_empty() {
        ops.list()?.into_iter().filter(|r| r.state == "running").map(|r| r.id).collect()
    } else {
        ids.to_vec()
    };
    let mut rows = Vec::new();
    for id in &ids {
        let info = ops.get(id)?;
        let pids = info.live.map(|l| l.pids).unwrap_or_default();
        let backend = info.row.backend.as_str();
        let mut r = if info.row.state != "running" || pids.is_empty() {
            json!({"deviations": [format!("not running (state {:?}): nothing to audit", info.row.state)]})
        } else if backend == "ct" {
            serde_json::to_value(clade_ct::jail_audit::audit(id, &pids))?
        } else {
            vm_audit(pids[0])
        };
        r["id"] = json!(id);
        r["backend"] = json!(backend);
        rows.push(r);
    }
    let ok = rows.iter().all(|r| r["deviations"].as_array().is_none_or(|d| d.is_empty()));
    Ok(json!({"ok": ok, "sandboxes": rows}))
}

/// The vm backend's jail as seen on its QEMU process.
fn vm_audit(qemu: u32) -> Value {
    let st = clade_ct::jail_audit::proc_status(qemu).unwrap_or_default();
    let get = |k: &str| st.get(k).cloned().unwrap_or_default();
    let cmdline: Vec<String> = std::fs::read(format!("/proc/{qemu}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let flag = |name: &str| cmdline.iter().position(|a| a == name).and_then(|i| cmdline.get(i + 1)).cloned();
    let sandbox = flag("-sandbox").unwrap_or_default();
    let root = std::fs::read_link(format!("/proc/{qemu}/root")).map(|p| p.display().to_string()).unwrap_or_default();
    let own_mnt =
        std::fs::read_link(format!("/proc/{qemu}/ns/mnt")).ok() != std::fs::read_link("/proc/self/ns/mnt").ok();
    let mut dev = Vec::new();
    if get("Uid") == "0" || get("Uid").is_empty() {
        dev.push(format!("QEMU {qemu} runs as uid {:?}", get("Uid")));
    }
    for k in ["CapEff", "CapPrm"] {
        if get(k) != "0000000000000000" {
            dev.push(format!("QEMU {qemu}: {k} {}", get(k)));
        }
    }
    if get("Seccomp") != "2" {
        dev.push(format!("QEMU {qemu}: seccomp mode {:?}", get("Seccomp")));
    }
    for want in ["on", "obsolete=deny", "spawn=deny", "resourcecontrol=deny"] {
        if !sandbox.split(',').any(|f| f == want) {
            dev.push(format!("QEMU {qemu}: -sandbox lacks {want} ({sandbox:?})"));
        }
    }
    if root == "/" || root.is_empty() {
        dev.push(format!("QEMU {qemu} is not chrooted"));
    }
    if !own_mnt {
        dev.push(format!("QEMU {qemu} shares the host's mount namespace"));
    }
    json!({
        "qemu_pid": qemu, "uid": get("Uid"), "cap_eff": get("CapEff"), "cap_bnd": get("CapBnd"),
        "seccomp": get("Seccomp"), "no_new_privs": get("NoNewPrivs"), "sandbox_flags": sandbox, "root": root,
        "own_mount_namespace": own_mnt, "deviations": dev,
    })
}

/// The human form of [`audit`]'s answer.
pub fn render(b: &Value) -> String {
    let mut s = String::new();
    let rows = b["sandboxes"].as_array().cloned().unwrap_or_default();
    if rows.is_empty() {
        s.push_str("no running sandbox to audit");
    }
    for r in rows {
        let devs: Vec<String> =
            r["deviations"].as_array().into_iter().flatten().filter_map(|d| d.as_str().map(str::to_string)).collect();
        s.push_str(&format!(
            "{} ({}): {}\n",
            r["id"].as_str().unwrap_or("?"),
            r["backend"].as_str().unwrap_or("?"),
            if devs.is_empty() {
                "conforms to the jail policy".to_string()
            } else {
                format!("{} deviation(s)", devs.len())
            }
        ));
        if r["backend"] == "ct" {
            for (k, v) in r["status"].as_object().into_iter().flatten() {
                s.push_str(&format!(
                    "  {k:<10} {}\n",
                    v.as_array()
                        .map(|a| a.iter().map(|x| x.as_str().unwrap_or("")).collect::<Vec<_>>().join(", "))
                        .unwrap_or_default()
                ));
            }
            s.push_str(&format!("  uid_map    {}\n", r["uid_map"].as_str().unwrap_or("")));
            s.push_str(&format!("  cgroup ns  {}\n", if r["own_cgroup_namespace"] == true { "own" } else { "HOST'S" }));
            for p in r["paths"].as_array().into_iter().flatten() {
                s.push_str(&format!("  path       {} {}\n", p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or("")));
            }
            for (k, v) in r["limits"].as_object().into_iter().flatten() {
                s.push_str(&format!("  limit      {k} = {}\n", v.as_str().unwrap_or("")));
            }
        } else if r["backend"] == "vm" {
            for k in [
                "qemu_pid",
                "uid",
                "cap_eff",
                "seccomp",
                "no_new_privs",
                "sandbox_flags",
                "root",
                "own_mount_namespace",
            ] {
                s.push_str(&format!("  {k:<20} {}\n", r[k]));
            }
        }
        for d in devs {
            s.push_str(&format!("  DEVIATION  {d}\n"));
        }
    }
    s.trim_end().to_string()
}
