//! `clade-bench scale` (`./x bench scale`): many siblings of one mark on one host, on `ct` (docs/scale.md).
//!
//! 1. Bulk fork: 100 siblings of the `minimal` base, all agent-ready, through [`Ops::fork`]; supervisors forked
//!    by the zygote against the same started with `exec` (`CLADE_SPAWNER=0`), alternating rounds; then the same
//!    100 claimed from a warm pool of 100. Bar: <= 400 ms.
//! 2. Host-side memory per added idle sibling: the PSS of the supervisors (and the zygote) after 20 siblings
//!    and after 100, the slope per added sibling; zygote against exec side by side. Bar: <= 0.25 MiB.
//! 3. A thousand idle siblings (`--siblings`; `--quick` 200), forked 100 at a time: the host's total PSS (every
//!    process's) added, right after and once KSM has had a minute, every sibling answering an exec, `ls` and
//!    `kill_all` timed. Bars: total PSS <= 6 GiB, every exec answered, kill of all <= 10 s.
//!
//! 4-5. vm (`--vm-siblings`, 0 skips): 20 from a warm pool of 20, and 50 idle siblings held (src/scale/vm.rs).
//!
//! The bench needs a host with no sandbox running (it ends all of them at the end): it refuses otherwise.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clade_core::CladeHome;
use clade_host::api::{ExecRequest, ForkRequest, SandboxApi};
use clade_host::Ops;
use serde_json::json;

use super::{median, percentile, Figure};

mod vm;

#[derive(clap::Args)]
pub struct Args {
    /// The template whose ct base is forked.
    #[arg(long, default_value = "minimal")]
    pub template: String,
    /// Idle siblings held at once in the last part (default 1000; --quick 200).
    #[arg(long)]
    pub siblings: Option<u32>,
    /// Short run: 200 idle siblings, one round per fork figure, 20 s for KSM.
    #[arg(long)]
    pub quick: bool,
    /// Only the idle-siblings part (3).
    #[arg(long)]
    pub idle_only: bool,
    /// Idle vm siblings held in the vm part (default 50; --quick 20; 0 skips the vm part).
    #[arg(long)]
    pub vm_siblings: Option<u32>,
    /// Only the vm part (4-5).
    #[arg(long, conflicts_with = "idle_only")]
    pub vm_only: bool,
    /// Where the figures go as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub(super) fn emit(figs: &mut Vec<Figure>, f: Figure) {
    println!("{}", serde_json::to_string(&f).unwrap_or_default());
    figs.push(f);
}

fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("Pss:").map(|v| v.trim().trim_end_matches(" kB").trim().to_string()))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The pids of every process on this host.
pub(super) fn host_pids() -> std::collections::HashSet<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .collect()
}

/// The PSS of every process on this host that is not in `before`, summed (KiB): what the siblings started
/// since cost (their processes, supervisors, the zygote). A difference of the whole host's PSS would be
/// skewed by KSM, which also merges pages of processes that ran before and so lowers their PSS.
pub(super) fn new_pss_kib(before: &std::collections::HashSet<u32>) -> u64 {
    host_pids().into_iter().filter(|p| !before.contains(p)).map(pss_kib).sum()
}

fn mem_available_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("MemAvailable:").map(|v| v.trim().trim_end_matches(" kB").trim().to_string())
            })
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Pids of this home's supervisor zygotes.
fn zygotes(home: &CladeHome) -> Vec<u32> {
    let needle = home.run_dir().join("spawner-").to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).replace('\0', " ").contains(&needle))
        })
        .collect()
}

fn set_spawner(on: bool) {
    // The bench is single-threaded here (no fork or kill in flight), which is what set_var asks.
    if on {
        std::env::remove_var("CLADE_SPAWNER");
    } else {
        std::env::set_var("CLADE_SPAWNER", "0");
    }
}

pub(super) fn fork(ops: &Ops, mark: &str, count: u32) -> anyhow::Result<(f64, Vec<u32>, Vec<String>)> {
    let out = ops.fork(&ForkRequest { from: mark.into(), backend: None, count, make_room: false })?;
    if let Some(bad) = out.sandboxes.iter().find(|s| !s.ok) {
        bail!("a sibling did not start: {}", bad.error.clone().unwrap_or_default());
    }
    Ok((
        out.total_ms,
        out.sandboxes.iter().map(|s| s.pid).collect(),
        out.sandboxes.iter().map(|s| s.sandbox.clone()).collect(),
    ))
}

