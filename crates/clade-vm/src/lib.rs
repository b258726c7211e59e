//! The `vm` backend: QEMU microVMs whose RAM is a tmpfs file mapped copy-on-write by siblings,
//! whose disks come from clade-nbd, and whose accelerator (KVM or TCG) is chosen by a real guest boot.

// Unsafe code only where the jail sets up QEMU's process between fork and exec (crate::jail).
#![deny(unsafe_code)]

pub mod accel;
pub mod agent_link;
pub mod backend;
pub mod boot;
pub mod disks;
pub mod footprint;
pub mod initramfs;
#[allow(unsafe_code)]
pub mod jail;
pub mod machine;
pub mod net;
pub mod qemu;
pub mod qmp;
pub mod ramdiff;
pub mod templating;
pub mod testkit;
