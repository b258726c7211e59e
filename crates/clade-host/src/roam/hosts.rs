//! The hosts sharing a blob tier (docs/roam.md, "Hosts and heartbeats"). Each host writes two records there
//! on every heartbeat (`clade serve` beats every `CLADE_HEARTBEAT_S`, 10 s by default; every push and pull
//! beats once):
//!
//! - `roam/hosts/<host>.json`: who it is, when it beat, what it runs and holds suspended;
//! - `leases/<host>.json` (clade_store::HostLease): the roots its sandboxes need (each one's head and origin
//!   mark, with a ct mark's lower layers that are store trees) and the roots of a push in flight, honoured by
//!   every host's blob gc for three heartbeats. A host that stops beating is shown as stopped once three
//!   heartbeats are missed, and its lease expires with them: what only it kept becomes collectable.

use std::time::Duration;

use anyhow::Context;
use clade_core::engine::{from_ledger, Engine};
use clade_core::time::now_ms;
use clade_ledger::{Mark, SandboxState};
use clade_store::{ManifestId, Root, TreeId};
use serde::{Deserialize, Serialize};

use crate::backends::footprint;
use crate::error::invalid;

/// A host's heartbeat record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Beat {
    pub host: String,
    /// The machine's name (`/etc/hostname`), for people.
    pub hostname: String,
    pub at_ms: u64,
    /// The interval it promises to beat at.
    pub every_ms: u64,
    pub version: String,
    /// Sandboxes running there, and suspended there.
    pub running: Vec<String>,
    pub suspended: Vec<String>,
    /// Roots its lease record holds.
    pub leased_roots: usize,
}

/// A host as `clade hosts` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostRow {
    #[serde(flatten)]
    pub beat: Beat,
    /// `live`, or `stopped` once three heartbeats are missed.
    pub state: String,
    /// Seconds since its last heartbeat.
    pub age_s: f64,
    /// Sandboxes of the blob tier whose owner record names it as having taken them.
    pub owns: Vec<String>,
    /// Whether its lease record is still honoured by blob gc.
    pub lease_live: bool,
}

fn beat_key(host: &str) -> String {
    format!("hosts/{host}.json")
}

/// The heartbeat interval: `CLADE_HEARTBEAT_S`, else 10 s.
pub fn beat_every() -> Duration {
    let s = std::env::var("CLADE_HEARTBEAT_S").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(10);
    Duration::from_secs(s.clamp(1, 3600))
}

/// The blob tier's name, or an error saying how to name one.
pub(crate) fn need_blob(engine: &Engine) -> anyhow::Result<String> {
    engine.store.blob_tier().ok_or_else(|| {
        invalid(
            "this home has no blob tier: set CLADE_BLOB=s3://BUCKET (and CLADE_BLOB_ENDPOINT, AWS_ACCESS_KEY_ID, \
             AWS_SECRET_ACCESS_KEY) on every host that shares it (docs/roam.md)",
        )
    })
}

/// Split a mark's roles into store manifests and trees, with the bytes they describe (its backend's layer and
/// word roles are neither: a ct mark's overlay lowers and network mode).
pub(crate) fn roots_of(engine: &Engine, mark: &Mark) -> anyhow::Result<(Vec<ManifestId>, Vec<TreeId>, u64)> {
    let fp = footprint(from_ledger(mark.backend));
    let (mut mans, mut trees, mut bytes) = (Vec::new(), Vec::new(), 0u64);
    for (role, v) in &mark.manifests {
        if fp.layers_role() == Some(role.as_str()) || fp.word_roles().contains(&role.as_str()) {
            continue;
        }
        let s = v.as_str();
        if let Ok(id) = s.parse::<ManifestId>() {
            if let Ok(m) = engine.store.manifest(&id) {
                bytes += m.size;
                mans.push(id);
                continue;
            }
        }
        let t: TreeId = s.parse().map_err(|_| anyhow::anyhow!("mark {} role {role}: {s} is no store id", mark.id))?;
        let tree = engine.store.tree(&t).with_context(|| format!("mark {} role {role}", mark.id))?;
        bytes += tree.manifests().map(|m| m.size).sum::<u64>();
        trees.push(t);
    }
    Ok((mans, trees, bytes))
}

