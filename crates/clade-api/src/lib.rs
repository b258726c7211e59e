//! clade's HTTP API, over the product library (`clade-host`):
//!
//! - [`server`]: the daemon (`clade serve`): the native API's router ([`routes`]) on unix sockets and TCP, with
//!   its doors (API key, Origin and Host checks), metrics, exec limits, the idle-suspend loop and the one-daemon
//!   lock; the E2B faces ([`e2b`]) beside it.
//! - [`client`]: the client the CLI uses when `CLADE_HOST` names a daemon.
//! - [`status`]: the one mapping between `clade_core::ErrorKind` and HTTP statuses, both ways.
//!
//! The connection loop and its limits shared with the E2B ports are `clade-http`'s.

#![forbid(unsafe_code)]

mod app;
pub mod client;
mod doors;
pub mod e2b;
mod e2b_base;
mod e2b_keys;
mod error;
mod exec;
#[cfg(test)]
mod faces;
#[cfg(test)]
mod fake;
mod idle;
mod inside;
mod lock;
mod metrics;
#[cfg(test)]
mod openapi_check;
mod port_relay;
pub mod routes;
pub mod server;
pub mod status;
mod watches;

pub use doors::load_or_create_key;
