//! Networking of `ct` sandboxes (docs/net.md).
//!
//! * `network = "none"` (the default): the sandbox's own network namespace with loopback only. It is also
//!   **external** to CRIU (marks record `network = loopback`): a dump names it instead of saving its links,
//!   addresses and firewall tables (CRIU runs `ip`, `iptables-save` and `nft` for those, ~150 ms of a browser's
//!   pause measured here), and a restore is handed a fresh namespace with `lo` up, made in a thread without
//!   running any program ([`loopback_netns`]), instead of CRIU running `ip ... restore` (~100 ms). Marks taken
//!   before (no `network` entry) still restore the namespace CRIU saved.
//! * `network = "egress"`: clade makes the network namespace (`ip netns add clade-<id>`, so it is visible and
//!   removable by name) with loopback up and one veth pair: `eth0` inside, `clade<N>` on the host, a /30 of
//!   10.213.0.0/16 (host `.1`, sandbox `.2`, default route via the host end). Egress is NATed by one static
//!   nftables table (`ip clade`): a masquerade rule for the source addresses in its set `egress`, where each
//!   sandbox adds its own /30 (and removes it on release), plus a forward rule that drops sandbox-to-sandbox
//!   traffic. The namespace is **external** to CRIU: dumps name it (`--external net[INODE]:clade-net`) and
//!   restores get a fresh one, made the same way, as an inherited fd (`--inherit-fd fd[N]:clade-net`), so each
//!   sibling has its own veth and address and CRIU restores no links at all.
//!
//! The pair index `N` is allocated by the kernel: creating `clade<N>` fails with EEXIST when another sandbox
//! (of any `$CLADE_HOME`) holds it, and the next index is tried. Everything is torn down by [`SandboxNet`]'s
//! release (the sandbox's drop guard): host link (which removes both ends), namespace, set element.

pub use clade_core::sandbox_net::*;

/// The manifest entry of a mark recording its network mode (value [`EGRESS`]; absent: none).
pub const ROLE_NETWORK: &str = "network";
pub const EGRESS: &str = "egress";
pub const LOOPBACK: &str = "loopback";
/// CRIU's key of the external network namespace.
pub const EXT_KEY: &str = "clade-net";
/// The fd number CRIU inherits the namespace on.
pub const INHERIT_FD: i32 = 10;
/// How a mark's network namespace comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkNet {
    /// In the images (marks taken before the namespace was made external): CRIU restores it.
    Saved,
    /// External, loopback only: a fresh one from [`loopback_netns`].
    Loopback,
    /// External, with a veth pair and NAT: a fresh [`SandboxNet`].
    Egress,
}

/// How a mark's network namespace is restored.
pub fn mark_net(mark: &clade_core::backend::MarkState) -> Result<MarkNet, clade_core::backend::BackendError> {
    match mark.manifests.get(ROLE_NETWORK).map(String::as_str) {
        None | Some("none") => Ok(MarkNet::Saved),
        Some(LOOPBACK) => Ok(MarkNet::Loopback),
        Some(EGRESS) => Ok(MarkNet::Egress),
        Some(other) => Err(clade_core::backend::BackendError::Corrupt(format!(
            "ct mark has network mode {other:?}: expected loopback or egress"
        ))),
    }
}

/// A new network namespace with only `lo`, up, as an open file (what CRIU inherits). Made in a short-lived
/// thread that unshares its own network namespace, so nothing is executed and the caller's namespace is
/// untouched; the namespace lives as long as the file (and then as long as the processes restored into it).
pub fn loopback_netns() -> Result<std::fs::File, String> {
    std::thread::spawn(|| -> Result<std::fs::File, String> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare(CLONE_NEWNET): {e}"))?;
        lo_up().map_err(|e| format!("bring lo up in a new network namespace: {e}"))?;
        std::fs::File::open("/proc/thread-self/ns/net").map_err(|e| format!("open /proc/thread-self/ns/net: {e}"))
    })
    .join()
    .map_err(|_| "the thread making a network namespace panicked".to_string())?
}

/// `ip link set lo up` in the calling thread's network namespace (SIOCGIFFLAGS / SIOCSIFFLAGS).
fn lo_up() -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket() with constant arguments; the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS fills `ifr_ifru.ifru_flags` of the ifreq we pass, which lives for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut ifr) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: reading the union member SIOCGIFFLAGS just wrote.
    unsafe { ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: SIOCSIFFLAGS only reads the ifreq, which lives for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &ifr) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The inode of a process's network namespace (what CRIU calls it in `--external net[INODE]`).
pub fn netns_inode(pid: u32) -> Result<u64, String> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .map(|m| m.ino())
        .map_err(|e| format!("network namespace of {pid}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mark_network_modes() {
        let mut mark = clade_core::backend::MarkState {
            backend: clade_core::backend::BackendKind::Ct,
            manifests: Default::default(),
            compat: Default::default(),
            shape: clade_core::backend::Shape { memory_mib: 1, vcpus: 1, disk_gib: 1 },
            logical_bytes: 0,
            stored_bytes: 0,
            pause: std::time::Duration::ZERO,
            clean: true,
        };
        assert_eq!(mark_net(&mark).unwrap(), MarkNet::Saved);
        mark.manifests.insert(ROLE_NETWORK.into(), LOOPBACK.into());
        assert_eq!(mark_net(&mark).unwrap(), MarkNet::Loopback);
        mark.manifests.insert(ROLE_NETWORK.into(), EGRESS.into());
        assert_eq!(mark_net(&mark).unwrap(), MarkNet::Egress);
        mark.manifests.insert(ROLE_NETWORK.into(), "bridge".into());
        assert!(mark_net(&mark).unwrap_err().to_string().contains("bridge"));
    }
}
