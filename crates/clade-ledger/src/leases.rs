//! Leases and GC roots. A lease holds a mark (a restore in progress, a sandbox loaded from it) or a
//! single store object (a manifest being written that no mark names yet) until it is released or
//! expires. [`Ledger::live_manifests`] is the store's GC root set: every manifest any mark or
//! unexpired lease names (a base names a mark, so its manifests are among the marks').

use std::collections::BTreeSet;

use rusqlite::{params, Row};

use crate::clock::UnixMillis;
use crate::error::{LedgerError, Result};
use crate::ids::{LeaseId, ManifestId, MarkId};
use crate::ledger::{found, Ledger};
use crate::model::{Lease, LeaseTarget};

const COLS: &str = "id, holder, mark, manifest, created_ms, expires_ms";

fn row(r: &Row<'_>) -> rusqlite::Result<Lease> {
    let mark: Option<MarkId> = r.get(2)?;
    let manifest: Option<ManifestId> = r.get(3)?;
    let target = match (mark, manifest) {
        (Some(m), None) => LeaseTarget::Mark(m),
        (None, Some(m)) => LeaseTarget::Manifest(m),
        _ => {
            return Err(rusqlite::Error::FromSqlConversionFailure(
                2,
                rusqlite::types::Type::Null,
                "a lease must hold exactly one of a mark or a manifest".into(),
            ))
        }
    };
    Ok(Lease { id: r.get(0)?, holder: r.get(1)?, target, created_ms: r.get(4)?, expires_ms: r.get(5)? })
}

impl Ledger {
    /// Takes a lease on `target` for `holder`, for `ttl_ms` from now (`None`: until released).
    pub fn add_lease(&self, holder: &str, target: &LeaseTarget, ttl_ms: Option<u64>) -> Result<Lease> {
        let now = self.now_ms();
        let id = LeaseId::generate();
        let expires = ttl_ms.map(|t| now.saturating_add(i64::try_from(t).unwrap_or(i64::MAX)));
        let (mark, manifest) = match target {
            LeaseTarget::Mark(m) => (Some(m), None),
            LeaseTarget::Manifest(m) => (None, Some(m)),
        };
        self.write(|tx| {
            if let Some(m) = mark {
                found(tx.query_row("SELECT 1 FROM marks WHERE id = ?1", [m], |_| Ok(())), "mark", m)?;
            }
            tx.execute(
                "INSERT INTO leases (id, holder, mark, manifest, created_ms, expires_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![id, holder, mark, manifest, now, expires],
            )?;
            Ok(Lease {
                id: id.clone(),
                holder: holder.to_owned(),
                target: target.clone(),
                created_ms: now,
                expires_ms: expires,
            })
        })
    }

    /// Extends a lease to `ttl_ms` from now (`None`: until released).
    pub fn renew_lease(&self, id: &LeaseId, ttl_ms: Option<u64>) -> Result<Lease> {
        let now = self.now_ms();
        let expires = ttl_ms.map(|t| now.saturating_add(i64::try_from(t).unwrap_or(i64::MAX)));
        self.write(|tx| {
            let n = tx.execute("UPDATE leases SET expires_ms = ?2 WHERE id = ?1", params![id, expires])?;
            if n == 0 {
                return Err(LedgerError::not_found("lease", id));
            }
            found(tx.query_row(&format!("SELECT {COLS} FROM leases WHERE id = ?1"), [id], row), "lease", id)
        })
    }

    /// Releases a lease. Returns whether it was still there (an expired-and-collected lease is not).
    pub fn release_lease(&self, id: &LeaseId) -> Result<bool> {
        self.write(|tx| Ok(tx.execute("DELETE FROM leases WHERE id = ?1", [id])? > 0))
    }

    /// Deletes leases whose expiry has passed; returns how many.
    pub fn expire_leases(&self) -> Result<usize> {
        let now = self.now_ms();
        self.write(|tx| expire(tx, now))
    }

    /// Every lease, expired or not, oldest first.
    pub fn leases(&self) -> Result<Vec<Lease>> {
        let conn = self.conn_ref()?;
        let mut st = conn.prepare(&format!("SELECT {COLS} FROM leases ORDER BY created_ms, rowid"))?;
        let rows = st.query_map([], row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The store's GC roots: every manifest named by any mark (bases' marks included) or by an
    /// unexpired lease, as of one snapshot of the ledger.
    pub fn live_manifests(&self) -> Result<BTreeSet<ManifestId>> {
        let now = self.now_ms();
        self.read(|tx| {
            let mut st = tx.prepare(
                "SELECT manifest FROM mark_manifests \
                 UNION SELECT manifest FROM leases \
                   WHERE manifest IS NOT NULL AND (expires_ms IS NULL OR expires_ms > ?1)",
            )?;
            let rows = st.query_map([now], |r| r.get(0))?;
            Ok(rows.collect::<rusqlite::Result<_>>()?)
        })
    }
}

pub(crate) fn expire(tx: &rusqlite::Connection, now: UnixMillis) -> Result<usize> {
    Ok(tx.execute("DELETE FROM leases WHERE expires_ms IS NOT NULL AND expires_ms <= ?1", [now])?)
}
