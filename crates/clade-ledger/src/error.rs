//! The ledger's errors. Each message says what went wrong and what to do next, because the CLI
//! prints them as they are.

use std::path::PathBuf;

/// Everything a ledger call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The file was written by a newer clade. Nothing was changed; upgrade clade to read it.
    #[error(
        "ledger {path} has schema version {found}, but this clade knows only up to {supported}; \
         nothing was changed: upgrade clade (or point CLADE_HOME at another ledger)"
    )]
    NewerSchema { path: PathBuf, found: i64, supported: i64 },

    /// The file is an SQLite database, but not a clade ledger.
    #[error(
        "{path} is an SQLite database but not a clade ledger ({why}); nothing was changed: \
         move it away or pass another path"
    )]
    NotALedger { path: PathBuf, why: String },

    /// Opening or creating the file failed.
    #[error("cannot open ledger {path}: {source}; check that the directory exists and is writable")]
    Open {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },

    /// A migration step failed; its transaction was rolled back, so the file is still at `from`.
    #[error("migrating ledger {path} from schema {from} to {to} failed: {source}; the file is unchanged at {from}")]
    Migration {
        path: PathBuf,
        from: i64,
        to: i64,
        #[source]
        source: rusqlite::Error,
    },

    /// A row the call names does not exist.
    #[error("{kind} {id} is not in the ledger; check the id (a collection may have let it go)")]
    NotFound { kind: &'static str, id: String },

    /// The call would contradict what is recorded (e.g. a template id reused for another spec).
    #[error("{0}")]
    Conflict(String),

    /// The call's arguments are not acceptable (e.g. a state change out of `dead`).
    #[error("{0}")]
    Invalid(String),

    /// The database was busy past the busy timeout (another process holds a long write).
    #[error("the ledger stayed locked by another process past the busy timeout; retry, or find the stuck writer")]
    Busy(#[source] rusqlite::Error),

    /// A row could not be decoded (a JSON column was edited by hand, an unknown enum value).
    #[error("ledger row {what} is malformed: {why}; the ledger may have been edited by hand")]
    Corrupt { what: String, why: String },

    /// Any other SQLite failure.
    #[error("ledger query failed: {0}")]
    Sqlite(#[source] rusqlite::Error),

    /// Creating the ledger's directory failed.
    #[error("cannot create the ledger directory {path}: {source}; create it or set CLADE_HOME")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The ledger file (or its -wal/-shm) could not be made 0600.
    #[error(
        "cannot make the ledger file {path} private (mode 0600): {source}; it holds every sandbox's record: \
             check its owner, or run clade as the user that owns it"
    )]
    Private {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl From<rusqlite::Error> for LedgerError {
    fn from(e: rusqlite::Error) -> Self {
        match &e {
            rusqlite::Error::FromSqlConversionFailure(col, _, why) => {
                return LedgerError::Corrupt { what: format!("column {col}"), why: why.to_string() }
            }
            rusqlite::Error::IntegralValueOutOfRange(col, v) => {
                return LedgerError::Corrupt { what: format!("column {col}"), why: format!("value {v} out of range") }
            }
            rusqlite::Error::InvalidColumnType(col, name, ty) => {
                return LedgerError::Corrupt {
                    what: format!("column {col} ({name})"),
                    why: format!("unexpected type {ty}"),
                }
            }
            _ => {}
        }
        match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::DatabaseBusy) | Some(rusqlite::ErrorCode::DatabaseLocked) => LedgerError::Busy(e),
            _ => LedgerError::Sqlite(e),
        }
    }
}

impl LedgerError {
    pub(crate) fn not_found(kind: &'static str, id: impl std::fmt::Display) -> Self {
        LedgerError::NotFound { kind, id: id.to_string() }
    }
}

pub type Result<T, E = LedgerError> = std::result::Result<T, E>;
