//! `clade fleet simulate [TRACE]`: replay a trace of agent sessions (or the built-in scenario) over hosts of one shape
//! and price, keep-running against suspend-idle, with suspend/resume costs clade measured itself (the ledger's
//! operations log, or `./x bench` outputs, or `--measure`: a quick ct suspend/resume run now through this binary).
//! `clade fleet trace` prints the built-in scenario as a trace file. Model and figures: docs/fleet.md.

use std::path::{Path, PathBuf};
use std::process::Command as Proc;
use std::time::Instant;

use anyhow::{anyhow, Context};
use clade_core::{CladeHome, ErrorKind, OpError};
use clade_fleet::costs::OpSample;
use clade_fleet::{compare, parse_trace, seed004, HostShape, Measured, Params, Seed004, Trace};
use clap::{Subcommand, ValueEnum};

#[derive(Subcommand)]
pub enum Command {
    /// Replay a trace (JSON lines; `-` for stdin; none: the built-in scenario), keep-running vs suspend-idle.
    Simulate(SimArgs),
    /// Print the built-in scenario as a trace file (JSON lines) to edit and replay.
    Trace(ScenarioArgs),
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// 18 retained sessions (12 coding, 6 build), exactly 6 active at every moment.
    Seed004,
    /// The same sessions, each user alternating on their own (about 6 active, fluctuating).
    Seed004Independent,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Source {
    /// The ledger's operations log first, then bench/out/*.jsonl.
    Auto,
    Ledger,
    Bench,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Vm,
    Ct,
}

impl Backend {
    fn as_str(self) -> &'static str {
        match self {
            Backend::Vm => "vm",
            Backend::Ct => "ct",
        }
    }
}

#[derive(clap::Args)]
pub struct ScenarioArgs {
    #[arg(long, value_enum, default_value = "seed004")]
    pub scenario: Scenario,
    /// Length of the built-in scenario, hours.
    #[arg(long, default_value_t = 8.0)]
    pub hours: f64,
    /// Seed of the scenario's generator and of the draws from the measured samples.
    #[arg(long, default_value_t = 4)]
    pub seed: u64,
}

#[derive(clap::Args)]
pub struct SimArgs {
    /// A trace file (docs/fleet.md); `-` reads stdin; none: the built-in scenario.
    pub trace: Option<PathBuf>,
    #[command(flatten)]
    pub scenario: ScenarioArgs,
    /// One JSON object: both policies, cost sources, and the hosts-billed time series.
    #[arg(long)]
    pub json: bool,
    /// Figure lines for the benchmark report (`./x bench fleet`): the host-hours ratio with the hosts billed
    /// over time, and the resume waits.
    #[arg(long, conflicts_with = "json")]
    pub figures: bool,
    /// Whose measured costs to use (default: the first found, vm then ct).
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Where to look for measured costs.
    #[arg(long, value_enum, default_value = "auto")]
    pub source: Source,
    /// Directory of the bench outputs (scripts/bench.sh writes bench/out/).
    #[arg(long, default_value = "bench/out")]
    pub bench_dir: PathBuf,
    /// Measure now: build (or reuse) a ct base, run a sandbox, suspend and resume it --samples times, kill it.
    #[arg(long)]
    pub measure: bool,
    /// Template for --measure (a built template's name, or a template.toml to build).
    #[arg(long, default_value = "templates/minimal/template.toml")]
    pub template: String,
    /// Suspend/resume rounds for --measure.
    #[arg(long, default_value_t = 3)]
    pub samples: u32,
    #[arg(long, default_value_t = 16.0)]
    pub host_vcpus: f64,
    #[arg(long, default_value_t = 64.0)]
    pub host_memory_gib: f64,
    #[arg(long, default_value_t = 400.0)]
    pub host_disk_gib: f64,
    /// Dollars per host-hour.
    #[arg(long, default_value_t = 0.80)]
    pub price: f64,
    /// Suspend a session idle this long (seconds).
    #[arg(long, default_value_t = 300.0)]
    pub idle_after_s: f64,
    /// An empty host stays billed this long before it is released (seconds).
    #[arg(long, default_value_t = 60.0)]
    pub scale_in_s: f64,
    /// A start that needs a new host waits this long for it (seconds).
    #[arg(long, default_value_t = 0.0)]
    pub host_start_s: f64,
}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    match cmd {
        Command::Trace(a) => {
            print!("{}", builtin(&a).to_jsonl());
            Ok(0)
        }
        Command::Simulate(a) => simulate(a),
    }
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow!(OpError::new(ErrorKind::Invalid, msg))
}

fn builtin(a: &ScenarioArgs) -> Trace {
    seed004(&Seed004 {
        hours: a.hours,
        fixed_concurrency: a.scenario == Scenario::Seed004,
        seed: a.seed,
        ..Default::default()
    })
}

