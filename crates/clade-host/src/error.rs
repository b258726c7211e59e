//! Errors at the product layer: operations return `anyhow::Error`s whose chain holds a kinded cause
//! ([`clade_core::OpError`], or an engine, ledger or backend error), so every face reads one [`ErrorKind`] from
//! them ([`kind`]) and says it in its own terms (exit codes in the CLI, HTTP statuses in `clade-api`).

use clade_core::{ErrorKind, OpError};

/// The kind of a failure: the first cause in its chain that knows its kind (`Internal` when none does).
pub fn kind(e: &anyhow::Error) -> ErrorKind {
    clade_core::error::kind_in(e.chain())
}

pub fn not_found(msg: impl Into<String>) -> anyhow::Error {
    OpError::not_found(msg).into()
}

pub fn conflict(msg: impl Into<String>) -> anyhow::Error {
    OpError::conflict(msg).into()
}

pub fn invalid(msg: impl Into<String>) -> anyhow::Error {
    OpError::invalid(msg).into()
}

/// A failure of the given kind.
pub fn kinded(kind: ErrorKind, msg: impl Into<String>) -> anyhow::Error {
    OpError::new(kind, msg).into()
}

/// A sandbox id names a directory under `$CLADE_HOME/run`: letters, digits, `.`, `_`, `-`, not starting with
/// a dot, at most 128 bytes, so no id can reach outside it.
pub fn check_id(id: &str) -> anyhow::Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!("sandbox id {id:?}: use letters, digits, '.', '_' and '-' (not leading '.')")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_could_leave_the_run_dir_are_invalid() {
        for bad in ["", ".", "..", ".hidden", "a/b", "../x", "a b", "x\0y", &"a".repeat(129)] {
            let e = check_id(bad).unwrap_err();
            assert_eq!(kind(&e), ErrorKind::Invalid, "{bad:?}");
        }
        for good in ["a", "sb-1", "A.b_c-9", &"a".repeat(128)] {
            check_id(good).unwrap();
        }
    }

    #[test]
    fn context_keeps_the_kind() {
        use anyhow::Context;
        let e = Err::<(), _>(not_found("no sandbox x")).context("kill x").unwrap_err();
        assert_eq!(kind(&e), ErrorKind::NotFound);
        assert_eq!(kind(&anyhow::anyhow!("plain")), ErrorKind::Internal);
        let ledger = anyhow::Error::from(clade_ledger::LedgerError::Invalid("bad".into()));
        assert_eq!(kind(&ledger), ErrorKind::Invalid);
    }
}
