//! `ct-bench --only jail`: what the jail (crate `clade_ct::jail`) costs, as ratios of jail-on over jail-off
//! p50s taken side by side in one run (arms alternate, the order flipping every round): cold start to
//! agent-ready, mark pause, restore with hygiene to agent-ready, and a fork of 10 (ten restores with hygiene,
//! one after another, to agent-ready each). Bar: each ratio within 1.10 (docs/security.md).

use std::time::Instant;

use clade_core::backend::{MarkOptions, Sandbox};
use clade_core::CladeHome;
use clade_ct::{CtBackend, CtConfig, CtSandbox};
use serde_json::json;

use crate::{figure, ms, pct, Bench, Workload};

const FORK: usize = 10;

fn arm(real: &CladeHome, cfg: &CtConfig, jail: bool, tag: &str) -> Result<Bench, String> {
    let mut cfg = cfg.clone();
    cfg.jail = jail;
    let home = CladeHome::at(real.tmp_dir().join(format!("ct-bench-{}-{tag}", std::process::id())));
    let store = clade_store::Store::open(&home.store_dir(), Default::default()).map_err(|e| e.to_string())?;
    let backend = CtBackend::new(home.clone(), store, cfg).map_err(|e| e.to_string())?;
    Ok(Bench { backend, home, seq: Default::default() })
}

#[derive(Default)]
struct Samples {
    cold: Vec<f64>,
    pause: Vec<f64>,
    restore: Vec<f64>,
    fork: Vec<f64>,
}

/// One round of one arm: cold, mark, one restore, a fork of 10; everything killed after.
fn round(b: &Bench, w: &Workload, s: &mut Samples) -> Result<(), String> {
    let (mut base, cold) = b.cold(w)?;
    let mark = base.mark(&MarkOptions::default()).map_err(|e| e.to_string())?;
    let _ = Box::new(base).kill();
    let (one, total, _, _) = b.restore(w, &mark)?;
    let _ = Box::new(one).kill();
    let t0 = Instant::now();
    let mut sibs: Vec<CtSandbox> = Vec::new();
    for _ in 0..FORK {
        sibs.push(b.restore(w, &mark)?.0);
    }
    let fork = t0.elapsed();
    crate::kill_all(sibs);
    s.cold.push(ms(cold));
    s.pause.push(ms(mark.pause));
    s.restore.push(ms(total));
    s.fork.push(ms(fork));
    Ok(())
}

pub fn run(real: &CladeHome, cfg: &CtConfig, w: &Workload, n: usize) -> Result<(), String> {
    let on = arm(real, cfg, true, "jail")?;
    let off = arm(real, cfg, false, "nojail")?;
    let (mut s_on, mut s_off) = (Samples::default(), Samples::default());
    // One untimed round of each first (caches, the agent layer, page cache).
    round(&on, w, &mut Samples::default())?;
    round(&off, w, &mut Samples::default())?;
    let result = (|| {
        for i in 0..n {
            if i % 2 == 0 {
                round(&on, w, &mut s_on)?;
                round(&off, w, &mut s_off)?;
            } else {
                round(&off, w, &mut s_off)?;
                round(&on, w, &mut s_on)?;
            }
            eprintln!("ct-bench: jail round {}/{n}", i + 1);
        }
        Ok::<(), String>(())
    })();
    for b in [&on, &off] {
        let _ = std::fs::remove_dir_all(b.home.root());
    }
    result?;
    for (what, a, b) in [
        ("cold start to agent-ready", &s_on.cold, &s_off.cold),
        ("mark pause", &s_on.pause, &s_off.pause),
        ("restore with hygiene to agent-ready", &s_on.restore, &s_off.restore),
        ("fork of 10 to agent-ready", &s_on.fork, &s_off.fork),
    ] {
        let (p_on, p_off) = (pct(a, 0.5), pct(b, 0.5));
        let ratio = p_on / p_off;
        figure(
            format!("ct {}: {what}, jail on / off (p50)", w.name),
            ratio,
            "x",
            "<= 1.10",
            ratio <= 1.10,
            a,
            json!({"jail_on_ms_p50": p_on, "jail_off_ms_p50": p_off, "jail_off_samples": b, "rounds": n}),
        );
    }
    Ok(())
}
