//! clade's product library: the sandbox operations over one `$CLADE_HOME`, what the `clade` binary's CLI, its
//! daemon (`clade serve`), the E2B surface and the benches all call.
//!
//! Layers, lowest first (a module uses only those above it in this list):
//! - [`error`]: the product's failures, each with a `clade_core::ErrorKind`; id checks.
//! - [`backends`]: opening `vm` or `ct` behind `clade_core::backend::Backend`.
//! - [`base`]: templates found or built, and their bases (cold boot, provision, mark).
//! - [`supervisor`]: one detached process per running sandbox (and per warm-pool member), its control
//!   protocol and client; [`supervisor::start`] starts them and waits for them to be ready.
//! - [`admit`], [`audit`], [`gc`], [`roam`], [`siblings`]: admission, ledger-against-host audit, collection,
//!   the shared blob tier, the sibling audit; each over the engine, none over [`ops`].
//! - [`ops`]: [`ops::Ops`], the operations themselves (fork, exec, files, mark, retake, suspend, resume, push,
//!   pull, kill, lists), built on all of the above; [`security`] audits sandboxes through it.
//!
//! Nothing here prints to stdout or parses arguments: progress goes to callbacks, answers are values.

// One module needs `unsafe`: supervisor::spawner (fork without exec, PR_SET_MM), each block with its invariant.
#![deny(unsafe_code)]

pub mod admit;
pub mod api;
pub mod audit;
pub mod backends;
pub mod base;
pub mod error;
pub mod gc;
pub mod ops;
pub mod roam;
pub mod security;
pub mod siblings;
pub mod supervisor;

pub use api::SandboxApi;
pub use ops::Ops;
