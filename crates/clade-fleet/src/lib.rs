//! clade's fleet simulator. It replays a trace of agent sessions (arrivals, active and idle periods, shapes)
//! over hosts of one shape and price and compares two policies: keep every retained session running, or
//! suspend a session once it has been idle for a while and resume it when its user returns. Suspend and
//! resume costs are clade's own measurements ([`costs`]), never typed in; the caller (the `clade fleet` CLI)
//! reads them from bench outputs or the ledger and says where each came from.
//!
//! This crate knows nothing of QEMU or CRIU: a sandbox here is a shape and a timeline. See `docs/fleet.md`.

#![forbid(unsafe_code)]

pub mod costs;
pub mod sim;
pub mod trace;

pub use costs::{CostError, Measured};
pub use sim::{compare, simulate, Comparison, Params, Policy, PolicyReport, SimError};
pub use trace::{parse_trace, seed004, AgentShape, HostShape, Seed004, Session, Trace, TraceError};
