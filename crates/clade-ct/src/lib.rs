//! The `ct` backend: namespace containers (PID/mount/net/IPC/UTS, overlayfs root) checkpointed and
//! restored by a privately installed CRIU.

#![forbid(unsafe_code)]

pub mod criu;