/// Fill the mark's pool to `n`, fork `n` from it, drain the refill; the fork's time.
pub(super) fn fork_from_pool(home: &CladeHome, ops: &Ops, mark: &str, n: u32) -> anyhow::Result<f64> {
    use clade_host::supervisor::pool;
    pool::set_size(home, mark, n as usize)?;
    pool::refill(home, mark)?;
    let t = Instant::now();
    while pool::members(home, mark).0.len() < n as usize {
        if t.elapsed() > Duration::from_secs(300) {
            bail!("the pool of {mark} was not full after 300 s (see its pool.log)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let the last members settle (KSM, their first idle tick) as a pool that waited would.
    std::thread::sleep(Duration::from_secs(3));
    let (ms, _, _) = fork(ops, mark, n)?;
    pool::drain(home, mark);
    // Members the refill had started end on their own once they see the pool drained.
    let t = Instant::now();
    while pool::members(home, mark).1 > 0 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    pool::drain(home, mark);
    Ok(ms)
}

pub(super) fn kill_all(ops: &Ops) -> anyhow::Result<f64> {
    let k = ops.kill_all()?;
    if let Some(f) = k.failed.first() {
        bail!("{} sandbox(es) not killed, first {}: {}", k.failed.len(), f.sandbox, f.error);
    }
    Ok(k.took_ms)
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let ops = Ops::open(&home)?;
    let running = ops.list()?.len();
    if running > 0 {
        bail!(
            "{running} sandbox(es) are running under {}: the scale bench ends every sandbox; kill them first \
             (clade kill --all) or point CLADE_HOME elsewhere",
            home.root().display()
        );
    }
    let mark = super::api::base_mark(&home, &ops, &a.template)?.0;
    let mark = mark.id.as_str().to_string();
    let rounds = if a.quick { 1 } else { 3 };
    let mut figs = Vec::new();

    if !a.idle_only && !a.vm_only {
        fork_figures(&home, &ops, &mark, rounds, &mut figs)?;
    }
    if !a.vm_only {
        idle_figures(&ops, &mark, &a, &mut figs)?;
    }
    let vm_n = if a.idle_only { 0 } else { a.vm_siblings.unwrap_or(if a.quick { 20 } else { 50 }) };
    if vm_n > 0 {
        vm::vm_figures(&home, &ops, &a.template, vm_n, rounds, &mut figs)?;
    }
    if let Some(p) = a.out {
        std::fs::write(&p, serde_json::to_vec_pretty(&figs)?)?;
    }
    Ok(if figs.iter().all(|f| f.pass) { 0 } else { 1 })
}

/// Parts 1 and 2.
fn fork_figures(home: &CladeHome, ops: &Ops, mark: &str, rounds: usize, figs: &mut Vec<Figure>) -> anyhow::Result<()> {
    let (home, ops, mark) = (home.clone(), ops, mark.to_string());
    // 1 and 2: zygote vs exec, alternating.
    let (mut fork_z, mut fork_x, mut per_z, mut per_x) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut supervisor_kib = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for zygote in [true, false] {
            set_spawner(zygote);
            let (ms, _, _) = fork(ops, &mark, 100)?;
            kill_all(ops)?;
            let (_, pids20, _) = fork(ops, &mark, 20)?;
            std::thread::sleep(Duration::from_millis(300));
            let extra = || zygotes(&home).into_iter().map(pss_kib).sum::<u64>();
            let p20: u64 = pids20.iter().map(|p| pss_kib(*p)).sum::<u64>() + extra();
            let (_, pids80, _) = fork(ops, &mark, 80)?;
            std::thread::sleep(Duration::from_millis(300));
            let all: Vec<u32> = pids20.iter().chain(&pids80).copied().collect();
            let p100: u64 = all.iter().map(|p| pss_kib(*p)).sum::<u64>() + extra();
            let per = (p100 as f64 - p20 as f64) / 80.0 / 1024.0;
            let avg = all.iter().map(|p| pss_kib(*p)).sum::<u64>() as f64 / all.len() as f64;
            kill_all(ops)?;
            if zygote {
                fork_z.push(ms);
                per_z.push(per);
                supervisor_kib.0.push(avg);
            } else {
                fork_x.push(ms);
                per_x.push(per);
                supervisor_kib.1.push(avg);
            }
            eprintln!("bench scale: zygote={zygote}: fork 100 in {ms:.0} ms; {per:.3} MiB per added sibling");
        }
    }
    set_spawner(true);
    let (fz, fx) = (median(&fork_z), median(&fork_x));
    emit(
        figs,
        Figure {
            name: "ct_fork_100_cold_ms".into(),
            value: fz,
            unit: "ms".into(),
            bar: "<= 400 ms (100 `minimal` siblings, all agent-ready)".into(),
            pass: fz <= 400.0,
            samples: fork_z.clone(),
            detail: json!({"exec_supervisors_ms": fork_x, "exec_median_ms": fx, "zygote_vs_exec": fz / fx,
                "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0), "mark": mark}),
        },
    );
    let (pz, px) = (median(&per_z), median(&per_x));
    emit(
        figs,
        Figure {
            name: "ct_host_pss_per_idle_sibling_mib".into(),
            value: pz,
            unit: "MiB".into(),
            bar: "<= 0.25 MiB host-side PSS per added idle sibling (supervisors and zygote, slope 20 -> 100)".into(),
            pass: pz <= 0.25,
            samples: per_z.clone(),
            detail: json!({"exec_supervisors_mib": per_x, "exec_median_mib": px, "zygote_vs_exec": pz / px,
                "avg_supervisor_pss_kib_zygote": median(&supervisor_kib.0),
                "avg_supervisor_pss_kib_exec": median(&supervisor_kib.1)}),
        },
    );

    // 1b: the same fork from a warm pool of 100 (members restored, hygiene done, paused; docs/pool.md).
    let mut pooled = Vec::new();
    for _ in 0..rounds {
        pooled.push(fork_from_pool(&home, ops, &mark, 100)?);
        kill_all(ops)?;
    }
    let fp = median(&pooled);
    emit(
        figs,
        Figure {
            name: "ct_fork_100_from_pool_ms".into(),
            value: fp,
            unit: "ms".into(),
            bar: "<= 400 ms (100 `minimal` siblings claimed from a warm pool of 100, all agent-ready)".into(),
            pass: fp <= 400.0,
            samples: pooled,
            detail: json!({"cold_median_ms": fz}),
        },
    );

    Ok(())
}

/// `exec true` in every sandbox of `ids`, `threads` at a time: the latencies (ms) of those that answered 0 and
/// what went wrong with the others.
pub(super) fn exec_all(ops: &Ops, ids: &[String], threads: usize) -> (Vec<f64>, Vec<String>) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let lat = std::sync::Mutex::new(Vec::new());
    let failed = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(id) = ids.get(i) else { return };
                let t = Instant::now();
                match ops.exec(id, ExecRequest { argv: vec!["true".into()], ..Default::default() }) {
                    Ok(o) if o.code == 0 => {
                        lat.lock().unwrap_or_else(|p| p.into_inner()).push(t.elapsed().as_secs_f64() * 1e3)
                    }
                    Ok(o) => failed.lock().unwrap_or_else(|p| p.into_inner()).push(format!("{id}: exit {}", o.code)),
                    Err(e) => failed.lock().unwrap_or_else(|p| p.into_inner()).push(format!("{id}: {e:#}")),
                }
            });
        }
    });
    (lat.into_inner().unwrap_or_default(), failed.into_inner().unwrap_or_default())
}

