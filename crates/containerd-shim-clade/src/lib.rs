//! The library side of `containerd-shim-clade`: the tooling its tests and `clade-bench k8s` share to run a
//! private containerd with the shim (the shim itself is the binary, src/main.rs).

pub mod testkit;
