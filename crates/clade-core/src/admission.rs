//! Admission and placement on one host, as a pure policy: given what the host has, what runs on it (with its
//! measured memory, shared base pages counted once) and a request, decide to admit it, to admit it after suspending
//! the idlest sandboxes, or to refuse it naming the resource, what it needs and what is free. Nothing here starts,
//! suspends or measures anything except [`Capacity::probe`]; the caller (run, fork, resume) acts on the decision.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::CladeHome;

/// What the host offers sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Capacity {
    pub vcpus: u32,
    /// Physical memory (MemTotal).
    pub memory_bytes: u64,
    /// Free space on the filesystem that holds the store and run directories now (sandboxes' written data is
    /// already counted by the filesystem, so running sandboxes' disk is not subtracted again).
    pub disk_free_bytes: u64,
    /// Tasks (processes and threads) the kernel allows at once: the lower of `kernel.pid_max` and
    /// `kernel.threads-max`.
    pub tasks_max: u64,
    /// Tasks on the host now, sandboxes' included (/proc/loadavg's fourth field).
    pub tasks_now: u64,
}

impl Capacity {
    /// This host: CPUs available to clade, MemTotal from /proc/meminfo, free space under `$CLADE_HOME`'s store.
    /// `None` when /proc/meminfo or the filesystem cannot be read.
    pub fn probe(home: &CladeHome) -> Option<Capacity> {
        let vcpus = std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let memory_bytes = parse_meminfo_total(&meminfo)?;
        let (disk_free_bytes, _) = crate::host::space(&home.store_dir())?;
        let (tasks_max, tasks_now) = crate::host::tasks().unwrap_or((u64::MAX, 0));
        Some(Capacity { vcpus, memory_bytes, disk_free_bytes, tasks_max, tasks_now })
    }
}

/// `MemTotal` of a /proc/meminfo text, in bytes.
pub fn parse_meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// What the host keeps back and how far vCPUs may be overcommitted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Policy {
    /// Memory never given to sandboxes (the host's own processes, page cache for the store).
    pub reserve_memory_bytes: u64,
    /// Disk kept free (the store's temp-then-rename, marks in flight).
    pub reserve_disk_bytes: u64,
    /// Sandbox vCPUs admitted per host CPU (agents mostly wait; 1.0 means no overcommit).
    pub vcpu_overcommit: f64,
    /// Tasks never given to sandboxes (the host's own processes must still fork).
    pub reserve_tasks: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Self { reserve_memory_bytes: 512 << 20, reserve_disk_bytes: 2 << 30, vcpu_overcommit: 1.0, reserve_tasks: 2048 }
    }
}

/// Tasks a new sandbox is expected to take before any sibling of its mark was measured: a supervisor's threads
/// and a vm's QEMU threads (main, I/O, RCU, one per vCPU) or a container's few processes, rounded up.
pub const TASKS_ESTIMATE: u64 = 16;

/// A sandbox running on the host, as measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Running {
    pub id: String,
    /// vCPUs it keeps busy, as measured (its processes' CPU time over the last interval): an idle sibling costs
    /// almost none, whatever its shape says.
    pub vcpus: f64,
    pub rss_bytes: u64,
    pub pss_bytes: u64,
    /// The base (image memory) whose pages it maps shared, if any.
    pub base: Option<String>,
    /// How much of its RSS is that base's shared pages (counted once per base over all its sandboxes).
    pub shared_base_bytes: u64,
    /// Last activity (exec, file op, API call), ms since the epoch: the idlest is suspended first.
    pub last_active_ms: i64,
    /// May be suspended to make room (false: pinned by its owner, or in the middle of an operation).
    pub suspendable: bool,
    /// Tasks (processes and threads) it holds, its supervisor's included.
    pub tasks: u64,
}

impl Running {
    /// Its own pages: RSS minus the base pages it shares. Without a base, its whole RSS.
    pub fn private_bytes(&self) -> u64 {
        match self.base {
            Some(_) => self.rss_bytes.saturating_sub(self.shared_base_bytes),
            None => self.rss_bytes,
        }
    }
}

