//! `clade audit --security` for a ct sandbox: reads back, from the host, what the kernel says about each of
//! its processes and its cgroups, and lists every way they differ from the jail policy (crate::jail). A
//! process started in the sandbox by any route (exec, a service, a restore) must show the same jail.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

/// What the audit saw in one sandbox, and the deviations from the policy (empty: it conforms).
#[derive(Debug, Clone, Serialize)]
pub struct JailAudit {
    pub policy: &'static str,
    pub processes: usize,
    /// Whether the sandbox runs with `no_new_privs` (the default; a template's `[jail] no_new_privs = false`
    /// turns it off). Read from its init: the flag can never be cleared once set, so a jailed init (seccomp
    /// on) without it shows what the sandbox was started with, and every other process must show the same.
    pub no_new_privs: bool,
    /// Per field of /proc/PID/status (CapBnd, CapEff, CapPrm, Seccomp, NoNewPrivs): the values seen (all
    /// processes agree when there is one value).
    pub status: BTreeMap<String, Vec<String>>,
    /// The init's `uid_map` (the policy: `0 2080374784 65536`, crate::userns; `0 0 4294967295`: no user
    /// namespace, the sandbox's root is host root).
    pub uid_map: String,
    pub own_cgroup_namespace: bool,
    /// Masked and read-only paths: (path, how it is mounted: `ro`, `rw` or `absent`).
    pub paths: Vec<(String, String)>,
    /// Cgroup limits: file -> value.
    pub limits: BTreeMap<String, String>,
    pub deviations: Vec<String>,
}

pub use clade_core::host::proc_status;

const JAIL_FIELDS: [&str; 6] = ["CapBnd", "CapEff", "CapPrm", "CapInh", "Seccomp", "NoNewPrivs"];

/// Mount points of `pid` as it sees them (mountinfo's 5th field) with their per-mount options (6th).
fn mounts(pid: u32) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    // A later mount on the same point hides an earlier one: the last line wins.
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            Some((f.get(4)?.to_string(), f.get(5)?.to_string()))
        })
        .collect()
}

fn ns_inode(pid: &str, ns: &str) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok()
}

/// Audit the sandbox `sandbox_id` whose processes are `pids` (the first is its init).
pub fn audit(sandbox_id: &str, pids: &[u32]) -> JailAudit {
    let mut dev = Vec::new();
    let want_caps = format!("{:016x}", crate::jail::keep_mask());
    // A template's opt-out shows as a jailed init (seccomp filtering) without the flag; an init without
    // seccomp is no jail at all, and its missing flag a deviation like the rest.
    let init: BTreeMap<String, String> =
        pids.first().and_then(|p| proc_status(*p)).unwrap_or_default().into_iter().collect();
    let opted_out =
        init.get("NoNewPrivs").map(String::as_str) == Some("0") && init.get("Seccomp").map(String::as_str) == Some("2");
    let want_nnp = if opted_out { "0" } else { "1" };
    let mut status: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut seen = 0;
    for &pid in pids {
        let Some(fields) = proc_status(pid) else { continue }; // exited meanwhile
        seen += 1;
        for (k, v) in fields.into_iter().filter(|(k, _)| JAIL_FIELDS.contains(&k.as_str())) {
            let want = match k.as_str() {
                "CapBnd" | "CapEff" | "CapPrm" => Some(want_caps.as_str()),
                "Seccomp" => Some("2"),
                "NoNewPrivs" => Some(want_nnp),
                _ => None,
            };
            // CapEff/CapPrm may be narrower than the policy (a process that dropped more), never wider.
            let wider = |have: &str| {
                let (h, w) = (u64::from_str_radix(have, 16).unwrap_or(u64::MAX), crate::jail::keep_mask());
                h & !w != 0
            };
            let bad = match (k.as_str(), want) {
                ("CapEff" | "CapPrm" | "CapBnd", Some(_)) => wider(&v),
                (_, Some(w)) => v != w,
                _ => false,
            };
            if bad {
                dev.push(format!("process {pid}: {k} {v}, policy {}", want.unwrap_or("")));
            }
            let vals = status.entry(k).or_default();
            if !vals.contains(&v) {
                vals.push(v);
            }
        }
    }
    if seen == 0 {
        dev.push("no process of the sandbox could be read".into());
    }
    let init = pids.first().copied().unwrap_or(0);
    let uid_map = std::fs::read_to_string(format!("/proc/{init}/uid_map"))
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let want_map = crate::userns::map_line().split_whitespace().collect::<Vec<_>>().join(" ");
    if !uid_map.is_empty() && uid_map != want_map {
        dev.push(format!(
            "uid_map {uid_map}, policy {want_map} (the sandbox's root is not mapped to the jail's block)"
        ));
    }
    let own_cgroup_namespace = ns_inode(&init.to_string(), "cgroup") != ns_inode("self", "cgroup");
    if !own_cgroup_namespace {
        dev.push("the sandbox shares the host's cgroup namespace".into());
    }
    let mounted = mounts(init);
    let mut paths = Vec::new();
    let ro_wanted = crate::jail::masked().chain(crate::jail::READ_ONLY).chain(["/sys"]);
    for p in ro_wanted {
        let state = match mounted.get(p) {
            Some(opts) if opts.split(',').any(|o| o == "ro") => "ro",
            Some(_) => "rw",
            None => "absent",
        };
        // A path this kernel does not have needs no mask (the host has none to leak).
        let missing_on_host = state == "absent" && !Path::new(p).exists();
        if state != "ro" && !missing_on_host {
            dev.push(format!("{p} is {state}, policy: masked or read-only"));
        }
        paths.push((p.to_string(), if missing_on_host { "not in this kernel".into() } else { state.to_string() }));
    }
    let mut lim = BTreeMap::new();
    let v2 = clade_core::host::cgroup_version() == Some("v2");
    let files: &[(&str, &str)] = if v2 {
        &[("memory", "memory.max"), ("pids", "pids.max"), ("cpu", "cpu.max")]
    } else {
        &[
            ("memory", "memory.limit_in_bytes"),
            ("pids", "pids.max"),
            ("cpu", "cpu.cfs_quota_us"),
            ("devices", "devices.list"),
        ]
    };
    for (controller, file) in files {
        let dir = if v2 {
            Path::new("/sys/fs/cgroup/clade").join(sandbox_id)
        } else {
            Path::new("/sys/fs/cgroup").join(controller).join("clade").join(sandbox_id)
        };
        let v = std::fs::read_to_string(dir.join(file)).map(|s| s.trim().replace('\n', "; ")).unwrap_or_default();
        let unlimited = v.is_empty()
            || v == "max"
            || v.starts_with("max ")
            || v == "-1"
            || v.contains("a *:* rwm")
            || (*file == "memory.limit_in_bytes" && v.parse::<u64>().is_ok_and(|n| n >= (1 << 62)));
        if unlimited {
            dev.push(format!("{file} is {:?}: no limit", if v.is_empty() { "missing" } else { &v }));
        }
        lim.insert(file.to_string(), v);
    }
    JailAudit {
        policy: crate::jail::POLICY,
        processes: seen,
        no_new_privs: want_nnp == "1",
        status,
        uid_map,
        own_cgroup_namespace,
        paths,
        limits: lim,
        deviations: dev,
    }
}
