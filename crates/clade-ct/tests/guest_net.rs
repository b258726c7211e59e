//! Networking of `ct` sandboxes on this host (docs/net.md), with real veth pairs, nftables NAT and CRIU:
//! an `egress` sandbox reaches, NATed, a listener in an "outside" network namespace (which sees the host's
//! address, not the sandbox's), and not a listener of the host's own, even at its gateway address (the control:
//! the host reaches it there); two siblings restored at once from its
//! mark get their own veth and address and reach the outside concurrently; a sandbox without network cannot;
//! after kill, and after a restore failing at each step, no link, namespace or NAT element is left.
//! Root, namespaces, CRIU, iproute2 and nft are required (tier names: `privileged`, `guest`).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clade_agent::ExecSpec;
use clade_core::backend::{Identity, MarkOptions, Sandbox};
use clade_ct::net::host_state;
use clade_ct::{CtSandbox, FailPoint};

mod common;
use common::Env;

fn env(name: &str) -> Option<Env> {
    common::env_with(name, 512, true, |_| {})
}

fn id(name: &str) -> Identity {
    clade_core::hygiene::new_identity(&format!("n{name}-{}", std::process::id()), 0)
}

/// Exit code and stdout of a shell line in the sandbox.
fn sh(sb: &dyn Sandbox, script: &str) -> (i32, String) {
    let out = sb.agent().run(ExecSpec::new(["/bin/sh", "-c", script])).expect("exec");
    (out.status.code.unwrap_or(-1), String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn ip(args: &str) {
    let st = std::process::Command::new("ip").args(args.split_whitespace()).status().unwrap();
    assert!(st.success(), "ip {args}");
}

/// A network namespace standing in for the internet: 10.214.0.2 behind a veth to the host (10.214.0.1).
struct Outside {
    ns: String,
    link: String,
}

impl Outside {
    fn new() -> Outside {
        Outside::at("", 214)
    }

    /// One of its own for each test that runs beside another: a name suffix and the block `10.<net>.0.0/30`.
    fn at(name: &str, net: u8) -> Outside {
        let tag = std::process::id() % 100_000;
        let o = Outside { ns: format!("ctnet-out{name}-{tag}"), link: format!("ctout{name}{tag}") };
        let _ = std::process::Command::new("ip").args(["netns", "del", &o.ns]).status();
        ip(&format!("netns add {}", o.ns));
        ip(&format!("link add {} type veth peer name eth0 netns {}", o.link, o.ns));
        ip(&format!("addr add 10.{net}.0.1/30 dev {}", o.link));
        ip(&format!("link set {} up", o.link));
        ip(&format!("-n {} addr add 10.{net}.0.2/30 dev eth0", o.ns));
        ip(&format!("-n {} link set eth0 up", o.ns));
        ip(&format!("-n {} link set lo up", o.ns));
        o
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", &self.link]).status();
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// (peer address, first line) of each connection.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

/// Answer each connection's first line with `pong <line>`; the listener is made in `netns` when given (a
/// thread that joined it: setns changes only the calling thread).
fn listen(netns: Option<String>, addr: &'static str) -> (u16, Seen) {
    let seen: Seen = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        if let Some(ns) = netns {
            let f = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
            nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        }
        let l = TcpListener::bind((addr, 0)).unwrap();
        tx.send(l.local_addr().unwrap().port()).unwrap();
        for conn in l.incoming().flatten() {
            let seen = seen2.clone();
            std::thread::spawn(move || {
                let peer = conn.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
                let mut line = String::new();
                if BufReader::new(conn.try_clone().unwrap()).read_line(&mut line).is_ok() {
                    let line = line.trim().to_string();
                    let mut w = conn;
                    let _ = writeln!(w, "pong {line}");
                    seen.lock().unwrap().push((peer, line));
                }
            });
        }
    });
    (rx.recv().unwrap(), seen)
}

fn nc(host: &str, port: u16, what: &str) -> String {
    format!("echo {what} | nc -w 5 {host} {port}")
}

fn eth0(sb: &dyn Sandbox) -> String {
    sh(sb, "ip -4 -o addr show eth0 | awk '{print $4}'").1
}

fn assert_net_gone(what: &str, link: &str, netns: &str, addr: &str) {
    let s = host_state();
    assert!(!s.links.iter().any(|l| l == link), "{what}: link {link} left: {s:?}");
    assert!(!s.netns.iter().any(|n| n == netns), "{what}: netns {netns} left: {s:?}");
    let sub: std::net::Ipv4Addr = addr.parse().unwrap();
    let sub = format!("{}/30", std::net::Ipv4Addr::from(u32::from(sub) & !3));
    assert!(!s.nat.contains(&sub), "{what}: nat element {sub} left: {s:?}");
}

fn restore(e: &Env, mark: &clade_core::backend::MarkState, name: &str) -> (CtSandbox, Duration) {
    let ident = id(name);
    let t = Instant::now();
    let sb = e.backend.restore_ct(mark, &ident).expect("restore");
    clade_core::hygiene::apply(sb.agent(), &ident, mark.clean).expect("hygiene");
    (sb, t.elapsed())
}

#[test]
fn privileged_guest_net_egress_siblings_none_and_cleanup() {
    let Some(e) = env("net") else { return };
    let outside = Outside::new();
    let (out_port, out_seen) = listen(Some(outside.ns.clone()), "10.214.0.2");
    let (host_port, host_seen) = listen(None, "0.0.0.0");
    let before = host_state();

    // Egress, cold: eth0 on its /30, default route via the host end, the (NATed) outside reachable; the host
    // itself is not (a listener on all its addresses, the sandbox's gateway included; the control: the host
    // reaches it at that same address).
    let mut base = e.backend.cold_start_ct(&e.image, &id("base")).expect("cold start");
    let net = base.net().expect("an egress sandbox has a network");
    let (base_link, base_ns, base_addr) = (net.link.clone(), net.netns.clone(), net.addr.to_string());
    assert_eq!(eth0(&base), format!("{base_addr}/30"));
    let gw = sh(&base, "ip route | awk '/^default/ {print $3}'").1;
    assert_eq!(gw, net.host_addr.to_string());
    assert_ne!(sh(&base, &nc(&gw, host_port, "base-host")).1, "pong base-host", "the sandbox reached the host");
    let mut ctl = std::net::TcpStream::connect((gw.as_str(), host_port)).expect("the host reaches its own listener");
    writeln!(ctl, "control").unwrap();
    let mut line = String::new();
    BufReader::new(ctl).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "pong control", "the control: the listener answers at the gateway address");
    assert!(!host_seen.lock().unwrap().iter().any(|(_, l)| l == "base-host"));
    assert_eq!(sh(&base, &nc("10.214.0.2", out_port, "base-out")), (0, "pong base-out".into()));
    assert!(
        out_seen.lock().unwrap().iter().any(|(p, l)| p == "10.214.0.1" && l == "base-out"),
        "the outside saw the sandbox's own address, not the host's (no NAT): {:?}",
        out_seen.lock().unwrap()
    );
    sh(&base, "echo marked > /root/note");

    let mark = base.mark(&MarkOptions::default()).expect("mark of an egress sandbox");
    assert_eq!(mark.manifests.get("network").map(String::as_str), Some("egress"));
    assert_eq!(sh(&base, &nc("10.214.0.2", out_port, "base-after")), (0, "pong base-after".into()));

    // Two siblings at once: each its own veth and address, both reach the outside concurrently.
    let sibs: Vec<(CtSandbox, Duration)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|i| {
                s.spawn({
                    let e = &e;
                    let mark = &mark;
                    move || restore(e, mark, &format!("sib{i}"))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let addrs: Vec<String> = sibs.iter().map(|(sb, _)| sb.net().unwrap().addr.to_string()).collect();
    assert!(addrs[0] != addrs[1] && !addrs.contains(&base_addr), "addresses {addrs:?} / {base_addr}");
    let answers: Vec<(i32, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = sibs
            .iter()
            .enumerate()
            .map(|(i, (sb, _))| {
                let script = format!("cat /root/note >/dev/null && {}", nc("10.214.0.2", out_port, &format!("sib{i}")));
                s.spawn(move || sh(sb, &script))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((sb, took), ans)) in sibs.iter().zip(&answers).enumerate() {
        eprintln!("sibling {i}: restore + hygiene with network {took:?}, address {}", eth0(sb));
        assert_eq!(eth0(sb), format!("{}/30", addrs[i]));
        assert_eq!(ans, &(0, format!("pong sib{i}")), "sibling {i}");
    }
    // Sandbox-to-sandbox traffic is dropped: sibling 0 cannot reach the marked sandbox's address.
    let (code, _) = sh(&sibs[0].0, &format!("nc -w 2 {base_addr} {host_port} </dev/null"));
    assert_ne!(code, 0, "a sibling reached another sandbox");

    // Kill: nothing of any of them is left.
    let mut gone = vec![("base".to_string(), base_link, base_ns, base_addr)];
    for (i, (sb, _)) in sibs.into_iter().enumerate() {
        let n = sb.net().unwrap();
        gone.push((format!("sib{i}"), n.link.clone(), n.netns.clone(), n.addr.to_string()));
        Box::new(sb).kill().expect("kill");
    }
    Box::new(base).kill().expect("kill");
    for (what, link, ns, addr) in &gone {
        assert_net_gone(what, link, ns, addr);
    }

    // No network: loopback only, neither the host listener nor the outside is reachable.
    let mut none_img = e.image.clone();
    none_img.egress = false;
    let mut none = e.backend.cold_start_ct(&none_img, &id("none")).expect("cold start without network");
    assert!(none.net().is_none());
    assert_eq!(sh(&none, "ip -o link | grep -c eth0").1, "0");
    assert_eq!(sh(&none, "ip route | grep -c default").1, "0");
    let (code, out) = sh(&none, &nc("10.214.0.2", out_port, "none"));
    assert!(code != 0 && !out.contains("pong"), "{code} {out}");
    let none_mark = none.mark(&MarkOptions::default()).expect("mark without network");
    assert_eq!(none_mark.manifests.get("network").map(String::as_str), Some("loopback"));

    // Restore time with and without network, interleaved (docs/net.md).
    let mut with = Vec::new();
    let mut without = Vec::new();
    let base2 = e.backend.cold_start_ct(&e.image, &id("base2")).expect("cold start");
    let mut base2 = base2;
    let net_mark = base2.mark(&MarkOptions::default()).expect("mark");
    for i in 0..5 {
        let (a, ta) = restore(&e, &net_mark, &format!("tw{i}"));
        Box::new(a).kill().unwrap();
        let (b, tb) = restore(&e, &none_mark, &format!("tn{i}"));
        Box::new(b).kill().unwrap();
        with.push(ta);
        without.push(tb);
    }
    with.sort();
    without.sort();
    eprintln!(
        "restore + hygiene p50: with network {:?}, without {:?} (all: {with:?} / {without:?})",
        with[2], without[2]
    );

    // A restore failing at each step leaves no link, namespace or NAT element.
    e.backend.set_lazy_threshold(None);
    for at in FailPoint::ALL {
        e.backend.inject_failure(Some(at));
        for cold in [true, false] {
            let ident = id(&format!("f{at:?}{cold}").to_lowercase());
            let res = if cold {
                e.backend.cold_start_ct(&e.image, &ident).map(|_| ())
            } else {
                e.backend.restore_ct(&net_mark, &ident).map(|_| ())
            };
            let err = res.unwrap_err().to_string();
            assert!(err.contains("injected"), "{at:?} cold={cold}: {err}");
            let left = clade_ct::net::leftovers_of_id(&ident.sandbox_id);
            assert!(left.is_empty(), "{at:?} cold={cold} left {left:?}");
        }
    }
    e.backend.inject_failure(None);

    // A supervisor killed outright never releases its sandbox's network: `release_by_id` (what `clade kill`
    // of a lost sandbox and `clade audit --fix` use) finds the veth, the NAT element and the namespace by id.
    let leak_id = format!("leak-{}", std::process::id());
    let leaked = clade_ct::net::SandboxNet::create(&leak_id).expect("a network to leak");
    let (leak_link, leak_ns, leak_addr) = (leaked.link.clone(), leaked.netns.clone(), leaked.addr.to_string());
    std::mem::forget(leaked);
    let s = host_state();
    assert!(s.links.contains(&leak_link) && s.netns.contains(&leak_ns), "{s:?}");
    let removed = clade_ct::net::release_by_id(&leak_id);
    assert_eq!(removed.len(), 3, "NAT element, link and namespace: {removed:?}");
    assert_net_gone("a leaked network released by id", &leak_link, &leak_ns, &leak_addr);
    assert!(clade_ct::net::release_by_id(&leak_id).is_empty(), "a second release found something");

    Box::new(base2).kill().unwrap();
    Box::new(none).kill().unwrap();
    let after = host_state();
    assert_eq!(after, before, "clade's host network state changed over the test");
}

/// Egress rules (E2B's allow/deny lists): enforced by the host in the sandbox's own namespace, where the sandbox's
/// root (no CAP_NET_ADMIN) cannot change them. Control first: without rules the outside and the host answer.
#[test]
fn privileged_guest_net_egress_rules_deny_and_allow() {
    use clade_core::backend::EgressRules;
    let Some(e) = env("rules") else { return };
    let outside = Outside::at("r", 216);
    let (out_port, _) = listen(Some(outside.ns.clone()), "10.216.0.2");
    // A second destination: another outside host.
    let other = Outside::at("s", 218);
    let (host_port, _) = listen(Some(other.ns.clone()), "10.218.0.2");
    let gw = "10.218.0.2".to_string();
    let mut sb = e.backend.cold_start_ct(&e.image, &id("rules")).expect("cold start");
    let reach = |sb: &CtSandbox, host: &str, port: u16| sh(sb, &nc(host, port, "x")).1 == "pong x";
    assert!(reach(&sb, "10.216.0.2", out_port) && reach(&sb, &gw, host_port), "control: no rules, both answer");

    let deny_outside = EgressRules { allow: vec![], deny: vec!["10.216.0.2".into()] };
    sb.set_egress_rules(&deny_outside).expect("deny one address");
    assert!(!reach(&sb, "10.216.0.2", out_port), "a denied address must not answer");
    assert!(reach(&sb, &gw, host_port), "what is not denied still answers");

    let only_outside = EgressRules { allow: vec!["10.216.0.0/30".into()], deny: vec!["0.0.0.0/0".into()] };
    sb.set_egress_rules(&only_outside).expect("deny all but one block");
    assert!(reach(&sb, "10.216.0.2", out_port), "an allowed block answers though everything is denied");
    assert!(!reach(&sb, &gw, host_port), "everything else is denied");
    assert!(sh(&sb, "ip link set eth0 down 2>/dev/null; echo $?").1 != "0", "the sandbox cannot change its network");

    sb.set_egress_rules(&EgressRules::default()).expect("clear");
    assert!(reach(&sb, &gw, host_port) && reach(&sb, "10.216.0.2", out_port), "cleared: both answer again");
    let bad = EgressRules { allow: vec!["example.com".into()], deny: vec![] };
    let err = sb.set_egress_rules(&bad).expect_err("a name is not an address");
    assert!(err.to_string().contains("IPv4"), "{err}");
    Box::new(sb).kill().expect("kill");
}
