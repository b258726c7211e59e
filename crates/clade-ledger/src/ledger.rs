//! Opening the ledger and running its transactions.
//!
//! One `Ledger` is one SQLite connection. Two processes (the daemon and a CLI) may each hold one on
//! the same file: the file is in WAL mode (readers never block the writer), every connection waits
//! up to the busy timeout for the write lock, and every write is one short `BEGIN IMMEDIATE`
//! transaction (taking the write lock up front, so a read never has to be upgraded and fail with
//! `SQLITE_BUSY` mid-transaction). `synchronous = FULL`: a collection's deletions must survive a
//! power cut, or the ledger could name manifests the store already deleted.

use std::cell::{Ref, RefCell};
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
    /// None after [`Ledger::close_idle`]: opened again by the next call.
    conn: RefCell<Option<Connection>>,
    path: PathBuf,
    clock: Arc<dyn Clock>,
    busy_timeout: Duration,
    migrations: Vec<schema::Migration>,
    /// Inside [`Ledger::batch`]: calls join its transaction.
    batch_depth: std::cell::Cell<u32>,
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
        let conn = connect(&path, options.busy_timeout, migrations)?;
        Ok(Self {
            conn: RefCell::new(Some(conn)),
            path,
            clock: options.clock,
            busy_timeout: options.busy_timeout,
            migrations: migrations.to_vec(),
            batch_depth: std::cell::Cell::new(0),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Close the connection until the next call needs it (which opens it again, ~1 ms): an idle long-lived
    /// holder (a supervisor, one per sandbox) gives back what SQLite keeps per connection (its lookaside,
    /// page cache, schema, statements: ~70 KiB each; docs/scale.md). Closing through SQLite is safe beside
    /// other connections of this process on the same file: SQLite defers closing a descriptor while any of its
    /// connections holds a lock on that file. Does nothing while a call is using the connection.
    pub fn close_idle(&self) {
        if self.batch_depth.get() > 0 {
            return;
        }
        if let Ok(mut c) = self.conn.try_borrow_mut() {
            c.take();
        }
    }

    /// SQLite's `quick_check` of the file: Ok, or what it found.
    pub fn quick_check(&self) -> Result<()> {
        let found: Vec<String> = {
            let conn = self.conn_ref()?;
            let mut st = conn.prepare("PRAGMA quick_check")?;
            let rows = st.query_map([], |r| r.get::<_, String>(0))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        if found.len() == 1 && found[0] == "ok" {
            Ok(())
        } else {
            Err(LedgerError::Invalid(format!("ledger {} fails its check: {}", self.path.display(), found.join("; "))))
        }
    }

    /// "Now" by the ledger's clock.
    pub fn now_ms(&self) -> UnixMillis {
        self.clock.now_ms()
    }

    /// The file's schema version (equal to [`schema::SCHEMA_VERSION`] once open).
    pub fn schema_version(&self) -> Result<i64> {
        Ok(self.conn_ref()?.query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    /// The connection, for single-statement reads (each is its own consistent snapshot).
    pub(crate) fn conn_ref(&self) -> Result<Ref<'_, Connection>> {
        BUSY_TIMEOUT.with(|t| t.set(self.busy_timeout));
        if self.conn.borrow().is_none() {
            let c = connect(&self.path, self.busy_timeout, &self.migrations)?;
            *self.conn.borrow_mut() = Some(c);
        }
        Ref::filter_map(self.conn.borrow(), Option::as_ref)
            .map_err(|_| LedgerError::Invalid("the ledger connection was closed while in use".into()))
    }

    /// Runs `f` in one `BEGIN IMMEDIATE` transaction; commits if it returns `Ok`. Inside [`Ledger::batch`], `f`
    /// runs in the batch's transaction.
    pub(crate) fn write<T>(&self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let conn = self.conn_ref()?;
        if self.batch_depth.get() > 0 {
            return f(&conn);
        }
        let tx = Transaction::new_unchecked(&conn, TransactionBehavior::Immediate)?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Runs `f` in one read transaction, so it sees one consistent snapshot (inside a batch, the batch's).
    pub(crate) fn read<T>(&self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        let conn = self.conn_ref()?;
        if self.batch_depth.get() > 0 {
            return f(&conn);
        }
        let tx = Transaction::new_unchecked(&conn, TransactionBehavior::Deferred)?;
        f(&tx)
    }

    /// Runs several ledger calls as one transaction: all of them are written, or (an error) none. Many
    /// siblings recorded at once pay one commit and one turn at the file's write lock instead of one each
    /// (a fork of 100 made 200 commits before; docs/scale.md).
    pub fn batch<T>(&self, f: impl FnOnce(&Ledger) -> Result<T>) -> Result<T> {
        if self.batch_depth.get() > 0 {
            return f(self);
        }
        {
            let conn = self.conn_ref()?;
            conn.execute_batch("BEGIN IMMEDIATE")?;
        }
        self.batch_depth.set(1);
        let out = f(self);
        self.batch_depth.set(0);
        let conn = self.conn_ref()?;
        match out {
            Ok(v) => match conn.execute_batch("COMMIT") {
                Ok(()) => Ok(v),
                Err(e) => {
                    let _ = conn.execute_batch("ROLLBACK");
                    Err(e.into())
                }
            },
            Err(e) => {
                let _ = conn.execute_batch("ROLLBACK");
                Err(e)
            }
        }
    }
}

thread_local! {
    /// The busy timeout of the ledger this thread is calling into (set before every call), and when the
    /// current wait for the write lock began.
    static BUSY_TIMEOUT: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::from_secs(30)) };
    static BUSY_SINCE: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
}

/// SQLite's busy handler: wait for another connection's write lock in short steps (100 us, then 500 us,
/// then 2 ms) until the ledger's busy timeout. SQLite's own handler sleeps 1, 2, 5, 10 ... 100 ms: with a
/// hundred supervisors writing at once (a fork of 100), waiters slept while the lock stood free and half the
/// host's CPU idled (docs/scale.md). `n` is how many times SQLite has called it for this one wait.
fn wait_while_busy(n: i32) -> bool {
    let now = std::time::Instant::now();
    let since = BUSY_SINCE.with(|s| {
        if n == 0 || s.get().is_none() {
            s.set(Some(now));
        }
        s.get().unwrap_or(now)
    });
    if now.duration_since(since) >= BUSY_TIMEOUT.with(|t| t.get()) {
        BUSY_SINCE.with(|s| s.set(None));
        return false;
    }
    let step = match n {
        0..=19 => Duration::from_micros(100),
        20..=199 => Duration::from_micros(500),
        _ => Duration::from_millis(2),
    };
    std::thread::sleep(step);
    true
}

/// One connection to the ledger file: checked (a newer or foreign file is refused before anything writes to it),
/// in WAL mode, migrated.
fn connect(path: &Path, busy_timeout: Duration, migrations: &[schema::Migration]) -> Result<Connection> {
    let open_err = |source| LedgerError::Open { path: path.to_owned(), source };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(open_err)?;
    BUSY_TIMEOUT.with(|t| t.set(busy_timeout));
    conn.busy_handler(Some(wait_while_busy)).map_err(open_err)?;
    schema::check(&conn, path, migrations.len() as i64)?;
    let mode = wal_mode(&conn, busy_timeout).map_err(open_err)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(LedgerError::Invalid(format!(
            "ledger {} could not be put in WAL mode (got {mode}); put it on a local filesystem",
            path.display()
        )));
    }
    // SQLite gives -wal and -shm its main file's mode; these were made (or were left by an older clade) now.
    private_files(path, true)?;
    conn.execute_batch("PRAGMA foreign_keys = ON; PRAGMA synchronous = FULL;").map_err(open_err)?;
    schema::migrate(&conn, path, migrations)?;
    Ok(conn)
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
