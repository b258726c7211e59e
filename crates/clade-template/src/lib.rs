//! Templates: from a recipe (TOML spec) to a root filesystem directory and a disk image in the store.

#![forbid(unsafe_code)]
