//! Branches and their marks. A branch is a line of marks; forking at a mark starts a new branch
//! whose parent is that mark. Recording a mark makes it the branch's head; a retake moves the head
//! back. Marks are immutable except for their pin.

use std::collections::BTreeMap;

use rusqlite::{params, OptionalExtension, Row};

use crate::error::{LedgerError, Result};
use crate::ids::{BranchId, ManifestId, MarkId};
use crate::ledger::{found, Ledger};
use crate::model::{Branch, Mark, NewBranch, NewMark, RetentionPolicy};

const BRANCH_COLS: &str = "id, name, parent_mark, head_mark, retain, thin, created_ms, deleted_ms";
const MARK_COLS: &str = "id, branch, label, parent, backend, logical_bytes, stored_bytes, pause_ms, \
                         timings, created_ms, pinned, clean";

fn branch_row(r: &Row<'_>) -> rusqlite::Result<Branch> {
    Ok(Branch {
        id: r.get(0)?,
        name: r.get(1)?,
        parent_mark: r.get(2)?,
        head_mark: r.get(3)?,
        policy: RetentionPolicy { retain: r.get(4)?, thin: r.get(5)? },
        created_ms: r.get(6)?,
        deleted_ms: r.get(7)?,
    })
}

fn mark_row(r: &Row<'_>) -> rusqlite::Result<Mark> {
    Ok(Mark {
        id: r.get(0)?,
        branch: r.get(1)?,
        label: r.get(2)?,
        parent: r.get(3)?,
        backend: r.get(4)?,
        manifests: BTreeMap::new(),
        logical_bytes: r.get(5)?,
        stored_bytes: r.get(6)?,
        pause_ms: r.get(7)?,
        timings: r.get(8)?,
        created_ms: r.get(9)?,
        pinned: r.get(10)?,
        clean: r.get(11)?,
    })
}

pub(crate) fn get_branch(tx: &rusqlite::Connection, id: &BranchId) -> Result<Branch> {
    found(tx.query_row(&format!("SELECT {BRANCH_COLS} FROM branches WHERE id = ?1"), [id], branch_row), "branch", id)
}

