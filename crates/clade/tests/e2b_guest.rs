//! The official E2B SDKs against `clade serve --e2b-api --e2b-sandbox`, with real supervisors and real sandboxes:
//! the Python SDK's whole flow (tests/e2b/sdk_flow.py: create, commands, streaming, files, a cut stream and
//! Connect, stdin, list with metadata, timeout, pause/resume, fork, snapshot and create from it, unknown template,
//! wrong key, envd of a killed sandbox) on `ct`, the JS SDK's smoke test (tests/e2b/smoke.mjs) on `ct`, and the
//! Python flow once on `vm`. The base is the `minimal` template, built in a temp home that borrows the real
//! home's kernel, CRIU and debootstrap caches.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{clade, real_home};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ok(home: &Path, args: &[&str]) -> String {
    let (code, out, err) = clade(home, args);
    assert_eq!(code, 0, "clade {args:?} failed: {err}{out}");
    out
}

struct Serve {
    child: Child,
    api: String,
    envd: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(home: &Path) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["serve", "--listen", "127.0.0.1:0", "--e2b-api", "127.0.0.1:0", "--e2b-sandbox", "127.0.0.1:0"])
        .env("CLADE_HOME", home)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let (mut api, mut envd) = (None, None);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            break;
        }
        eprint!("serve: {line}");
        if let Some(rest) = line.trim().strip_prefix("clade serve: E2B API on ") {
            // "http://A, envd on http://B (keys: ...)"
            let mut parts = rest.split(", envd on ");
            api = parts.next().map(str::to_owned);
            envd = parts.next().and_then(|s| s.split_whitespace().next()).map(str::to_owned);
        }
        if line.contains("ready") {
            break;
        }
    }
    std::thread::spawn(move || {
        let mut l = String::new();
        while err.read_line(&mut l).map(|n| n > 0).unwrap_or(false) {
            eprint!("serve: {l}");
            l.clear();
        }
    });
    Serve { child, api: api.expect("clade serve printed the E2B API address"), envd: envd.expect("envd address") }
}

/// A temp home borrowing the real one's kernel, CRIU, accelerator probe and pristine debootstraps.
fn test_home() -> tempfile::TempDir {
    let real = real_home();
    let t = tempfile::Builder::new().prefix("clade-e2b").tempdir_in("/var/tmp").unwrap();
    for d in ["kernel", "criu"] {
        if real.join(d).exists() {
            std::os::unix::fs::symlink(real.join(d), t.path().join(d)).unwrap();
        }
    }
    std::fs::create_dir_all(t.path().join("cache")).unwrap();
    let _ = std::fs::copy(real.join("cache/accel.json"), t.path().join("cache/accel.json"));
    let tdir = t.path().join("templates");
    std::fs::create_dir_all(&tdir).unwrap();
    if let Ok(rd) = std::fs::read_dir(real.join("templates")) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.starts_with("debootstrap-") || n.starts_with("packages-") {
                let _ = std::os::unix::fs::symlink(e.path(), tdir.join(&n));
            }
        }
    }
    t
}

fn python() -> Option<PathBuf> {
    let py = real_home().join("py/bin/python");
    let ok = Command::new(&py).args(["-c", "import e2b"]).status().map(|s| s.success()).unwrap_or(false);
    ok.then_some(py)
}

fn node_modules() -> Option<PathBuf> {
    let m = real_home().join("node/node_modules");
    m.join("e2b/package.json").exists().then_some(m)
}

fn node() -> PathBuf {
    let private = real_home().join("node/node_modules/.bin/node");
    if private.exists() {
        private
    } else {
        PathBuf::from("node")
    }
}

