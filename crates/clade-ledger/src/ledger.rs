//! Opening the ledger and running its transactions.
//!
//! One `Ledger` is one SQLite connection. Two processes (the daemon and a CLI) may each hold one on
//! the same file: the file is in WAL mode (readers never block the writer), every connection waits
//! up to the busy timeout for the write lock, and every write is one short `BEGIN IMMEDIATE`
//! transaction (taking the write lock up front, so a read never has to be upgraded and fail with
//! `SQLITE_BUSY` mid-transaction). `synchronous = FULL`: a collection's deletions must survive a
//! power cut, or the ledger could name manifests the store already deleted.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use rusqlite::{Connection, OpenFlags, Transaction, TransactionBehavior};

use crate::clock::{Clock, SystemClock, UnixMillis};
use crate::error::{LedgerError, Result};
use crate::model::{Backend, SandboxState};
use crate::schema;

/// How to open a ledger.
#[derive(Debug, Clone)]
pub struct LedgerOptions {
    /// "Now" for timestamps and retention.
    pub clock: Arc<dyn Clock>,
    /// How long a call waits for another process's write before failing with `Busy`. 30 s by default: with 32
    /// clients forking through the daemon on 2 loaded cores (`./x bench api`), a supervisor starting up waited
    /// more than 5 s for its turn once in ~1100 starts; writes are short, so only a stuck writer waits this long.
    pub busy_timeout: Duration,
}

impl Default for LedgerOptions {
    fn default() -> Self {
        Self { clock: Arc::new(SystemClock), busy_timeout: Duration::from_secs(30) }
    }
}

/// The ledger: one connection to one SQLite file.
#[derive(Debug)]
pub struct Ledger {
    conn: Connection,
    path: PathBuf,
    clock: Arc<dyn Clock>,
}

/// The ledger file is its owner's alone (0600): created so before SQLite opens it (SQLite would make it 0644
/// and its -wal/-shm alike), and tightened when an older clade left it open. With `sidecars`, the -wal and
/// -shm beside it too.
fn private_files(path: &Path, sidecars: bool) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let err = |p: &Path, source| LedgerError::Private { path: p.to_owned(), source };
    // A missing ledger is made empty and 0600. An existing one is never opened here: closing any descriptor of
    // a file drops every POSIX lock this process holds on it, so opening and closing the ledger beside a
    // connection already open in this process (a second `Ledger::open`, as base building does inside the
    // daemon) took that connection's SQLite locks away, and it then read a WAL another process was
    // checkpointing (SQLITE_IOERR_SHORT_READ, "file truncated?").
    if !sidecars && std::fs::symlink_metadata(path).is_err() {
        std::fs::OpenOptions::new().append(true).create(true).mode(0o600).open(path).map_err(|e| err(path, e))?;
    }
    let mut files = vec![path.to_owned()];
    if sidecars {
        for ext in ["-wal", "-shm"] {
            let mut p = path.as_os_str().to_owned();
            p.push(ext);
            files.push(PathBuf::from(p));
        }
    }
    for p in files {
        match std::fs::metadata(&p) {
            Ok(md) if md.permissions().mode() & 0o077 != 0 => {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).map_err(|e| err(&p, e))?
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(&p, e)),
        }
    }
    Ok(())
}

