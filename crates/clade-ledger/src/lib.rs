//! The ledger: one SQLite file recording templates, bases, sandboxes, branches, marks, leases and
//! retention. It knows nothing of QEMU or CRIU.

#![forbid(unsafe_code)]
