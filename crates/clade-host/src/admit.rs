//! Admission for run, fork and resume: measure what runs on this host, ask
//! [`clade_core::admission::decide`] whether the new sandboxes fit, and act on its answer: start them, start them
//! after suspending the idlest sandboxes (only when the caller allowed it), or refuse naming the resource
//! (kind `no_capacity` for memory, CPU or pids, which may free up; `no_space` for disk, which needs a person).
//!
//! Measuring must stay cheap, because every fork pays for it: a `ct` sandbox's memory is its memory cgroup's
//! charge (one file read; its tmpfs upper is charged there too), and it reserves no vCPU (a container has no vCPU
//! threads). A `vm` sandbox is asked for its PSS and RSS through its supervisor; the RAM file pages it maps from
//! its origin mark are its base (counted once over all siblings), estimated as RSS - PSS. It counts the vCPUs its
//! QEMU kept busy since it was last asked (at least a second before) or since it started, not its shape's
//! vCPUs: an idle sibling costs what it uses (docs/scale.md, "Admission"). New sandboxes count what their running
//! siblings measure (the median), else their shape. A fork counts only the siblings its mark's warm pool
//! cannot hand out: pool members already run, and are counted among what runs ([`pool_members`]: their memory
//! cgroup's charge on ct, the mark's estimate on vm), waiting or still restoring, though no ledger names them
//! yet; `clade pool fill` asks admission for the members it adds. Every sandbox also holds tasks (processes and threads, from
//! one PID space the kernel caps): its supervisor's threads plus a ct sandbox's pids cgroup count or a vm's
//! QEMU threads, measured the same way; a new one counts its siblings' median, else
//! [`clade_core::admission::TASKS_ESTIMATE`].
//!
//! Host capacity is [`Capacity::probe`] (CPUs, MemTotal, free space under the store, the kernel's task limit and
//! tasks now), overridable for tests and for hosts shared with other work: `CLADE_CAPACITY_MEMORY_MIB`,
//! `CLADE_CAPACITY_VCPUS`, `CLADE_CAPACITY_TASKS`; the policy's knobs are `CLADE_ADMIT_RESERVE_MIB` (memory kept
//! for the host, default 512), `CLADE_ADMIT_RESERVE_TASKS` (default 2048), `CLADE_VCPU_OVERCOMMIT` (default 8:
//! agents mostly wait) and `CLADE_ADMIT=off` (admit everything).

use std::collections::BTreeMap;

use anyhow::anyhow;
use clade_core::admission::{decide, Capacity, Decision, Policy, Request, Running};
use clade_core::engine::{from_ledger, Engine};
use clade_core::ErrorKind;
use clade_ledger::{Mark, MarkId, SandboxState};

use crate::supervisor::client;
use crate::supervisor::protocol::Request as SupRequest;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// This host's capacity, with the environment's overrides.
pub fn capacity(engine: &Engine) -> Capacity {
    let mut cap = Capacity::probe(&engine.home).unwrap_or(Capacity {
        vcpus: std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1),
        memory_bytes: u64::MAX,
        disk_free_bytes: u64::MAX,
        tasks_max: u64::MAX,
        tasks_now: 0,
    });
    if let Some(m) = env_u64("CLADE_CAPACITY_MEMORY_MIB") {
        cap.memory_bytes = m << 20;
    }
    if let Some(c) = env_u64("CLADE_CAPACITY_VCPUS") {
        cap.vcpus = c as u32;
    }
    if let Some(t) = env_u64("CLADE_CAPACITY_TASKS") {
        cap.tasks_max = t;
    }
    cap
}

pub fn policy() -> Policy {
    let d = Policy::default();
    Policy {
        reserve_memory_bytes: env_u64("CLADE_ADMIT_RESERVE_MIB").map(|m| m << 20).unwrap_or(d.reserve_memory_bytes),
        reserve_disk_bytes: d.reserve_disk_bytes,
        vcpu_overcommit: std::env::var("CLADE_VCPU_OVERCOMMIT")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v > 0.0)
            .unwrap_or(8.0),
        reserve_tasks: env_u64("CLADE_ADMIT_RESERVE_TASKS").unwrap_or(d.reserve_tasks),
    }
}

/// vCPUs a sandbox of this mark's shape reserves (its backend's footprint says: a vm's vCPU threads; none for
/// a container).
fn vcpus_of(engine: &Engine, m: &Mark) -> u32 {
    let fp = crate::backends::footprint(from_ledger(m.backend));
    let one = clade_core::backend::Shape { memory_mib: 0, vcpus: 1, disk_gib: 0 };
    engine.mark_state(m).map(|s| fp.reserved_vcpus(&s.shape)).unwrap_or_else(|_| fp.reserved_vcpus(&one))
}