fn run_sdk(mut cmd: Command, s: &Serve, key: &str, template: &str, what: &str) {
    let t = Instant::now();
    let out = cmd
        .env("E2B_API_KEY", key)
        .env("E2B_API_URL", format!("http://{}", s.api.trim_start_matches("http://")))
        .env("E2B_SANDBOX_URL", format!("http://{}", s.envd.trim_start_matches("http://")))
        .env("E2B_TEMPLATE", template)
        .current_dir(repo().join("crates/clade/tests/e2b"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{what} ({:.1} s):\n{stdout}{}", t.elapsed().as_secs_f64(), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("all passed"), "{what} failed");
    assert!(!stdout.contains("FAIL"), "{what} reported a failure");
}

fn build_base(h: &Path, backend: &str) {
    build_base_of(h, "minimal", backend)
}

fn build_base_of(h: &Path, template: &str, backend: &str) {
    let spec = repo().join("templates").join(template).join("template.toml");
    let t = Instant::now();
    ok(h, &["base", "build", spec.to_str().unwrap(), "--backend", backend]);
    eprintln!("{template} base on {backend} built in {:.1} s", t.elapsed().as_secs_f64());
}

fn nothing_left(h: &Path) {
    let (_, out, _) = clade(h, &["ls"]);
    let live: Vec<&str> = out.lines().skip(1).filter(|l| l.contains("running")).collect();
    assert!(live.is_empty(), "sandboxes left running: {live:?}");
}

fn can_run(backend: &str) -> Option<PathBuf> {
    let Some(py) = python() else {
        eprintln!("skip: no e2b Python SDK in {} (run ./x setup)", real_home().join("py").display());
        return None;
    };
    if backend == "ct" && !real_home().join("criu").exists() {
        eprintln!("skip: no CRIU (run ./x setup)");
        return None;
    }
    if backend == "vm"
        && (clade_vm::qemu::qemu_binary().is_none() || !real_home().join("kernel/current/vmlinux").exists())
    {
        eprintln!("skip: no QEMU or guest kernel (run ./x setup)");
        return None;
    }
    Some(py)
}

#[test]
fn guest_e2b_python_and_js_sdks_on_ct() {
    let Some(py) = can_run("ct") else { return };
    let t = test_home();
    let h = t.path();
    build_base(h, "ct");
    let key = ok(h, &["e2b", "key", "create"]).trim().to_string();
    assert!(key.starts_with("e2b_") && key.len() == 44, "{key}");
    let s = serve(h);
    let mut c = Command::new(py);
    c.arg("sdk_flow.py");
    run_sdk(c, &s, &key, "minimal:ct", "python sdk on ct");
    match node_modules() {
        Some(m) => {
            let mut c = Command::new(node());
            c.arg("smoke.mjs").env("NODE_PATH", m);
            run_sdk(c, &s, &key, "minimal:ct", "js sdk on ct");
        }
        None => panic!("no e2b npm package under {}/node (run ./x setup)", real_home().display()),
    }
    drop(s);
    nothing_left(h);
}

#[test]
fn guest_e2b_python_sdk_on_vm() {
    let Some(py) = can_run("vm") else { return };
    let t = test_home();
    let h = t.path();
    build_base(h, "vm");
    let key = ok(h, &["e2b", "key", "create"]).trim().to_string();
    let s = serve(h);
    let mut c = Command::new(&py);
    // The whole flow; under TCG each restore is seconds, so this is the slow one.
    c.arg("sdk_flow.py");
    run_sdk(c, &s, &key, "minimal:vm", "python sdk on vm");
    let mut c = Command::new(&py);
    c.arg("ports.py");
    run_sdk(c, &s, &key, "minimal:vm", "ports on vm through <port>-<id> hosts (a relay process in the guest)");
    let mut c = Command::new(&py);
    c.arg("pause_modes.py").env("HOME_DIR", "/root");
    run_sdk(c, &s, &key, "minimal:vm", "pause modes on vm (a filesystem-only pause boots the guest's disk cold)");
    drop(s);
    nothing_left(h);
}

/// E2B's `base` on ct through the Python SDK, on a home where nothing was built: the first create builds
/// clade's e2b-base template and its base from the shipped spec (crates/clade-api/src/e2b_base.rs), then the
/// default user is `user` in /home/user, root when asked, python/pip/curl/git/node are there, and `sudo -n`
/// makes `user` root (the template opts out of the ct jail's no_new_privs: docs/security.md). Then envd 0.6.4's file behaviours
/// (tests/e2b/files_parity.py): ownership by the user, metadata as xattrs, symlinks, signed URLs, watches;
/// the API's (tests/e2b/api_parity.py): list filters, metrics, Template.exists, a command's timeout, a PTY
/// reattached, a kill under a running command; ports (tests/e2b/ports.py); pause modes (tests/e2b/pause_modes.py).
#[test]
fn guest_e2b_base_template_on_ct() {
    let Some(py) = can_run("ct") else { return };
    // The template's package stage is cached in the real home first (minutes on a new host, once), as the
    // debootstrap is: the first create below then builds in about a second, inside the SDK's request timeout.
    let spec = repo().join("templates/e2b-base/template.toml");
    ok(&real_home(), &["template", "build", spec.to_str().unwrap()]);
    let t = test_home();
    let h = t.path();
    let key = ok(h, &["e2b", "key", "create"]).trim().to_string();
    let bases = || ok(h, &["base", "ls", "--json"]);
    assert!(!bases().contains("e2b-base"), "no base before the first create: {}", bases());
    let s = serve(h);
    let mut c = Command::new(&py);
    // sudo works on ct too: the template turns the jail's no_new_privs off ([jail] in its template.toml).
    c.arg("base_template.py").env("E2B_SUDO", "1");
    run_sdk(c, &s, &key, "base", "e2b base template on ct, built on first use");
    let mut c = Command::new(&py);
    c.arg("files_parity.py");
    run_sdk(
        c,
        &s,
        &key,
        "base",
        "envd 0.6.4 file behaviours on ct (owner, metadata, symlinks, signed URLs, watch entries)",
    );
    let mut c = Command::new(&py);
    c.arg("api_parity.py");
    let what = "list filters, metrics, Template.exists, timeouts, PTY reattach, a kill under a command";
    run_sdk(c, &s, &key, "base", what);
    let mut c = Command::new(&py);
    c.arg("ports.py");
    run_sdk(c, &s, &key, "base", "ports through <port>-<id> hosts (the sandbox's network namespace)");
    let mut c = Command::new(&py);
    c.arg("pause_modes.py");
    run_sdk(c, &s, &key, "base", "full and filesystem-only pause, reboot, filesystem-only snapshot and auto-pause");
    drop(s);
    assert!(bases().contains("e2b-base"), "the first create built e2b-base's ct base: {}", bases());
    nothing_left(h);
}

/// The "internet" of the network test: a namespace behind a veth from the host (10.215.0.1 here, 10.215.0.2
/// there) with a listener answering `pong` on 10.215.0.2. Sandbox traffic to it is NATed by clade's table and
/// routed by the host to the veth: nothing leaves the machine.
struct Outside {
    ns: common::hostnet::Netns,
    link: String,
    port: u16,
}

impl Outside {
    fn new() -> Outside {
        let ns = common::hostnet::Netns::new("e2bnet");
        let link = format!("e2bo{}", std::process::id() % 100_000);
        let ip = |args: &str| {
            let st = Command::new("ip").args(args.split_whitespace()).status().unwrap();
            assert!(st.success(), "ip {args}");
        };
        let _ = Command::new("ip").args(["link", "del", &link]).status();
        ip(&format!("link add {link} type veth peer name eth0 netns {}", ns.name));
        ip(&format!("addr add 10.215.0.1/30 dev {link}"));
        ip(&format!("link set {link} up"));
        ip(&format!("-n {} addr add 10.215.0.2/30 dev eth0", ns.name));
        ip(&format!("-n {} link set eth0 up", ns.name));
        let nsfile = std::fs::File::open(ns.path()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            nix::sched::setns(nsfile, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let l = std::net::TcpListener::bind(("10.215.0.2", 0)).unwrap();
            tx.send(l.local_addr().unwrap().port()).unwrap();
            for mut c in l.incoming().flatten() {
                let _ = std::io::Write::write_all(&mut c, b"pong\n");
            }
        });
        Outside { ns, link, port: rx.recv().unwrap() }
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.link]).status();
        let _ = &self.ns;
    }
}

