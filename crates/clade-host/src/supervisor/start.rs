//! Starting sandboxes: a detached supervisor per sandbox, the wait for its ready file, and a fork of N siblings
//! that claims warm-pool members first. The operations in `ops` and the warm pool build on these.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clade_core::engine::{from_ledger, Engine};
use clade_core::CladeHome;
use clade_ledger::{Mark, SandboxId, SandboxState};

use super::protocol::Ready;
use super::{ready_file, sup_dir};
use crate::error::conflict;

/// How long a start or resume may take before the caller gives up (a cold vm start under TCG is seconds).
pub const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// Start a supervisor for `sandbox` restoring `mark`, (forked by the zygote, [`super::spawner`]).
pub fn spawn_supervisor(home: &CladeHome, sandbox: &SandboxId, mark: &Mark, generation: u64) -> anyhow::Result<u32> {
    let dir = sup_dir(home, sandbox.as_str());
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let _ = std::fs::remove_file(ready_file(home, sandbox.as_str()));
    let log = std::fs::File::create(super::log_file(home, sandbox.as_str()))?;
    let generation = generation.to_string();
    super::spawner::spawn(
        home,
        &["--sandbox", sandbox.as_str(), "--mark", mark.id.as_str(), "--generation", &generation],
        log,
    )
}

/// Wait for a starting supervisor's ready file. A supervisor (`pid`) that ends without writing it answers at
/// once as not ok, with its log, and its ledger row (still `starting`) is marked failed, so nothing waits for
/// the whole timeout nor stays `starting` forever.
pub fn wait_ready(engine: &Engine, sandbox: &SandboxId, pid: Option<u32>, timeout: Duration) -> anyhow::Result<Ready> {
    let home = &engine.home;
    let path = ready_file(home, sandbox.as_str());
    let start = Instant::now();
    let read = || std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Ready>(&b).ok());
    loop {
        if let Some(r) = read() {
            return Ok(r);
        }
        if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
            if let Some(r) = read() {
                return Ok(r);
            }
            let log = std::fs::read_to_string(super::log_file(home, sandbox.as_str())).unwrap_or_default();
            let error = format!("its supervisor ended before the sandbox was ready: {}", log.trim());
            let l = engine.ledger();
            if l.sandbox(sandbox).is_ok_and(|r| r.state == SandboxState::Starting) {
                let _ = l.set_sandbox_state(sandbox, SandboxState::Failed, Some(&error));
            }
            return Ok(serde_json::from_value(serde_json::json!({"ok": false, "sandbox": sandbox, "error": error}))?);
        }
        if start.elapsed() > timeout {
            let log = std::fs::read_to_string(super::log_file(home, sandbox.as_str())).unwrap_or_default();
            return Err(anyhow!("sandbox {sandbox} not ready after {timeout:?}; supervisor log: {}", log.trim()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Fork `count` siblings of a mark: claim warm-pool members first (all at once), start supervisors for the
/// rest, wait for all, then refill the pool in the background. Every sibling's ledger record is written in one
/// transaction (docs/scale.md).
pub fn fork_mark(engine: &Engine, mark: &Mark, count: u32) -> anyhow::Result<(Vec<Ready>, Duration)> {
    use super::pool;
    let home = &engine.home;
    let start = Instant::now();
    let mut claimed = Vec::new();
    while claimed.len() < count as usize {
        match pool::take(home, mark.id.as_str()) {
            Some(m) => claimed.push(m),
            None => break,
        }
    }
    let ids: Vec<Option<SandboxId>> =
        claimed.iter().map(|(id, _)| Some(id.clone())).chain((claimed.len()..count as usize).map(|_| None)).collect();
    let records = engine.new_sandboxes(from_ledger(mark.backend), Some(mark), &ids).map_err(|e| {
        // The mark was collected between resolving it and recording the sandboxes.
        match engine.ledger().collecting(mark.id.as_str()) {
            Ok(Some(_)) => conflict(format!("mark {} is being collected (`clade gc`)", mark.id)),
            _ => anyhow::Error::from(e),
        }
    })?;
    let mut cold = Vec::new();
    for rec in records.iter().skip(claimed.len()) {
        let pid = spawn_supervisor(home, &rec.id, mark, 1)?;
        cold.push((rec.id.clone(), pid));
    }
    let any_claimed = !claimed.is_empty();
    let mut out = Vec::new();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let handles: Vec<_> =
            claimed.into_iter().map(|(id, conn)| scope.spawn(move || pool::claim(&id, conn))).collect();
        for h in handles {
            out.push(h.join().map_err(|_| anyhow!("a claim thread panicked"))??);
        }
        Ok(())
    })?;
    for (id, pid) in &cold {
        out.push(wait_ready(engine, id, Some(*pid), READY_TIMEOUT)?);
    }
    let took = start.elapsed();
    if any_claimed {
        let _ = pool::refill(home, mark.id.as_str());
    }
    Ok((out, took))
}