/// Write this host's heartbeat and lease records. `extra`: roots of a push in flight, leased with the rest.
pub fn beat(engine: &Engine, me: &str, extra: &[Root]) -> anyhow::Result<Beat> {
    beat_without(engine, me, extra, None)
}

/// [`beat`] as if this host's ledger no longer held sandbox `gone` (a push's last beat, written while the
/// owner record says `pushed`, before the ledger forgets it).
pub fn beat_without(engine: &Engine, me: &str, extra: &[Root], gone: Option<&str>) -> anyhow::Result<Beat> {
    let every = beat_every();
    // The ledger is read first and let go: reading the marks' trees may take round trips to the blob tier,
    // and a resume that pulled a sandbox runs this while its restore needs the ledger.
    let (mut running, mut suspended, mut marks) = (Vec::new(), Vec::new(), Vec::new());
    {
        let l = engine.ledger();
        for s in l.sandboxes(None)? {
            if gone == Some(s.id.as_str()) {
                continue;
            }
            match s.state {
                SandboxState::Running | SandboxState::Starting => running.push(s.id.as_str().to_string()),
                SandboxState::Suspended => suspended.push(s.id.as_str().to_string()),
                _ => continue,
            }
            marks.extend(l.head(&s.branch)?);
            marks.extend(s.origin_mark.as_ref().and_then(|m| l.mark(m).ok()));
        }
    }
    let mut roots = extra.to_vec();
    for m in &marks {
        // A mark whose roots this store cannot read is not this host's to lease (nothing of it is here).
        if let Ok((mans, trees, _)) = roots_of(engine, m) {
            roots.extend(mans.into_iter().map(Root::Manifest).chain(trees.into_iter().map(Root::Tree)));
        }
        // A ct mark's lower layers that are store trees (read lazily from the blob tier after a pull).
        let fp = footprint(from_ledger(m.backend));
        if let Some(l) = fp.layers_role().and_then(|r| m.manifests.get(r)) {
            roots.extend(l.as_str().split(':').filter_map(|p| fp.layer_tree(p)).map(Root::Tree));
        }
    }
    roots.sort_by_key(|r| format!("{r:?}"));
    roots.dedup();
    let beat = Beat {
        host: me.to_string(),
        hostname: std::fs::read_to_string("/etc/hostname").unwrap_or_default().trim().to_string(),
        at_ms: now_ms(),
        every_ms: every.as_millis() as u64,
        version: env!("CARGO_PKG_VERSION").to_string(),
        running,
        suspended,
        leased_roots: roots.len(),
    };
    // Both records at once: each is a round trip through the store's quorum.
    let record = serde_json::to_vec(&beat)?;
    let (lease, put) = super::at_once(
        || engine.store.blob_lease(me, &roots, every * 3),
        || engine.store.blob_put_meta(&beat_key(me), record),
    )?;
    put?;
    lease?;
    Ok(beat)
}

/// The hosts that beat into this blob tier, with what they own there.
pub fn list(engine: &Engine) -> anyhow::Result<Vec<HostRow>> {
    need_blob(engine)?;
    let now = now_ms();
    let leases = engine.store.blob_leases()?;
    let mut owners: Vec<(String, super::owner::Owner)> = Vec::new();
    for k in engine.store.blob_list_meta("sandboxes")? {
        let Some(sbx) = k.strip_prefix("sandboxes/").and_then(|s| s.strip_suffix("/owner.json")) else { continue };
        if let Some(o) = super::owner::read_owner(&engine.store, sbx)? {
            owners.push((sbx.to_string(), o));
        }
    }
    let mut out = Vec::new();
    for k in engine.store.blob_list_meta("hosts")? {
        let Some(bytes) = engine.store.blob_get_meta(&k)? else { continue };
        let Ok(beat) = serde_json::from_slice::<Beat>(&bytes) else { continue };
        let age = now.saturating_sub(beat.at_ms);
        let state = if age > beat.every_ms * 3 { "stopped" } else { "live" };
        let owns =
            owners.iter().filter(|(_, o)| o.host == beat.host && o.state == "taken").map(|(s, _)| s.clone()).collect();
        let lease_live = leases.iter().any(|l| l.host == beat.host && l.live(now));
        out.push(HostRow { state: state.into(), age_s: age as f64 / 1e3, owns, lease_live, beat });
    }
    out.sort_by(|a, b| a.beat.host.cmp(&b.beat.host));
    Ok(out)
}