/// A sandbox asking to start (run, fork, resume) on this host.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Request {
    /// vCPUs the new sandboxes are expected to keep busy: what their running siblings measure, else their shape.
    pub vcpus: f64,
    /// Memory it will hold of its own (for a restore: the mark's diverged pages plus expected growth; at most its
    /// shape's memory).
    pub private_bytes: u64,
    /// The base it maps shared, and that base's resident size (needed only when no running sandbox maps it).
    pub base: Option<String>,
    pub base_bytes: u64,
    /// Disk it may write on this host (its private overlay or dirty blocks, plus what a restore fetches).
    pub disk_bytes: u64,
    /// Tasks the new sandboxes will hold: their running siblings' measure, else [`TASKS_ESTIMATE`] each.
    pub tasks: u64,
    /// Whether idle sandboxes may be suspended to make room ("when asked").
    pub allow_suspend: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Resource {
    Memory,
    Cpu,
    Disk,
    /// Tasks (processes and threads): `kernel.pid_max` / `kernel.threads-max`.
    Pids,
}

impl Resource {
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Memory => "memory",
            Resource::Cpu => "cpu",
            Resource::Disk => "disk",
            Resource::Pids => "pids",
        }
    }
}

/// What suspending some sandboxes gives back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Freed {
    pub vcpus: f64,
    pub memory_bytes: u64,
    pub tasks: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    Admit,
    /// Suspend these (idlest first, by last activity), then start the request.
    AdmitAfterSuspending {
        sandboxes: Vec<String>,
        freed: Freed,
    },
    /// `need` and `free` are bytes for memory and disk, vCPUs for cpu, tasks for pids.
    Refuse {
        resource: Resource,
        need: u64,
        free: u64,
        reason: String,
    },
}

/// Memory the sandboxes in `set` hold together, plus the request's if given: private pages each, and each base's
/// shared pages once (the largest share measured among its sandboxes, or the request's `base_bytes`).
fn memory_of<'a>(set: impl Iterator<Item = &'a Running>, req: Option<&Request>) -> u64 {
    let mut private = 0u64;
    let mut bases: BTreeMap<&str, u64> = BTreeMap::new();
    for r in set {
        private = private.saturating_add(r.private_bytes());
        if let Some(b) = &r.base {
            let e = bases.entry(b.as_str()).or_insert(0);
            *e = (*e).max(r.shared_base_bytes);
        }
    }
    if let Some(q) = req {
        private = private.saturating_add(q.private_bytes);
        match &q.base {
            Some(b) => {
                let e = bases.entry(b.as_str()).or_insert(0);
                *e = (*e).max(q.base_bytes);
            }
            None => private = private.saturating_add(q.base_bytes),
        }
    }
    bases.values().fold(private, |a, b| a.saturating_add(*b))
}

/// Memory the running sandboxes hold now, shared base pages counted once.
pub fn memory_in_use(running: &[Running]) -> u64 {
    memory_of(running.iter(), None)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

struct Check {
    mem_limit: u64,
    cpu_limit: f64,
    /// Tasks sandboxes may hold together: the kernel's limit less the reserve and the host's own tasks.
    tasks_limit: u64,
}

impl Check {
    /// The first resource (memory, cpu, then pids) that `set` + the request exceed: (resource, need, free).
    fn short<'a>(&self, set: impl Iterator<Item = &'a Running> + Clone, req: &Request) -> Option<(Resource, u64, u64)> {
        let without = memory_of(set.clone(), None);
        let with = memory_of(set.clone(), Some(req));
        if with > self.mem_limit {
            return Some((Resource::Memory, with - without, self.mem_limit.saturating_sub(without)));
        }
        let cpus: f64 = set.clone().map(|r| r.vcpus.max(0.0)).sum();
        let want = req.vcpus.max(0.0);
        if cpus + want > self.cpu_limit + 1e-9 {
            // Whole vCPUs in the answer: what is needed rounded up, what is free rounded down.
            return Some((Resource::Cpu, want.ceil() as u64, (self.cpu_limit - cpus).max(0.0).floor() as u64));
        }
        let tasks: u64 = set.map(|r| r.tasks).fold(0, u64::saturating_add);
        if tasks.saturating_add(req.tasks) > self.tasks_limit {
            return Some((Resource::Pids, req.tasks, self.tasks_limit.saturating_sub(tasks)));
        }
        None
    }
}

