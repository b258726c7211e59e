//! clade's NBD server: a copy-on-write block device whose base is a store manifest and whose
//! writes go to a private sparse overlay, snapshotted back into the store as a new manifest.
//!
//! Layout: [`proto`] is the wire format (pure, fuzzed), [`handshake`] and [`transmission`] the two
//! protocol phases, [`export`] the copy-on-write device, [`source`] the traits an export reads
//! from and snapshots into, [`server`] the accept loop, [`control`] the snapshot socket, and
//! [`run`] the blocking entry point the CLI uses. See `docs/nbd.md`.

#![forbid(unsafe_code)]

pub mod control;
pub mod export;
pub mod handshake;
pub mod proto;
pub mod run;
pub mod server;
pub mod source;
#[cfg(feature = "store")]
pub mod store;
pub mod transmission;

pub use export::{Export, ExportError, ExportStats};
pub use server::Server;
pub use source::{
    BlockSource, Change, Changes, Extent, FileSource, MemSnapshotter, MemSource, Run, SnapshotError, Snapshotter, BLOCK,
};
#[cfg(feature = "store")]
pub use store::{store_export, StoreSnapshotter, StoreSource};
