//! One vocabulary for what went wrong, shared by every face of clade: the library's operations, the supervisor
//! protocol, the HTTP API and the CLI. A failure is sorted once, where it happens, into an [`ErrorKind`]; each face
//! then says it in its own terms from that kind alone, in one place each: the CLI's exit codes in the `clade`
//! binary, HTTP statuses (and back, for the remote client) in `clade-api`. So the same refused fork exits 5
//! whether the CLI ran it in-process or through `clade serve`.

use serde::{Deserialize, Serialize};

/// What kind of failure, as a caller would act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request itself is wrong (a bad id, a bad field, a command that cannot start): fix it and retry.
    Invalid,
    /// What the request names does not exist (any more).
    NotFound,
    /// It exists, but its state refuses the request (suspended, being collected, already there).
    Conflict,
    /// The host lacks memory, CPU or pids for it now: retry later, or let clade make room.
    NoCapacity,
    /// The disk is full or would be: a person has to free space.
    NoSpace,
    /// The sandbox (or the host) refused it for want of permission.
    Permission,
    /// It did not finish in the time it was given.
    Timeout,
    /// The service is stopping or not there: nothing was done, send it again.
    Unavailable,
    /// Anything else: a bug, or a failure of the host that the message explains.
    Internal,
}

impl ErrorKind {
    /// The name used on the wire (supervisor protocol, HTTP error bodies).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Invalid => "invalid",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::NoCapacity => "no_capacity",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::Permission => "permission",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Internal => "internal",
        }
    }

    /// The kind named by [`ErrorKind::as_str`], if any.
    pub fn parse(s: &str) -> Option<ErrorKind> {
        ALL.iter().copied().find(|k| k.as_str() == s)
    }

    /// Running short of an admission resource: disk needs a person, memory and CPU may free up.
    pub fn of_resource(r: crate::admission::Resource) -> ErrorKind {
        match r {
            crate::admission::Resource::Disk => ErrorKind::NoSpace,
            _ => ErrorKind::NoCapacity,
        }
    }

    /// The kind of an OS error number from a sandbox's agent (a file or process operation inside it).
    pub fn of_errno(errno: i32) -> ErrorKind {
        use nix::errno::Errno;
        match Errno::from_raw(errno) {
            // In use, or there already: the path's state refuses it (renaming `/`, a mount point).
            Errno::EEXIST | Errno::ENOTEMPTY | Errno::EBUSY => ErrorKind::Conflict,
            Errno::ENOENT => ErrorKind::NotFound,
            // The caller's path cannot name that (a directory into itself, too long, a loop of links).
            Errno::ENOTDIR | Errno::EISDIR | Errno::EINVAL | Errno::ENAMETOOLONG | Errno::ELOOP => ErrorKind::Invalid,
            Errno::EACCES | Errno::EPERM | Errno::EROFS => ErrorKind::Permission,
            Errno::ENOSPC | Errno::EDQUOT => ErrorKind::NoSpace,
            _ => ErrorKind::Internal,
        }
    }
}

/// Every kind, for tables and tests.
pub const ALL: [ErrorKind; 9] = [
    ErrorKind::Invalid,
    ErrorKind::NotFound,
    ErrorKind::Conflict,
    ErrorKind::NoCapacity,
    ErrorKind::NoSpace,
    ErrorKind::Permission,
    ErrorKind::Timeout,
    ErrorKind::Unavailable,
    ErrorKind::Internal,
];

/// An operation's failure with its kind: what library code returns (inside an `anyhow::Error` at the product
/// layers) when it decides the kind itself. The message says what went wrong and what to do next.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct OpError {
    pub kind: ErrorKind,
    pub message: String,
}

