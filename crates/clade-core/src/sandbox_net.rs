//! A sandbox's own network namespace on the host, with egress (docs/net.md): clade makes the namespace
//! (`ip netns add clade-<id>`, so it is visible and removable by name) with loopback up and one veth pair,
//! `eth0` inside and `clade<N>` on the host, on a /30 of 10.213.0.0/16 (host `.1`, sandbox `.2`, default route
//! via the host end). Egress is NATed by one static nftables table (`ip clade`): a masquerade rule for the
//! source addresses in its set `egress`, where each sandbox adds its own /30 (and removes it on release), a
//! forward rule that drops sandbox-to-sandbox traffic, and an input rule that drops what a sandbox opens
//! towards the host itself (only replies to the host's own connections come in from a sandbox's link). Egress rules (`EgressRules`) are an nftables table in
//! the namespace itself. Both backends use it: a ct sandbox's processes live in the namespace; a vm guest's
//! QEMU does, so its user-mode network (slirp) opens its sockets there and reaches neither the host's loopback
//! nor another sandbox.
//!
//! The pair index `N` is allocated by the kernel: creating `clade<N>` fails with EEXIST when another sandbox
//! (of any `$CLADE_HOME`) holds it, and the next index is tried. Everything is torn down by [`SandboxNet`]'s
//! release (the sandbox's drop guard): host link (which removes both ends), namespace, set element.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// Prefixes of what clade creates on the host: links `clade<N>`, namespaces `/run/netns/clade-<id>`.
pub const LINK_PREFIX: &str = "clade";
pub const NETNS_PREFIX: &str = "clade-";
const NETNS_DIR: &str = "/run/netns";
/// 10.213.0.0/16 in /30s.
const NET_BASE: u32 = (10 << 24) | (213 << 16);
const SLOTS: u32 = 1 << 14;

/// One sandbox's network: its namespace, veth pair and NAT entry. `release` (also on drop) removes them.
#[derive(Debug)]
pub struct SandboxNet {
    pub netns: String,
    pub link: String,
    /// Host end and sandbox end.
    pub host_addr: std::net::Ipv4Addr,
    pub addr: std::net::Ipv4Addr,
    nat: bool,
    released: bool,
}

fn ip4(v: u32) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(v)
}

/// Run a command, optionally feeding stdin; the error carries its stderr.
fn run(prog: &str, args: &[&str], stdin: Option<&str>) -> Result<(), String> {
    let mut cmd = Command::new(prog);
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child = cmd.spawn().map_err(|e| format!("run {prog}: {e} (install iproute2 and nftables: ./x setup)"))?;
    if let (Some(text), Some(mut w)) = (stdin, child.stdin.take()) {
        w.write_all(text.as_bytes()).map_err(|e| format!("write to {prog}: {e}"))?;
    }
    let out = child.wait_with_output().map_err(|e| format!("wait for {prog}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{prog} {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
            stdin.map(|s| format!(" (input: {})", s.trim().replace('\n', "; "))).unwrap_or_default()
        ))
    }
}

fn slot_start(id: &str) -> u32 {
    // FNV-1a of the id: siblings start at different slots, so allocation rarely retries.
    let mut h: u32 = 0x811c_9dc5;
    for b in id.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    h % SLOTS
}

