//! `clade-bench scale`'s vm part (`--vm-siblings`): siblings of the `minimal` vm base under whatever accelerator
//! the host gives (TCG here), docs/scale.md.
//!
//! 4. Fork 20 from a warm pool of 20 (members restored, paused; a claim continues the guest). Bar: <= 1 s.
//! 5. N idle vm siblings held at once (default 50), forked 10 at a time with admission on: admission must count
//!    an idle sibling by the vCPUs it keeps busy, not its shape (by shape this 2-core host stops at 16), every
//!    sibling answers an exec; every process's PSS added per sibling, and what admission measured.

use anyhow::Context;
use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use clade_host::Ops;
use serde_json::json;

use super::{emit, exec_all, fork, fork_from_pool, host_pids, kill_all, new_pss_kib};
use crate::{median, percentile, Figure};

/// The vm base of `template`, built when missing.
fn vm_mark(home: &CladeHome, ops: &Ops, template: &str) -> anyhow::Result<String> {
    if let Ok(m) = ops.engine.resolve_mark(template, Some(BackendKind::Vm)) {
        return Ok(m.id.as_str().to_string());
    }
    clade_host::base::build(home, template, BackendKind::Vm, false, &|l| eprintln!("{l}"))
        .with_context(|| format!("building the vm base of {template}"))?;
    Ok(ops.engine.resolve_mark(template, Some(BackendKind::Vm))?.id.as_str().to_string())
}

pub(super) fn vm_figures(
    home: &CladeHome,
    ops: &Ops,
    template: &str,
    n: u32,
    rounds: usize,
    figs: &mut Vec<Figure>,
) -> anyhow::Result<()> {
    let mark = vm_mark(home, ops, template)?;
    let accel = clade_vm::backend::VmBackend::open(home, ops.engine.store.clone(), None)?.accel().as_str().to_string();

    // 4: fork 20 from a pool of 20.
    let mut pooled = Vec::new();
    for _ in 0..rounds {
        pooled.push(fork_from_pool(home, ops, &mark, 20)?);
        kill_all(ops)?;
    }
    let fp = median(&pooled);
    emit(
        figs,
        Figure {
            name: "vm_fork_20_from_pool_ms".into(),
            value: fp,
            unit: "ms".into(),
            bar: format!("<= 1000 ms (20 `{template}` vm siblings claimed from a warm pool of 20, {accel})"),
            pass: fp <= 1000.0,
            samples: pooled,
            detail: json!({"mark": mark, "accel": accel}),
        },
    );

    // 5: n idle siblings, admission on.
    let before = host_pids();
    let mut ids = Vec::new();
    let mut batches = Vec::new();
    while ids.len() < n as usize {
        let count = (n as usize - ids.len()).min(10) as u32;
        let (ms, _, got) =
            fork(ops, &mark, count).with_context(|| format!("forking vm siblings after {} of {n}", ids.len()))?;
        batches.push(ms);
        ids.extend(got);
        eprintln!("bench scale: {} idle vm siblings ({ms:.0} ms for the last {count})", ids.len());
    }
    // Let the guests settle (their first idle ticks), then measure as admission does.
    std::thread::sleep(std::time::Duration::from_secs(5));
    let pss = new_pss_kib(&before);
    let measured = clade_host::admit::running(&ops.engine)?;
    let busy: f64 = measured.iter().map(|r| r.vcpus).sum();
    let tasks: u64 = measured.iter().map(|r| r.tasks).sum();
    let cap = clade_host::admit::capacity(&ops.engine);
    let policy = clade_host::admit::policy();
    // One at a time: under TCG a guest's answer is what is timed, not the host's queue.
    let (lat, failed) = exec_all(ops, &ids, 1);
    let kill_ms = kill_all(ops)?;
    emit(
        figs,
        Figure {
            name: "vm_idle_siblings_held".into(),
            value: lat.len() as f64,
            unit: "siblings".into(),
            bar: format!("{n} idle vm siblings admitted and held at once, all answer `exec true` ({accel})"),
            pass: lat.len() == n as usize,
            samples: batches.clone(),
            detail: json!({
                "pss_per_sibling_mib": pss as f64 / 1024.0 / f64::from(n.max(1)),
                "host_pss_gib": pss as f64 / (1024.0 * 1024.0),
                "admission_busy_vcpus_total": busy,
                "admission_vcpu_limit": f64::from(cap.vcpus) * policy.vcpu_overcommit,
                "admission_tasks_total": tasks,
                "exec_p50_ms": median(&lat), "exec_p99_ms": percentile(&lat, 0.99),
                "fork_batches_ms": batches, "kill_all_ms": kill_ms, "failed": failed.iter().take(5).collect::<Vec<_>>(),
            }),
        },
    );
    Ok(())
}
