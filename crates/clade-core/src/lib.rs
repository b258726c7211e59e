//! The sandbox model shared by both backends: the `Backend` trait, marks, restore, fork, suspend,
//! retake, and the hygiene policy that makes every sibling a distinct machine. Also the host facts
//! (`host`) and the `$CLADE_HOME` layout (`home`) every layer above the store agrees on.

#![forbid(unsafe_code)]

pub mod admission;
pub mod backend;
pub mod cgroup;
pub mod engine;
pub mod home;
pub mod host;
pub mod hygiene;

pub use home::CladeHome;

/// An error that carries the process exit code the CLI should use (2 usage, 3 not found, 4 conflict,
/// 5 resource). Wrap it into an `anyhow::Error` at the binary edge; `clade` finds it in the chain.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ExitCoded {
    pub code: i32,
    pub message: String,
}

impl ExitCoded {
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}
