//! `clade audit`: is what the ledger says true on this host, and did anything leak? It checks every sandbox
//! the ledger knows (a running one must have a live supervisor; a suspended one a head mark whose manifests
//! the store has), every mark's manifests, and what sandboxes hold on the host once they are gone: processes
//! naming a run dir, mounts under one, memory cgroups, run dirs and per-sandbox RAM files. With `fix`, the
//! leftovers are taken down (processes killed, mounts detached, cgroups and directories removed); a lost or
//! unresumable sandbox is only reported, since ending it is the user's call (`clade kill`).
//!
//! Only what belongs to this `$CLADE_HOME` is judged: cgroups and RAM files are host-wide names, so a
//! leftover there must be a sandbox of this ledger that is no longer live (never "any name we do not know",
//! which would take another home's sandboxes down). Anything younger than [`settle`] is left out, so a
//! sandbox starting while the audit runs is not reported as a leak.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clade_ledger::{ManifestId, SandboxState};
use serde::{Deserialize, Serialize};

use clade_core::engine::Engine;

use crate::supervisor::client::supervisor_alive;

/// Leftovers younger than this are not judged (a start in progress holds them legitimately);
/// `CLADE_AUDIT_SETTLE_MS` overrides it (tests plant leftovers and audit at once).
fn settle() -> Duration {
    let ms = std::env::var("CLADE_AUDIT_SETTLE_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    Duration::from_millis(ms)
}

/// One thing found wrong.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Finding {
    /// lost, unresumable, missing-manifest, orphan-process, stray-supervisor, leftover-mount, leftover-cgroup,
    /// leftover-network, leftover-run-dir, leftover-ram-file.
    pub kind: std::borrow::Cow<'static, str>,
    /// The sandbox or mark it concerns.
    pub id: String,
    pub detail: String,
    /// Whether `--fix` took it down.
    pub fixed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct AuditReport {
    pub sandboxes: usize,
    pub marks: usize,
    pub live: usize,
    pub findings: Vec<Finding>,
    /// No finding left unfixed.
    pub ok: bool,
}

/// Audit this home; with `fix`, take leftovers down.
pub fn audit(engine: &Engine, fix: bool) -> anyhow::Result<AuditReport> {
    let home = &engine.home;
    let run = home.run_dir();
    let mut rep = AuditReport::default();
    let supervisors = live_supervisors();
    let (records, marks) = {
        let l = engine.ledger();
        let recs = l.sandboxes(None)?;
        let mut marks = Vec::new();
        for b in l.branches()? {
            marks.extend(l.marks(&b.id)?);
        }
        (recs, marks)
    };
    rep.sandboxes = records.len();
    rep.marks = marks.len();

    // Ids whose supervisor lives (sandboxes and pool members): nothing of theirs is a leftover.
    let mut live: BTreeSet<String> = supervisors.iter().map(|(_, id)| id.clone()).collect();
    live.extend(pool_members(&run));
    rep.live = live.len();

    for r in &records {
        let id = r.id.as_str().to_string();
        match r.state {
            SandboxState::Running | SandboxState::Starting => {
                let alive = r.supervisor_pid.is_some_and(supervisor_alive);
                let young = now_ms().saturating_sub(r.last_active_ms.max(r.created_ms)) < settle().as_millis() as i64;
                if !(alive || r.state == SandboxState::Starting && young) {
                    rep.findings.push(Finding {
                        kind: "lost".into(),
                        detail: format!(
                            "the ledger says {} but its supervisor ({}) is gone: `clade kill {id}` reaps it",
                            r.state.as_str(),
                            r.supervisor_pid.map_or("never started".to_string(), |p| format!("pid {p}"))
                        ),
                        id,
                        fixed: false,
                    });
                }
            }
            SandboxState::Suspended => {
                let l = engine.ledger();
                let head = l.head(&r.branch).ok().flatten();
                let missing = match &head {
                    None => Some("it has no head mark".to_string()),
                    Some(m) => m
                        .manifests
                        .values()
                        .find(|mf| !stored(engine, mf))
                        .map(|mf| format!("its head mark {} names manifest {mf}, which the store lacks", m.id)),
                };
                if let Some(why) = missing {
                    rep.findings.push(Finding { kind: "unresumable".into(), id, detail: why, fixed: false });
                }
            }
            _ => {}
        }
    }
    for m in &marks {
        for (role, mf) in &m.manifests {
            if !stored(engine, mf) {
                rep.findings.push(Finding {
                    kind: "missing-manifest".into(),
                    id: m.id.to_string(),
                    detail: format!("its {role} manifest {mf} is not in the store (`clade store fsck` says more)"),
                    fixed: false,
                });
            }
        }
    }

    // A supervisor alive for a sandbox the ledger calls dead (or does not know) holds resources for nothing.
    let known: std::collections::HashMap<String, SandboxState> =
        records.iter().map(|r| (r.id.as_str().to_string(), r.state)).collect();
    for (pid, id) in &supervisors {
        if matches!(known.get(id), Some(SandboxState::Dead) | Some(SandboxState::Failed)) {
            let fixed = fix && signal(*pid, nix::sys::signal::Signal::SIGKILL);
            rep.findings.push(Finding {
                kind: "stray-supervisor".into(),
                id: id.clone(),
                detail: format!("supervisor pid {pid} still runs for a sandbox the ledger calls dead"),
                fixed,
            });
        }
    }

    // Leftovers: candidates are this ledger's sandboxes that are not live, plus run dirs of this home that
    // no live supervisor owns.
    let mut gone: BTreeSet<String> =
        records.iter().map(|r| r.id.as_str().to_string()).filter(|id| !live.contains(id)).collect();
    for e in std::fs::read_dir(&run).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let id = name.strip_suffix(".sup").unwrap_or(&name).to_string();
        if e.path().is_dir() && id != "pool" && !live.contains(&id) && crate::error::check_id(&id).is_ok() {
            gone.insert(id);
        }
    }
    for id in &gone {
        leftovers_of(home, id, fix, true, &mut rep.findings);
    }
    rep.ok = rep.findings.iter().all(|f| f.fixed);
    Ok(rep)
}

