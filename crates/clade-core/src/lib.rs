//! The sandbox model shared by both backends: the `Backend` trait, marks, restore, fork, suspend,
//! retake, and the hygiene policy that makes every sibling a distinct machine. Also the host facts
//! (`host`), the `$CLADE_HOME` layout (`home`) and the clock reading (`time::now_ms`) every layer above the
//! store agrees on.

#![forbid(unsafe_code)]

pub mod admission;
pub mod backend;
pub mod cgroup;
pub mod engine;
pub mod error;
pub mod footprint;
pub mod home;
pub mod host;
pub mod hygiene;
pub use clade_agent::procgroup;
pub mod sandbox_net;
pub mod time;

pub use home::CladeHome;

pub use error::{ErrorKind, OpError};