fn load_trace(a: &SimArgs) -> anyhow::Result<(Trace, String)> {
    let Some(p) = &a.trace else {
        if !(a.scenario.hours.is_finite() && a.scenario.hours > 0.0) {
            return Err(usage(format!("--hours must be a positive number, got {}", a.scenario.hours)));
        }
        let name = match a.scenario.scenario {
            Scenario::Seed004 => "seed004",
            Scenario::Seed004Independent => "seed004-independent",
        };
        return Ok((builtin(&a.scenario), format!("built-in {name} (seed {})", a.scenario.seed)));
    };
    let text = if p == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("reading the trace from stdin")?
    } else {
        std::fs::read_to_string(p).map_err(|e| usage(format!("cannot read trace {}: {e}", p.display())))?
    };
    let t = parse_trace(&text).map_err(|e| usage(format!("{}: {e}", p.display())))?;
    Ok((t, p.display().to_string()))
}

fn simulate(a: SimArgs) -> anyhow::Result<i32> {
    let (trace, trace_name) = load_trace(&a)?;
    let home = CladeHome::from_env();
    let costs = if a.measure { measure(&home, &a)? } else { find_costs(&home, &a)? };
    let params = Params {
        host: HostShape {
            vcpus: a.host_vcpus,
            memory_gib: a.host_memory_gib,
            disk_gib: a.host_disk_gib,
            price_per_hour: a.price,
        },
        idle_after_s: a.idle_after_s,
        scale_in_s: a.scale_in_s,
        host_start_s: a.host_start_s,
        seed: a.scenario.seed,
    };
    let c = compare(&trace, &costs, &params).map_err(|e| usage(e.to_string()))?;
    if a.figures {
        for f in figures(&c, &trace_name) {
            println!("{}", serde_json::to_string(&f)?);
        }
        return Ok(0);
    }
    if a.json {
        let mut v = serde_json::to_value(&c)?;
        v["trace"] = trace_name.into();
        println!("{}", serde_json::to_string(&v)?);
        return Ok(0);
    }
    let h = &params.host;
    println!(
        "fleet: {trace_name}: {} sessions over {:.1} h, {:.1} active on average; hosts of {} vCPU / {} GiB / {} GiB at ${:.2}/h",
        c.sessions, c.hours, c.mean_active, h.vcpus, h.memory_gib, h.disk_gib, h.price_per_hour
    );
    println!(
        "suspend after {} s idle; empty hosts released after {} s; new host start {} s",
        params.idle_after_s, params.scale_in_s, params.host_start_s
    );
    println!("measured costs ({}):", costs.backend);
    let stats = |v: &[f64]| {
        format!(
            "p50 {:.0} ms, p99 {:.0} ms",
            clade_fleet::sim::percentile(v, 0.5),
            clade_fleet::sim::percentile(v, 0.99)
        )
    };
    let src = &c.cost_sources;
    let get = |k: &str| src.get(k).cloned().unwrap_or_default();
    println!("  resume  {:<28} from {}", stats(&costs.resume_ms), get("resume_ms"));
    println!("  suspend {:<28} from {}", stats(&costs.suspend_ms), get("suspend_ms"));
    let mib = |b: Option<f64>| b.map(|b| format!("{:.2} MiB", b / 1048576.0)).unwrap_or_else(|| "-".into());
    println!("  suspend writes {:<21} from {}", mib(costs.suspend_bytes), get("suspend_bytes"));
    println!("  resume fetches {:<21} {}", mib(costs.resume_bytes_or_suspend()), get("resume_bytes"));
    println!();
    println!(
        "{:<14} {:>10} {:>9} {:>6} {:>9} {:>8} {:>11} {:>11} {:>10} {:>10}",
        "policy",
        "host-hours",
        "cost $",
        "peak",
        "suspends",
        "resumes",
        "p50 resume",
        "p99 resume",
        "GiB out",
        "GiB in"
    );
    for r in [&c.keep_running, &c.suspend_idle] {
        println!(
            "{:<14} {:>10.2} {:>9.2} {:>6} {:>9} {:>8} {:>8.0} ms {:>8.0} ms {:>10.2} {:>10.2}",
            r.policy.name(),
            r.host_hours,
            r.cost_usd,
            r.peak_hosts,
            r.suspends,
            r.resumes,
            r.p50_resume_wait_ms,
            r.p99_resume_wait_ms,
            r.bytes_suspended / (1u64 << 30) as f64,
            r.bytes_resumed / (1u64 << 30) as f64
        );
    }
    println!();
    println!("seed cost formula terms (unit-hours):");
    println!(
        "{:<14} {:>9} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14}",
        "policy", "vCPU-h", "RAM req GiB-h", "RAM base", "RAM dirty", "disk req", "disk base", "disk dirty"
    );
    for r in [&c.keep_running, &c.suspend_idle] {
        let t = &r.terms;
        println!(
            "{:<14} {:>9.1} {:>14.1} {:>14.1} {:>14.1} {:>14.1} {:>14.1} {:>14.1}",
            r.policy.name(),
            t.vcpu_h,
            t.memory_requested_gib_h,
            t.memory_base_gib_h,
            t.memory_dirty_gib_h,
            t.disk_requested_gib_h,
            t.disk_base_gib_h,
            t.disk_dirty_gib_h
        );
    }
    println!(
        "(old: a*vCPU + b*requested RAM + c*requested disk; new: a*vCPU + b*(base + dirty RAM) + c*(base + dirty disk))"
    );
    println!();
    println!(
        "{}: {:.3} (bar {}) {}",
        c.figure.name,
        c.figure.value,
        c.figure.bar,
        if c.figure.pass { "PASS" } else { "FAIL" }
    );
    Ok(0)
}