pub(crate) fn manifests_of(tx: &rusqlite::Connection, mark: &MarkId) -> Result<BTreeMap<String, ManifestId>> {
    let mut st = tx.prepare_cached("SELECT role, manifest FROM mark_manifests WHERE mark = ?1 ORDER BY role")?;
    let rows = st.query_map([mark], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

fn get_mark(tx: &rusqlite::Connection, id: &MarkId) -> Result<Mark> {
    let mut m =
        found(tx.query_row(&format!("SELECT {MARK_COLS} FROM marks WHERE id = ?1"), [id], mark_row), "mark", id)?;
    m.manifests = manifests_of(tx, id)?;
    Ok(m)
}

fn live_branch(tx: &rusqlite::Connection, id: &BranchId) -> Result<Branch> {
    let b = get_branch(tx, id)?;
    if b.deleted_ms.is_some() {
        return Err(LedgerError::Invalid(format!(
            "branch {id} was deleted; fork a new branch from one of its kept marks"
        )));
    }
    Ok(b)
}

fn check_policy(p: &RetentionPolicy) -> Result<()> {
    if p.thin && p.retain.is_none() {
        return Err(LedgerError::Invalid(
            "thinning needs `retain`: set how many newest marks to keep before thinning starts".into(),
        ));
    }
    Ok(())
}

impl Ledger {
    /// Creates a branch, forked at `parent_mark` if given (which becomes its first head).
    pub fn create_branch(&self, new: &NewBranch) -> Result<Branch> {
        check_policy(&new.policy)?;
        let now = self.now_ms();
        let id = new.id.clone().unwrap_or_else(BranchId::generate);
        self.write(|tx| {
            if let Some(m) = &new.parent_mark {
                found(tx.query_row("SELECT 1 FROM marks WHERE id = ?1", [m], |_| Ok(())), "mark", m)?;
            }
            if let Some(name) = &new.name {
                let taken: Option<BranchId> =
                    tx.query_row("SELECT id FROM branches WHERE name = ?1", [name], |r| r.get(0)).optional()?;
                if let Some(other) = taken {
                    return Err(LedgerError::Conflict(format!(
                        "branch name {name:?} is taken by {other}; pick another name"
                    )));
                }
            }
            let n = tx.execute(
                "INSERT OR IGNORE INTO branches (id, name, parent_mark, head_mark, retain, thin, \
                 created_ms, deleted_ms) VALUES (?1, ?2, ?3, ?3, ?4, ?5, ?6, NULL)",
                params![id, new.name, new.parent_mark, new.policy.retain, new.policy.thin, now],
            )?;
            if n == 0 {
                return Err(LedgerError::Conflict(format!("branch {id} already exists")));
            }
            get_branch(tx, &id)
        })
    }

    pub fn branch(&self, id: &BranchId) -> Result<Branch> {
        get_branch(&*self.conn_ref()?, id)
    }

    pub fn branch_by_name(&self, name: &str) -> Result<Option<Branch>> {
        Ok(self
            .conn_ref()?
            .query_row(&format!("SELECT {BRANCH_COLS} FROM branches WHERE name = ?1"), [name], branch_row)
            .optional()?)
    }

    /// Branches not deleted, oldest first.
    pub fn branches(&self) -> Result<Vec<Branch>> {
        let conn = self.conn_ref()?;
        let mut st = conn.prepare(&format!(
            "SELECT {BRANCH_COLS} FROM branches WHERE deleted_ms IS NULL ORDER BY created_ms, rowid"
        ))?;
        let rows = st.query_map([], branch_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn set_policy(&self, branch: &BranchId, policy: RetentionPolicy) -> Result<Branch> {
        check_policy(&policy)?;
        self.write(|tx| {
            live_branch(tx, branch)?;
            tx.execute(
                "UPDATE branches SET retain = ?2, thin = ?3 WHERE id = ?1",
                params![branch, policy.retain, policy.thin],
            )?;
            get_branch(tx, branch)
        })
    }

    /// Deletes a branch: it disappears from `branches()` and its own marks go at the next
    /// collection, except those still needed elsewhere (a fork point of a live branch, a base, a
    /// lease, a live sandbox's origin). Refused while a live sandbox is on it.
    pub fn delete_branch(&self, branch: &BranchId) -> Result<()> {
        let now = self.now_ms();
        self.write(|tx| {
            live_branch(tx, branch)?;
            let live: Option<String> = tx
                .query_row(
                    "SELECT id FROM sandboxes WHERE branch = ?1 \
                     AND state IN ('starting', 'running', 'suspended') LIMIT 1",
                    [branch],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(sb) = live {
                return Err(LedgerError::Invalid(format!(
                    "sandbox {sb} still lives on branch {branch}; stop it before deleting the branch"
                )));
            }
            tx.execute("UPDATE branches SET deleted_ms = ?2, name = NULL WHERE id = ?1", params![branch, now])?;
            Ok(())
        })
    }

    /// Records a mark and makes it the branch's head, in one transaction.
    pub fn add_mark(&self, new: &NewMark) -> Result<Mark> {
        let now = self.now_ms();
        let id = new.id.clone().unwrap_or_else(MarkId::generate);
        if !new.timings.is_object() {
            return Err(LedgerError::Invalid(format!(
                "mark timings must be a JSON object of name -> value, got {}",
                new.timings
            )));
        }
        self.write(|tx| {
            let b = live_branch(tx, &new.branch)?;
            let parent = new.parent.clone().or(b.head_mark);
            if let Some(p) = &parent {
                found(tx.query_row("SELECT 1 FROM marks WHERE id = ?1", [p], |_| Ok(())), "mark", p)?;
            }
            let n = tx.execute(
                "INSERT OR IGNORE INTO marks (id, branch, label, parent, backend, logical_bytes, \
                 stored_bytes, pause_ms, timings, created_ms, pinned, clean) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                params![
                    id,
                    new.branch,
                    new.label,
                    parent,
                    new.backend,
                    new.logical_bytes,
                    new.stored_bytes,
                    new.pause_ms,
                    new.timings,
                    now,
                    new.pinned,
                    new.clean
                ],
            )?;
            if n == 0 {
                return Err(LedgerError::Conflict(format!(
                    "mark {id} already exists; marks are immutable, record a new one"
                )));
            }
            let mut st = tx.prepare_cached("INSERT INTO mark_manifests (mark, role, manifest) VALUES (?1, ?2, ?3)")?;
            for (role, manifest) in &new.manifests {
                st.execute(params![id, role, manifest])?;
            }
            tx.execute("UPDATE branches SET head_mark = ?2 WHERE id = ?1", params![new.branch, id])?;
            get_mark(tx, &id)
        })
    }

    pub fn mark(&self, id: &MarkId) -> Result<Mark> {
        self.read(|tx| get_mark(tx, id))
    }

    /// The newest mark of `branch` labelled `label`.
    pub fn mark_by_label(&self, branch: &BranchId, label: &str) -> Result<Option<Mark>> {
        self.read(|tx| {
            let id: Option<MarkId> = tx
                .query_row(
                    "SELECT id FROM marks WHERE branch = ?1 AND label = ?2 \
                     ORDER BY created_ms DESC, rowid DESC LIMIT 1",
                    params![branch, label],
                    |r| r.get(0),
                )
                .optional()?;
            id.map(|id| get_mark(tx, &id)).transpose()
        })
    }

    /// The branch's own marks, oldest first (the fork mark belongs to the parent branch).
    pub fn marks(&self, branch: &BranchId) -> Result<Vec<Mark>> {
        self.read(|tx| {
            get_branch(tx, branch)?;
            let mut st =
                tx.prepare(&format!("SELECT {MARK_COLS} FROM marks WHERE branch = ?1 ORDER BY created_ms, rowid"))?;
            let mut marks = st.query_map([branch], mark_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
            for m in &mut marks {
                m.manifests = manifests_of(tx, &m.id)?;
            }
            Ok(marks)
        })
    }

    /// The mark a restore of the branch takes, if it has one yet.
    pub fn head(&self, branch: &BranchId) -> Result<Option<Mark>> {
        self.read(|tx| {
            let b = get_branch(tx, branch)?;
            b.head_mark.map(|m| get_mark(tx, &m)).transpose()
        })
    }

    /// Moves the branch's head (a retake): to one of its own marks or to its fork mark.
    pub fn set_head(&self, branch: &BranchId, mark: &MarkId) -> Result<Branch> {
        self.write(|tx| {
            let b = live_branch(tx, branch)?;
            let on: BranchId =
                found(tx.query_row("SELECT branch FROM marks WHERE id = ?1", [mark], |r| r.get(0)), "mark", mark)?;
            if &on != branch && b.parent_mark.as_ref() != Some(mark) {
                return Err(LedgerError::Invalid(format!(
                    "mark {mark} is on branch {on}, not {branch}; fork a branch at it instead"
                )));
            }
            tx.execute("UPDATE branches SET head_mark = ?2 WHERE id = ?1", params![branch, mark])?;
            get_branch(tx, branch)
        })
    }

    /// Pins or unpins a mark (`keep`): the newest 20 pins of a branch are never thinned.
    pub fn pin(&self, mark: &MarkId, pinned: bool) -> Result<()> {
        self.write(|tx| {
            let n = tx.execute("UPDATE marks SET pinned = ?2 WHERE id = ?1", params![mark, pinned])?;
            if n == 0 {
                return Err(LedgerError::not_found("mark", mark));
            }
            Ok(())
        })
    }
}