/// The nftables table every egress sandbox uses, created once per host boot (idempotent, under a lock).
const NFT_TABLE: &str = "table ip clade {
  set egress { type ipv4_addr; flags interval; }
  chain nat_out { type nat hook postrouting priority srcnat; policy accept; ip saddr @egress oifname != \"clade*\" masquerade; }
  chain isolate { type filter hook forward priority filter; policy accept; iifname \"clade*\" oifname \"clade*\" drop; }
}
";

/// The host's own addresses are not a sandbox's to connect to (its services on any interface, the sandbox's
/// gateway included): only replies to what the host opened come in from a sandbox's link. Added on its own to
/// a table made before it existed.
const NFT_GUARD: &str = "table ip clade {
  chain guard_in { type filter hook input priority filter; policy accept; iifname \"clade*\" ct state established,related accept; iifname \"clade*\" drop; }
}
";

fn ensure_nat_table() -> Result<(), String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/run/clade-net.lock")
        .map_err(|e| format!("open /run/clade-net.lock: {e}"))?;
    // Held until the end of this function (released when dropped).
    let _lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| format!("lock /run/clade-net.lock: {e}"))?;
    if run("nft", &["list", "table", "ip", "clade"], None).is_err() {
        run("nft", &["-f", "-"], Some(NFT_TABLE))?;
    }
    if run("nft", &["list", "chain", "ip", "clade", "guard_in"], None).is_err() {
        run("nft", &["-f", "-"], Some(NFT_GUARD))?;
    }
    // Forwarding is host-wide; egress needs it (docs/net.md).
    let fwd = "/proc/sys/net/ipv4/ip_forward";
    if std::fs::read_to_string(fwd).map(|s| s.trim() != "1").unwrap_or(true) {
        std::fs::write(fwd, "1").map_err(|e| format!("enable {fwd}: {e}"))?;
    }
    Ok(())
}

