//! clade's HTTP faces: the native API (axum) and, later, the E2B-compatible control plane and envd.

#![forbid(unsafe_code)]
