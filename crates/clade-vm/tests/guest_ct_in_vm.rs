//! clade's ct jail on a cgroup v2 host with Debian's own kernel: the ct escape suite
//! (`crates/clade-ct/tests/guest_jail.rs`: cold, restored sibling and grandchild, the unjailed control) run inside
//! a clade `vm` guest booted with the kernel `./x setup` installed, with only cgroup2 mounted. This project's
//! hosts are cgroup v1 on another kernel; most users' are v2. The same guest then runs the incremental-mark test
//! (`crates/clade-ct/tests/guest_predump.rs`), since that kernel tracks dirty pages and these hosts' do not.
//! About 40 s under TCG. `./x test` passes the built test binaries as `CT_JAIL_TEST_BIN` and
//! `CT_PREDUMP_TEST_BIN` (scripts/test.sh); without the first the test says so and skips. `CLADE_GUEST_KERNEL`
//! boots another extracted kernel instead (scripts/guest-kernel.sh; `./x bench scale` boots Debian trixie's for
//! the browser's mark pause, docs/scale.md).
mod common;

use std::path::Path;

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, Shape, TemplateImage};
use common::*;

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    let st = std::process::Command::new("cp").arg("-a").arg(from).arg(to).status().unwrap();
    assert!(st.success(), "cp -a {} {}", from.display(), to.display());
}

