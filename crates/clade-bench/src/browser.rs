//! `clade-bench browser --backend ct|vm` (run by `./x bench browser`): clade's headline measurement (an agent's
//! warm browser session: is a restore with hygiene at most half a cold start, at no more memory per sibling?)
//! with the `browser` template (Xvfb, openbox, Chromium with a page, the screen server) on one backend, one
//! run, arms interleaved:
//!
//! * time to agent-ready, cold versus restored from the template's base with hygiene, where agent-ready is the
//!   template's own readiness URL answered inside the sandbox (the screenshot differs from the blank desktop in
//!   more than 10% of pixels AND the page has a title; `templates/browser/files/screen-server.py`);
//! * host memory per added sandbox: the slope of the summed PSS of N restored siblings, against the slope of N
//!   cold sandboxes;
//! * the mark pause of a restored, agent-ready sandbox, and the storage of a second mark taken a while later.
//!
//! The template and its base are built first when missing (with progress lines), so this is also the `browser`
//! build step of `./x bench`. Every figure is a JSON line (`super::Figure`) and the whole set is written to
//! `--out`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_agent::proto::ReadyTarget;
use clade_core::backend::{Backend, BackendKind, MarkOptions, MarkState, Sandbox, TemplateImage};
use clade_core::engine::Engine;
use clade_core::{hygiene, CladeHome};

use super::{median, percentile, slope, Figure};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    pub backend: BackendKind,
    /// Template spec dir.
    #[arg(long, default_value = "templates/browser")]
    pub template: PathBuf,
    /// Starts per arm (default: 20 on ct, 6 on vm).
    #[arg(long)]
    pub n: Option<usize>,
    /// Restored siblings side by side for the memory slope (comma-separated counts).
    #[arg(long, default_value = "1,4,8")]
    pub mem_counts: String,
    /// Cold sandboxes side by side for the cold slope (default: the same counts on ct, 1,2 on vm).
    #[arg(long)]
    pub cold_mem_counts: Option<String>,
    /// Seconds between the first and the second mark.
    #[arg(long, default_value_t = 60)]
    pub mark_gap_secs: u64,
    /// How long one start may take to reach agent-ready.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout_secs: u64,
    /// Only build the template and the base (the build step of `./x bench`).
    #[arg(long)]
    pub build_only: bool,
    /// Where to write the figures (JSON); default bench/out/browser-<backend>.json.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn counts(s: &str) -> anyhow::Result<Vec<usize>> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.trim().parse().map_err(|_| anyhow!("{s:?}: comma-separated counts")))
        .collect::<Result<_, _>>()?;
    if v.is_empty() || v.contains(&0) {
        return Err(anyhow!("{s:?}: counts must be at least 1"));
    }
    Ok(v)
}

struct Run {
    be: std::sync::Arc<dyn Backend>,
    image: TemplateImage,
    state: MarkState,
    ready: ReadyTarget,
    timeout: Duration,
    seq: std::sync::atomic::AtomicU32,
}

impl Run {
    fn ident(&self, what: &str) -> clade_core::backend::Identity {
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        hygiene::new_identity(&format!("bb{}-{what}{n}", std::process::id()), u64::from(what != "c"))
    }

    /// Cold start to agent-ready.
    fn cold(&self) -> anyhow::Result<(Box<dyn Sandbox>, Duration)> {
        let id = self.ident("c");
        let t = Instant::now();
        let s = self.be.cold_start(&self.image, &id).context("cold start")?;
        s.agent().wait_ready(self.ready.clone(), self.timeout).context("cold start: agent-ready")?;
        Ok((s, t.elapsed()))
    }

    /// Restore of the base with hygiene to agent-ready: (sandbox, total, restore alone, hygiene alone).
    fn restore(&self) -> anyhow::Result<(Box<dyn Sandbox>, Duration, Duration, Duration)> {
        let id = self.ident("r");
        let t = Instant::now();
        let s = self.be.restore(&self.state, &id).context("restore")?;
        let restored = t.elapsed();
        let h = hygiene::apply(s.agent(), &id, self.state.clean).context("hygiene")?;
        if !h.errors.is_empty() {
            eprintln!("bench browser: hygiene reported: {:?}", h.errors);
        }
        s.agent().wait_ready(self.ready.clone(), self.timeout).context("restore: agent-ready")?;
        Ok((s, t.elapsed(), restored, h.took))
    }
}

