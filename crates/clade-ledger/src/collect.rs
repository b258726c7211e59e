//! A collection run: expire leases, apply each branch's retention, delete the marks let go, purge
//! deleted branches left empty, and report what was kept, what was deleted, which manifests no
//! longer have any reference (for the caller to delete from the store) and the bytes freed (the
//! deleted marks' recorded stored sizes). It is one write transaction, so a concurrent `add_mark`
//! lands wholly before or after it; a dry run does all of it and rolls back, so its report is exactly
//! what a real run would do at that moment.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rusqlite::{params, Connection};
use serde::{Deserialize, Serialize};

use crate::clock::UnixMillis;
use crate::error::Result;
use crate::ids::{BranchId, ManifestId, MarkId};
use crate::leases::expire;
use crate::ledger::Ledger;
use crate::marks::{get_branch, manifests_of};
use crate::model::{Branch, NewOp};
use crate::retention::{plan_branch, BranchInput, KeepReason, MarkFacts};

/// What a collection covers.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CollectOptions {
    /// Compute and report, change nothing.
    pub dry_run: bool,
    /// Only this branch's marks (`None`: every branch).
    pub branch: Option<BranchId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptMark {
    pub mark: MarkId,
    pub branch: BranchId,
    pub reasons: Vec<KeepReason>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletedMark {
    pub mark: MarkId,
    pub branch: BranchId,
    pub label: Option<String>,
    pub created_ms: UnixMillis,
    pub stored_bytes: u64,
    pub manifests: BTreeMap<String, ManifestId>,
}

/// What a collection did (or, dry, would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectReport {
    pub dry_run: bool,
    pub now_ms: UnixMillis,
    pub kept: Vec<KeptMark>,
    pub deleted: Vec<DeletedMark>,
    /// Manifests the deleted marks named that nothing in the ledger names any more: delete them
    /// from the store (its GC finds the same set from [`Ledger::live_manifests`]).
    pub unreferenced_manifests: Vec<ManifestId>,
    /// Sum of the deleted marks' stored sizes.
    pub bytes_freed: u64,
    pub leases_expired: usize,
    /// Deleted branches whose last mark went, now gone from the ledger.
    pub branches_purged: Vec<BranchId>,
}

fn push(map: &mut HashMap<MarkId, Vec<KeepReason>>, id: MarkId, why: KeepReason) {
    map.entry(id).or_default().push(why);
}

/// Marks needed outside their own branch's policy, with why.
fn needed_elsewhere(tx: &Connection) -> Result<HashMap<MarkId, Vec<KeepReason>>> {
    let mut out = HashMap::new();
    let queries: [(&str, KeepReason); 5] = [
        (
            "SELECT parent_mark FROM branches WHERE deleted_ms IS NULL AND parent_mark IS NOT NULL",
            KeepReason::ForkPoint,
        ),
        ("SELECT head_mark FROM branches WHERE deleted_ms IS NULL AND head_mark IS NOT NULL", KeepReason::Head),
        ("SELECT mark FROM bases", KeepReason::Base),
        ("SELECT mark FROM leases WHERE mark IS NOT NULL", KeepReason::Lease),
        (
            "SELECT origin_mark FROM sandboxes WHERE origin_mark IS NOT NULL \
             AND state IN ('starting', 'running', 'suspended')",
            KeepReason::LiveSandbox,
        ),
    ];
    for (sql, why) in queries {
        let mut st = tx.prepare(sql)?;
        let ids = st.query_map([], |r| r.get::<_, MarkId>(0))?;
        for id in ids {
            push(&mut out, id?, why);
        }
    }
    Ok(out)
}

