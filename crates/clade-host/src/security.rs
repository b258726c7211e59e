//! `clade audit --security [SBX...]`: for each running sandbox, what the host's kernel says about its jail,
//! checked against the policy (docs/security.md) by its backend's footprint (`clade_core::footprint`). ct: every
//! process's capability sets, seccomp mode and `no_new_privs`, its id map, cgroup namespace, masked and
//! read-only paths and cgroup limits. vm: the QEMU process's uid, capabilities, seccomp mode, `-sandbox` flags,
//! root directory and mount namespace. Any deviation makes the command exit 1.

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
        } else {
            crate::backends::footprint(info.row.backend).jail_audit(id, &pids)
        };
        r["id"] = json!(id);
        r["backend"] = json!(backend);
        rows.push(r);
    }
    let ok = rows.iter().all(|r| r["deviations"].as_array().is_none_or(|d| d.is_empty()));
    Ok(json!({"ok": ok, "sandboxes": rows}))
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
