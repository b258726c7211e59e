//! Who owns a roaming sandbox, and how exactly one host takes it when several try at once (docs/roam.md,
//! "Ownership").
//!
//! The owner record `roam/sandboxes/<id>/owner.json` says `pushed` (any host may take it) or `taken` (that
//! host has it). Taking must be exclusive, and the blob tier gives no compare-and-swap to make it so: S3's
//! `If-None-Match: *` is not implemented by Garage (a store without consensus cannot offer it), nor by moto or
//! a shared directory. What every such store does give is **read-after-write with quorums**: once a put has
//! returned, every later read and listing sees it. On that, taking is a claim and a settle:
//!
//! 1. write a claim of one's own, `roam/sandboxes/<id>/claims/<host>`, holding the time this host started
//!    writing it (`at_ms`). A claim whose put took longer than half the settle time is withdrawn: its time
//!    could be older than claims that listed before it landed.
//! 2. wait the settle time (`CLADE_ROAM_SETTLE_MS`, 1000 by default), then list the claims, then read the owner
//!    record.
//! 3. the owner record says `taken` by another host: withdraw, refused (409, naming the owner). Otherwise the
//!    claim with the lowest `(at_ms, host)` among those younger than [`CLAIM_TTL`] wins; every other claimant
//!    withdraws and is refused, naming the winner.
//! 4. the winner writes the owner record (`taken`, itself), then deletes its claim.
//!
//! Why exactly one wins: two claimants that listed each other's claims pick the same lowest one. A claimant
//! that did not see a rival's claim listed after its own settle time, so the rival's put landed after that:
//! the rival started writing later (its time is higher, clocks agreeing to within a quarter of the settle
//! time) and sees the first claim when it lists, or sees the owner record once the first has won and
//! deleted its claim (the record is written before the claim is deleted, and read after the claims are
//! listed). A claim left by a host that died mid-take stops counting after [`CLAIM_TTL`]; a winner that
//! took longer than half of it withdraws instead of writing the owner record.

use std::time::{Duration, Instant};

use anyhow::Context;
use clade_core::time::now_ms;
use clade_store::Store;
use serde::{Deserialize, Serialize};

use crate::error::conflict;

/// A claim older than this is a dead host's leftover and does not count.
pub const CLAIM_TTL: Duration = Duration::from_secs(30);

/// The owner record of a sandbox in the blob tier.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Owner {
    pub host: String,
    /// `pushed` (any host may pull it) or `taken` (that host has it).
    pub state: String,
    pub at_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Claim {
    host: String,
    at_ms: u64,
}

pub(crate) fn owner_key(sbx: &str) -> String {
    format!("sandboxes/{sbx}/owner.json")
}

fn claims_prefix(sbx: &str) -> String {
    format!("sandboxes/{sbx}/claims")
}

fn claim_key(sbx: &str, host: &str) -> String {
    format!("{}/{host}", claims_prefix(sbx))
}

/// The settle time of a take: `CLADE_ROAM_SETTLE_MS`, else 1 s.
pub fn settle_time() -> Duration {
    let ms = std::env::var("CLADE_ROAM_SETTLE_MS").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(1000);
    Duration::from_millis(ms.clamp(50, 60_000))
}

pub(crate) fn read_owner(store: &Store, sbx: &str) -> anyhow::Result<Option<Owner>> {
    match store.blob_get_meta(&owner_key(sbx))? {
        Some(b) => Ok(Some(serde_json::from_slice(&b).context("the blob tier's owner record does not parse")?)),
        None => Ok(None),
    }
}

pub(crate) fn write_owner(store: &Store, sbx: &str, host: &str, state: &str) -> anyhow::Result<()> {
    let o = Owner { host: host.into(), state: state.into(), at_ms: now_ms() };
    store.blob_put_meta(&owner_key(sbx), serde_json::to_vec(&o)?)?;
    Ok(())
}

/// The refusal when `owner` has the sandbox.
pub(crate) fn taken_by(sbx: &str, owner: &Owner) -> anyhow::Error {
    conflict(format!(
        "sandbox {sbx} was taken by host {} (it may be running there); it must push it again first",
        owner.host
    ))
}

/// Take `sbx` for host `me` (the claim and settle above). Refused (a conflict naming the other host) when
/// another host has it or wins the race; on any error this host's claim is withdrawn.
pub fn take(store: &Store, sbx: &str, me: &str, settle: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let at_ms = now_ms();
    let mine = claim_key(sbx, me);
    store.blob_put_meta(&mine, serde_json::to_vec(&Claim { host: me.into(), at_ms })?)?;
    let r = settle_and_decide(store, sbx, me, started, settle);
    if r.is_err() {
        let _ = store.blob_delete_meta(&mine);
        return r;
    }
    write_owner(store, sbx, me, "taken")?;
    store.blob_delete_meta(&mine)?;
    Ok(())
}

fn settle_and_decide(store: &Store, sbx: &str, me: &str, started: Instant, settle: Duration) -> anyhow::Result<()> {
    let put = started.elapsed();
    if put > settle / 2 {
        return Err(conflict(format!(
            "taking sandbox {sbx}: the blob tier took {} ms to store this host's claim (more than half the settle \
             time, {} ms); nothing was taken, retry (or raise CLADE_ROAM_SETTLE_MS)",
            put.as_millis(),
            settle.as_millis()
        )));
    }
    std::thread::sleep(settle);
    let now = now_ms();
    let mut claims = Vec::new();
    for key in store.blob_list_meta(&claims_prefix(sbx))? {
        let Some(bytes) = store.blob_get_meta(&key)? else { continue };
        let Ok(c) = serde_json::from_slice::<Claim>(&bytes) else { continue };
        if now.saturating_sub(c.at_ms) < CLAIM_TTL.as_millis() as u64 || c.host == me {
            claims.push(c);
        }
    }
    if let Some(o) = read_owner(store, sbx)? {
        if o.state == "taken" && o.host != me {
            return Err(taken_by(sbx, &o));
        }
    }
    let winner = claims.iter().min_by(|a, b| (a.at_ms, &a.host).cmp(&(b.at_ms, &b.host)));
    match winner {
        Some(w) if w.host != me => Err(conflict(format!(
            "sandbox {sbx} is being taken by host {} at the same moment (its claim came first); it is that host's now",
            w.host
        ))),
        // Our own claim not listed: the tier lost a put it acknowledged; do not take on such a tier.
        None => Err(conflict(format!(
            "taking sandbox {sbx}: this host's claim is not listed after it was stored (the blob tier does not give \
             read-after-write); nothing was taken"
        ))),
        Some(_) if started.elapsed() > CLAIM_TTL / 2 => Err(conflict(format!(
            "taking sandbox {sbx} took {} s, too long to be sure no other host took it; nothing was taken, retry",
            started.elapsed().as_secs()
        ))),
        Some(_) => Ok(()),
    }
}