fn amount(resource: Resource, v: u64) -> String {
    match resource {
        Resource::Cpu => format!("{v} vCPU"),
        Resource::Pids => format!("{v} tasks"),
        _ => gib(v),
    }
}

/// Decides whether `req` may start on a host of `cap` where `running` run.
pub fn decide(cap: &Capacity, running: &[Running], req: &Request, policy: &Policy) -> Decision {
    let mem_limit = cap.memory_bytes.saturating_sub(policy.reserve_memory_bytes);
    let overcommit =
        if policy.vcpu_overcommit.is_finite() && policy.vcpu_overcommit > 0.0 { policy.vcpu_overcommit } else { 1.0 };
    // The host's own tasks are those not held by a running sandbox; they stay whatever is suspended.
    let sandbox_tasks: u64 = running.iter().map(|r| r.tasks).fold(0, u64::saturating_add);
    let host_own_tasks = cap.tasks_now.saturating_sub(sandbox_tasks);
    let tasks_limit = cap.tasks_max.saturating_sub(policy.reserve_tasks).saturating_sub(host_own_tasks);
    let check = Check { mem_limit, cpu_limit: (f64::from(cap.vcpus) * overcommit).floor(), tasks_limit };
    // Disk first: suspending frees no disk (a mark's chunks stay in the local tier until evicted).
    let disk_free = cap.disk_free_bytes.saturating_sub(policy.reserve_disk_bytes);
    if req.disk_bytes > disk_free {
        return Decision::Refuse {
            resource: Resource::Disk,
            need: req.disk_bytes,
            free: disk_free,
            reason: format!(
                "disk: needs {}, {} free after the {} reserve; suspending frees no disk: run `clade store gc`, or \
                 point CLADE_HOME at a larger filesystem",
                gib(req.disk_bytes),
                gib(disk_free),
                gib(policy.reserve_disk_bytes)
            ),
        };
    }
    let Some((resource, need, free)) = check.short(running.iter(), req) else { return Decision::Admit };
    let describe = |resource: Resource, need: u64, free: u64| {
        let of = match resource {
            Resource::Memory => format!(
                "{} usable ({} running hold {}, shared base pages counted once)",
                gib(mem_limit),
                running.len(),
                gib(memory_in_use(running))
            ),
            Resource::Pids => format!(
                "{} tasks usable (kernel limit {}, {} kept for the host, {} host tasks outside sandboxes)",
                check.tasks_limit, cap.tasks_max, policy.reserve_tasks, host_own_tasks
            ),
            _ => format!("{} vCPU usable (overcommit {overcommit})", check.cpu_limit),
        };
        format!("{}: needs {}, {} free of {of}", resource.as_str(), amount(resource, need), amount(resource, free))
    };
    // The idlest first, by last activity; ties by id so the choice is stable.
    let mut idle: Vec<&Running> = running.iter().filter(|r| r.suspendable).collect();
    idle.sort_by(|a, b| a.last_active_ms.cmp(&b.last_active_ms).then_with(|| a.id.cmp(&b.id)));
    if !req.allow_suspend {
        let hint = if idle.is_empty() {
            "no running sandbox may be suspended".to_string()
        } else {
            format!("{} idle sandbox(es) could be suspended to make room (ask with suspension allowed)", idle.len())
        };
        return Decision::Refuse {
            resource,
            need,
            free,
            reason: format!("{}; {hint}", describe(resource, need, free)),
        };
    }
    let mut gone: BTreeSet<&str> = BTreeSet::new();
    for r in &idle {
        gone.insert(r.id.as_str());
        let rest = running.iter().filter(|x| !gone.contains(x.id.as_str()));
        if check.short(rest, req).is_none() {
            let chosen: Vec<&Running> = idle.iter().copied().filter(|x| gone.contains(x.id.as_str())).collect();
            let kept = running.iter().filter(|x| !gone.contains(x.id.as_str()));
            let freed = Freed {
                vcpus: chosen.iter().map(|x| x.vcpus).sum(),
                memory_bytes: memory_in_use(running).saturating_sub(memory_of(kept, None)),
                tasks: chosen.iter().map(|x| x.tasks).sum(),
            };
            return Decision::AdmitAfterSuspending { sandboxes: chosen.iter().map(|x| x.id.clone()).collect(), freed };
        }
    }
    let rest = running.iter().filter(|x| !gone.contains(x.id.as_str()));
    let (resource, need, free) = check.short(rest, req).unwrap_or((resource, need, free));
    let pinned = running.len() - idle.len();
    Decision::Refuse {
        resource,
        need,
        free,
        reason: format!(
            "{} even after suspending all {} idle sandbox(es) ({pinned} may not be suspended)",
            describe(resource, need, free),
            idle.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn cap(vcpus: u32, mem: u64) -> Capacity {
        Capacity { vcpus, memory_bytes: mem, disk_free_bytes: 100 * GIB, tasks_max: 1 << 22, tasks_now: 0 }
    }

    fn no_reserve() -> Policy {
        Policy { reserve_memory_bytes: 0, reserve_disk_bytes: 0, vcpu_overcommit: 1.0, reserve_tasks: 0 }
    }

    fn sib(id: &str, base: &str, rss: u64, shared: u64, last: i64) -> Running {
        Running {
            id: id.into(),
            vcpus: 1.0,
            rss_bytes: rss,
            pss_bytes: rss - shared / 2,
            base: Some(base.into()),
            shared_base_bytes: shared,
            last_active_ms: last,
            suspendable: true,
            tasks: 4,
        }
    }

    fn req(private: u64, base: Option<&str>, base_bytes: u64) -> Request {
        Request {
            vcpus: 1.0,
            private_bytes: private,
            base: base.map(String::from),
            base_bytes,
            disk_bytes: GIB,
            allow_suspend: false,
            tasks: 4,
        }
    }

    #[test]
    fn shared_base_pages_count_once() {
        // Three siblings of base B: 300 MiB RSS each, 250 MiB of it B's pages -> 3 * 50 + 250 = 400 MiB in use.
        let run: Vec<Running> = (0..3).map(|i| sib(&format!("s{i}"), "B", 300 * MIB, 250 * MIB, i)).collect();
        assert_eq!(memory_in_use(&run), 400 * MIB);
        // A fourth sibling (50 MiB of its own) fits in 512 MiB, though the RSS sum would be 1.2 GiB.
        let d = decide(&cap(8, 512 * MIB), &run, &req(50 * MIB, Some("B"), 250 * MIB), &no_reserve());
        assert_eq!(d, Decision::Admit);
        // A sandbox of another base brings its base pages: 50 + 250 more does not fit.
        let d = decide(&cap(8, 512 * MIB), &run, &req(50 * MIB, Some("C"), 250 * MIB), &no_reserve());
        match d {
            Decision::Refuse { resource: Resource::Memory, need, free, reason } => {
                assert_eq!((need, free), (300 * MIB, 112 * MIB));
                assert!(reason.starts_with("memory: needs 0.29 GiB, 0.11 GiB free"), "{reason}");
                assert!(reason.contains("3 idle sandbox(es) could be suspended"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn suspends_the_idlest_first_and_only_as_many_as_needed() {
        let mut run = vec![
            sib("busy", "B", 300 * MIB, 100 * MIB, 900),
            sib("idlest", "B", 300 * MIB, 100 * MIB, 100),
            sib("idle", "B", 300 * MIB, 100 * MIB, 500),
            sib("pinned", "B", 300 * MIB, 100 * MIB, 0),
        ];
        run[3].suspendable = false;
        // In use: 4 * 200 + 100 = 900 MiB of 1 GiB; the request needs 300 MiB.
        let mut q = req(300 * MIB, Some("B"), 100 * MIB);
        q.allow_suspend = true;
        match decide(&cap(8, GIB), &run, &q, &no_reserve()) {
            Decision::AdmitAfterSuspending { sandboxes, freed } => {
                assert_eq!(sandboxes, vec!["idlest".to_string()]);
                assert_eq!(freed, Freed { vcpus: 1.0, memory_bytes: 200 * MIB, tasks: 4 });
            }
            other => panic!("{other:?}"),
        }
        // Needing 500 MiB takes the two idlest (the pinned one, idler still, is never chosen).
        q.private_bytes = 500 * MIB;
        match decide(&cap(8, GIB), &run, &q, &no_reserve()) {
            Decision::AdmitAfterSuspending { sandboxes, .. } => assert_eq!(sandboxes, vec!["idlest", "idle"]),
            other => panic!("{other:?}"),
        }
        // More than suspending every idle one can give: refused, saying so.
        q.private_bytes = 900 * MIB;
        match decide(&cap(8, GIB), &run, &q, &no_reserve()) {
            Decision::Refuse { resource: Resource::Memory, reason, .. } => {
                assert!(reason.contains("even after suspending all 3 idle") && reason.contains("1 may not"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn suspending_a_bases_last_sandbox_frees_the_base() {
        let run = vec![sib("a", "B", 600 * MIB, 500 * MIB, 1), sib("b", "C", 300 * MIB, 200 * MIB, 2)];
        let mut q = req(400 * MIB, None, 0);
        q.allow_suspend = true;
        match decide(&cap(8, GIB), &run, &q, &no_reserve()) {
            Decision::AdmitAfterSuspending { sandboxes, freed } => {
                assert_eq!(sandboxes, vec!["a"]);
                assert_eq!(freed.memory_bytes, 600 * MIB); // its 100 private + B's 500
            }
            other => panic!("{other:?}"),
        }
    }

    /// Idle siblings count what they measure, not their shape: 60 idle 1-vCPU vm siblings keeping 0.02 vCPU busy
    /// each leave room on a 2-core host (16 vCPU at 8x) for 10 more, and 15 busy ones (1 vCPU each) do not.
    #[test]
    fn idle_siblings_cost_their_measured_cpu() {
        let p = Policy { vcpu_overcommit: 8.0, ..no_reserve() };
        let idle: Vec<Running> =
            (0..60).map(|i| Running { vcpus: 0.02, ..sib(&format!("i{i}"), "B", MIB, 0, i) }).collect();
        let mut q = req(MIB, None, 0);
        q.vcpus = 10.0;
        assert_eq!(decide(&cap(2, 8 * GIB), &idle, &q, &p), Decision::Admit);
        let busy: Vec<Running> = (0..15).map(|i| sib(&format!("b{i}"), "B", MIB, 0, i)).collect();
        match decide(&cap(2, 8 * GIB), &busy, &q, &p) {
            Decision::Refuse { resource: Resource::Cpu, need: 10, free: 1, .. } => {}
            other => panic!("{other:?}"),
        }
        // A fraction left free is not rounded into a whole vCPU: 15.5 busy leave 0.5, which 0.6 does not fit.
        let mut almost = busy.clone();
        almost.push(Running { vcpus: 0.5, ..sib("h", "B", MIB, 0, 99) });
        q.vcpus = 0.6;
        assert!(matches!(decide(&cap(2, 8 * GIB), &almost, &q, &p), Decision::Refuse { resource: Resource::Cpu, .. }));
        q.vcpus = 0.4;
        assert_eq!(decide(&cap(2, 8 * GIB), &almost, &q, &p), Decision::Admit);
    }

    #[test]
    fn tasks_count_the_hosts_own_and_each_siblings() {
        // 10 siblings of 50 tasks each, 300 host tasks outside them, a kernel limit of 2,000 with 500 kept back:
        // 1,200 may go to sandboxes, 500 are held, 700 free.
        let run: Vec<Running> =
            (0..10).map(|i| Running { tasks: 50, ..sib(&format!("s{i}"), "B", MIB, 0, i) }).collect();
        let c = Capacity { tasks_max: 2000, tasks_now: 800, ..cap(64, 64 * GIB) };
        let p = Policy { reserve_tasks: 500, ..no_reserve() };
        let mut q = req(MIB, None, 0);
        q.tasks = 700;
        assert_eq!(decide(&c, &run, &q, &p), Decision::Admit);
        q.tasks = 701;
        match decide(&c, &run, &q, &p) {
            Decision::Refuse { resource: Resource::Pids, need: 701, free: 700, reason } => {
                assert!(reason.starts_with("pids: needs 701 tasks, 700 tasks free of 1200 tasks usable"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // Suspending idle siblings gives their tasks back.
        q.allow_suspend = true;
        match decide(&c, &run, &q, &p) {
            Decision::AdmitAfterSuspending { sandboxes, freed } => {
                assert_eq!((sandboxes, freed.tasks), (vec!["s0".to_string()], 50))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cpu_and_disk_refusals_name_the_resource() {
        let run = vec![sib("a", "B", 10 * MIB, 0, 1), sib("b", "B", 10 * MIB, 0, 2)];
        let mut q = req(MIB, None, 0);
        q.vcpus = 2.0;
        match decide(&cap(2, 8 * GIB), &run, &q, &no_reserve()) {
            Decision::Refuse { resource: Resource::Cpu, need: 2, free: 0, reason } => {
                assert!(reason.starts_with("cpu: needs 2 vCPU, 0 vCPU free of 2 vCPU usable"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // Overcommit 2x admits it.
        let over = Policy { vcpu_overcommit: 2.0, ..no_reserve() };
        assert_eq!(decide(&cap(2, 8 * GIB), &run, &q, &over), Decision::Admit);
        // Suspension is never offered for disk.
        q.vcpus = 1.0;
        q.disk_bytes = 10 * GIB;
        q.allow_suspend = true;
        let small = Capacity { disk_free_bytes: 11 * GIB, ..cap(8, 8 * GIB) };
        match decide(&small, &run, &q, &Policy::default()) {
            Decision::Refuse { resource: Resource::Disk, need, free, reason } => {
                assert_eq!((need, free), (10 * GIB, 9 * GIB));
                assert!(reason.contains("suspending frees no disk") && reason.contains("clade store gc"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn odd_inputs_do_not_panic() {
        // Shared bytes above RSS, zero capacity, a NaN overcommit.
        let run =
            vec![sib("a", "B", 10 * MIB, 0, 1), Running { shared_base_bytes: 99 * GIB, ..sib("b", "B", MIB, 0, 2) }];
        let p = Policy { vcpu_overcommit: f64::NAN, ..no_reserve() };
        let d = decide(
            &Capacity { vcpus: 0, memory_bytes: 0, disk_free_bytes: 0, tasks_max: 0, tasks_now: 0 },
            &run,
            &req(0, None, 0),
            &p,
        );
        assert!(matches!(d, Decision::Refuse { resource: Resource::Disk, .. }), "{d:?}");
        let mut q = req(0, None, 0);
        q.disk_bytes = 0;
        let d = decide(
            &Capacity { vcpus: 0, memory_bytes: 0, disk_free_bytes: 0, tasks_max: 0, tasks_now: 0 },
            &run,
            &q,
            &p,
        );
        assert!(matches!(d, Decision::Refuse { .. }), "{d:?}");
        assert_eq!(serde_json::to_value(&d).unwrap()["decision"], "refuse");
    }

    #[test]
    fn meminfo_total() {
        assert_eq!(parse_meminfo_total("MemTotal:       16384 kB\nMemFree: 1 kB\n"), Some(16384 * 1024));
        assert_eq!(parse_meminfo_total("MemFree: 1 kB\n"), None);
        assert!(Capacity::probe(&CladeHome::at("/tmp")).is_some_and(|c| c.vcpus >= 1 && c.memory_bytes > 0));
    }
}
