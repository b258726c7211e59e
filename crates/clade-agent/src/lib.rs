//! clade-agent: the program inside every sandbox and the versioned wire format the host side imports.
//!
//! The binary (`src/bin/clade-agent/`) is PID 1 or a plain server inside a sandbox; this library is what
//! the `vm` and `ct` backends link: the framing ([`wire`]), the request/reply/event types ([`proto`]) and a
//! host-side [`AgentClient`]. Keeping the types here, once, means the two backends never re-declare them
//! and a version bump is one constant ([`WIRE_VERSION`]). See `docs/agent.md` for the format.
// No unsafe code but the two ioctls of `netif` (each with its invariant beside it).
#![deny(unsafe_code)]

pub mod client;
#[allow(unsafe_code)]
pub mod netif;
pub mod procgroup;
pub mod proto;
pub mod wire;

pub use client::{AgentClient, ClientError, ClockSync, Output, ProcEvent, Process};
pub use proto::*;
pub use wire::{Chan, Kind, WireError, DATA_CHUNK, FLAG_END, MAX_FRAME, WIRE_VERSION};

/// Where the agent listens in a `ct` sandbox (inside the sandbox's own /run); the host reaches it through
/// `/proc/<pid>/root` + this path.
pub const CT_SOCKET: &str = "/run/clade/agent.sock";
/// The virtio-serial port name the `vm` backend gives the agent channel (`virtserialport,name=...`).
pub const VM_PORT_NAME: &str = "clade";
/// The kernel command line key that tells `clade-agent init` its channel, e.g.
/// `clade.agent=virtio:/dev/virtio-ports/clade` or `clade.agent=unix:/run/clade/agent.sock`.
pub const CMDLINE_KEY: &str = "clade.agent";