fn facts(tx: &Connection, branch: &BranchId) -> Result<Vec<MarkFacts>> {
    let mut st = tx.prepare_cached("SELECT id, created_ms, pinned, rowid FROM marks WHERE branch = ?1")?;
    let rows = st.query_map([branch], |r| {
        Ok(MarkFacts { id: r.get(0)?, created_ms: r.get(1)?, pinned: r.get(2)?, seq: r.get(3)? })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

fn in_scope(tx: &Connection, only: Option<&BranchId>) -> Result<Vec<Branch>> {
    if let Some(id) = only {
        return Ok(vec![get_branch(tx, id)?]);
    }
    let mut st = tx.prepare("SELECT id FROM branches ORDER BY created_ms, rowid")?;
    let ids = st.query_map([], |r| r.get::<_, BranchId>(0))?.collect::<rusqlite::Result<Vec<_>>>()?;
    ids.iter().map(|id| get_branch(tx, id)).collect()
}

impl Ledger {
    /// When a mark (by id or label) was deleted by a collection whose store sweep has not finished
    /// ([`Ledger::finish_collecting`]): a restore of it must be refused as a conflict, not a miss.
    pub fn collecting(&self, id_or_label: &str) -> Result<Option<UnixMillis>> {
        use rusqlite::OptionalExtension;
        Ok(self
            .conn_ref()?
            .query_row(
                "SELECT since_ms FROM collecting WHERE mark = ?1 OR label = ?1 ORDER BY since_ms DESC LIMIT 1",
                [id_or_label],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Manifests of marks being collected that no mark or lease names any more: what the store must
    /// unpublish to finish the collections so far (including one killed before it did).
    pub fn collecting_manifests(&self) -> Result<Vec<ManifestId>> {
        let conn = self.conn_ref()?;
        let mut st = conn.prepare(
            "SELECT DISTINCT j.value FROM collecting, json_each(collecting.manifests) AS j \
             WHERE NOT EXISTS (SELECT 1 FROM mark_manifests WHERE manifest = j.value) \
             AND NOT EXISTS (SELECT 1 FROM leases WHERE manifest = j.value) ORDER BY 1",
        )?;
        let rows = st.query_map([], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The store has swept what the collections so far let go: forget the marks being collected
    /// (they are unknown from now on). Returns how many were forgotten.
    pub fn finish_collecting(&self) -> Result<usize> {
        self.write(|tx| Ok(tx.execute("DELETE FROM collecting", [])?))
    }

    /// Runs retention over every branch (or one) and deletes what it lets go; see the module docs.
    pub fn collect(&self, opts: &CollectOptions) -> Result<CollectReport> {
        let started = std::time::Instant::now();
        let now = self.now_ms();
        let conn_guard = self.conn_ref()?;
        let tx = rusqlite::Transaction::new_unchecked(&conn_guard, rusqlite::TransactionBehavior::Immediate)?;
        let mut report = CollectReport {
            dry_run: opts.dry_run,
            now_ms: now,
            kept: Vec::new(),
            deleted: Vec::new(),
            unreferenced_manifests: Vec::new(),
            bytes_freed: 0,
            leases_expired: expire(&tx, now)?,
            branches_purged: Vec::new(),
        };
        let elsewhere = needed_elsewhere(&tx)?;
        // A deleted branch's head and fork point hold nothing any more (in or out of scope); clear
        // them so the marks they name can go.
        tx.execute(
            "UPDATE branches SET head_mark = NULL, parent_mark = NULL \
             WHERE deleted_ms IS NOT NULL AND (head_mark IS NOT NULL OR parent_mark IS NOT NULL)",
            [],
        )?;
        let branches = in_scope(&tx, opts.branch.as_ref())?;
        let mut dead_branches = Vec::new();
        for b in &branches {
            let marks = facts(&tx, &b.id)?;
            let live = b.deleted_ms.is_none();
            if !live {
                dead_branches.push(b.id.clone());
            }
            let input = BranchInput { policy: b.policy, live, head: b.head_mark.as_ref(), marks: &marks };
            for v in plan_branch(input, &elsewhere, now) {
                if v.keep() {
                    report.kept.push(KeptMark { mark: v.id, branch: b.id.clone(), reasons: v.reasons });
                    continue;
                }
                let (label, created_ms, stored_bytes) =
                    tx.query_row("SELECT label, created_ms, stored_bytes FROM marks WHERE id = ?1", [&v.id], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                    })?;
                report.deleted.push(DeletedMark {
                    manifests: manifests_of(&tx, &v.id)?,
                    mark: v.id,
                    branch: b.id.clone(),
                    label,
                    created_ms,
                    stored_bytes,
                });
            }
        }
        for d in &report.deleted {
            tx.execute("DELETE FROM marks WHERE id = ?1", [&d.mark])?;
            let manifests: Vec<&ManifestId> = d.manifests.values().collect();
            tx.execute(
                "INSERT OR REPLACE INTO collecting (mark, label, manifests, since_ms) VALUES (?1, ?2, ?3, ?4)",
                params![d.mark, d.label, serde_json::to_string(&manifests).unwrap_or_else(|_| "[]".into()), now],
            )?;
            report.bytes_freed = report.bytes_freed.saturating_add(d.stored_bytes);
        }
        let named: BTreeSet<&ManifestId> = report.deleted.iter().flat_map(|d| d.manifests.values()).collect();
        for m in named {
            let still: bool = tx.query_row(
                "SELECT EXISTS (SELECT 1 FROM mark_manifests WHERE manifest = ?1) \
                 OR EXISTS (SELECT 1 FROM leases WHERE manifest = ?1)",
                [m],
                |r| r.get(0),
            )?;
            if !still {
                report.unreferenced_manifests.push(m.clone());
            }
        }
        for b in dead_branches {
            let empty: bool =
                tx.query_row("SELECT NOT EXISTS (SELECT 1 FROM marks WHERE branch = ?1)", [&b], |r| r.get(0))?;
            if empty {
                tx.execute("DELETE FROM branches WHERE id = ?1", [&b])?;
                report.branches_purged.push(b);
            }
        }
        if opts.dry_run {
            return Ok(report); // dropping `tx` rolls everything back
        }
        let op = NewOp::ok("collect", started.elapsed().as_millis() as u64).details(serde_json::json!({
            "kept": report.kept.len(),
            "deleted": report.deleted.len(),
            "unreferenced_manifests": report.unreferenced_manifests.len(),
            "bytes_freed": report.bytes_freed,
            "leases_expired": report.leases_expired,
            "branches_purged": report.branches_purged.len(),
        }));
        tx.execute(
            "INSERT INTO ops (op, started_ms, duration_ms, ok, details) VALUES (?1, ?2, ?3, 1, ?4)",
            params![op.op, now, op.duration_ms, op.details],
        )?;
        tx.commit()?;
        Ok(report)
    }
}
