//! `clade demo` (and `./x demo`): clade's main job on the embedded defaults, told step by step with live output.
//! Per backend: build the `minimal` template and its base (cached after the first run), cold start versus restore
//! (both timed), exec, write a file, mark, fork 5 siblings and show each is a distinct machine yet shares memory,
//! retake one to the mark, suspend one and resume it, and the store's dedup. Ends with a table of the timings.
//! Every step goes through the same code as the CLI commands (supervisors, the engine, the backends).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_core::backend::BackendKind;
use clade_core::{hygiene, CladeHome};

use clade_host::api::{ExecRequest, ForkRequest, MarkRequest, SandboxApi};
use clade_host::Ops;

#[derive(clap::Args, Default)]
pub struct Args {
    /// Which backends to show (default: vm then ct).
    #[arg(long)]
    pub backend: Option<BackendKind>,
    /// The template spec to use (default: templates/minimal of this repository).
    #[arg(long)]
    pub template: Option<PathBuf>,
    /// Also print the timings as JSON.
    #[arg(long)]
    pub json: bool,
}

struct Timings(Vec<(String, String, f64)>);

impl Timings {
    fn add(&mut self, backend: BackendKind, what: &str, ms: f64) {
        self.0.push((backend.as_str().to_string(), what.to_string(), ms));
    }
}