/// Every running sandbox (supervisor alive), measured.
pub fn running(engine: &Engine) -> anyhow::Result<Vec<Running>> {
    let rows = engine.ledger().sandboxes(Some(SandboxState::Running))?;
    let mut marks: BTreeMap<String, Option<Mark>> = BTreeMap::new();
    let mut out = Vec::new();
    for s in rows {
        if !s.supervisor_pid.is_some_and(client::supervisor_alive) {
            continue;
        }
        let origin = s.origin_mark.as_ref().map(|m| m.as_str().to_string());
        let mark = origin.as_ref().and_then(|o| {
            marks.entry(o.clone()).or_insert_with(|| engine.ledger().mark(&MarkId::new(o.clone())).ok()).clone()
        });
        let shape_vcpus = mark.as_ref().map(|m| vcpus_of(engine, m)).unwrap_or(0);
        // What its backend charges it (a ct sandbox's memory cgroup), else its processes' PSS from its supervisor,
        // the pages it maps from its origin mark's RAM file (RSS - PSS) counted once as their shared base, and
        // the vCPUs its processes kept busy lately (its shape's vCPUs when its supervisor does not say).
        let fp = crate::backends::footprint(from_ledger(s.backend));
        // Tasks: its supervisor's threads, and its processes' (its pids cgroup, else its supervisor's count).
        let sup_tasks = s.supervisor_pid.and_then(clade_core::host::threads).unwrap_or(1);
        let (rss, pss, base, shared, vcpus, tasks) = match fp.charged_memory(s.id.as_str()) {
            Some(m) => (m, m, None, 0, f64::from(shape_vcpus), fp.charged_tasks(s.id.as_str()).unwrap_or(0)),
            None => {
                let info = client::call(&engine.home, s.id.as_str(), &SupRequest::Info).unwrap_or_default();
                let rss = info["rss"].as_u64().unwrap_or(0);
                let pss = info["pss"].as_u64().unwrap_or(rss);
                let busy = info["cpu_busy"].as_f64().filter(|b| b.is_finite() && *b >= 0.0);
                let vcpus = if shape_vcpus == 0 { 0.0 } else { busy.unwrap_or(f64::from(shape_vcpus)) };
                let tasks = info["tasks"].as_u64().unwrap_or(clade_core::admission::TASKS_ESTIMATE);
                (rss, pss, origin.clone(), rss.saturating_sub(pss), vcpus, tasks)
            }
        };
        out.push(Running {
            id: s.id.as_str().to_string(),
            vcpus,
            rss_bytes: rss,
            pss_bytes: pss,
            base,
            shared_base_bytes: shared,
            last_active_ms: s.last_active_ms,
            suspendable: true,
            tasks: sup_tasks + tasks,
        });
    }
    out.extend(pool_members(engine));
    Ok(out)
}

/// Every warm-pool member on this host (`$CLADE_HOME/run/pool/<mark>/`), waiting or still restoring, as what
/// runs: it holds its memory and tasks though no ledger record names it until a fork claims it. A waiting ct
/// member is measured by its memory and pids cgroups (named by its sandbox id); a vm member, and a member still
/// restoring, counts its mark's estimate. Paused, it keeps no vCPU busy, and admission never suspends it.
pub fn pool_members(engine: &Engine) -> Vec<Running> {
    use crate::supervisor::pool;
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(engine.home.run_dir().join("pool")) else { return out };
    for e in rd.flatten() {
        let mark_id = e.file_name().to_string_lossy().into_owned();
        let (ready, starting) = pool::members(&engine.home, &mark_id);
        if ready.is_empty() && starting == 0 {
            continue;
        }
        let Ok(mark) = engine.ledger().mark(&MarkId::new(mark_id.clone())) else { continue };
        let fp = crate::backends::footprint(from_ledger(mark.backend));
        let shape_bytes = engine.mark_state(&mark).map(|s| u64::from(s.shape.memory_mib) << 20).unwrap_or(512 << 20);
        let (estimate, base_bytes) = fp.memory_estimate(mark.logical_bytes, shape_bytes);
        let member = |id: String, charged: Option<u64>, tasks: Option<u64>| {
            let (rss, base, shared) = match charged {
                Some(m) => (m, None, 0),
                None => (estimate + base_bytes, (base_bytes > 0).then(|| mark_id.clone()), base_bytes),
            };
            Running {
                id,
                vcpus: 0.0,
                rss_bytes: rss,
                pss_bytes: rss.saturating_sub(shared),
                base,
                shared_base_bytes: shared,
                last_active_ms: 0,
                suspendable: false,
                tasks: tasks.unwrap_or(clade_core::admission::TASKS_ESTIMATE),
            }
        };
        for sock in &ready {
            let Some(id) = sock.file_stem().and_then(|s| s.to_str()) else { continue };
            out.push(member(format!("pool:{id}"), fp.charged_memory(id), fp.charged_tasks(id)));
        }
        for n in 0..starting {
            out.push(member(format!("pool:{mark_id}:starting-{n}"), None, None));
        }
    }
    out
}

