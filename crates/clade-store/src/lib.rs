//! Content-addressed chunk store: objects named by BLAKE3, packed, compressed, described by
//! flat manifests, tiered (local + blob via object_store), verified on every read, collected by GC.
//! It knows nothing of QEMU or CRIU.

#![forbid(unsafe_code)]
