//! The ct backend's host footprint (`clade_core::footprint`): the caches its restores lay out from store trees,
//! a gone sandbox's network namespace, the memory cgroup admission reads, the overlay's lower layers that roam
//! as trees, and the jail audit of a running sandbox.

use std::path::Path;

use clade_core::backend::{BackendKind, Shape};
use clade_core::footprint::{Footprint, Leftover};
use clade_core::CladeHome;

use crate::sandbox::ROLE_ROOTFS;

pub struct CtFootprint;

/// A counter of a sandbox's cgroup: `v2_file` in its v2 directory, else `v1_file` in its directory of the v1
/// `controller` hierarchy.
fn cgroup_counter(sandbox: &str, v2_file: &str, controller: &str, v1_file: &str) -> Option<u64> {
    let v2 = format!("/sys/fs/cgroup/clade/{sandbox}/{v2_file}");
    let v1 = format!("/sys/fs/cgroup/{controller}/clade/{sandbox}/{v1_file}");
    [v2, v1].iter().find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse().ok())
}

impl Footprint for CtFootprint {
    fn kind(&self) -> BackendKind {
        BackendKind::Ct
    }

    /// Uppers and CRIU images a restore copies out of the mark's trees (`$CLADE_HOME/cache/<kind>/<tree>`).
    fn tree_caches(&self) -> &'static [&'static str] {
        &[crate::restore::UPPERS, crate::restore::IMAGES]
    }

    /// The sandbox's network namespace (egress: with its veth and NAT element), once its processes are gone.
    fn leftovers(&self, _home: &CladeHome, sandbox: &str, fix: bool, settled: &dyn Fn(&Path) -> bool) -> Vec<Leftover> {
        crate::net::network_leftover(sandbox, fix, settled).into_iter().collect()
    }

    /// A container has no vCPU threads to reserve.
    fn reserved_vcpus(&self, _shape: &Shape) -> u32 {
        0
    }

    /// About its image (what its processes had resident when marked), at most its shape's memory; nothing shared.
    fn memory_estimate(&self, mark_bytes: u64, shape_bytes: u64) -> (u64, u64) {
        (mark_bytes.min(shape_bytes), 0)
    }

    /// Its memory cgroup's charge (its tmpfs upper is charged there too): one file read.
    fn charged_memory(&self, sandbox: &str) -> Option<u64> {
        cgroup_counter(sandbox, "memory.current", "memory", "memory.usage_in_bytes")
    }

    /// Its pids cgroup's count (a jailed sandbox has one): one file read.
    fn charged_tasks(&self, sandbox: &str) -> Option<u64> {
        cgroup_counter(sandbox, "pids.current", "pids", "pids.current")
    }

    fn layers_role(&self) -> Option<&'static str> {
        Some(ROLE_ROOTFS)
    }

    fn word_roles(&self) -> &'static [&'static str] {
        &[crate::net::ROLE_NETWORK, crate::sandbox::ROLE_NO_NEW_PRIVS, clade_core::backend::ROLE_BOOT]
    }

    fn layer_tree(&self, entry: &str) -> Option<clade_store::TreeId> {
        crate::lower::tree_of(entry)
    }

    fn tree_layer(&self, tree: &clade_store::TreeId) -> String {
        format!("{}{tree}", crate::lower::TREE_PREFIX)
    }

    fn jail_audit(&self, sandbox: &str, pids: &[u32]) -> serde_json::Value {
        serde_json::to_value(crate::jail_audit::audit(sandbox, pids))
            .unwrap_or_else(|e| serde_json::json!({"deviations": [format!("the audit did not serialize: {e}")]}))
    }
}