#[test]
fn guest_ct_jail_suite_in_a_cgroup_v2_vm() {
    let Some(bin) = std::env::var_os("CT_JAIL_TEST_BIN") else {
        eprintln!("skip: set CT_JAIL_TEST_BIN to the built guest_jail test binary");
        return;
    };
    let Some(agent) = agent_binary() else { return };
    let home = home();
    if clade_vm::qemu::qemu_binary().is_none() || !home.join("kernel/current/modules").is_dir() {
        eprintln!("skip: no QEMU or guest kernel with its modules (run ./x setup)");
        return;
    }
    let chome = clade_core::CladeHome::at(home.clone());
    // Another kernel (module doc) boots through a home of its own whose `kernel/current` is that one. Its cache
    // is its own too: the accelerator probe's one entry is keyed by kernel release, and sharing it would make
    // the next run on setup's kernel probe again.
    let other_kernel = std::env::var_os("CLADE_GUEST_KERNEL").filter(|k| !k.is_empty()).map(std::path::PathBuf::from);
    let kernel = other_kernel.clone().unwrap_or_else(|| home.join("kernel/current"));
    let testroot = clade_ct::testroot::ensure(&chome, &agent).expect("the ct test rootfs");
    let work = tempfile::Builder::new().prefix("clade-ctvm").tempdir_in("/var/tmp").unwrap();
    let w = work.path();
    // A busybox root (every applet) with GNU cp (xattrs), the test binary and its libraries, CRIU and the test
    // rootfs where the ct tests look for them.
    let root = w.join("root");
    let img = w.join("root.img");
    clade_vm::testkit::busybox_root_image(w, &agent, &w.join("scratch.img"), 64).unwrap();
    let list = std::process::Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let link = root.join("bin").join(applet);
        if !link.exists() {
            std::os::unix::fs::symlink("busybox", link).unwrap();
        }
    }
    std::fs::remove_file(root.join("bin/cp")).ok();
    clade_vm::testkit::install_with_libs(Path::new("/bin/cp"), &root, "/bin/cp").unwrap();
    clade_vm::testkit::install_with_libs(Path::new(&bin), &root, "/opt/guest_jail").unwrap();
    // Incremental marks (crates/clade-ct/tests/guest_predump.rs) where the kernel tracks dirty pages.
    let predump = std::env::var_os("CT_PREDUMP_TEST_BIN");
    match &predump {
        Some(p) => clade_vm::testkit::install_with_libs(Path::new(p), &root, "/opt/guest_predump").unwrap(),
        None => eprintln!("note: CT_PREDUMP_TEST_BIN is not set, so the pre-dump test does not run in the guest"),
    }
    // Debian's kernel has these as modules: overlayfs, what CRIU's kernel feature probe creates (a tun
    // device, a veth pair, an nftables set) and the socket-diag modules CRIU collects sockets with, in load
    // order.
    let mut insmod = String::new();
    for m in [
        "fs/overlayfs/overlay",
        "lib/libcrc32c",
        "net/netfilter/nfnetlink",
        "net/netfilter/nf_tables",
        "drivers/net/tun",
        "drivers/net/veth",
        "net/unix/unix_diag",
        "net/netlink/netlink_diag",
        "net/packet/af_packet_diag",
        "net/ipv4/inet_diag",
        "net/ipv4/tcp_diag",
        "net/ipv4/udp_diag",
        "net/ipv4/raw_diag",
        "net/ipv4/netfilter/nf_defrag_ipv4",
        "net/ipv6/netfilter/nf_defrag_ipv6",
        "net/netfilter/nf_conntrack",
        "net/netfilter/nf_conntrack_netlink",
    ] {
        let name = Path::new(m).file_name().unwrap().to_string_lossy().to_string();
        let ko = kernel.join(format!("modules/kernel/{m}.ko"));
        if other_kernel.is_some() && !ko.exists() {
            eprintln!("note: {} has no module {m} (built in or gone): not loaded", kernel.display());
            continue;
        }
        std::fs::copy(&ko, root.join(format!("{name}.ko"))).expect("a guest kernel module");
        insmod.push_str(&format!("insmod /{name}.ko; "));
    }
    copy_tree(&home.join("criu"), &root.join("var/lib/clade/criu"));
    copy_tree(&testroot, &root.join("var/lib/clade/tmp/ct-test-rootfs"));
    // `./x bench scale` also measures the browser template's own mark pause here (guest_predump's
    // guest_browser_mark_pause_with_and_without_predump): its built rootfs goes in too, with room to run it.
    let browser = std::env::var_os("CT_BROWSER_ROOTFS_HOST").filter(|_| predump.is_some());
    if let Some(b) = &browser {
        copy_tree(Path::new(b), &root.join("var/lib/clade/browser-rootfs"));
    }
    let st = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(&root)
        .arg(&img)
        .arg(if browser.is_some() { "3072M" } else { "1024M" })
        .status()
        .unwrap();
    assert!(st.success());
    let store = clade_store::Store::open(&w.join("store"), clade_store::StoreConfig::default()).unwrap();
    let disk = store.put_file(&img, clade_store::ImageKind::Disk).unwrap().id.unwrap().to_string();
    let shm = tempfile::Builder::new().prefix("clade-ctvm-shm").tempdir_in("/dev/shm").unwrap();
    let vhome = match &other_kernel {
        Some(k) => {
            let h = w.join("home");
            std::fs::create_dir_all(h.join("kernel")).unwrap();
            std::os::unix::fs::symlink(k, h.join("kernel/current")).unwrap();
            clade_core::CladeHome::at(h)
        }
        None => chome.clone(),
    };
    let backend = clade_vm::backend::VmBackend::open(&vhome, store, Some(shm.path().to_path_buf())).unwrap();
    let image = TemplateImage {
        name: "ct-in-vm".into(),
        hash: "test".into(),
        rootfs: root.clone(),
        disk_manifest: Some(disk),
        shape: Shape { memory_mib: if browser.is_some() { 4096 } else { 2048 }, vcpus: 2, disk_gib: 1 },
        egress: false,
        no_new_privs: true,
    };
    let id = clade_core::hygiene::new_identity(&format!("ctvm{}", std::process::id()), 0);
    let sb = backend.cold_start(&image, &id).expect("boot the guest");
    let script = insmod
        + "set -e; uname -r; mount -t cgroup2 none /sys/fs/cgroup; grep cgroup /proc/mounts; \
                  mkdir -p /dev/shm; grep -q ' /dev/shm ' /proc/mounts || mount -t tmpfs tmpfs /dev/shm; \
                  cd /; CLADE_HOME=/var/lib/clade CLADE_TEST_HOME=/var/lib/clade \
                  CLADE_AGENT_BIN=/usr/lib/clade/clade-agent CLADE_EXPECT_SOFT_DIRTY=1 RUST_BACKTRACE=1 \
                  /opt/guest_jail --test-threads=1 2>&1; \
                  if [ -x /opt/guest_predump ]; then CLADE_HOME=/var/lib/clade CLADE_TEST_HOME=/var/lib/clade \
                  CLADE_AGENT_BIN=/usr/lib/clade/clade-agent CLADE_EXPECT_SOFT_DIRTY=1 RUST_BACKTRACE=1 \
                  /opt/guest_predump --nocapture guest_incremental_mark 2>&1; \
                  CLADE_HOME=/var/lib/clade CLADE_TEST_HOME=/var/lib/clade CLADE_AGENT_BIN=/usr/lib/clade/clade-agent \
                  /opt/guest_predump --nocapture guest_freeze 2>&1; fi"
        + &if browser.is_some() {
            // CRIU's timestamped log, where the browser's pauses go, when asked for (CLADE_CRIU_VERBOSE=1).
            let verbose = if std::env::var_os("CLADE_CRIU_VERBOSE").is_some() { "CLADE_CRIU_VERBOSE=1" } else { "" };
            format!(
                "; CLADE_HOME=/var/lib/clade CLADE_TEST_HOME=/var/lib/clade CLADE_AGENT_BIN=/usr/lib/clade/clade-agent \
                 CT_BROWSER_ROOTFS=/var/lib/clade/browser-rootfs RUST_BACKTRACE=1 {verbose} \
                 /opt/guest_predump --nocapture guest_browser 2>&1"
            )
        } else {
            String::new()
        };
    let spec = ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script], ..Default::default() };
    let out = sb.agent().run(spec).unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cgroup2") && !text.contains(" cgroup "), "only cgroup v2 is mounted: {text}");
    eprintln!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let _ = Box::new(sb).kill();
    assert_eq!(out.status.code, Some(0));
    // The escape suite, and Debian's kernel tracking dirty pages as `clade doctor` probes it.
    // (guest_jail's 5 tests: the escape suite, its control, the agent-socket link, no_new_privs off for
    // setuid, and the dirty-page probe.)
    assert!(text.contains("test result: ok. 5 passed"), "{text}");
    // Incremental marks: pre-dumped, at most half the full mark's pause, every page in the siblings (run alone,
    // as its pause figures want); then the cgroup v2 freezer.
    if predump.is_some() {
        let runs = if browser.is_some() { 3 } else { 2 };
        assert_eq!(text.matches("test result: ok. 1 passed").count(), runs, "{text}");
    }
}