/// Whether a mark's entry is in the store, in either tier (a mark pulled from another host may live only in
/// the shared blob tier). Entries are manifests (images) or trees (directories), which share one id space; an
/// entry that is no store id at all (a ct mark's lower directories, its network mode) is not the store's to
/// hold.
fn stored(engine: &Engine, m: &ManifestId) -> bool {
    let store = &engine.store;
    match m.as_str().parse::<clade_store::ManifestId>() {
        Ok(id) => {
            let tree = clade_store::TreeId(id.0);
            store.has_manifest(&id) || store.has_tree(&tree) || store.manifest(&id).is_ok() || store.tree(&tree).is_ok()
        }
        Err(_) => true,
    }
}

/// Take down at once everything sandbox `id` still holds on the host (its processes, mounts, cgroup, network,
/// run dirs, RAM file): `clade kill` of a sandbox whose supervisor died, which the ledger now calls dead.
pub fn take_down(home: &clade_core::CladeHome, id: &str) -> Vec<Finding> {
    let mut out = Vec::new();
    leftovers_of(home, id, true, false, &mut out);
    out
}

/// What a gone sandbox `id` still holds on the host; taken down with `fix`: its processes, mounts (under its run
/// dir and each backend's mount roots), cgroups and run dirs, then what only its backend knows (each backend's
/// `Footprint::leftovers`: a ct sandbox's network, a cold vm sandbox's RAM file). With `settle`, what is younger
/// than the settle time is left alone (a sandbox may be starting).
fn leftovers_of(home: &clade_core::CladeHome, id: &str, fix: bool, settle: bool, out: &mut Vec<Finding>) {
    let settled = |p: &Path| !settle || settled(p);
    let run = home.run_dir();
    let dir = run.join(id);
    let footprints = crate::backends::footprints();
    let mut roots = vec![dir.clone()];
    roots.extend(footprints.iter().flat_map(|f| f.mount_roots(home, id)));
    let needle = format!("{}/", dir.display());
    for (pid, cmd) in processes() {
        if cmd.contains(&needle) && !cmd.contains(" supervise ") {
            let fixed = fix && signal(pid, nix::sys::signal::Signal::SIGKILL);
            let short: String = cmd.chars().take(120).collect();
            out.push(Finding {
                kind: "orphan-process".into(),
                id: id.into(),
                detail: format!("pid {pid}: {short}"),
                fixed,
            });
        }
    }
    // Deepest first, so a mount inside another comes off before its parent.
    let mut mounts: Vec<PathBuf> =
        mount_points().into_iter().filter(|m| roots.iter().any(|r| m.starts_with(r))).collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    for m in mounts {
        let fixed = fix && nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).is_ok();
        out.push(Finding { kind: "leftover-mount".into(), id: id.into(), detail: m.display().to_string(), fixed });
    }
    // Every hierarchy a sandbox has a cgroup in (memory, pids, cpu, devices on v1), either backend.
    for cg in clade_core::cgroup::leftover_dirs(id) {
        if cg.is_dir() && settled(&cg) {
            let fixed = fix && remove_cgroup(&cg);
            out.push(Finding {
                kind: "leftover-cgroup".into(),
                id: id.into(),
                detail: cg.display().to_string(),
                fixed,
            });
        }
    }
    for fp in footprints {
        for l in fp.leftovers(home, id, fix, &settled) {
            out.push(Finding { kind: l.kind.into(), id: id.into(), detail: l.detail, fixed: l.fixed });
        }
    }
    for d in [dir.clone(), run.join(format!("{id}.sup"))] {
        if d.is_dir() && settled(&d) {
            let fixed = fix && std::fs::remove_dir_all(&d).is_ok();
            out.push(Finding {
                kind: "leftover-run-dir".into(),
                id: id.into(),
                detail: d.display().to_string(),
                fixed,
            });
        }
    }
}

