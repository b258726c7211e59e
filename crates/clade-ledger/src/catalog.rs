//! Templates and their bases: what a sandbox is made from. A template's id is the caller's hash of
//! everything that shapes it, so recording one twice is a no-op and recording another spec under
//! the same id is a conflict. A base is the one mark per (template, backend) that new sandboxes
//! start from; it is a GC root and retention never lets it go.

use rusqlite::{params, OptionalExtension, Row};

use crate::error::{LedgerError, Result};
use crate::ids::{MarkId, TemplateId};
use crate::ledger::{found, Ledger};
use crate::model::{Backend, Base, Template};

fn template_row(r: &Row<'_>) -> rusqlite::Result<Template> {
    Ok(Template { id: r.get(0)?, name: r.get(1)?, spec: r.get(2)?, created_ms: r.get(3)? })
}

fn base_row(r: &Row<'_>) -> rusqlite::Result<Base> {
    Ok(Base { template: r.get(0)?, backend: r.get(1)?, mark: r.get(2)?, created_ms: r.get(3)? })
}

const TEMPLATE_COLS: &str = "id, name, spec, created_ms";
const BASE_COLS: &str = "template, backend, mark, created_ms";

impl Ledger {
    /// Records a template (idempotent). Returns the stored row: the existing one if the id was
    /// already known with the same spec; `Conflict` if it was known with another spec.
    pub fn put_template(&self, id: &TemplateId, name: &str, spec: &serde_json::Value) -> Result<Template> {
        let now = self.now_ms();
        self.write(|tx| {
            let existing = tx
                .query_row(&format!("SELECT {TEMPLATE_COLS} FROM templates WHERE id = ?1"), [id], template_row)
                .optional()?;
            if let Some(t) = existing {
                if &t.spec != spec {
                    return Err(LedgerError::Conflict(format!(
                        "template {id} is already recorded with another spec; a template id must be \
                         the hash of everything that shapes it, so recompute it"
                    )));
                }
                return Ok(t);
            }
            tx.execute(
                "INSERT INTO templates (id, name, spec, created_ms) VALUES (?1, ?2, ?3, ?4)",
                params![id, name, spec, now],
            )?;
            Ok(Template { id: id.clone(), name: name.to_owned(), spec: spec.clone(), created_ms: now })
        })
    }

    pub fn template(&self, id: &TemplateId) -> Result<Template> {
        found(
            self.conn_ref()?.query_row(
                &format!("SELECT {TEMPLATE_COLS} FROM templates WHERE id = ?1"),
                [id],
                template_row,
            ),
            "template",
            id,
        )
    }

    /// The newest template recorded under `name`.
    pub fn template_by_name(&self, name: &str) -> Result<Option<Template>> {
        Ok(self
            .conn_ref()?
            .query_row(
                &format!(
                    "SELECT {TEMPLATE_COLS} FROM templates WHERE name = ?1 \
                     ORDER BY created_ms DESC, rowid DESC LIMIT 1"
                ),
                [name],
                template_row,
            )
            .optional()?)
    }

    pub fn templates(&self) -> Result<Vec<Template>> {
        let conn = self.conn_ref()?;
        let mut st = conn.prepare(&format!("SELECT {TEMPLATE_COLS} FROM templates ORDER BY created_ms, rowid"))?;
        let rows = st.query_map([], template_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Makes `mark` the base of (`template`, `backend`), replacing any earlier one (which is then
    /// an ordinary mark again, let go by its branch's retention). Returns the replaced mark.
    pub fn put_base(&self, template: &TemplateId, backend: Backend, mark: &MarkId) -> Result<Option<MarkId>> {
        let now = self.now_ms();
        self.write(|tx| {
            found(tx.query_row("SELECT 1 FROM templates WHERE id = ?1", [template], |_| Ok(())), "template", template)?;
            let mark_backend: Backend =
                found(tx.query_row("SELECT backend FROM marks WHERE id = ?1", [mark], |r| r.get(0)), "mark", mark)?;
            if mark_backend != backend {
                return Err(LedgerError::Invalid(format!(
                    "mark {mark} was taken on the {mark_backend} backend and cannot be the {backend} base"
                )));
            }
            let old: Option<MarkId> = tx
                .query_row(
                    "SELECT mark FROM bases WHERE template = ?1 AND backend = ?2",
                    params![template, backend],
                    |r| r.get(0),
                )
                .optional()?;
            tx.execute(
                "INSERT INTO bases (template, backend, mark, created_ms) VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT (template, backend) DO UPDATE SET mark = excluded.mark, \
                 created_ms = excluded.created_ms",
                params![template, backend, mark, now],
            )?;
            Ok(old.filter(|m| m != mark))
        })
    }

    /// The base new sandboxes of `template` on `backend` start from, if it was built.
    pub fn base_for(&self, template: &TemplateId, backend: Backend) -> Result<Option<Base>> {
        Ok(self
            .conn_ref()?
            .query_row(
                &format!("SELECT {BASE_COLS} FROM bases WHERE template = ?1 AND backend = ?2"),
                params![template, backend],
                base_row,
            )
            .optional()?)
    }

    pub fn bases(&self) -> Result<Vec<Base>> {
        let conn = self.conn_ref()?;
        let mut st = conn.prepare(&format!("SELECT {BASE_COLS} FROM bases ORDER BY template, backend"))?;
        let rows = st.query_map([], base_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Forgets the base of (`template`, `backend`); its mark stays until retention lets it go.
    /// Returns whether there was one.
    pub fn remove_base(&self, template: &TemplateId, backend: Backend) -> Result<bool> {
        self.write(|tx| {
            Ok(tx.execute("DELETE FROM bases WHERE template = ?1 AND backend = ?2", params![template, backend])? > 0)
        })
    }
}
