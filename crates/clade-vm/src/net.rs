//! Guest networking of the `vm` backend (docs/net.md).
//!
//! * `network = "none"` (the default): the guest has no network device at all, only loopback (the agent brings
//!   `lo` up). No default route, nothing to leak.
//! * `network = "egress"`: one virtio-net device on QEMU's user-mode network (libslirp, inside the QEMU process).
//!   The guest is configured by clade's initramfs from the kernel command line (`clade.net=ADDR/LEN,GATEWAY`)
//!   before it switches root: `eth0` = 10.0.2.15/24, default route via 10.0.2.2 (slirp's host alias).
//!   Outgoing TCP/UDP is NATed by slirp to sockets of the QEMU process, which runs in the sandbox's own network
//!   namespace (clade_core::sandbox_net: veth, NAT, egress rules), so 10.0.2.2 is that namespace's loopback,
//!   never the host's.
//!
//! Siblings forked from one mark keep the guest address of the mark (it is in their RAM): every sibling has
//! 10.0.2.15 and the same MAC, and they never collide because each QEMU process has its own slirp stack (no
//! shared L2 or L3 on the host). A mark records its network mode in its manifests (`network = egress`), so a
//! restore builds the same device set (a migration stream loads only into the same devices); marks without the
//! entry are `none`, as every mark taken before networking existed.

use clade_core::backend::{BackendError, MarkState};
use serde::{Deserialize, Serialize};

use crate::machine::{MachineType, VmSpec};

/// The manifest entry of a mark that records its network mode (value [`EGRESS`]; absent: none).
pub const ROLE_NETWORK: &str = "network";
pub const EGRESS: &str = "egress";

/// The guest's address and its gateway (slirp's defaults, so the guest sees a familiar QEMU network).
pub const GUEST_ADDR: &str = "10.0.2.15/24";
pub const GATEWAY: &str = "10.0.2.2";
/// One fixed MAC: the guest's driver state in a mark holds it, so every restore must present the same one.
pub const GUEST_MAC: &str = "52:54:00:c1:ad:01";

/// QEMU user-mode networking of one guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserNet {
    /// `restrict=on`: the guest can reach nothing outside (only forwarded ports would pass).
    pub restrict: bool,
    /// The network namespace QEMU runs in (the sandbox's own, clade_core::sandbox_net), so that slirp's sockets
    /// are made there: the guest reaches the outside through the sandbox's veth and NAT, under its egress
    /// rules, and neither the host's loopback nor another sandbox. `None`: the caller's namespace.
    #[serde(default)]
    pub netns: Option<std::path::PathBuf>,
}

impl UserNet {
    /// The `-netdev` and `-device` arguments.
    pub fn qemu_args(&self, machine: MachineType) -> Vec<String> {
        let dev = match machine {
            MachineType::Q35 => "virtio-net-pci",
            MachineType::Microvm => "virtio-net-device",
        };
        let netdev = format!(
            "user,id=net0,net=10.0.2.0/24,host={GATEWAY},dns=10.0.2.3,ipv6=off,restrict={}",
            if self.restrict { "on" } else { "off" }
        );
        // romfile= (q35): no option ROM, the guest never PXE-boots and it saves a file read per start.
        let rom = if machine == MachineType::Q35 { ",romfile=" } else { "" };
        vec!["-netdev".into(), netdev, "-device".into(), format!("{dev},netdev=net0,mac={GUEST_MAC}{rom}")]
    }
}

/// The kernel command line word clade's initramfs reads to configure `eth0`.
pub fn cmdline_word() -> String {
    format!("clade.net={GUEST_ADDR},{GATEWAY}")
}

/// Give `spec` the network of a guest with egress, its QEMU in `netns` (the sandbox's own namespace,
/// clade_core::sandbox_net); `None`: no network device at all.
pub fn apply(spec: &mut VmSpec, netns: Option<std::path::PathBuf>) {
    if let Some(ns) = netns {
        spec.net = Some(UserNet { restrict: false, netns: Some(ns) });
        spec.append.push(' ');
        spec.append.push_str(&cmdline_word());
    } else {
        spec.net = None;
    }
}

/// Whether a mark was taken with egress networking.
pub fn mark_egress(mark: &MarkState) -> Result<bool, BackendError> {
    match mark.manifests.get(ROLE_NETWORK).map(String::as_str) {
        None | Some("none") => Ok(false),
        Some(EGRESS) => Ok(true),
        Some(other) => {
            Err(BackendError::Corrupt(format!("vm mark has network mode {other:?}: expected none or egress")))
        }
    }
}

/// Record the network mode in a mark's manifests.
pub fn record(manifests: &mut std::collections::BTreeMap<String, String>, egress: bool) {
    if egress {
        manifests.insert(ROLE_NETWORK.to_string(), EGRESS.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_and_mark_roundtrip() {
        let a = UserNet { restrict: false, netns: None }.qemu_args(MachineType::Q35);
        assert_eq!(a[0], "-netdev");
        assert!(a[1].starts_with("user,id=net0,") && a[1].contains("restrict=off"), "{}", a[1]);
        assert!(a[3].starts_with("virtio-net-pci,netdev=net0,mac=52:54:00:c1:ad:01"), "{}", a[3]);
        let m = UserNet { restrict: true, netns: None }.qemu_args(MachineType::Microvm);
        assert!(m[1].contains("restrict=on") && m[3].starts_with("virtio-net-device"), "{m:?}");
        let mut manifests = std::collections::BTreeMap::new();
        record(&mut manifests, false);
        assert!(manifests.is_empty());
        record(&mut manifests, true);
        let mut mark = MarkState {
            backend: clade_core::backend::BackendKind::Vm,
            manifests,
            compat: Default::default(),
            shape: clade_core::backend::Shape { memory_mib: 1, vcpus: 1, disk_gib: 1 },
            logical_bytes: 0,
            stored_bytes: 0,
            pause: Default::default(),
            clean: true,
        };
        assert!(mark_egress(&mark).unwrap());
        mark.manifests.insert(ROLE_NETWORK.into(), "bridge".into());
        assert!(mark_egress(&mark).unwrap_err().to_string().contains("bridge"));
        mark.manifests.clear();
        assert!(!mark_egress(&mark).unwrap());
    }
}
