//! Templates: from a recipe (a TOML spec) to a cached root filesystem and, for the `vm` backend, an ext4
//! disk image in the chunk store. A template is named by the hash of everything that shapes its root
//! filesystem, so a second build of an unchanged spec is a file read, and a changed byte anywhere makes a
//! new template instead of silently reusing a stale one.
//!
//! - [`spec`]: the TOML format, strict (unknown keys are errors with their line);
//! - [`identity`]: the hash;
//! - [`build`]: the builder and the cache layout;
//! - [`oci`]: `docker save` / OCI layout tarballs, layers and whiteouts;
//! - [`debian`]: debootstrap (cached once per suite and mirror) and apt in a chroot;
//! - [`image`]: `mkfs.ext4 -d`, no mounting;
//! - [`catalog`]: `ls` and `rm`.
//!
//! Booting a template once, provisioning it and marking it (a "base") is the backends' job; they start
//! from a [`TemplateRecord`]: its `rootfs` (ct: the overlay lower layer, never written) or its
//! `disk.manifest` (vm), plus `memory_mib`, `vcpus`, `ready` and `/etc/clade/provision.sh` in the rootfs.

#![forbid(unsafe_code)]

pub mod build;
pub mod catalog;
mod chroot;
pub mod debian;
mod error;
pub mod identity;
pub mod image;
pub mod oci;
pub mod rootfs;
pub mod spec;

pub use build::{Backends, BuildReport, Builder, DiskRecord, Progress, TemplateRecord};
pub use catalog::{find, list, remove, Removed};
pub use chroot::{mounts_under, sweep_stale};
pub use error::{Result, TemplateError};
pub use identity::{Identity, BUILDER_VERSION};
pub use spec::{Ready, Service, Source, TemplateSpec};

use std::path::PathBuf;

/// `$CLADE_HOME/templates`: built templates (`<hash>/`) and pristine debootstraps (`debootstrap-<key>/`).
pub fn templates_dir(home: &clade_core::CladeHome) -> PathBuf {
    home.root().join("templates")
}
