//! VM templating with a real QEMU guest (TCG or KVM as `clade doctor` chose): boot a busybox guest whose RAM is a
//! shared tmpfs file, save its device state, start three clones mapping that RAM privately, and check that each
//! clone continues the guest's own program (its tick counter goes on from where the base stopped) and that the
//! clones share their clean pages (PSS well under RSS).

use std::path::Path;
use std::time::{Duration, Instant};

use clade_vm::initramfs::Initramfs;
use clade_vm::machine::{MachineType, RamBacking, Vm, VmSpec};

mod common;
use common::{accel, home};

fn wait_console(vm: &Vm, needle: &str, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if vm.console().contains(needle) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn last_tick(console: &str) -> Option<u64> {
    console.lines().rev().find_map(|l| l.trim().strip_prefix("tick ")?.parse().ok())
}

fn spec(kernel: &Path, initrd: &Path, ram: &Path, share: bool, incoming: bool) -> VmSpec {
    VmSpec {
        accel: accel(),
        machine: MachineType::Q35,
        memory_mib: 256,
        vcpus: 1,
        kernel: kernel.to_path_buf(),
        initrd: Some(initrd.to_path_buf()),
        append: "console=ttyS0 rdinit=/init panic=-1 quiet".into(),
        ram: RamBacking { path: ram.to_path_buf(), share },
        disks: vec![],
        agent_socket: None,
        vmgenid: true,
        incoming,
        devstate_only: false,
        net: None,
    }
}

#[test]
fn guest_clones_continue_the_base_and_share_its_pages() {
    let kernel = home().join("kernel/current/vmlinux");
    let Some(qemu) = clade_vm::qemu::qemu_binary() else {
        eprintln!("skip: no qemu-system-x86_64 (run ./x setup)");
        return;
    };
    if !kernel.exists() {
        eprintln!("skip: no guest kernel (run ./x setup)");
        return;
    }
    let work = tempfile::Builder::new().prefix("clade-vm-test").tempdir_in("/dev/shm").unwrap();
    let initrd = work.path().join("initrd.cpio");
    let mut img = Initramfs::new();
    img.dir("bin").dir("proc").host_file("bin/busybox", Path::new("/bin/busybox")).unwrap();
    img.file(
        "init",
        0o755,
        b"#!/bin/busybox sh\n/bin/busybox mount -t proc proc /proc\necho BOOTED\ni=0\nwhile true; do i=$((i+1)); echo \"tick $i\"; /bin/busybox usleep 100000; done\n",
    );
    img.write_to(&initrd).unwrap();
    let ram = work.path().join("base.ram");

    let mut base = Vm::spawn(&qemu, spec(&kernel, &initrd, &ram, true, false), &work.path().join("base")).unwrap();
    assert!(wait_console(&base, "tick 5", Duration::from_secs(60)), "base never ticked: {}", base.console());
    let state = work.path().join("base.state");
    let saved = clade_vm::templating::save_device_state(&mut base, &state).unwrap();
    let base_tick = last_tick(&base.console()).unwrap();
    drop(base);
    eprintln!("saved device state: {saved:?}");
    assert!(saved.state_bytes < 4 << 20, "device state should exclude RAM, got {} bytes", saved.state_bytes);

    let mut clones = Vec::new();
    for i in 0..3 {
        let run = work.path().join(format!("clone{i}"));
        let (vm, stats) =
            clade_vm::templating::restore(&qemu, spec(&kernel, &initrd, &ram, false, true), &state, &run).unwrap();
        eprintln!("clone {i}: {stats:?}");
        clones.push(vm);
    }
    for vm in &clones {
        let next = format!("tick {}", base_tick + 3);
        assert!(wait_console(vm, &next, Duration::from_secs(30)), "clone did not continue: {}", vm.console());
        // The clone's console starts after the restore: it never printed the boot banner.
        assert!(!vm.console().contains("BOOTED"));
    }
    let (mut pss, mut rss) = (0u64, 0u64);
    for vm in &clones {
        let (p, r) = clade_core::host::pss_rss(vm.pid()).unwrap();
        pss += p;
        rss += r;
    }
    eprintln!("3 clones: PSS {} MiB, RSS {} MiB, ratio {:.2}", pss >> 20, rss >> 20, pss as f64 / rss as f64);
    assert!((pss as f64) < 0.8 * rss as f64, "clones do not share pages: PSS {pss} RSS {rss}");

    // Mark a running clone (its RAM is a private mapping): device state alone plus its diverged pages.
    let mut clone = clones.remove(0);
    drop(clones);
    std::thread::sleep(Duration::from_millis(500));
    let cstate = work.path().join("clone.state");
    let mark = clade_vm::templating::save_clone_state(&mut clone, &cstate).unwrap();
    let clone_tick = last_tick(&clone.console()).unwrap();
    eprintln!(
        "clone mark: pause {:.1} ms, device state {} KiB, {} diverged pages ({} KiB)",
        mark.stats.pause_ms,
        mark.stats.state_bytes >> 10,
        mark.pages.len(),
        mark.data.len() >> 10
    );
    assert!(!mark.pages.is_empty());
    assert!(mark.pages.len() < 256 * 256 / 2, "most of RAM diverged? {}", mark.pages.len());
    assert!(clone_tick > base_tick);
    // The clone runs on after its mark.
    clone.qmp.execute("cont", serde_json::json!({})).unwrap();
    assert!(wait_console(&clone, &format!("tick {}", clone_tick + 2), Duration::from_secs(30)));
    drop(clone);

    // A child of the clone's mark: base RAM file + the mark's pages + its device state.
    let mut s = spec(&kernel, &initrd, &ram, false, true);
    s.devstate_only = true;
    let (child, stats) = clade_vm::templating::restore_clone_mark(
        &qemu,
        s,
        &cstate,
        &mark.pages,
        &mark.data,
        &work.path().join("child"),
    )
    .unwrap();
    eprintln!("child of the clone's mark: {stats:?}");
    let want = format!("tick {}", clone_tick + 3);
    assert!(
        wait_console(&child, &want, Duration::from_secs(30)),
        "child did not continue the clone: {}",
        child.console()
    );
    let first = child.console().lines().find_map(|l| l.trim().strip_prefix("tick ")?.parse::<u64>().ok()).unwrap();
    assert_eq!(first, clone_tick + 1, "child must continue exactly where the clone was marked");
}