/// What `count` new sandboxes restored from `mark` will need: their siblings' measured private memory and busy
/// vCPUs (the median over running sandboxes of the same origin), else its backend's estimate from the mark
/// (`Footprint::memory_estimate`: a container, its image size at most its shape's memory; a vm, an eighth of
/// its RAM private and the RAM file as the shared base).
pub fn request(engine: &Engine, mark: &Mark, count: u32, running: &[Running], allow_suspend: bool) -> Request {
    let fp = crate::backends::footprint(from_ledger(mark.backend));
    let shape_bytes = engine.mark_state(mark).map(|s| u64::from(s.shape.memory_mib) << 20).unwrap_or(512 << 20);
    let siblings: Vec<&Running> = {
        let l = engine.ledger();
        let ids: std::collections::BTreeSet<String> = l
            .sandboxes(Some(SandboxState::Running))
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.origin_mark.as_ref() == Some(&mark.id))
            .map(|s| s.id.as_str().to_string())
            .collect();
        running.iter().filter(|r| ids.contains(&r.id)).collect()
    };
    let measured = median(siblings.iter().map(|r| r.private_bytes()), u64::cmp).filter(|b| *b > 0);
    // CPU and tasks likewise: the median sibling's, else the shape's vCPUs and the estimate (none running yet).
    let per_vcpus =
        median(siblings.iter().map(|r| r.vcpus), f64::total_cmp).unwrap_or_else(|| f64::from(vcpus_of(engine, mark)));
    let per_tasks = median(siblings.iter().map(|r| r.tasks), u64::cmp).unwrap_or(clade_core::admission::TASKS_ESTIMATE);
    let (estimate, base_bytes) = fp.memory_estimate(mark.logical_bytes, shape_bytes);
    let private = measured.unwrap_or(estimate);
    let base = (base_bytes > 0).then(|| mark.id.as_str().to_string());
    let n = u64::from(count.max(1));
    Request {
        vcpus: per_vcpus * n as f64,
        private_bytes: private.saturating_mul(n),
        base,
        base_bytes,
        disk_bytes: mark.stored_bytes.saturating_mul(n).min(1 << 30),
        allow_suspend,
        tasks: per_tasks.saturating_mul(n),
    }
}

/// The median of `values` by `cmp` (the upper one of an even count); `None` when there are none.
fn median<T: Copy>(values: impl Iterator<Item = T>, cmp: fn(&T, &T) -> std::cmp::Ordering) -> Option<T> {
    let mut v: Vec<T> = values.collect();
    v.sort_unstable_by(cmp);
    v.get(v.len() / 2).copied()
}

/// Serializes decisions in this process, so two concurrent forks do not both take the last room.
static GATE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Admit `count` sandboxes of `mark`: Ok with the sandboxes suspended to make room (none, usually), or
/// [`Refused`]. `suspend` is how a sandbox is suspended (the caller's `Ops::suspend`).
pub fn admit(
    engine: &Engine,
    mark: &Mark,
    count: u32,
    allow_suspend: bool,
    suspend: &dyn Fn(&str) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<String>> {
    if count == 0 || std::env::var("CLADE_ADMIT").is_ok_and(|v| v == "off" || v == "0") {
        return Ok(Vec::new());
    }
    let _gate = GATE.lock();
    let running = running(engine)?;
    let req = request(engine, mark, count, &running, allow_suspend);
    match decide(&capacity(engine), &running, &req, &policy()) {
        Decision::Admit => Ok(Vec::new()),
        Decision::AdmitAfterSuspending { sandboxes, freed } => {
            for id in &sandboxes {
                suspend(id).map_err(|e| anyhow!("suspending {id} to make room: {e:#}"))?;
            }
            eprintln!(
                "clade: suspended {} idle sandbox(es) to make room ({} MiB, {:.2} vCPU freed): {}",
                sandboxes.len(),
                freed.memory_bytes >> 20,
                freed.vcpus,
                sandboxes.join(", ")
            );
            Ok(sandboxes)
        }
        Decision::Refuse { resource, reason, .. } => Err(crate::error::kinded(
            ErrorKind::of_resource(resource),
            format!("cannot start {count} sandbox(es) of mark {} here: {reason}", mark.id),
        )),
    }
}