impl Ledger {
    /// Opens (creating and migrating if needed) the ledger at `path`, usually
    /// `clade_core::CladeHome::from_env().ledger_path()`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, LedgerOptions::default())
    }

    /// Like [`Ledger::open`] with a given clock (tests use a `ManualClock`).
    pub fn open_with_clock(path: impl AsRef<Path>, clock: Arc<dyn Clock>) -> Result<Self> {
        Self::open_with(path, LedgerOptions { clock, ..LedgerOptions::default() })
    }

    pub fn open_with(path: impl AsRef<Path>, options: LedgerOptions) -> Result<Self> {
        Self::open_migrating(path.as_ref(), options, schema::MIGRATIONS)
    }

    /// Opens with an explicit migration list (tests of the migration machinery).
    #[doc(hidden)]
    pub fn open_migrating(path: &Path, options: LedgerOptions, migrations: &[schema::Migration]) -> Result<Self> {
        let path = path.to_owned();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| LedgerError::Io { path: dir.to_owned(), source })?;
        }
        private_files(&path, false)?;
        let open_err = |source| LedgerError::Open { path: path.clone(), source };
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&path, flags).map_err(open_err)?;
        conn.busy_timeout(options.busy_timeout).map_err(open_err)?;
        // Read-only checks first: a newer or foreign file is refused before anything writes to it.
        schema::check(&conn, &path, migrations.len() as i64)?;
        let mode = wal_mode(&conn, options.busy_timeout).map_err(open_err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(LedgerError::Invalid(format!(
                "ledger {} could not be put in WAL mode (got {mode}); put it on a local filesystem",
                path.display()
            )));
        }
        // SQLite gives -wal and -shm its main file's mode; these were made (or were left by an older clade) now.
        private_files(&path, true)?;
        conn.execute_batch("PRAGMA foreign_keys = ON; PRAGMA synchronous = FULL;").map_err(open_err)?;
        schema::migrate(&conn, &path, migrations)?;
        Ok(Self { conn, path, clock: options.clock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Give back the memory this connection caches (SQLite's page cache, the prepared statements): a long-lived
    /// idle holder (a supervisor, one per sandbox) keeps only the open connection.
    pub fn shrink(&self) {
        self.conn.flush_prepared_statement_cache();
        let _ = self.conn.execute_batch("PRAGMA shrink_memory");
    }

    /// "Now" by the ledger's clock.
    pub fn now_ms(&self) -> UnixMillis {
        self.clock.now_ms()
    }

    /// The file's schema version (equal to [`schema::SCHEMA_VERSION`] once open).
    pub fn schema_version(&self) -> Result<i64> {
        Ok(self.conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    /// The connection, for single-statement reads (each is its own consistent snapshot).
    pub(crate) fn conn_ref(&self) -> &Connection {
        &self.conn
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction; commits if it returns `Ok`.
    pub(crate) fn write<T>(&self, f: impl FnOnce(&Transaction<'_>) -> Result<T>) -> Result<T> {
        let tx = Transaction::new_unchecked(&self.conn, TransactionBehavior::Immediate)?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Runs `f` in one read transaction, so it sees one consistent snapshot.
    pub(crate) fn read<T>(&self, f: impl FnOnce(&Transaction<'_>) -> Result<T>) -> Result<T> {
        let tx = Transaction::new_unchecked(&self.conn, TransactionBehavior::Deferred)?;
        f(&tx)
    }
}

/// Switches the file to WAL. The switch needs the file to itself for a moment and SQLite reports
/// `SQLITE_BUSY` for it without calling the busy handler when another connection is reading (two
/// processes opening a new ledger at once), so it is retried here until the busy timeout.
fn wal_mode(conn: &Connection, timeout: Duration) -> rusqlite::Result<String> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get::<_, String>(0)) {
            Err(e)
                if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            r => return r,
        }
    }
}

/// Maps a "no rows" result to `NotFound`.
pub(crate) fn found<T>(r: rusqlite::Result<T>, kind: &'static str, id: &dyn std::fmt::Display) -> Result<T> {
    match r {
        Ok(v) => Ok(v),
        Err(rusqlite::Error::QueryReturnedNoRows) => Err(LedgerError::not_found(kind, id)),
        Err(e) => Err(e.into()),
    }
}

fn unknown(what: &str, s: &str) -> FromSqlError {
    FromSqlError::Other(format!("unknown {what} {s:?}").into())
}

impl ToSql for Backend {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.as_str()))
    }
}

impl FromSql for Backend {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
        let s = value.as_str()?;
        Backend::parse(s).ok_or_else(|| unknown("backend", s))
    }
}

impl ToSql for SandboxState {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.as_str()))
    }
}

impl FromSql for SandboxState {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
        let s = value.as_str()?;
        SandboxState::parse(s).ok_or_else(|| unknown("sandbox state", s))
    }
}
