//! Leases across hosts: what a host needs from the blob tier, kept from every host's blob gc until the lease
//! expires (docs/roam.md, "Blob gc with several hosts").
//!
//! Local leases are flocks and die with their process; a host sharing a blob tier is another machine, so its
//! leases are records in the tier: `leases/<host>.json` holds the roots the host depends on, the packs their
//! frames live in, and when the record expires. The host rewrites it (its heartbeat) before it expires; a
//! host that stopped (crashed, lost its network, was switched off) stops rewriting it, and once it has
//! expired the next blob gc ignores and deletes it, so what only it kept becomes collectable.
//!
//! The record names packs as well as roots because a host leases roots that are not in the blob tier yet (a
//! push in flight uploads packs before the roots that name them): another host's gc cannot read such a root,
//! but it keeps the packs named.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::PackId;
use crate::lease::Root;
use crate::{Store, StoreError};

/// One host's lease record in the blob tier.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostLease {
    /// The host (its `host-id`).
    pub host: String,
    /// Written at (ms since the epoch).
    pub at_ms: u64,
    /// Not honoured after (ms since the epoch).
    pub expires_ms: u64,
    /// The roots, as `manifest <hex>` / `tree <hex>`.
    pub roots: Vec<String>,
    /// The packs their frames live in (hex ids).
    pub packs: Vec<String>,
}

impl HostLease {
    /// Still honoured at `now_ms`.
    pub fn live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_ms
    }
}

fn key(host: &str) -> Result<String, StoreError> {
    if host.is_empty() || !host.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) {
        return Err(StoreError::Invalid(format!("bad host name {host:?} for a lease")));
    }
    Ok(format!("leases/{host}.json"))
}

fn now_ms() -> u64 {
    crate::blob::now_millis().max(0) as u64
}

impl Store {
    /// Write (or rewrite) `host`'s lease on `roots` in the blob tier, honoured for `ttl`. Every root must be
    /// readable here (it is this host's: local, or in the blob tier).
    pub fn blob_lease(&self, host: &str, roots: &[Root], ttl: Duration) -> Result<HostLease, StoreError> {
        let blob = self.need_blob()?;
        let mut packs = BTreeSet::new();
        let mut lines = Vec::new();
        for r in roots {
            let mans: Vec<std::sync::Arc<crate::Manifest>> = match r {
                Root::Manifest(m) => vec![self.manifest(m)?],
                Root::Tree(t) => self.tree(t)?.manifests().cloned().map(std::sync::Arc::new).collect(),
            };
            packs.extend(self.packs_of(mans.iter().map(|m| &**m))?.iter().map(|p| p.to_hex()));
            lines.push(r.line().trim().to_string());
        }
        let at_ms = now_ms();
        let lease = HostLease {
            host: host.to_string(),
            at_ms,
            expires_ms: at_ms + ttl.as_millis() as u64,
            roots: lines,
            packs: packs.into_iter().collect(),
        };
        let bytes = serde_json::to_vec(&lease).map_err(|e| StoreError::Invalid(format!("encode lease: {e}")))?;
        blob.put(&key(host)?, bytes)?;
        Ok(lease)
    }

    /// Remove `host`'s lease record (absent is fine).
    pub fn blob_unlease(&self, host: &str) -> Result<(), StoreError> {
        self.need_blob()?.delete(&key(host)?)
    }

    /// Every host's lease record in the blob tier, live or expired (records that do not parse are skipped).
    pub fn blob_leases(&self) -> Result<Vec<HostLease>, StoreError> {
        let blob = self.need_blob()?;
        let mut out = Vec::new();
        for k in blob.list("leases")? {
            if let Some(b) = blob.get(&k)? {
                if let Ok(l) = serde_json::from_slice::<HostLease>(&b) {
                    out.push(l);
                }
            }
        }
        Ok(out)
    }

    /// The packs live leases keep, and the expired records (deleted unless `dry_run`).
    pub(crate) fn leased_packs(&self, dry_run: bool) -> Result<(BTreeSet<PackId>, u64, u64), StoreError> {
        let now = now_ms();
        let (mut packs, mut live, mut expired) = (BTreeSet::new(), 0, 0);
        for l in self.blob_leases()? {
            if l.live(now) {
                live += 1;
                packs.extend(l.packs.iter().filter_map(|p| p.parse::<PackId>().ok()));
            } else {
                expired += 1;
                if !dry_run {
                    self.need_blob()?.delete(&key(&l.host)?)?;
                }
            }
        }
        Ok((packs, live, expired))
    }
}