fn backends(a: &SimArgs) -> Vec<Backend> {
    match a.backend {
        Some(b) => vec![b],
        None => vec![Backend::Vm, Backend::Ct],
    }
}

/// The first measured costs found, in order: the ledger (suspend + resume ops), then the bench outputs.
fn find_costs(home: &CladeHome, a: &SimArgs) -> anyhow::Result<Measured> {
    let mut tried = Vec::new();
    if a.source != Source::Bench {
        let path = home.ledger_path();
        if path.exists() {
            let ops = ledger_ops(&path)?;
            for b in backends(a) {
                match Measured::from_ops(&ops, b.as_str(), &path.display().to_string()) {
                    Ok(m) => return Ok(m),
                    Err(e) => tried.push(e.to_string()),
                }
            }
        } else {
            tried.push(format!("no ledger at {}", path.display()));
        }
    }
    if a.source != Source::Ledger {
        for b in backends(a) {
            let file = a.bench_dir.join(format!("{}.jsonl", b.as_str()));
            let name = file.display().to_string();
            match std::fs::read_to_string(&file) {
                Ok(text) => {
                    let r = match b {
                        Backend::Vm => Measured::from_vm_bench(&text, &name),
                        Backend::Ct => Measured::from_ct_bench(&text, &name),
                    };
                    match r {
                        Ok(m) => return Ok(m),
                        Err(e) => tried.push(e.to_string()),
                    }
                }
                Err(_) => tried.push(format!("no {name}")),
            }
        }
    }
    Err(anyhow!(OpError::new(
        ErrorKind::NotFound,
        clade_fleet::CostError::NoneFound { tried: tried.join("; ") }.to_string()
    )))
}

/// The suspend, resume and restore entries of the ledger's log, with each sandbox's backend and each mark's bytes.
fn ledger_ops(path: &Path) -> anyhow::Result<Vec<OpSample>> {
    let l = clade_ledger::Ledger::open(path).with_context(|| format!("opening the ledger {}", path.display()))?;
    let mut out = Vec::new();
    for op in ["suspend", "resume", "restore"] {
        let q = clade_ledger::OpQuery { op: Some(op.into()), limit: Some(10_000), ..Default::default() };
        for r in l.ops(&q)? {
            let Some(sbx) = r.sandbox.clone() else { continue };
            let Ok(rec) = l.sandbox(&sbx) else { continue };
            let stored = match (&r.mark, op) {
                (Some(m), "suspend") => l.mark(m).ok().map(|m| m.stored_bytes),
                _ => None,
            };
            out.push(OpSample {
                op: r.op.clone(),
                backend: rec.backend.as_str().to_string(),
                sandbox: Some(sbx.as_str().to_string()),
                started_ms: r.started_ms,
                duration_ms: r.duration_ms as f64,
                ok: r.ok,
                stored_bytes: stored,
            });
        }
    }
    Ok(out)
}