fn step(n: &mut u32, text: &str) {
    *n += 1;
    println!("\n[{n}] {text}");
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn default_template() -> anyhow::Result<PathBuf> {
    clade_host::base::shipped_template("minimal")
        .and_then(|spec| spec.parent().map(PathBuf::from))
        .ok_or_else(|| anyhow!("cannot find templates/minimal: run from the repository or pass --template DIR"))
}

/// Run a shell script in a sandbox; its stdout, or an error with its stderr.
fn sh(ops: &Ops, sbx: &str, script: &str) -> anyhow::Result<String> {
    let req = ExecRequest { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() };
    let out = ops.exec(sbx, req)?;
    if out.code != 0 {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(anyhow!("`{script}` in {sbx} exited {}: {}", out.code, err.trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A python process started before the mark holds RNG state that every sibling inherits; the on-restore hook
/// (run by the agent during hygiene) makes it reseed through its signal handler.
const RNG_DAEMON: &str = r#"mkdir -p /etc/clade/on-restore.d /run/demo
cat > /run/demo/rng.py <<'PY'
import os, random, signal, time
def reseed(*_): random.seed(os.urandom(16))
def report(*_):
    with open('/run/demo/rand.tmp', 'w') as f: f.write(repr(random.random()))
    os.rename('/run/demo/rand.tmp', '/run/demo/rand')
signal.signal(signal.SIGUSR2, reseed)
signal.signal(signal.SIGUSR1, report)
with open('/run/demo/rng.pid', 'w') as f: f.write(str(os.getpid()))
while True: time.sleep(3600)
PY
nohup python3 /run/demo/rng.py >/dev/null 2>&1 &
printf '#!/bin/sh\nkill -USR2 $(cat /run/demo/rng.pid)\n' > /etc/clade/on-restore.d/50-reseed-python
chmod +x /etc/clade/on-restore.d/50-reseed-python
i=0; while [ $i -lt 300 ]; do [ -f /run/demo/rng.pid ] && exit 0; sleep 0.1; i=$((i+1)); done; exit 1"#;

const IDENTITY: &str = r#"rm -f /run/demo/rand; kill -USR1 $(cat /run/demo/rng.pid); i=0; while [ $i -lt 200 ]; do [ -f /run/demo/rand ] && break; sleep 0.05; i=$((i+1)); done
echo "$(hostname) $(cat /etc/machine-id | cut -c1-12) $(od -An -N4 -tx4 /dev/urandom | tr -d ' ') $(cat /run/demo/rand)""#;

pub fn run(args: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let template = match args.template {
        Some(t) => t,
        None => default_template()?,
    };
    let backends = match args.backend {
        Some(b) => vec![b],
        None => vec![BackendKind::Vm, BackendKind::Ct],
    };
    println!("clade demo: CLADE_HOME={}, template {}", home.root().display(), template.display());
    let mut t = Timings(Vec::new());
    let mut failures = Vec::new();
    for b in backends {
        println!("\n===================== backend {} =====================", b.as_str());
        if let Err(e) = demo_backend(&home, &template, b, &mut t) {
            println!("\nbackend {}: the demo stopped: {e:#}", b.as_str());
            failures.push(b);
        }
    }
    println!("\n===================== timings =====================");
    println!("{:<4} {:<48} {:>10}", "", "step", "ms");
    for (b, what, v) in &t.0 {
        println!("{b:<4} {what:<48} {v:>10.1}");
    }
    if args.json {
        let rows: Vec<_> = t.0.iter().map(|(b, w, v)| serde_json::json!({"backend": b, "step": w, "ms": v})).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    println!("\nThe benchmark report (./x bench) is bench/out/report.html; figures per mechanism are in docs/.");
    Ok(if failures.is_empty() { 0 } else { 1 })
}

/// Ends every sandbox the demo started, also when a step fails half-way.
struct Cleanup<'a> {
    ops: &'a Ops,
    ids: Vec<String>,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        for id in &self.ids {
            let _ = self.ops.kill(id);
        }
    }
}

fn demo_backend(home: &CladeHome, template: &std::path::Path, b: BackendKind, t: &mut Timings) -> anyhow::Result<()> {
    let mut n = 0;
    let ops = Ops::open(home)?;
    let engine = &ops.engine;
    let mut cleanup = Cleanup { ops: &ops, ids: Vec::new() };
    step(&mut n, &format!("template and base: build `minimal` for {} (cached after the first run)", b.as_str()));
    let start = Instant::now();
    let base = clade_host::base::build(home, &template.display().to_string(), b, false, &|l| println!("{l}"))?;
    println!(
        "    base {} ({}, {:.1} s)",
        base.mark,
        if base.cached { "cached" } else { "built now" },
        start.elapsed().as_secs_f64()
    );
    let base_mark = engine.resolve_mark(&base.mark, Some(b))?;
    // Measure a plain restore: members a warm pool of this base may have waiting would answer in milliseconds.
    clade_host::supervisor::pool::drain(home, base_mark.id.as_str());
    let backend = clade_host::backends::open(engine, b)?;

    step(&mut n, "cold start (boot the template's image) versus restore from the base");
    let record = clade_host::base::template_record(home, &template.display().to_string(), b)?;
    let image = clade_host::base::image_of(&record);
    let cold_id = engine.new_sandbox(b, None)?;
    let start = Instant::now();
    let cold = backend.cold_start(&image, &hygiene::new_identity(cold_id.id.as_str(), 0)).context("cold start")?;
    if let Some(r) = clade_host::base::ready_target(&record) {
        cold.agent().wait_ready(r, Duration::from_secs(120)).context("cold sandbox ready")?;
    }
    let cold_ms = ms(start.elapsed());
    cold.kill()?;
    let _ = engine.ledger().set_sandbox_state(&cold_id.id, clade_ledger::SandboxState::Dead, None);
    let start = Instant::now();
    let forked = ops.fork(&ForkRequest::new(base_mark.id.as_str(), None, 1))?;
    let took = start.elapsed();
    let r0 = &forked.sandboxes[0];
    if !r0.ok {
        return Err(anyhow!("restore failed: {}", r0.error.clone().unwrap_or_default()));
    }
    println!("    cold start to ready: {cold_ms:>8.0} ms");
    println!(
        "    restore with hygiene: {:>7.0} ms in the supervisor ({:.0} ms with process start)   {:.1}x faster",
        r0.ready_ms,
        ms(took),
        cold_ms / r0.ready_ms
    );
    t.add(b, "cold start to ready", cold_ms);
    t.add(b, "restore from base, with hygiene", r0.ready_ms);
    let s = r0.sandbox.clone();
    cleanup.ids.push(s.clone());

    step(&mut n, "exec a command, write a file");
    let start = Instant::now();
    let uname = sh(&ops, &s, "uname -sr; python3 --version")?;
    t.add(b, "exec (uname; python3 --version)", ms(start.elapsed()));
    println!("    {}", uname.replace('\n', " | "));
    sh(&ops, &s, "echo 'written before the mark' > /root/note.txt")?;
    sh(&ops, &s, RNG_DAEMON)?;
    println!("    /root/note.txt written; a python process holding RNG state started (it will be cloned)");

    step(&mut n, "mark (the sandbox keeps running)");
    let m = ops.mark(&s, &MarkRequest { label: Some("demo".into()), ..Default::default() })?;
    let mark_id = m.id.to_string();
    let pause = m.pause_ms.unwrap_or(0);
    println!("    mark {mark_id}: pause {pause} ms, {} KiB new in the store", m.stored_bytes >> 10);
    t.add(b, "mark pause", pause as f64);

    step(&mut n, "fork 5 siblings from the mark: distinct machines, shared memory");
    let start = Instant::now();
    let sibs = ops.fork(&ForkRequest::new(mark_id.as_str(), None, 5))?.sandboxes;
    let took = start.elapsed();
    cleanup.ids.extend(sibs.iter().map(|r| r.sandbox.clone()));
    if let Some(bad) = sibs.iter().find(|r| !r.ok) {
        return Err(anyhow!("fork failed: {}", bad.error.clone().unwrap_or_default()));
    }
    t.add(b, "fork 5 siblings (all ready)", ms(took));
    println!("    5 siblings ready in {:.0} ms", ms(took));
    println!("    {:<38} {:<20} {:<14} {:<10} python random.random()", "sandbox", "hostname", "machine-id", "urandom");
    let mut seen = std::collections::BTreeSet::new();
    let (mut pss, mut rss) = (0u64, 0u64);
    for r in &sibs {
        let line = sh(&ops, &r.sandbox, IDENTITY)?;
        let f: Vec<&str> = line.split_whitespace().collect();
        println!(
            "    {:<38} {:<20} {:<14} {:<10} {}",
            r.sandbox,
            f.first().unwrap_or(&""),
            f.get(1).unwrap_or(&""),
            f.get(2).unwrap_or(&""),
            f.get(3).unwrap_or(&"")
        );
        for (i, v) in f.iter().enumerate() {
            seen.insert((i, v.to_string()));
        }
        let live = ops.get(&r.sandbox)?.live.unwrap_or_default();
        pss += live.pss;
        rss += live.rss;
    }
    let distinct = (0..4).all(|i| seen.iter().filter(|(j, _)| *j == i).count() == sibs.len());
    println!("    every column differs between siblings: {}", if distinct { "yes" } else { "NO" });
    println!(
        "    host memory of the 5: PSS {} MiB of RSS {} MiB (PSS/RSS {:.2}: clean pages are shared)",
        pss >> 20,
        rss >> 20,
        pss as f64 / rss.max(1) as f64
    );
    if !distinct {
        return Err(anyhow!("siblings are not distinct machines"));
    }

    step(&mut n, "retake a sibling to the mark: its own change disappears");
    let sib = sibs[0].sandbox.clone();
    sh(&ops, &sib, "echo 'changed after the fork' > /root/note.txt")?;
    println!("    before: {}", sh(&ops, &sib, "cat /root/note.txt")?);
    let r = ops.retake(&sib, &mark_id)?;
    println!("    after retake ({:.0} ms): {}", r.retake_ms, sh(&ops, &sib, "cat /root/note.txt")?);
    t.add(b, "retake to the mark", r.retake_ms);

    step(&mut n, "suspend a sibling (mark, release CPU and memory) and resume it");
    let sib2 = sibs[1].sandbox.clone();
    sh(&ops, &sib2, "echo 'state across suspend' > /root/suspended.txt")?;
    let start = Instant::now();
    ops.suspend(&sib2)?;
    let suspend_ms = ms(start.elapsed());
    let start = Instant::now();
    let resumed = ops.resume(&sib2)?;
    let resume_ms = ms(start.elapsed());
    if !resumed.ok {
        return Err(anyhow!("resume of {sib2} failed: {}", resumed.error.unwrap_or_default()));
    }
    println!(
        "    suspend {suspend_ms:.0} ms, resume {resume_ms:.0} ms; the file: {}",
        sh(&ops, &sib2, "cat /root/suspended.txt")?
    );
    t.add(b, "suspend", suspend_ms);
    t.add(b, "resume", resume_ms);

    step(&mut n, "the store: what is described versus what is stored");
    let st = engine.store.stats()?;
    println!(
        "    {} manifests describe {} MiB ({} MiB non-zero); {} MiB unique, {} MiB on disk after compression ({:.1}x)",
        st.manifests,
        st.logical_bytes >> 20,
        st.data_bytes >> 20,
        st.unique_bytes >> 20,
        st.pack_bytes >> 20,
        st.logical_bytes as f64 / st.pack_bytes.max(1) as f64
    );

    step(&mut n, "clean up: kill every demo sandbox");
    drop(cleanup);
    println!("    done");
    Ok(())
}
