//! Hygiene: what makes every restored sibling a distinct machine, applied through the agent on every restore
//! (both backends; the `vm` backend adds a fresh VM generation id on its own). Why (Firecracker's
//! random-for-clones note says the same): siblings restored from one mark share RNG state, hostname, machine-id and a
//! clock that stopped at the mark, and hold connections whose peers have moved on.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::backend::{BackendError, Identity};

/// What hygiene did on one restore, and how long each step took.
#[derive(Debug, Clone, Serialize)]
pub struct HygieneReport {
    pub hostname_set: bool,
    pub machine_id_set: bool,
    pub entropy_bytes: u32,
    pub crng_reseeded: bool,
    pub on_restore_scripts: usize,
    pub signalled: u32,
    /// Guest wall clock error against the host after stepping, in ns.
    pub clock_error_ns: i64,
    pub clock_steps: u32,
    /// Established TCP connections destroyed (stale after the restore).
    pub connections_reset: u32,
    pub errors: Vec<String>,
    pub took: Duration,
    /// Per step, in ms: identity (hostname, machine-id, entropy, hooks), clock, connections.
    pub identity_ms: f64,
    pub clock_ms: f64,
    pub net_ms: f64,
}

/// The identity of a sandbox: hostname and machine-id follow from its id (so a retake or a resume of the same
/// sandbox keeps them, and siblings, having distinct ids, differ); entropy is fresh every time.
pub fn new_identity(sandbox_id: &str, generation: u64) -> Identity {
    let mut entropy = vec![0u8; 64];
    getrandom(&mut entropy);
    let digest = blake3::hash(sandbox_id.as_bytes());
    let tail: String = sandbox_id.rsplit('-').next().unwrap_or(sandbox_id).chars().take(12).collect();
    Identity {
        sandbox_id: sandbox_id.to_string(),
        hostname: format!("clade-{tail}"),
        machine_id: digest.to_hex()[..32].to_string(),
        entropy,
        generation,
        continues: false,
    }
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    // /dev/urandom never blocks after boot and needs no unsafe; a failure here leaves zeros, which the agent
    // still mixes in but does not credit as real entropy.
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = f.read_exact(buf);
    }
}

/// Apply hygiene through a connected agent. `clean == false` (a mark declared not clean, e.g. a logged-in
/// browser) keeps what the programs hold: hostname, machine-id, connections, and runs no on-restore hook and
/// signals no registered process (the browser's hook would clear the session the mark was taken to keep).
/// The kernel's random pool is still reseeded and the clock still stepped: neither is state a user keeps,
/// and a sandbox whose clock stopped at the mark is wrong, not kept. A ct sandbox (on the host's kernel) has
/// neither of its own: both are left to the host.
pub fn apply(
    agent: &clade_agent::client::AgentClient,
    id: &Identity,
    clean: bool,
) -> Result<HygieneReport, BackendError> {
    let start = Instant::now();
    let fail = |what: &str, e: clade_agent::client::ClientError| BackendError::Failed(format!("hygiene: {what}: {e}"));
    // A ct sandbox runs on the host's kernel: its random pool is the host's (CRIU copies no kernel state), and
    // the jail lets it credit no entropy; its clock is the host's too (the agent's client only probes it).
    let shared_kernel = agent.shared_kernel().map_err(|e| fail("hello", e))?;
    let ident = clade_agent::proto::Identity {
        hostname: clean.then(|| id.hostname.clone()),
        machine_id: clean.then(|| id.machine_id.clone()),
        entropy: if shared_kernel { Vec::new() } else { id.entropy.clone() },
        generation: Some(id.generation),
        run_on_restore: clean,
        signal_registered: clean,
        continues: id.continues,
    };
    let r = agent.set_identity(ident).map_err(|e| fail("identity", e))?;
    let identity_ms = start.elapsed().as_secs_f64() * 1e3;
    let clock = agent.sync_clock(0).map_err(|e| fail("clock", e))?;
    let clock_ms = start.elapsed().as_secs_f64() * 1e3 - identity_ms;
    let mut errors = r.errors;
    // A sandbox whose kernel cannot destroy sockets still runs: the failure is reported, not fatal.
    let connections_reset = if clean {
        agent.net_reset(None, &[]).unwrap_or_else(|e| {
            errors.push(format!("net reset: {e}"));
            0
        })
    } else {
        0
    };
    Ok(HygieneReport {
        hostname_set: r.hostname_set,
        machine_id_set: r.machine_id_set,
        entropy_bytes: r.entropy_added,
        crng_reseeded: r.crng_reseeded,
        on_restore_scripts: r.scripts.len(),
        signalled: r.signalled,
        clock_error_ns: clock.error_ns,
        clock_steps: clock.steps,
        connections_reset,
        errors,
        took: start.elapsed(),
        identity_ms,
        clock_ms,
        net_ms: start.elapsed().as_secs_f64() * 1e3 - identity_ms - clock_ms,
    })
}

/// Before a mark: runs the sandbox's `/etc/clade/pre-mark.d` hooks through its agent (with `CLADE_MARK_CLEAN`),
/// so that programs can prepare what their restores' hygiene will use (the browser template opens the window
/// its hygiene loads the page in). Never fails the mark: what went wrong comes back as lines to report, and
/// an agent from before this request (in an older mark) just has no hooks run.
pub fn pre_mark(agent: &clade_agent::client::AgentClient, clean: bool) -> Vec<String> {
    match agent.pre_mark(clean) {
        Ok(r) => r.errors,
        Err(clade_agent::ClientError::Agent(clade_agent::AgentError::UnknownOp { .. })) => Vec::new(),
        Err(e) => vec![format!("pre-mark hooks: {e}")],
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn identities_differ() {
        let a = super::new_identity("abc", 1);
        let b = super::new_identity("abd", 1);
        assert_ne!(a.machine_id, b.machine_id);
        assert_ne!(a.entropy, b.entropy);
        assert_eq!(a.machine_id.len(), 32);
        assert!(a.machine_id.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a.hostname, b.hostname);
    }
}