/// KSM's merged pages (pages_sharing).
fn ksm_sharing() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/ksm/pages_sharing").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// Part 3.
fn idle_figures(ops: &Ops, mark: &str, a: &Args, figs: &mut Vec<Figure>) -> anyhow::Result<()> {
    let (ops, mark) = (ops, mark.to_string());
    // 3: many idle siblings.
    let n = a.siblings.unwrap_or(if a.quick { 200 } else { 1000 });
    let (before, avail0) = (host_pids(), mem_available_kib());
    let mut ids = Vec::new();
    let mut batches = Vec::new();
    let t0 = Instant::now();
    while ids.len() < n as usize {
        let count = (n as usize - ids.len()).min(100) as u32;
        let (ms, _, got) = fork(ops, &mark, count).with_context(|| format!("after {} siblings", ids.len()))?;
        batches.push(ms);
        ids.extend(got);
        eprintln!("bench scale: {} idle siblings ({ms:.0} ms for the last {count})", ids.len());
    }
    let forked_s = t0.elapsed().as_secs_f64();
    let pss_now = new_pss_kib(&before);
    // KSM merges identical pages across siblings at its own pace (pages_to_scan per 20 ms): wait until a
    // minute passes in which it merged less than 1% more, at most 10 minutes (quick: 1 minute).
    let limit = Duration::from_secs(if a.quick { 60 } else { 600 });
    let t = Instant::now();
    let mut last = ksm_sharing();
    loop {
        std::thread::sleep(Duration::from_secs(if a.quick { 20 } else { 60 }));
        let now = ksm_sharing();
        eprintln!("bench scale: KSM pages shared {now} (+{})", now.saturating_sub(last));
        if now.saturating_sub(last) * 100 <= now.max(1) || t.elapsed() >= limit {
            break;
        }
        last = now;
    }
    let settle = t.elapsed().as_secs();
    let pss_settled = new_pss_kib(&before);
    let used = avail0.saturating_sub(mem_available_kib());
    let gib = |k: u64| k as f64 / (1024.0 * 1024.0);
    emit(
        figs,
        Figure {
            name: "ct_idle_siblings_total_pss_gib".into(),
            value: gib(pss_settled),
            unit: "GiB".into(),
            bar: format!("<= 6 GiB for {n} idle `minimal` siblings (the PSS of every process started for them added, after {settle} s)"),
            pass: gib(pss_settled) <= 6.0 * f64::from(n) / 1000.0,
            samples: vec![gib(pss_now), gib(pss_settled)],
            detail: json!({"siblings": n, "ksm_settle_s": settle, "ksm_pages_sharing": ksm_sharing(), "pss_right_after_gib": gib(pss_now), "mem_available_drop_gib": gib(used),
                "per_sibling_mib": pss_settled as f64 / 1024.0 / f64::from(n), "fork_batches_ms": batches,
                "fork_all_s": forked_s}),
        },
    );
    // Every sibling answers an exec (8 at a time).
    let (lat, failed) = exec_all(ops, &ids, 8);
    emit(
        figs,
        Figure {
            name: "ct_idle_siblings_exec_answered".into(),
            value: lat.len() as f64,
            unit: "siblings".into(),
            bar: format!("all {n} answer `exec true`"),
            pass: lat.len() == n as usize,
            samples: vec![],
            detail: json!({"p50_ms": median(&lat), "p99_ms": percentile(&lat, 0.99), "failed": failed.iter().take(5).collect::<Vec<_>>()}),
        },
    );
    let t = Instant::now();
    let listed = ops.list()?.len();
    let list_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let cli = std::process::Command::new(clade_host::supervisor::clade_exe()?).args(["ls", "--json"]).output()?;
    let cli_ms = t.elapsed().as_secs_f64() * 1e3;
    let kill_ms = kill_all(ops)?;
    let left = ops.list()?.len();
    let intact = ops.engine.ledger().quick_check();
    emit(
        figs,
        Figure {
            name: "ct_kill_all_idle_siblings_s".into(),
            value: kill_ms / 1e3,
            unit: "s".into(),
            bar: format!("<= 10 s to kill all {n}, none left, the ledger passes its check"),
            pass: kill_ms <= 10_000.0 && left == 0 && intact.is_ok(),
            samples: vec![kill_ms / 1e3],
            detail: json!({"left": left, "ledger_check": intact.as_ref().map(|_| "ok".to_string()).unwrap_or_else(|e| e.to_string()), "listed": listed, "list_ms": list_ms, "cli_ls_ms": cli_ms,
                "cli_ls_ok": cli.status.success()}),
        },
    );
    Ok(())
}
