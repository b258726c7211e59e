//! The ledger: one SQLite file recording templates, bases, sandboxes, branches, marks, leases and
//! an operations log, and deciding which marks retention lets go. It knows nothing of QEMU, CRIU or
//! the chunk store's format: store object ids are opaque strings here, and
//! [`Ledger::live_manifests`] plus a [`CollectReport`] are all the store's GC needs from it.
//!
//! The file lives at `clade_core::CladeHome::from_env().ledger_path()` by default; the library takes
//! the path as an argument (it sits below `clade-core` and does not depend on it). The daemon and
//! the CLI may open it at the same time (WAL, busy timeout, short `BEGIN IMMEDIATE` writes). See
//! `docs/ledger.md` for the schema, migrations and retention rules.

#![forbid(unsafe_code)]

mod catalog;
pub mod clock;
mod collect;
mod error;
mod ids;
mod leases;
mod ledger;
mod marks;
mod model;
mod ops;
pub mod retention;
mod sandboxes;
pub mod schema;

pub use clock::{Clock, ManualClock, SystemClock, UnixMillis};
pub use collect::{CollectOptions, CollectReport, DeletedMark, KeptMark};
pub use error::{LedgerError, Result};
pub use ids::{BranchId, LeaseId, ManifestId, MarkId, OpId, SandboxId, TemplateId};
pub use ledger::{Ledger, LedgerOptions};
pub use model::Sandbox as SandboxRecord;
pub use model::{
    Backend, Base, Branch, Lease, LeaseTarget, Mark, NewBranch, NewMark, NewOp, NewSandbox, OpRecord, RetentionPolicy,
    SandboxState, Template,
};
pub use ops::OpQuery;
pub use retention::KeepReason;
pub use schema::SCHEMA_VERSION;
