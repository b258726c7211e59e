//! The testkit (src/testkit.rs) with this build's binaries.
#![allow(dead_code)]

pub use containerd_shim_clade::testkit::*;

/// A private containerd over a temp clade home, with this build's shim and `clade`; `None` (and a printed
/// reason) where containerd or CRIU is not installed.
pub fn containerd(extra_config: &str) -> Option<Containerd> {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_containerd-shim-clade-v2"));
    Containerd::start(extra_config, bin.parent().unwrap(), None, &[])
}