fn pss(sbs: &[Box<dyn Sandbox>]) -> u64 {
    sbs.iter().flat_map(|s| s.pids()).filter_map(|p| clade_core::host::pss_rss(p).map(|x| x.0)).sum()
}

fn kill_all(v: Vec<Box<dyn Sandbox>>) {
    for s in v {
        let _ = s.kill();
    }
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let kind = a.backend;
    let key = a.template.display().to_string();
    let t0 = Instant::now();
    eprintln!("bench browser ({}): template and base of {key} (built when missing)", kind.as_str());
    let base = clade_host::base::build(&home, &key, kind, false, &|l| eprintln!("{l}"))?;
    eprintln!(
        "bench browser ({}): base {} {} in {:.1} s",
        kind.as_str(),
        base.mark,
        if base.cached { "cached" } else { "built" },
        t0.elapsed().as_secs_f64()
    );
    if a.build_only {
        println!("{}", serde_json::json!({"bench": "browser-build", "backend": kind, "base": base}));
        return Ok(0);
    }
    let record = clade_host::base::template_record(&home, &key, kind)?;
    let ready = clade_host::base::ready_target(&record)
        .ok_or_else(|| anyhow!("template {} has no `ready`: agent-ready cannot be checked", record.name))?;
    let engine = Engine::open(&home)?;
    let mark = engine.ledger().mark(&clade_ledger::MarkId::new(base.mark.as_str()))?;
    let run = Run {
        be: clade_host::backends::open(&engine, kind)?,
        image: clade_host::base::image_of(&record),
        state: engine.mark_state(&mark)?,
        ready,
        timeout: Duration::from_secs(a.ready_timeout_secs),
        seq: Default::default(),
    };
    let accel = match kind {
        BackendKind::Vm => {
            clade_vm::backend::VmBackend::open(&home, engine.store.clone(), None)?.accel().as_str().to_string()
        }
        BackendKind::Ct => "none (namespaces)".to_string(),
    };
    let n = a.n.unwrap_or(if kind == BackendKind::Vm { 6 } else { 20 });
    let mem = counts(&a.mem_counts)?;
    let cold_mem =
        counts(a.cold_mem_counts.as_deref().unwrap_or(if kind == BackendKind::Vm { "1,2" } else { &a.mem_counts }))?;
    let mut figs = Vec::new();
    let name = |what: &str| format!("{} browser: {what}", kind.as_str());
    let ctx = serde_json::json!({"backend": kind, "accel": accel, "template": record.name, "template_hash": record.hash, "base": mark.id});

    // 1. Time to agent-ready, interleaved: cold, restore, cold, restore, ...
    let (mut cold, mut rest, mut rest_only, mut hyg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // One untimed start of each arm first (the figures are for a warm page cache; the first restore of a mark
    // on a host also lays its state out of the store).
    run.cold()?.0.kill()?;
    run.restore()?.0.kill()?;
    for i in 0..n {
        let (s, tc) = run.cold()?;
        s.kill()?;
        let (s, tr, tro, th) = run.restore()?;
        s.kill()?;
        eprintln!(
            "bench browser ({}): start {}/{n}: cold {:.0} ms, restore+hygiene {:.0} ms (restore {:.0}, hygiene {:.0})",
            kind.as_str(),
            i + 1,
            ms(tc),
            ms(tr),
            ms(tro),
            ms(th)
        );
        cold.push(ms(tc));
        rest.push(ms(tr));
        rest_only.push(ms(tro));
        hyg.push(ms(th));
    }
    let (c50, r50, c95, r95) = (median(&cold), median(&rest), percentile(&cold, 0.95), percentile(&rest, 0.95));
    let detail = serde_json::json!({"ctx": ctx, "n": n, "cold_ms": cold, "restore_hygiene_ms": rest, "restore_only_ms": rest_only,
        "hygiene_ms": hyg, "cold_p50_ms": c50, "cold_p95_ms": c95, "restore_p50_ms": r50, "restore_p95_ms": r95});
    emit(
        &mut figs,
        Figure {
            name: name("restore with hygiene p50 / cold p50, to agent-ready (screenshot + title)"),
            value: r50 / c50,
            unit: "x".into(),
            bar: "<= 0.5x (clade's floor; plain CRIU with hygiene measured 0.57x before clade)".into(),
            pass: r50 / c50 <= 0.5,
            samples: rest.clone(),
            detail: detail.clone(),
        },
    );
    emit(
        &mut figs,
        Figure {
            name: name("restore with hygiene p95 vs cold p95"),
            value: r95,
            unit: "ms".into(),
            bar: format!("<= cold p95 ({c95:.0} ms)"),
            pass: r95 <= c95,
            samples: rest.clone(),
            detail: serde_json::json!({"ctx": ctx, "cold_p95_ms": c95, "cold_ms": cold}),
        },
    );

    // 1b. A fork from a warm pool (what `clade pool fill` keeps waiting): each member restored, its hygiene
    // applied and the template's readiness reached *before* the claim, then paused; the timed part is the
    // claim (continue, clock step, ledger record) to a confirmed agent-ready. Not a restore on demand: reported
    // beside the bar, never in its place.
    let mut pooled = Vec::new();
    // Under TCG each member's restore to agent-ready takes tens of seconds: fewer samples there.
    for i in 0..n.min(if kind == BackendKind::Vm { 3 } else { 10 }) {
        let sbx = clade_ledger::SandboxId::generate();
        let Some(prepared) = engine.prepare(run.be.as_ref(), &sbx, &mark, 1)? else {
            eprintln!("bench browser ({}): no warm pool on this backend", kind.as_str());
            break;
        };
        let warm = engine.warm(prepared, Some((run.ready.clone(), run.timeout)))?;
        engine.new_sandbox_with_id(kind, Some(&mark), Some(sbx.clone()))?;
        let t = Instant::now();
        let claimed = engine.claim_warm(warm, &sbx, &mark)?;
        claimed.sandbox.agent().wait_ready(run.ready.clone(), run.timeout).context("pool claim: agent-ready")?;
        let took = ms(t.elapsed());
        let _ = engine.ledger().set_sandbox_state(&sbx, clade_ledger::SandboxState::Dead, None);
        claimed.sandbox.kill()?;
        eprintln!("bench browser ({}): pool claim {}: {took:.1} ms to agent-ready", kind.as_str(), i + 1);
        pooled.push(took);
    }
    if !pooled.is_empty() {
        let p50 = median(&pooled);
        emit(
            &mut figs,
            Figure {
                name: name("fork from a warm pool (restored, hygiene applied, agent-ready, paused) p50 / cold p50"),
                value: p50 / c50,
                unit: "x".into(),
                bar: "reported (the restore-on-demand figure above is the bar's)".into(),
                pass: true,
                samples: pooled.clone(),
                detail: serde_json::json!({"ctx": ctx, "claim_to_ready_ms": pooled, "claim_p50_ms": p50, "cold_p50_ms": c50}),
            },
        );
    }

    // 2. Memory per added sandbox: restored siblings (slope over `mem`) against cold sandboxes (over `cold_mem`).
    let mut ys = Vec::new();
    let mut sibs: Vec<Box<dyn Sandbox>> = Vec::new();
    for &c in &mem {
        while sibs.len() < c {
            sibs.push(run.restore()?.0);
        }
        std::thread::sleep(Duration::from_secs(3));
        if kind == BackendKind::Ct {
            clade_ct::ksm_settle(Duration::from_secs(120));
        }
        ys.push(pss(&sibs) as f64);
        eprintln!("bench browser ({}): {c} restored: PSS {:.0} MiB", kind.as_str(), ys[ys.len() - 1] / 1048576.0);
    }
    kill_all(std::mem::take(&mut sibs));
    let mut cys = Vec::new();
    let mut colds: Vec<Box<dyn Sandbox>> = Vec::new();
    for &c in &cold_mem {
        while colds.len() < c {
            colds.push(run.cold()?.0);
        }
        std::thread::sleep(Duration::from_secs(3));
        cys.push(pss(&colds) as f64);
        eprintln!("bench browser ({}): {c} cold: PSS {:.0} MiB", kind.as_str(), cys[cys.len() - 1] / 1048576.0);
    }
    kill_all(colds);
    let xs: Vec<f64> = mem.iter().map(|&c| c as f64).collect();
    let cxs: Vec<f64> = cold_mem.iter().map(|&c| c as f64).collect();
    // One count only: the per-sandbox average stands in for the slope.
    let per = |x: &[f64], y: &[f64]| if x.len() >= 2 { slope(x, y) } else { y[0] / x[0] };
    let (rs, cs) = (per(&xs, &ys), per(&cxs, &cys));
    emit(
        &mut figs,
        Figure {
            name: name("host memory per added restored sibling / per added cold sandbox (PSS slope)"),
            value: rs / cs,
            unit: "x".into(),
            bar: "<= 1.0x (plain CRIU before clade: 1.038x)".into(),
            pass: rs / cs <= 1.0,
            samples: ys.clone(),
            detail: serde_json::json!({"ctx": ctx, "restored_counts": xs, "restored_sum_pss_bytes": ys, "cold_counts": cxs,
            "cold_sum_pss_bytes": cys, "restored_mib_per_sibling": rs / 1048576.0, "cold_mib_per_sandbox": cs / 1048576.0}),
        },
    );

    // 3. Mark pause and storage: a restored, agent-ready sandbox marked twice, `mark_gap_secs` apart.
    let (mut s, ..) = run.restore()?;
    let m1 = s.mark(&MarkOptions::default()).context("first mark")?;
    s.agent().wait_ready(run.ready.clone(), run.timeout).context("agent-ready after the first mark")?;
    std::thread::sleep(Duration::from_secs(a.mark_gap_secs));
    let m2 = s.mark(&MarkOptions::default()).context("second mark")?;
    s.kill()?;
    let pause = ms(m1.pause).max(ms(m2.pause));
    emit(
        &mut figs,
        Figure {
            name: name("mark pause of an agent-ready sandbox (worse of two marks)"),
            value: pause,
            unit: "ms".into(),
            bar: "<= 200 ms (plain CRIU's dump before clade: 810 ms)".into(),
            pass: pause <= 200.0,
            samples: vec![ms(m1.pause), ms(m2.pause)],
            detail: serde_json::json!({"ctx": ctx, "logical_bytes": [m1.logical_bytes, m2.logical_bytes]}),
        },
    );
    // The first mark that stored this session in full is the base; a restored sibling's own first mark is
    // already stored against it (8 MB of 187 MB on ct), which would make any later mark look large beside it.
    let first = mark.stored_bytes;
    let ratio = m2.stored_bytes as f64 / first.max(1) as f64;
    emit(
        &mut figs,
        Figure {
            name: name(&format!("storage of a mark {} s later / the session's first mark (the base)", a.mark_gap_secs)),
            value: ratio,
            unit: "ratio".into(),
            bar: "<= 0.25".into(),
            pass: ratio <= 0.25,
            samples: vec![first as f64, m1.stored_bytes as f64, m2.stored_bytes as f64],
            detail: serde_json::json!({"ctx": ctx, "base_stored_bytes": first, "base_logical_bytes": mark.logical_bytes,
            "sibling_first_stored_bytes": m1.stored_bytes, "sibling_second_stored_bytes": m2.stored_bytes,
            "first_logical_bytes": m1.logical_bytes, "second_logical_bytes": m2.logical_bytes,
            "note": "samples: the base mark, the restored sibling's first mark (stored against the base), its second",
            "plot": {"kind": "xy", "x": [1, 2, 3], "series": {"stored MiB": [mib(first), mib(m1.stored_bytes), mib(m2.stored_bytes)]},
                "xlabel": "mark: 1 the base, 2 a restored sibling's first, 3 its second", "ylabel": "stored MiB"}}),
        },
    );

    let out = a.out.clone().unwrap_or_else(|| PathBuf::from(format!("bench/out/browser-{}.json", kind.as_str())));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(
        &out,
        serde_json::to_vec_pretty(&serde_json::json!({"backend": kind, "accel": accel, "figures": figs,
            "took_s": t0.elapsed().as_secs_f64()}))?,
    )?;
    eprintln!(
        "bench browser ({}): {} figures, {} pass, {:.0} s; written to {}",
        kind.as_str(),
        figs.len(),
        figs.iter().filter(|f| f.pass).count(),
        t0.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(0)
}

fn emit(figs: &mut Vec<Figure>, f: Figure) {
    println!("{}", serde_json::to_string(&f).unwrap_or_default());
    figs.push(f);
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}