impl OpError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        OpError { kind, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        OpError::new(ErrorKind::Invalid, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        OpError::new(ErrorKind::NotFound, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        OpError::new(ErrorKind::Conflict, message)
    }
}

impl From<&clade_ledger::LedgerError> for ErrorKind {
    fn from(e: &clade_ledger::LedgerError) -> ErrorKind {
        use clade_ledger::LedgerError as L;
        match e {
            L::Invalid(_) => ErrorKind::Invalid,
            L::NotFound { .. } => ErrorKind::NotFound,
            L::Conflict(_) => ErrorKind::Conflict,
            L::Busy(_) => ErrorKind::Unavailable,
            _ => ErrorKind::Internal,
        }
    }
}

impl From<&crate::backend::BackendError> for ErrorKind {
    fn from(e: &crate::backend::BackendError) -> ErrorKind {
        use crate::backend::BackendError as B;
        match e {
            // The host lacks something a person must provide (room in /dev/shm, a kernel feature the jail
            // needs, the agent binary): as for a full disk, retrying alone does not help.
            B::Resource { .. } => ErrorKind::NoSpace,
            B::Incompatible { .. } => ErrorKind::Conflict,
            _ => ErrorKind::Internal,
        }
    }
}

impl From<&crate::engine::EngineError> for ErrorKind {
    fn from(e: &crate::engine::EngineError) -> ErrorKind {
        use crate::engine::EngineError as E;
        match e {
            E::NotFound(_) => ErrorKind::NotFound,
            E::Conflict(_) => ErrorKind::Conflict,
            E::Invalid(_) => ErrorKind::Invalid,
            E::Backend(b) => b.into(),
            E::Ledger(l) => l.into(),
            _ => ErrorKind::Internal,
        }
    }
}

/// The kind of a failure, from its chain of causes (outermost first, as `anyhow::Error::chain` gives it): the
/// first cause that knows its kind decides; `Internal` when none does.
pub fn kind_in<'a>(chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>) -> ErrorKind {
    for cause in chain {
        if let Some(e) = cause.downcast_ref::<OpError>() {
            return e.kind;
        }
        if let Some(e) = cause.downcast_ref::<crate::engine::EngineError>() {
            return e.into();
        }
        if let Some(e) = cause.downcast_ref::<clade_ledger::LedgerError>() {
            return e.into();
        }
        if let Some(e) = cause.downcast_ref::<crate::backend::BackendError>() {
            return e.into();
        }
    }
    ErrorKind::Internal
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_serde_agrees() {
        for k in ALL {
            assert_eq!(ErrorKind::parse(k.as_str()), Some(k));
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::json!(k.as_str()));
        }
        assert_eq!(ErrorKind::parse("exit 3"), None);
    }

    #[test]
    fn the_first_cause_that_knows_decides() {
        let inner = OpError::not_found("no sandbox x");
        let chain: [&(dyn std::error::Error + 'static); 1] = [&inner];
        assert_eq!(kind_in(chain), ErrorKind::NotFound);
        let io = std::io::Error::other("disk");
        let chain: [&(dyn std::error::Error + 'static); 2] = [&io, &inner];
        assert_eq!(kind_in(chain), ErrorKind::NotFound);
        let chain: [&(dyn std::error::Error + 'static); 1] = [&io];
        assert_eq!(kind_in(chain), ErrorKind::Internal);
        let ledger = clade_ledger::LedgerError::Conflict("two writers".into());
        let chain: [&(dyn std::error::Error + 'static); 1] = [&ledger];
        assert_eq!(kind_in(chain), ErrorKind::Conflict);
    }

    #[test]
    fn agent_errnos_sort_into_kinds() {
        assert_eq!(ErrorKind::of_errno(2), ErrorKind::NotFound);
        assert_eq!(ErrorKind::of_errno(13), ErrorKind::Permission);
        assert_eq!(ErrorKind::of_errno(17), ErrorKind::Conflict);
        assert_eq!(ErrorKind::of_errno(21), ErrorKind::Invalid);
        assert_eq!(ErrorKind::of_errno(28), ErrorKind::NoSpace);
        assert_eq!(ErrorKind::of_errno(16), ErrorKind::Conflict, "EBUSY: renaming / is the path's state, not a bug");
        assert_eq!(ErrorKind::of_errno(5), ErrorKind::Internal);
    }
}
