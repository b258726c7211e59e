//! The operations log: every operation (boot, mark, restore, fork, suspend, retake, gc, ...) with
//! when it started, how long it took, whether it worked and its phase timings, so figures such as
//! pause and restore times can be read back from real runs instead of re-measured.

use rusqlite::{params, Row};

use crate::clock::UnixMillis;
use crate::error::{LedgerError, Result};
use crate::ids::{OpId, SandboxId};
use crate::ledger::Ledger;
use crate::model::{NewOp, OpRecord};

const COLS: &str = "id, op, sandbox, mark, started_ms, duration_ms, ok, error, details";

fn row(r: &Row<'_>) -> rusqlite::Result<OpRecord> {
    Ok(OpRecord {
        id: OpId(r.get(0)?),
        op: r.get(1)?,
        sandbox: r.get(2)?,
        mark: r.get(3)?,
        started_ms: r.get(4)?,
        duration_ms: r.get(5)?,
        ok: r.get(6)?,
        error: r.get(7)?,
        details: r.get(8)?,
    })
}

/// Which log entries to read.
#[derive(Debug, Clone, Default)]
pub struct OpQuery {
    pub op: Option<String>,
    pub sandbox: Option<SandboxId>,
    /// Only entries that started at or after this time.
    pub since_ms: Option<UnixMillis>,
    /// At most this many, newest first (`None`: 1000).
    pub limit: Option<u32>,
}

impl Ledger {
    /// Appends one operation to the log.
    pub fn record_op(&self, op: &NewOp) -> Result<OpId> {
        if !op.details.is_object() {
            return Err(LedgerError::Invalid(format!("operation details must be a JSON object, got {}", op.details)));
        }
        let now = self.now_ms();
        let duration = i64::try_from(op.duration_ms).unwrap_or(i64::MAX);
        let started = op.started_ms.unwrap_or_else(|| now.saturating_sub(duration));
        self.write(|tx| {
            tx.execute(
                "INSERT INTO ops (op, sandbox, mark, started_ms, duration_ms, ok, error, details) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![op.op, op.sandbox, op.mark, started, duration, op.error.is_none(), op.error, op.details],
            )?;
            Ok(OpId(tx.last_insert_rowid()))
        })
    }

    /// Log entries matching `q`, newest first.
    pub fn ops(&self, q: &OpQuery) -> Result<Vec<OpRecord>> {
        let conn = self.conn_ref()?;
        let mut st = conn.prepare(&format!(
            "SELECT {COLS} FROM ops WHERE (?1 IS NULL OR op = ?1) AND (?2 IS NULL OR sandbox = ?2) \
             AND (?3 IS NULL OR started_ms >= ?3) ORDER BY started_ms DESC, id DESC LIMIT ?4"
        ))?;
        let rows = st.query_map(params![q.op, q.sandbox, q.since_ms, q.limit.unwrap_or(1000)], row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Deletes log entries that started before `before_ms`; returns how many.
    pub fn prune_ops(&self, before_ms: UnixMillis) -> Result<usize> {
        self.write(|tx| Ok(tx.execute("DELETE FROM ops WHERE started_ms < ?1", [before_ms])?))
    }
}
