//! The store's error type. Each message names the thing at fault and says what to do next.

use std::path::PathBuf;

/// Everything that can go wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An I/O error on a named path.
    #[error("{op} {path}: {source}")]
    Io {
        /// What we were doing.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Text that should be a 64-hex-digit id is not.
    #[error("{text:?} is not a {kind} id (expected 64 hex digits)")]
    BadId {
        /// Which kind of id.
        kind: &'static str,
        /// The text given.
        text: String,
    },
    /// The named thing does not exist in any tier.
    #[error("{kind} {id} is not in the store (local tier{blob}); check the id, or that the blob tier is configured")]
    NotFound {
        /// Which kind of thing.
        kind: &'static str,
        /// Its id.
        id: String,
        /// ", blob tier" when a blob tier was also asked.
        blob: &'static str,
    },
    /// Stored bytes do not hash to their name: the data was corrupted and is never returned.
    #[error("corrupt {kind} {id} in {location}: {detail}; run `clade store fsck` and restore the file from a replica or the blob tier")]
    Corrupt {
        /// Which kind of thing.
        kind: &'static str,
        /// Its id.
        id: String,
        /// Where it was read from (pack file, manifest file, blob key).
        location: String,
        /// What was wrong.
        detail: String,
    },
    /// A manifest or tree names data that the store does not hold.
    #[error("{what} names {kind} {id}, which the store does not hold; the store is damaged: run `clade store fsck`")]
    Missing {
        /// Who names it.
        what: String,
        /// Which kind of thing is missing.
        kind: &'static str,
        /// Its id.
        id: String,
    },
    /// A caller passed an argument the store cannot use.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Another writer or collector holds the store.
    #[error("store {0} is busy: {1}; retry when the other writer or gc has finished")]
    Busy(PathBuf, String),
    /// The blob tier failed (unreachable, refused the credentials, full, ...). Nothing local was changed by
    /// the failed call, so the operation can be retried once the tier answers.
    #[error(
        "blob tier {tier}: {op} {key}: {detail}; check that the endpoint answers and that the bucket and \
         credentials are right (CLADE_BLOB, CLADE_BLOB_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); \
         nothing here was changed, so retry once it answers"
    )]
    Blob {
        /// The tier and its endpoint (`s3://bucket at http://host:port`).
        tier: String,
        /// What we were doing.
        op: &'static str,
        /// The object key.
        key: String,
        /// The underlying error text.
        detail: String,
    },
    /// A file was written by a newer clade.
    #[error("{path}: format version {found} is newer than this clade understands ({known}); upgrade clade")]
    NewerFormat {
        /// The file.
        path: PathBuf,
        /// Version found.
        found: u32,
        /// Newest version known here.
        known: u32,
    },
}

impl StoreError {
    /// An I/O error on `path` while doing `op`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io { op, path: path.into(), source }
    }

    /// True if this error means "not there" (as opposed to damaged or failing).
    pub fn is_not_found(&self) -> bool {
        matches!(self, StoreError::NotFound { .. })
    }
}

/// Attach a path and operation to an `io::Result`.
pub(crate) trait IoCtx<T> {
    fn ctx(self, op: &'static str, path: &std::path::Path) -> Result<T, StoreError>;
}

impl<T> IoCtx<T> for std::io::Result<T> {
    fn ctx(self, op: &'static str, path: &std::path::Path) -> Result<T, StoreError> {
        self.map_err(|e| StoreError::io(op, path, e))
    }
}
