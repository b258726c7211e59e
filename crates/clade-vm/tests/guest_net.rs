//! Guest networking of the `vm` backend with real guests (docs/net.md): a guest of an `egress` template reaches a
//! TCP listener "outside" (a network namespace of the test's own behind a veth from the host) through QEMU's
//! user-mode network, whose QEMU runs in the sandbox's own network namespace (veth and NAT, as a ct sandbox's);
//! it cannot reach the host's loopback through slirp's host alias 10.0.2.2, nor the host at its namespace's
//! gateway (a listener on all the host's addresses is the control: the host itself reaches it there); two siblings restored at once from its mark, both with the mark's address
//! 10.0.2.15, reach the outside concurrently, each from its own namespace; egress rules deny and allow; a guest
//! without network has no NIC and no route and cannot connect; after kill no QEMU and no namespace is left.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, MarkOptions, Sandbox, Shape, TemplateImage};
use clade_core::hygiene;

/// Exit code, stdout and stderr of a shell line in the guest.
fn sh(sbx: &dyn Sandbox, script: &str) -> (i32, String, String) {
    let out = sbx
        .agent()
        .run(ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() })
        .unwrap();
    (
        out.status.code.unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

fn ip(args: &str) {
    let st = std::process::Command::new("ip").args(args.split_whitespace()).status().unwrap();
    assert!(st.success(), "ip {args}");
}

/// A network namespace standing in for the internet: 10.217.0.2 behind a veth to the host (10.217.0.1).
struct Outside {
    ns: String,
    link: String,
}

impl Outside {
    fn new() -> Outside {
        let tag = std::process::id() % 100_000;
        let o = Outside { ns: format!("vmnet-out-{tag}"), link: format!("vmout{tag}") };
        let _ = std::process::Command::new("ip").args(["netns", "del", &o.ns]).status();
        ip(&format!("netns add {}", o.ns));
        ip(&format!("link add {} type veth peer name eth0 netns {}", o.link, o.ns));
        ip(&format!("addr add 10.217.0.1/30 dev {}", o.link));
        ip(&format!("link set {} up", o.link));
        ip(&format!("-n {} addr add 10.217.0.2/30 dev eth0", o.ns));
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

/// A listener on `addr` (in network namespace `netns` when given) that answers each connection's first line with
/// `pong <line>` and records the lines.
fn listener(netns: Option<&str>, addr: &'static str) -> (u16, Arc<Mutex<Vec<String>>>) {
    let netns = netns.map(|n| std::fs::File::open(format!("/run/netns/{n}")).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        if let Some(f) = netns {
            nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        }
        let l = TcpListener::bind((addr, 0)).unwrap();
        tx.send(l.local_addr().unwrap().port()).unwrap();
        for conn in l.incoming().flatten() {
            let seen = seen2.clone();
            std::thread::spawn(move || {
                let mut line = String::new();
                let mut r = BufReader::new(conn.try_clone().unwrap());
                if r.read_line(&mut line).is_ok() {
                    let line = line.trim().to_string();
                    let mut w = conn;
                    let _ = writeln!(w, "pong {line}");
                    seen.lock().unwrap().push(line);
                }
            });
        }
    });
    (rx.recv().unwrap(), seen)
}

/// Exit code, stdout, stderr.
type Answer = (i32, String, String);

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

#[test]
fn guest_vm_net_egress_siblings_and_none() {
    let Some(common::VmEnv { work, store: _, home, shm: _, backend, disk }) = common::vm_env("clade-vmnet") else {
        return;
    };
    let w = work.path();
    let image = |egress| TemplateImage {
        name: "busybox-net".into(),
        hash: "test".into(),
        rootfs: w.join("root"),
        disk_manifest: Some(disk.clone()),
        shape: Shape { memory_mib: 256, vcpus: 1, disk_gib: 1 },
        egress,
        no_new_privs: true,
    };
    let outside = Outside::new();
    let (port, seen) = listener(Some(&outside.ns), "10.217.0.2");
    let (host_port, host_seen) = listener(None, "0.0.0.0");
    let tag = std::process::id();
    let connect = |who: &str| format!("echo {who} | /bin/busybox nc -w 5 10.217.0.2 {port}");

    // Egress: the guest is configured by the initramfs and reaches the host.
    let t = Instant::now();
    let mut cold = backend.cold_start(&image(true), &hygiene::new_identity(&format!("t{tag}ncold"), 0)).unwrap();
    eprintln!("cold start with network: {:?}", t.elapsed());
    let (_, addr, _) = sh(cold.as_ref(), "/bin/busybox ip -4 addr show eth0");
    assert!(addr.contains("inet 10.0.2.15/24"), "eth0: {addr}");
    let (_, route, _) = sh(cold.as_ref(), "/bin/busybox ip route");
    assert!(route.contains("default via 10.0.2.2"), "routes: {route}");
    let (code, out, err) = sh(cold.as_ref(), &connect("cold"));
    assert_eq!((code, out.as_str()), (0, "pong cold"), "{err}");
    // slirp's host alias is the loopback of the namespace QEMU runs in, never the host's: a listener on the
    // host's loopback (the control: the host reaches it) is out of the guest's reach.
    let reach_host = format!("echo escaped | /bin/busybox nc -w 3 10.0.2.2 {host_port}");
    let (_, out, _) = sh(cold.as_ref(), &reach_host);
    assert!(!out.contains("pong"), "the guest reached the host's loopback through 10.0.2.2: {out}");
    // Nor the host at any address of its own: the gateway of the QEMU's namespace is the host's end of its veth.
    let ns = clade_core::sandbox_net::netns_path_of(cold.id());
    let ns_name = ns.file_name().unwrap().to_string_lossy().to_string();
    let route = std::process::Command::new("ip").args(["-n", &ns_name, "route", "show", "default"]).output().unwrap();
    let route = String::from_utf8_lossy(&route.stdout).to_string();
    let gw = route.split_whitespace().nth(2).expect("a default route in the QEMU's namespace").to_string();
    let (_, out, _) = sh(cold.as_ref(), &format!("echo escaped | /bin/busybox nc -w 3 {gw} {host_port}"));
    assert!(!out.contains("pong"), "the guest reached the host at {gw}: {out}");
    let mut ctl = std::net::TcpStream::connect((gw.as_str(), host_port)).unwrap();
    writeln!(ctl, "control").unwrap();
    let mut line = String::new();
    BufReader::new(ctl).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "pong control", "the control: the host listener answers at that address");
    assert!(!host_seen.lock().unwrap().iter().any(|l| l == "escaped"));
    // Egress rules hold in the QEMU's namespace: a denied address does not answer, an allowed one does.
    use clade_core::backend::EgressRules;
    let deny = EgressRules { allow: vec![], deny: vec!["10.217.0.2".into()] };
    cold.set_egress_rules(&deny).expect("deny the outside");
    let (_, out, _) = sh(cold.as_ref(), &connect("denied"));
    assert!(!out.contains("pong"), "a denied address answered: {out}");
    let allow = EgressRules { allow: vec!["10.217.0.0/30".into()], deny: vec!["0.0.0.0/0".into()] };
    cold.set_egress_rules(&allow).expect("allow only the outside");
    assert_eq!(sh(cold.as_ref(), &connect("allowed")).1, "pong allowed");
    cold.set_egress_rules(&EgressRules::default()).expect("clear the rules");
    let mark = cold.mark(&MarkOptions::default()).unwrap();
    assert_eq!(mark.manifests.get(clade_vm::net::ROLE_NETWORK).map(String::as_str), Some("egress"));
    // The marked sandbox runs on as a clone, still networked.
    assert_eq!(sh(cold.as_ref(), &connect("after-mark")).1, "pong after-mark");

    // Two siblings restored at once; both keep 10.0.2.15 and connect concurrently.
    let sibs: Vec<(Box<dyn Sandbox>, Duration)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let (backend, mark) = (&backend, &mark);
                s.spawn(move || {
                    let id = hygiene::new_identity(&format!("t{tag}ns{i}"), 1);
                    let t = Instant::now();
                    let sbx = backend.restore(mark, &id).unwrap();
                    let took = t.elapsed();
                    hygiene::apply(sbx.agent(), &id, true).unwrap();
                    (sbx, took)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (_, took)) in sibs.iter().enumerate() {
        eprintln!("sibling {i} restored with network in {took:?}");
    }
    // Each sibling's connection runs on its own thread, all at once (the sandbox moves there and back).
    let (sibs, answers): (Vec<Box<dyn Sandbox>>, Vec<Answer>) = std::thread::scope(|s| {
        let hs: Vec<_> = sibs
            .into_iter()
            .enumerate()
            .map(|(i, (sbx, _))| {
                let script = format!(
                    "/bin/busybox ip -4 addr show eth0 | /bin/busybox grep -q 'inet 10.0.2.15/' && {}",
                    connect(&format!("sib{i}"))
                );
                s.spawn(move || {
                    let r = sh(sbx.as_ref(), &script);
                    (sbx, r)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).unzip()
    });
    for (i, (code, out, err)) in answers.iter().enumerate() {
        assert_eq!((*code, out.as_str()), (0, format!("pong sib{i}").as_str()), "sibling {i}: {err}");
    }
    {
        let seen = seen.lock().unwrap();
        for who in ["cold", "after-mark", "sib0", "sib1"] {
            assert!(seen.iter().any(|l| l == who), "the listener saw {seen:?}");
        }
    }
    let mut pids: Vec<u32> = cold.pids();
    for s in &sibs {
        pids.extend(s.pids());
    }
    assert_eq!(pids.len(), 3);
    // User-mode networking runs inside QEMU: each QEMU of an egress guest runs in its sandbox's own network
    // namespace (not the host's, not a sibling's), with the host's resolv.conf copied into its chroot (libslirp
    // reads it after the chroot).
    let netns = |p: u32| std::fs::read_link(format!("/proc/{p}/ns/net")).unwrap();
    let host_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let spaces: std::collections::BTreeSet<_> = pids.iter().map(|p| netns(*p)).collect();
    assert!(!spaces.contains(&host_ns), "a QEMU of an egress guest is in the host's network namespace");
    assert_eq!(spaces.len(), 3, "each sandbox has its own network namespace: {spaces:?}");
    for id in [cold.id().to_string()].into_iter().chain(sibs.iter().map(|s| s.id().to_string())) {
        assert!(clade_core::sandbox_net::netns_path_of(&id).exists(), "{id}'s namespace is clade-{id}");
    }
    for s in &sibs {
        let jail = home.run_dir().join(s.id()).join("qemu/jail");
        assert!(jail.join("etc/resolv.conf").is_file(), "{} holds etc/resolv.conf", jail.display());
    }
    for s in sibs {
        s.kill().unwrap();
    }
    cold.kill().unwrap();

    // No network: no NIC, no route, the connection fails.
    let none = backend.cold_start(&image(false), &hygiene::new_identity(&format!("t{tag}nnone"), 0)).unwrap();
    let (_, links, _) = sh(none.as_ref(), "/bin/busybox ip -o link");
    assert!(!links.contains("eth0"), "a guest without network has a NIC: {links}");
    let (_, route, _) = sh(none.as_ref(), "/bin/busybox ip route");
    assert!(!route.contains("default"), "routes: {route}");
    let (code, out, _) = sh(none.as_ref(), &connect("none"));
    assert!(code != 0 && !out.contains("pong"), "a guest without network connected: {code} {out}");
    assert_ne!(netns(none.pids()[0]), host_ns, "a QEMU without egress has its own network namespace");
    pids.extend(none.pids());
    none.kill().unwrap();
    assert!(!seen.lock().unwrap().iter().any(|l| l == "none"));

    // Nothing left: every QEMU ended, no run dir.
    let t = Instant::now();
    while pids.iter().any(|p| alive(*p)) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(pids.iter().all(|p| !alive(*p)), "QEMU processes left: {pids:?}");
    for id in ["ncold", "ns0", "ns1", "nnone"] {
        assert!(!home.run_dir().join(format!("t{tag}{id}")).exists(), "run dir of {id} left");
        let left = clade_core::sandbox_net::leftovers_of_id(&format!("t{tag}{id}"));
        assert!(left.is_empty(), "network of {id} left: {left:?}");
    }
}
