//! One error type for the whole builder. Every message names the thing to fix: the spec line or key, the
//! package, the file, or the command and the tail of its output.

use std::path::PathBuf;

/// Anything that stops a template from being parsed, built, listed or removed.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{}: cannot read the spec: {source}", path.display())]
    ReadSpec { path: PathBuf, source: std::io::Error },

    /// Bad TOML or an unknown/mistyped key; `message` is the TOML parser's, with line, column and key.
    #[error("{}: {message}", path.display())]
    Parse { path: PathBuf, message: String },

    /// A value that parsed but makes no sense (two sources, a relative destination, a bad package name...).
    #[error("{}:{line}: {message}", path.display())]
    Invalid { path: PathBuf, line: usize, message: String },

    /// A file the spec names does not exist.
    #[error("{}:{line}: `{key}` names {}, which does not exist (paths are relative to the spec's directory)", spec.display(), file.display())]
    MissingFile { spec: PathBuf, line: usize, key: String, file: PathBuf },

    /// A package name apt does not know.
    #[error(
        "package `{package}` does not exist in {suite} (check the name with `apt-cache search`, or the suite/mirror)"
    )]
    PackageNotFound { package: String, suite: String },

    /// A tool the builder runs failed.
    #[error("{step}: `{command}` failed ({status}); last output:\n{output}")]
    Command { step: String, command: String, status: String, output: String },

    /// A tool is not installed or the builder lacks a privilege.
    #[error("{0}")]
    Host(String),

    /// A broken source archive or directory (`from = ...`).
    #[error("{}: {message}", path.display())]
    Source { path: PathBuf, message: String },

    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },

    #[error("store: {0}")]
    Store(#[from] clade_store::StoreError),

    #[error("ledger: {0}")]
    Ledger(#[from] clade_ledger::LedgerError),

    #[error("no template named or hashed `{0}` (see `clade template ls`)")]
    NotFound(String),

    /// `template rm` of a template that a base still needs.
    #[error("{0}")]
    InUse(String),

    #[error("`{0}` matches several templates; give more of the hash")]
    Ambiguous(String),

    /// A corrupt record file in the cache.
    #[error("{}: {message}; remove the directory and build again", path.display())]
    Record { path: PathBuf, message: String },
}

pub type Result<T, E = TemplateError> = std::result::Result<T, E>;

/// Attach a path and a verb to an `io::Error`.
pub(crate) trait IoCtx<T> {
    fn ctx(self, what: &'static str, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoCtx<T> for std::io::Result<T> {
    fn ctx(self, what: &'static str, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| TemplateError::Io { what, path: path.into(), source })
    }
}
