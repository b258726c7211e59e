//! A host of its own on this machine, for the multihost tests (docs/roam.md, "Several machines"): a network
//! namespace (`ip netns`) that the host's clade commands, its `clade serve`, supervisors and sandboxes run in,
//! whose only way to the shared blob tier is a [`Link`]: a TCP relay listening on the namespace's own loopback
//! and forwarding to the Garage cluster on this machine's loopback. No traffic leaves loopback, the hosts cannot
//! reach each other or the store except through their link, and cutting a link cuts that host's network.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The environment variable through which a test names the namespace a clade command runs in (read by
/// [`super::clade_cmd`], not passed on to clade).
pub const NETNS_VAR: &str = "CLADE_TEST_NETNS";

/// A network namespace made for a test, removed when dropped.
pub struct Netns {
    pub name: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip (iproute2)");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let name = format!("clade-{tag}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        Netns { name }
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Run `f` on a thread inside the namespace (sockets it makes stay in it).
    pub fn within<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let ns = std::fs::File::open(self.path()).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                f()
            })
            .join()
            .unwrap()
        })
    }

    /// Whether a TCP connection to `port` on this namespace's loopback succeeds.
    pub fn reaches(&self, port: u16) -> bool {
        self.within(|| TcpStream::connect(("127.0.0.1", port)).is_ok())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// A TCP relay to the store that can be cut (every connection reset, new ones refused) and restored: the
/// network between one host and the blob tier. It counts the bytes going up.
pub struct Link {
    pub port: u16,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    up: Arc<AtomicU64>,
}

impl Link {
    /// A relay listening on `ns`'s loopback, forwarding to `target` on this machine's loopback.
    pub fn into(ns: &Netns, target: u16) -> Link {
        Self::serve(ns.within(|| TcpListener::bind("127.0.0.1:0").unwrap()), target)
    }

    fn serve(lis: TcpListener, target: u16) -> Link {
        let port = lis.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let up = Arc::new(AtomicU64::new(0));
        let (c2, k2, u2) = (cut.clone(), conns.clone(), up.clone());
        // This thread is in the test's own namespace: its connections to the store are made there.
        std::thread::spawn(move || {
            for s in lis.incoming() {
                let Ok(client) = s else { continue };
                if c2.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(up) = TcpStream::connect(("127.0.0.1", target)) else { continue };
                let mut k = k2.lock().unwrap();
                k.push(client.try_clone().unwrap());
                k.push(up.try_clone().unwrap());
                let pairs =
                    [(client.try_clone().unwrap(), up.try_clone().unwrap(), Some(u2.clone())), (up, client, None)];
                for (mut from, mut to, count) in pairs {
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 65536];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            if let Some(c) = &count {
                                c.fetch_add(n as u64, Ordering::SeqCst);
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Link { port, cut, conns, up }
    }

    /// Bytes relayed from the host to the store so far.
    pub fn up(&self) -> u64 {
        self.up.load(Ordering::SeqCst)
    }

    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// A host's network: its namespace and its link to the Garage cluster, and the environment its clade commands
/// run with (the blob tier through the link, the namespace).
pub struct HostNet {
    pub link: Link,
    pub ns: Netns,
}

impl HostNet {
    /// A namespace whose link leads to `g`'s first node. Checks that the namespace is one: the store is not
    /// reachable from it except through the link (the control: it is from the test's own namespace).
    pub fn new(tag: &str, g: &clade_store::testkit::Garage) -> HostNet {
        let ns = Netns::new(tag);
        let target = g.nodes[0].s3_port;
        let link = Link::into(&ns, target);
        assert!(TcpStream::connect(("127.0.0.1", target)).is_ok(), "the store answers on this machine's loopback");
        assert!(!ns.reaches(target), "{}: the store must not be reachable except through the link", ns.name);
        assert!(ns.reaches(link.port), "{}: the link answers in the namespace", ns.name);
        HostNet { link, ns }
    }

    /// `g`'s environment with the endpoint through the link, and the namespace to run in.
    pub fn env(&self, g: &clade_store::testkit::Garage) -> super::Env {
        let mut env = g.env();
        env.retain(|(k, _)| *k != "CLADE_BLOB_ENDPOINT");
        env.push(("CLADE_BLOB_ENDPOINT", format!("http://127.0.0.1:{}", self.link.port)));
        env.push((NETNS_VAR, self.ns.name.clone()));
        env
    }
}