fn clade_json(args: &[&str]) -> anyhow::Result<(serde_json::Value, f64)> {
    let exe = std::env::current_exe().context("locating the clade binary")?;
    let t = Instant::now();
    let out = Proc::new(&exe).args(args).output().with_context(|| format!("running clade {}", args.join(" ")))?;
    let took = t.elapsed().as_secs_f64() * 1e3;
    if !out.status.success() {
        return Err(anyhow!(
            "clade {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // One object, pretty-printed or on one line (the last JSON line if other lines come first).
    let v = serde_json::from_str::<serde_json::Value>(text.trim())
        .ok()
        .or_else(|| text.lines().rev().find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()))
        .ok_or_else(|| anyhow!("clade {} printed no JSON: {text}", args.join(" ")))?;
    Ok((v, took))
}

/// A quick ct measurement through this binary: base (cached), run, `samples` x (suspend, resume), kill.
fn measure(home: &CladeHome, a: &SimArgs) -> anyhow::Result<Measured> {
    if a.backend == Some(Backend::Vm) {
        return Err(usage("--measure runs the ct backend; for vm costs run `./x bench vm --quick`"));
    }
    if a.samples == 0 {
        return Err(usage("--samples must be at least 1"));
    }
    eprintln!("fleet: measuring ct suspend/resume in {} ({} rounds)", home.root().display(), a.samples);
    let (base, _) = clade_json(&["base", "build", &a.template, "--backend", "ct", "--json"])?;
    let mark = base["mark"].as_str().ok_or_else(|| anyhow!("base build gave no mark: {base}"))?.to_string();
    let (run, _) = clade_json(&["run", &mark, "--backend", "ct", "--json"])?;
    let sbx = run["sandboxes"][0]["sandbox"]
        .as_str()
        .or_else(|| run["sandbox"].as_str())
        .ok_or_else(|| anyhow!("run gave no sandbox id: {run}"))?
        .to_string();
    let result = (|| -> anyhow::Result<Measured> {
        let (mut resume, mut suspend, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.samples {
            let (m, took) = clade_json(&["suspend", &sbx, "--json"])?;
            suspend.push(took);
            bytes.extend(m["stored_bytes"].as_f64());
            let (r, took) = clade_json(&["resume", &sbx, "--json"])?;
            if r["ok"].as_bool() == Some(false) {
                return Err(anyhow!("resume of {sbx} failed: {}", r["error"]));
            }
            resume.push(r["resume_ms"].as_f64().unwrap_or(took));
        }
        let exe = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "clade".into());
        let mut sources = std::collections::BTreeMap::new();
        let n = a.samples;
        sources.insert("resume_ms".into(), format!("measured now: `{exe} resume` resume_ms, {n} rounds, ct"));
        sources.insert("suspend_ms".into(), format!("measured now: `{exe} suspend` wall time, {n} rounds, ct"));
        let suspend_bytes = (!bytes.is_empty()).then(|| bytes.iter().sum::<f64>() / bytes.len() as f64);
        if suspend_bytes.is_some() {
            sources.insert("suspend_bytes".into(), "measured now: the suspend marks' stored_bytes".into());
        }
        Ok(Measured {
            backend: "ct".into(),
            resume_ms: resume,
            suspend_ms: suspend,
            suspend_bytes,
            resume_bytes: None,
            sources,
        })
    })();
    if let Err(e) = clade_json(&["kill", &sbx, "--json"]) {
        eprintln!("fleet: could not end the measuring sandbox {sbx}: {e:#} (run `clade kill {sbx}`)");
    }
    result
}

/// Hosts billed at time `t` from a step series of `[t, hosts]` changes.
fn hosts_at(series: &[[f64; 2]], t: f64) -> f64 {
    series.iter().take_while(|p| p[0] <= t).last().map(|p| p[1]).unwrap_or(0.0)
}

/// The report's figures of one comparison (docs/report.md): the host-hours ratio (bar: <= 0.5) with both
/// policies' hosts billed over the day, and the resume waits suspend-idle costs its users.
fn figures(c: &clade_fleet::sim::Comparison, trace: &str) -> Vec<serde_json::Value> {
    let (k, s) = (&c.keep_running, &c.suspend_idle);
    let steps = 96;
    let xs: Vec<f64> = (0..=steps).map(|i| c.hours * f64::from(i) / f64::from(steps)).collect();
    let at = |series: &[[f64; 2]]| -> Vec<f64> { xs.iter().map(|h| hosts_at(series, h * 3600.0)).collect() };
    let mut main = serde_json::to_value(&c.figure).unwrap_or_default();
    main["samples"] = serde_json::json!([]);
    main["detail"] = serde_json::json!({
        "trace": trace, "sessions": c.sessions, "mean_active": c.mean_active, "costs": c.cost_sources,
        "keep_running": {"host_hours": k.host_hours, "cost_usd": k.cost_usd, "terms": k.terms},
        "suspend_idle": {"host_hours": s.host_hours, "cost_usd": s.cost_usd, "terms": s.terms},
        "plot": {"kind": "xy", "xlabel": "hours", "ylabel": "hosts billed", "x": xs,
                 "series": {"keep-running": at(&k.series), "suspend-idle": at(&s.series)}},
    });
    let waits = serde_json::json!({
        "name": "fleet p99 resume wait, suspend-idle (simulated with measured resume costs)",
        "value": s.p99_resume_wait_ms, "unit": "ms", "bar": "reported", "pass": true, "samples": [],
        "detail": {"p50_ms": s.p50_resume_wait_ms, "max_ms": s.max_resume_wait_ms, "resumes": s.resumes},
    });
    vec![main, waits]
}
