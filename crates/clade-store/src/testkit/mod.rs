//! For tests and benches of the crates above: real S3-compatible servers on loopback, ended on drop.
//!
//! - [`Garage`]: a 3-node Garage cluster (replication factor 3), the blob tier of every figure and test of
//!   several hosts (docs/roam.md). Installed by `./x setup` under `$CLADE_HOME/garage`.
//! - [`Moto`]: moto's single-process S3 mock, kept for unit tests of the S3 code.

mod garage;
mod moto;

pub use garage::{Garage, GarageNode};
pub use moto::Moto;
