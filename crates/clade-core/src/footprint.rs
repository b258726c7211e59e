//! What a backend keeps on the host outside the store and the ledger, named without opening the backend: the
//! product layer's collection, audit, admission, roaming and jail audit ask each backend through this trait
//! instead of knowing its paths. It is separate from [`crate::backend::Backend`] because those run where a backend
//! could not open (CRIU gone, QEMU not installed, no accelerator probe yet) and must still clean up after it.

use std::path::{Path, PathBuf};

use crate::backend::{BackendKind, Shape};
use crate::CladeHome;

/// One thing a gone sandbox left on the host, and whether it was taken down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    /// `leftover-network`, `leftover-ram-file`, ...
    pub kind: &'static str,
    pub detail: String,
    pub fixed: bool,
}

/// A backend's host footprint (see the module doc). Every method has the answer of a backend that keeps nothing
/// of that kind.
pub trait Footprint: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// Host files derived from a store manifest, deleted when the manifest is (the vm backend's root RAM file of
    /// a mark, on tmpfs).
    fn derived_files(&self, _home: &CladeHome, _manifest: &str) -> Vec<PathBuf> {
        Vec::new()
    }

    /// Directories under `home.cache_dir()` holding one entry per store tree, laid out by restores (the ct
    /// backend's uppers and CRIU images); gc sweeps the entries no mark names.
    fn tree_caches(&self) -> &'static [&'static str] {
        &[]
    }

    /// Directories where a sandbox's mounts may outlive it besides its run dir (the vm backend's lazy RAM mounts).
    fn mount_roots(&self, _home: &CladeHome, _sandbox: &str) -> Vec<PathBuf> {
        Vec::new()
    }

    /// What a gone sandbox left that only this backend knows (a ct sandbox's network namespace with its veth
    /// and NAT element; a cold vm sandbox's RAM file), among the paths `settled` accepts (old enough not to
    /// belong to a sandbox still starting); taken down with `fix`.
    fn leftovers(
        &self,
        _home: &CladeHome,
        _sandbox: &str,
        _fix: bool,
        _settled: &dyn Fn(&Path) -> bool,
    ) -> Vec<Leftover> {
        Vec::new()
    }

    /// vCPUs a running sandbox of this shape takes from admission's budget (a container has no vCPU threads).
    fn reserved_vcpus(&self, shape: &Shape) -> u32 {
        shape.vcpus
    }

    /// Memory a new sandbox of a mark takes before any sibling was measured, from the mark's size and its
    /// shape's memory: bytes of its own, and bytes it maps from a base every sibling of the mark shares
    /// (counted once over them).
    fn memory_estimate(&self, _mark_bytes: u64, shape_bytes: u64) -> (u64, u64) {
        (shape_bytes, 0)
    }

    /// Bytes a running sandbox is charged, when the backend can read it cheaply itself (a ct sandbox's memory
    /// cgroup); `None`: ask its supervisor for its processes' PSS.
    fn charged_memory(&self, _sandbox: &str) -> Option<u64> {
        None
    }

    /// Tasks a running sandbox's own processes hold, when the backend can read it cheaply itself (a ct
    /// sandbox's pids cgroup); `None`: ask its supervisor.
    fn charged_tasks(&self, _sandbox: &str) -> Option<u64> {
        None
    }

    /// The mark role whose value names layers on the host (`:`-separated directories, or store trees in the
    /// form [`Footprint::tree_layer`] writes) rather than one store object: the ct backend's overlay lowers.
    /// Roaming carries such layers to another host as trees.
    fn layers_role(&self) -> Option<&'static str> {
        None
    }

    /// Mark roles whose value is a word the mark carries, not stored data (a disk-only mark's `boot`, a
    /// network mode, the ct jail's `no_new_privs`). A backend that adds its own lists [`crate::backend::ROLE_BOOT`]
    /// too.
    fn word_roles(&self) -> &'static [&'static str] {
        &[crate::backend::ROLE_BOOT]
    }

    /// The store tree a layer entry names, if it names one.
    fn layer_tree(&self, _entry: &str) -> Option<clade_store::TreeId> {
        None
    }

    /// The layer entry naming a store tree.
    fn tree_layer(&self, tree: &clade_store::TreeId) -> String {
        tree.to_string()
    }

    /// Whether a running sandbox keeps reading the store through its supervisor (a vm's disk, served over NBD):
    /// then its supervisor keeps the store's index after a mark and sheds only the dedup table.
    fn reads_store_while_running(&self) -> bool {
        false
    }

    /// The jail of a running sandbox as the host's kernel reports it, with a `deviations` list (empty: it
    /// conforms to docs/security.md's policy).
    fn jail_audit(&self, sandbox: &str, pids: &[u32]) -> serde_json::Value;
}
