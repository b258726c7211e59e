//! The one place where clade's error vocabulary ([`ErrorKind`]) meets HTTP: the status and error code a server
//! answers with for each kind, and the kind a client reads back from a status. Every HTTP face (the native API,
//! its typed client, the E2B surface) goes through these two functions, so a refusal keeps its kind across the
//! wire: a fork refused for memory exits 5 from `clade fork` whether it ran in-process or through `clade serve`.
//!
//! The error codes in bodies (`{"error": {"code", "message"}}`) are the names clients already parse; a few
//! differ from the kind's own name (`bad_request`, `insufficient_storage`, `permission_denied`, `exec_timeout`,
//! `stopping`) and are kept as they are.

use clade_core::ErrorKind;

/// The HTTP status and body error code for a kind.
pub fn status_of(kind: ErrorKind) -> (u16, &'static str) {
    match kind {
        ErrorKind::Invalid => (400, "bad_request"),
        ErrorKind::NotFound => (404, "not_found"),
        ErrorKind::Conflict => (409, "conflict"),
        // Memory or CPU may free up: 429 is HTTP's "retry later".
        ErrorKind::NoCapacity => (429, "no_capacity"),
        ErrorKind::NoSpace => (507, "insufficient_storage"),
        ErrorKind::Permission => (403, "permission_denied"),
        ErrorKind::Timeout => (504, "exec_timeout"),
        ErrorKind::Unavailable => (503, "stopping"),
        ErrorKind::Internal => (500, "internal"),
    }
}

/// The kind an HTTP error status means (the reverse of [`status_of`]; 413, a body too large, is the caller's
/// to fix like any invalid request).
pub fn kind_of_status(status: u16) -> ErrorKind {
    match status {
        400 | 413 | 422 => ErrorKind::Invalid,
        404 => ErrorKind::NotFound,
        409 => ErrorKind::Conflict,
        429 => ErrorKind::NoCapacity,
        507 => ErrorKind::NoSpace,
        401 | 403 => ErrorKind::Permission,
        504 => ErrorKind::Timeout,
        503 => ErrorKind::Unavailable,
        _ => ErrorKind::Internal,
    }
}

/// The kind an error body's code names (the reverse of [`status_of`]'s code).
pub fn kind_of_code(code: &str) -> ErrorKind {
    clade_core::error::ALL.into_iter().find(|k| status_of(*k).1 == code).unwrap_or(ErrorKind::Internal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_survives_the_round_trip_through_a_status() {
        for k in clade_core::error::ALL {
            let (status, code) = status_of(k);
            assert!((400..600).contains(&status), "{k:?}");
            assert!(!code.is_empty());
            assert_eq!(kind_of_status(status), k, "{k:?} -> {status}");
            assert_eq!(kind_of_code(code), k, "{k:?} -> {code}");
        }
        assert_eq!(kind_of_status(413), ErrorKind::Invalid);
        assert_eq!(kind_of_status(502), ErrorKind::Internal);
    }
}
