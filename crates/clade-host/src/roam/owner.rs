//! Who owns a roaming sandbox, and how exactly one host takes it when several try at once (docs/roam.md,
//! "Ownership").
//!
//! The owner record `roam/sandboxes/<id>/owner.json` says `pushed` (any host may take it) or `taken` (that
//! host has it). Taking must be exclusive, and the blob tier gives no compare-and-swap to make it so: S3's
//! `If-None-Match: *` is not implemented by Garage (a store without consensus cannot offer it), nor by moto or
//! a shared directory. What every such store does give is **read-after-write with quorums**: once a put or a
//! delete has returned, every read and listing that starts later sees it. On that alone (no clocks, no
//! waiting), taking is an announce-and-look:
//!
//! 1. write a claim of one's own, `roam/sandboxes/<id>/claims/<host>`;
//! 2. list the claims, then read the owner record;
//! 3. the owner record says `taken` by another host: withdraw, refused (409, naming the owner);
//! 4. this host's claim is the only live one: write the owner record (`taken`, itself), then delete the claim;
//! 5. another live claim is listed: withdraw (delete the claim), wait a random 20-400 ms, and start again at 1.
//!    A rival that has won by then is named by its owner record (3); one that still holds a claim after
//!    [`patience`] has it refused with that host named ("retry").
//!
//! Why at most one wins: a host wins only if its listing showed no other claim. Of two hosts A and B, say B's
//! claim was stored last. A's claim was then stored before B's listing started, so B saw it, unless A had
//! already deleted it: A deleted it only after writing the owner record, which B reads after listing, so B is
//! refused. Either way B does not win. Rivals that see each other both withdraw and retry after random waits,
//! so one of them soon looks alone. A claim left by a host that died mid-take stops counting after
//! [`CLAIM_TTL`] (the one use of a clock: hosts' clocks must agree to within half of it), and a host whose take
//! ran longer than half of it withdraws instead of writing the owner record.
//!
//! Until 2026-12-07 the rule was a claim, a settle wait of 1 s and the lowest claim time wins: one round, but
//! every take waited the settle time and relied on clocks agreeing to within a quarter of it.

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

/// How long a take keeps retrying while another host's live claim is listed: `CLADE_ROAM_TAKE_PATIENCE_MS`,
/// else 10 s.
pub fn patience() -> Duration {
    let ms = std::env::var("CLADE_ROAM_TAKE_PATIENCE_MS").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(10_000);
    Duration::from_millis(ms.clamp(100, 60_000))
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

/// Take `sbx` for host `me` (the announce-and-look above). Refused (a conflict naming the other host) when
/// another host has it, wins the race, or still claims it after `patience`; on any error this host's claim is
/// withdrawn.
pub fn take(store: &Store, sbx: &str, me: &str, patience: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let mine = claim_key(sbx, me);
    let mut attempt = 0u32;
    loop {
        let claim = Claim { host: me.into(), at_ms: now_ms() };
        store.blob_put_meta(&mine, serde_json::to_vec(&claim)?)?;
        let rivals = match look(store, sbx, me, started) {
            Ok(r) => r,
            Err(e) => {
                let _ = store.blob_delete_meta(&mine);
                return Err(e);
            }
        };
        if rivals.is_empty() {
            write_owner(store, sbx, me, "taken")?;
            store.blob_delete_meta(&mine)?;
            return Ok(());
        }
        store.blob_delete_meta(&mine)?;
        if started.elapsed() >= patience {
            return Err(conflict(format!(
                "sandbox {sbx} is being taken by host {} at the same moment (its claim stayed for {} ms); nothing was \
                 taken here, retry",
                rivals.join(", "),
                started.elapsed().as_millis()
            )));
        }
        std::thread::sleep(backoff(me, attempt));
        attempt = attempt.saturating_add(1);
        // A rival that won meanwhile is named by its owner record.
        refuse_if_taken(store, sbx, me)?;
    }
}

/// Refused (naming it) when another host than `me` has `sbx`.
fn refuse_if_taken(store: &Store, sbx: &str, me: &str) -> anyhow::Result<()> {
    match read_owner(store, sbx)? {
        Some(o) if o.state == "taken" && o.host != me => Err(taken_by(sbx, &o)),
        _ => Ok(()),
    }
}

/// A random wait before claiming again, 20-400 ms, growing with the attempts (rivals that keep seeing each other
/// fall out of step). The randomness is a hash of the host, the attempt and the clock: it only has to differ
/// between hosts.
fn backoff(me: &str, attempt: u32) -> Duration {
    let seed = format!("{me}/{attempt}/{:?}", std::time::SystemTime::now());
    let h = blake3::hash(seed.as_bytes());
    let r = u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or_default());
    let top = (40u64 << attempt.min(4)).min(400);
    Duration::from_millis(20 + r % top)
}

/// Step 2 of a take: the hosts other than `me` holding a live claim (sorted), after checking that `me`'s own
/// claim is listed and no other host has the sandbox.
fn look(store: &Store, sbx: &str, me: &str, started: Instant) -> anyhow::Result<Vec<String>> {
    let prefix = claims_prefix(sbx);
    let keys = store.blob_list_meta(&prefix)?;
    let mut seen_mine = false;
    let mut rivals = Vec::new();
    for key in keys {
        let host = key.rsplit('/').next().unwrap_or_default();
        if host == me {
            seen_mine = true;
            continue;
        }
        // A claim deleted since the listing is gone: no rival.
        let Some(bytes) = store.blob_get_meta(&key)? else { continue };
        let Ok(c) = serde_json::from_slice::<Claim>(&bytes) else { continue };
        if now_ms().saturating_sub(c.at_ms) < CLAIM_TTL.as_millis() as u64 {
            rivals.push(c.host);
        }
    }
    refuse_if_taken(store, sbx, me)?;
    if !seen_mine {
        // The tier lost a put it acknowledged; do not take on such a tier.
        return Err(conflict(format!(
            "taking sandbox {sbx}: this host's claim is not listed after it was stored (the blob tier does not give \
             read-after-write); nothing was taken"
        )));
    }
    if started.elapsed() > CLAIM_TTL / 2 {
        return Err(conflict(format!(
            "taking sandbox {sbx} took {} s, too long to be sure no other host took it; nothing was taken, retry",
            started.elapsed().as_secs()
        )));
    }
    rivals.sort();
    rivals.dedup();
    Ok(rivals)
}