/// E2B's network settings through the Python SDK (tests/e2b/network_rules.py): a template like E2B's base but
/// with egress, `update_network` denials, `allow_internet_access=False` with `allow_out`, and rules that hold
/// across a pause and resume; the control (no rules) reaches the outside first. ct: the rules are the
/// sandbox's namespace's; vm: its QEMU's (slirp opens its sockets there).
fn network_rules(backend: &str) {
    let Some(py) = can_run(backend) else { return };
    let t = test_home();
    let h = t.path();
    // e2b-base with egress on, under another name.
    let spec_dir = h.join("e2b-net");
    std::fs::create_dir_all(&spec_dir).unwrap();
    for f in ["sudoers", "provision.sh"] {
        std::fs::copy(repo().join("templates/e2b-base").join(f), spec_dir.join(f)).unwrap();
    }
    let spec = std::fs::read_to_string(repo().join("templates/e2b-base/template.toml")).unwrap();
    let spec = spec.replace("name = \"e2b-base\"", "name = \"e2b-net\"").replace("egress = false", "egress = true");
    assert!(spec.contains("egress = true"));
    std::fs::write(spec_dir.join("template.toml"), spec).unwrap();
    let t0 = Instant::now();
    ok(h, &["base", "build", spec_dir.join("template.toml").to_str().unwrap(), "--backend", backend]);
    eprintln!("e2b-net base on {backend} built in {:.1} s", t0.elapsed().as_secs_f64());
    let outside = Outside::new();
    let key = ok(h, &["e2b", "key", "create"]).trim().to_string();
    let s = serve(h);
    let mut c = Command::new(&py);
    c.arg("network_rules.py").env("OUTSIDE", format!("10.215.0.2:{}", outside.port));
    run_sdk(c, &s, &key, &format!("e2b-net:{backend}"), &format!("E2B network settings on {backend}"));
    drop(s);
    nothing_left(h);
}

#[test]
fn guest_e2b_network_rules_on_ct() {
    network_rules("ct");
}

#[test]
fn guest_e2b_network_rules_on_vm() {
    network_rules("vm");
}