fn settled(p: &Path) -> bool {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_none_or(|age| age >= settle())
}

/// Kill what is left in a cgroup, then remove it (a cgroup directory is removed with rmdir, never recursively).
fn remove_cgroup(cg: &Path) -> bool {
    // Its groups first (a pod member frozen by containerd's Pause when the supervisor died).
    clade_core::cgroup::remove_groups(cg);
    for pid in std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default().lines() {
        if let Ok(pid) = pid.trim().parse::<u32>() {
            signal(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
    for _ in 0..50 {
        if std::fs::remove_dir(cg).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).is_ok()
}

/// Every process's pid and command line (arguments joined by spaces).
fn processes() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        if raw.is_empty() {
            continue;
        }
        let cmd = raw.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect::<Vec<_>>();
        out.push((pid, cmd.join(" ")));
    }
    out
}

/// Live supervisors: (pid, sandbox id). Pool members say `--sandbox -` and are found by [`pool_members`].
fn live_supervisors() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for (pid, cmd) in processes() {
        let args: Vec<&str> = cmd.split(' ').collect();
        if !args.contains(&"supervise") {
            continue;
        }
        if let Some(i) = args.iter().position(|a| *a == "--sandbox") {
            if let Some(id) = args.get(i + 1).filter(|id| **id != "-") {
                out.push((pid, id.to_string()));
            }
        }
    }
    out
}

/// Ids of prepared pool members (`run/pool/<mark>/<id>.sock`).
fn pool_members(run: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for mark in std::fs::read_dir(run.join("pool")).into_iter().flatten().flatten() {
        for e in std::fs::read_dir(mark.path()).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(id) = name.strip_suffix(".sock").or_else(|| name.strip_suffix(".bind")) {
                out.push(id.to_string());
            }
        }
    }
    out
}

/// Mount points (field 5 of mountinfo, octal escapes undone).
fn mount_points() -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines().filter_map(|l| l.split(' ').nth(4)).map(|p| PathBuf::from(unescape(p))).collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Milliseconds since the epoch, as the ledger counts them.
fn now_ms() -> i64 {
    clade_core::time::now_ms() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/run/a\040b"), "/run/a b");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/trailing\04"), r"/trailing\04");
    }
}
