//! Sandboxes: which exist, on which branch and backend, in which state, supervised by which process
//! on which host. `dead` is final; a live sandbox (starting, running, suspended) keeps the mark it
//! was loaded from alive.

use rusqlite::{params, Row};

use crate::error::{LedgerError, Result};
use crate::ids::{MarkId, SandboxId};
use crate::ledger::{found, Ledger};
use crate::model::{NewSandbox, Sandbox, SandboxState};

const COLS: &str = "id, backend, branch, origin_mark, state, supervisor_pid, host, error, \
                    created_ms, last_active_ms";

fn row(r: &Row<'_>) -> rusqlite::Result<Sandbox> {
    Ok(Sandbox {
        id: r.get(0)?,
        backend: r.get(1)?,
        branch: r.get(2)?,
        origin_mark: r.get(3)?,
        state: r.get(4)?,
        supervisor_pid: r.get(5)?,
        host: r.get(6)?,
        error: r.get(7)?,
        created_ms: r.get(8)?,
        last_active_ms: r.get(9)?,
    })
}

fn get(tx: &rusqlite::Connection, id: &SandboxId) -> Result<Sandbox> {
    found(tx.query_row(&format!("SELECT {COLS} FROM sandboxes WHERE id = ?1"), [id], row), "sandbox", id)
}

impl Ledger {
    /// Records a new sandbox in state `starting` on a live branch.
    pub fn create_sandbox(&self, new: &NewSandbox) -> Result<Sandbox> {
        let now = self.now_ms();
        let id = new.id.clone().unwrap_or_else(SandboxId::generate);
        self.write(|tx| {
            let deleted: Option<i64> = found(
                tx.query_row("SELECT deleted_ms FROM branches WHERE id = ?1", [&new.branch], |r| r.get(0)),
                "branch",
                &new.branch,
            )?;
            if deleted.is_some() {
                return Err(LedgerError::Invalid(format!(
                    "branch {} was deleted; fork a new branch for the sandbox",
                    new.branch
                )));
            }
            if let Some(m) = &new.origin_mark {
                found(tx.query_row("SELECT 1 FROM marks WHERE id = ?1", [m], |_| Ok(())), "mark", m)?;
            }
            let n = tx.execute(
                "INSERT OR IGNORE INTO sandboxes (id, backend, branch, origin_mark, state, \
                 supervisor_pid, host, error, created_ms, last_active_ms) \
                 VALUES (?1, ?2, ?3, ?4, 'starting', ?5, ?6, NULL, ?7, ?7)",
                params![id, new.backend, new.branch, new.origin_mark, new.supervisor_pid, new.host, now],
            )?;
            if n == 0 {
                return Err(LedgerError::Conflict(format!(
                    "sandbox {id} already exists; pick another id or let the ledger generate one"
                )));
            }
            get(tx, &id)
        })
    }

    pub fn sandbox(&self, id: &SandboxId) -> Result<Sandbox> {
        get(&*self.conn_ref()?, id)
    }

    /// Every sandbox, or those in `state`, oldest first.
    pub fn sandboxes(&self, state: Option<SandboxState>) -> Result<Vec<Sandbox>> {
        let conn = self.conn_ref()?;
        let mut st = conn.prepare(&format!(
            "SELECT {COLS} FROM sandboxes WHERE ?1 IS NULL OR state = ?1 ORDER BY created_ms, rowid"
        ))?;
        let rows = st.query_map([state], row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Moves a sandbox to `state` (recording `error`, or clearing it when `None`) and touches
    /// `last_active`. Leaving `dead` is refused.
    pub fn set_sandbox_state(&self, id: &SandboxId, state: SandboxState, error: Option<&str>) -> Result<Sandbox> {
        let now = self.now_ms();
        self.write(|tx| {
            let cur = get(tx, id)?;
            if cur.state == SandboxState::Dead && state != SandboxState::Dead {
                return Err(LedgerError::Invalid(format!(
                    "sandbox {id} is dead and cannot become {state}; start a new sandbox from its branch"
                )));
            }
            if state.is_live() && !cur.state.is_live() {
                let deleted: Option<i64> =
                    tx.query_row("SELECT deleted_ms FROM branches WHERE id = ?1", [&cur.branch], |r| r.get(0))?;
                if deleted.is_some() {
                    return Err(LedgerError::Invalid(format!(
                        "sandbox {id} is on deleted branch {}; start a new sandbox on a live branch",
                        cur.branch
                    )));
                }
            }
            tx.execute(
                "UPDATE sandboxes SET state = ?2, error = ?3, last_active_ms = ?4 WHERE id = ?1",
                params![id, state, error, now],
            )?;
            get(tx, id)
        })
    }

    /// Records which process supervises the sandbox, and where.
    pub fn set_supervisor(&self, id: &SandboxId, pid: Option<u32>, host: Option<&str>) -> Result<()> {
        self.write(|tx| {
            let n = tx
                .execute("UPDATE sandboxes SET supervisor_pid = ?2, host = ?3 WHERE id = ?1", params![id, pid, host])?;
            if n == 0 {
                return Err(LedgerError::not_found("sandbox", id));
            }
            Ok(())
        })
    }

    /// Records the mark the sandbox now runs from (after a restore or retake).
    pub fn set_sandbox_origin(&self, id: &SandboxId, mark: Option<&MarkId>) -> Result<()> {
        let now = self.now_ms();
        self.write(|tx| {
            let n = tx.execute(
                "UPDATE sandboxes SET origin_mark = ?2, last_active_ms = ?3 WHERE id = ?1",
                params![id, mark, now],
            )?;
            if n == 0 {
                return Err(LedgerError::not_found("sandbox", id));
            }
            Ok(())
        })
    }

    /// Stamps `last_active` with now (the idle-suspend policy reads it).
    pub fn touch_sandbox(&self, id: &SandboxId) -> Result<()> {
        let now = self.now_ms();
        self.write(|tx| {
            let n = tx.execute("UPDATE sandboxes SET last_active_ms = ?2 WHERE id = ?1", params![id, now])?;
            if n == 0 {
                return Err(LedgerError::not_found("sandbox", id));
            }
            Ok(())
        })
    }

    /// Forgets a sandbox that is `dead` or `failed`.
    pub fn remove_sandbox(&self, id: &SandboxId) -> Result<()> {
        self.write(|tx| {
            let cur = get(tx, id)?;
            if cur.state.is_live() {
                return Err(LedgerError::Invalid(format!(
                    "sandbox {id} is {}; stop it before removing it from the ledger",
                    cur.state
                )));
            }
            tx.execute("DELETE FROM sandboxes WHERE id = ?1", [id])?;
            Ok(())
        })
    }
}
