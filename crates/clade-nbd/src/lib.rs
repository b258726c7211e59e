//! clade's NBD server: a copy-on-write block device whose base is a store manifest and whose
//! writes go to a private sparse overlay, snapshotted back into the store as a new manifest.

#![forbid(unsafe_code)]