impl SandboxNet {
    /// Make the namespace, the veth pair with addresses and routes, and the NAT entry of sandbox `id`. On error
    /// everything made so far is removed again.
    pub fn create(id: &str) -> Result<SandboxNet, String> {
        let netns = format!("{NETNS_PREFIX}{id}");
        if netns.len() > 200 {
            return Err(format!("sandbox id {id:?} is too long for a network namespace name"));
        }
        run("ip", &["netns", "add", &netns], None)
            .map_err(|e| format!("{e} (a namespace {netns} left by a crashed run? `ip netns del {netns}`)"))?;
        let mut net =
            SandboxNet { netns, link: String::new(), host_addr: ip4(0), addr: ip4(0), nat: false, released: false };
        let start = slot_start(id);
        let mut last = String::new();
        for k in 0..64 {
            let slot = (start + k) % SLOTS;
            let link = format!("{LINK_PREFIX}{slot}");
            match run("ip", &["link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &net.netns], None)
            {
                Ok(()) => {
                    net.link = link;
                    let base = NET_BASE + slot * 4;
                    net.host_addr = ip4(base + 1);
                    net.addr = ip4(base + 2);
                    break;
                }
                Err(e) if e.contains("File exists") => last = e,
                Err(e) => return Err(e),
            }
        }
        if net.link.is_empty() {
            return Err(format!("no free veth slot near {start}: {last} (clade links left behind? see docs/net.md)"));
        }
        let host = format!("addr add {}/30 dev {}\nlink set {} up\n", net.host_addr, net.link, net.link);
        run("ip", &["-batch", "-"], Some(&host))?;
        let inside = format!(
            "link set lo up\naddr add {}/30 dev eth0\nlink set eth0 up\nroute add default via {}\n",
            net.addr, net.host_addr
        );
        run("ip", &["-n", &net.netns, "-batch", "-"], Some(&inside))?;
        ensure_nat_table()?;
        run("nft", &["add", "element", "ip", "clade", "egress", &format!("{{ {}/30 }}", net.subnet())], None)?;
        net.nat = true;
        Ok(net)
    }

    fn subnet(&self) -> std::net::Ipv4Addr {
        ip4(u32::from(self.addr) & !3)
    }

    /// Replace the sandbox's egress rules: an nftables table `inet clade_rules` inside its own namespace (the
    /// sandbox holds no CAP_NET_ADMIN, so it cannot change it), filtering the output hook: loopback always
    /// passes, then `allow` destinations, then `deny` ones are rejected (admin-prohibited, so a connect fails
    /// at once). The namespace is fresh after every restore, so whoever keeps the rules applies them again.
    pub fn set_rules(&self, rules: &crate::backend::EgressRules) -> Result<(), String> {
        rules.check()?;
        let set = |v: &[String]| v.join(", ");
        let mut script = String::from("table inet clade_rules\ndelete table inet clade_rules\n");
        if !rules.is_empty() {
            script.push_str(
                "table inet clade_rules {\n  chain out {\n    type filter hook output priority 0; policy accept;\n",
            );
            script.push_str("    oifname \"lo\" accept\n");
            if !rules.allow.is_empty() {
                script.push_str(&format!("    ip daddr {{ {} }} accept\n", set(&rules.allow)));
            }
            if !rules.deny.is_empty() {
                script.push_str(&format!(
                    "    ip daddr {{ {} }} reject with icmp type admin-prohibited\n",
                    set(&rules.deny)
                ));
            }
            script.push_str("  }\n}\n");
        }
        run("ip", &["netns", "exec", &self.netns, "nft", "-f", "-"], Some(&script))
    }

    /// The namespace's file (`/run/netns/clade-<id>`).
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from(NETNS_DIR).join(&self.netns)
    }

    /// Remove the NAT entry, the veth pair and the namespace; every step runs, the failures are returned.
    pub fn release(&mut self) -> Result<(), String> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let mut errors = Vec::new();
        if self.nat {
            let el = format!("{{ {}/30 }}", self.subnet());
            if let Err(e) = run("nft", &["delete", "element", "ip", "clade", "egress", &el], None) {
                errors.push(e);
            }
        }
        if !self.link.is_empty() {
            if let Err(e) = run("ip", &["link", "del", &self.link], None) {
                if !e.contains("Cannot find device") {
                    errors.push(e);
                }
            }
        }
        if let Err(e) = run("ip", &["netns", "del", &self.netns], None) {
            if !e.contains("No such file") {
                errors.push(e);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Leftovers of this sandbox's network on the host (empty after release).
    pub fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        if !self.link.is_empty() && std::path::Path::new("/sys/class/net").join(&self.link).exists() {
            left.push(format!("link {}", self.link));
        }
        left.extend(leftovers_of(&self.netns, &format!("{}/30", self.subnet())));
        left
    }
}

impl Drop for SandboxNet {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// What clade's networking holds on the host: `clade<N>` links, `clade-*` namespaces, NAT set elements.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HostNet {
    pub links: Vec<String>,
    pub netns: Vec<String>,
    pub nat: Vec<String>,
}

/// Read [`HostNet`] from the kernel (sysfs, `/run/netns`, `nft list set`).
pub fn host_state() -> HostNet {
    let names = |dir: &str, prefix: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|rd| rd.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        v.retain(|n| n.starts_with(prefix) && (prefix != LINK_PREFIX || n[prefix.len()..].parse::<u32>().is_ok()));
        v.sort();
        v
    };
    HostNet { links: names("/sys/class/net", LINK_PREFIX), netns: names(NETNS_DIR, NETNS_PREFIX), nat: nat_elements() }
}

fn nat_elements() -> Vec<String> {
    let Ok(out) = Command::new("nft").args(["list", "set", "ip", "clade", "egress"]).stderr(Stdio::null()).output()
    else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(start) = text.find("elements = {") else { return Vec::new() };
    let rest = &text[start + "elements = {".len()..];
    let body = &rest[..rest.find('}').unwrap_or(rest.len())];
    body.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

/// The leftovers of sandbox `id`'s network (namespace `clade-<id>`, NAT element `subnet`).
fn leftovers_of(netns: &str, subnet: &str) -> Vec<String> {
    let s = host_state();
    let mut left = Vec::new();
    if s.netns.iter().any(|n| n == netns) {
        left.push(format!("netns {netns}"));
    }
    if s.nat.iter().any(|n| n == subnet) {
        left.push(format!("nat element {subnet}"));
    }
    left
}

/// Leftovers of the sandbox `id` whose network is gone from view (after a failed start): its namespace, and
/// any NAT element or link whose namespace was its.
pub fn leftovers_of_id(id: &str) -> Vec<String> {
    let netns = format!("{NETNS_PREFIX}{id}");
    leftovers_of(&netns, "-")
}

/// What a gone sandbox's network left on the host (its supervisor was killed), taken down when `fix`: one
/// [`crate::footprint::Leftover`] for either backend's footprint, `None` when nothing is left or the namespace
/// is not `settled` yet (just made by a start in flight).
pub fn network_leftover(
    id: &str,
    fix: bool,
    settled: &dyn Fn(&std::path::Path) -> bool,
) -> Option<crate::footprint::Leftover> {
    let netns = netns_path_of(id);
    if !netns.exists() || !settled(&netns) {
        return None;
    }
    let removed = if fix { release_by_id(id) } else { Vec::new() };
    let detail = if removed.is_empty() { netns.display().to_string() } else { removed.join(", ") };
    Some(crate::footprint::Leftover { kind: "leftover-network", detail, fixed: fix && !netns.exists() })
}

/// The namespace file sandbox `id`'s network has while it exists (`/run/netns/clade-<id>`).
pub fn netns_path_of(id: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(format!("{NETNS_PREFIX}{id}"))
}

/// Take down what sandbox `id`'s network left on the host when nobody released it (its supervisor was
/// killed): the namespace `clade-<id>`, the host link of the veth whose peer is in it and, derived from that
/// link's slot as [`SandboxNet::create`] assigns it, the NAT element; then the same [`SandboxNet::release`] a
/// live sandbox uses. Returns what was removed (empty when nothing was left).
pub fn release_by_id(id: &str) -> Vec<String> {
    let netns = format!("{NETNS_PREFIX}{id}");
    if !netns_path_of(id).exists() {
        return Vec::new();
    }
    // `eth0@if123`: the peer's host end has ifindex 123.
    let peer = Command::new("ip").args(["-n", &netns, "-o", "link", "show"]).stderr(Stdio::null()).output();
    let host_index = peer.ok().and_then(|o| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        text.split_whitespace()
            .find_map(|w| w.split_once("@if").and_then(|(_, n)| n.trim_end_matches(':').parse::<u32>().ok()))
    });
    let link = host_index.and_then(|want| {
        host_state().links.into_iter().find(|l| {
            std::fs::read_to_string(format!("/sys/class/net/{l}/ifindex")).ok().and_then(|s| s.trim().parse().ok())
                == Some(want)
        })
    });
    let base =
        link.as_deref().and_then(|l| l.strip_prefix(LINK_PREFIX)?.parse::<u32>().ok()).map(|slot| NET_BASE + slot * 4);
    let mut net = SandboxNet {
        netns,
        link: link.unwrap_or_default(),
        host_addr: ip4(base.map_or(0, |b| b + 1)),
        addr: ip4(base.map_or(0, |b| b + 2)),
        nat: base.is_some_and(|b| nat_elements().contains(&format!("{}/30", ip4(b)))),
        released: false,
    };
    let before = net.leftovers();
    let _ = net.release();
    let after = net.leftovers();
    before.into_iter().filter(|l| !after.contains(l)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_addresses() {
        assert!(slot_start("a") < SLOTS && slot_start("sibling-1") != slot_start("sibling-2"));
        let base = NET_BASE + 5 * 4;
        assert_eq!(ip4(base + 2).to_string(), "10.213.0.22");
        let n = SandboxNet {
            netns: "x".into(),
            link: String::new(),
            host_addr: ip4(base + 1),
            addr: ip4(base + 2),
            nat: false,
            released: true,
        };
        assert_eq!(n.subnet().to_string(), "10.213.0.20");
        assert_eq!(n.netns_path(), PathBuf::from("/run/netns/x"));
    }
}
