//! The guest boot path with a real QEMU: clade's initramfs loads the modules, finds the root disk on an NBD
//! export over a unix socket, mounts the ext4 root and switch_roots to the init named on the command line.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use clade_vm::machine::{MachineType, NbdDisk, RamBacking, Vm, VmSpec};

mod common;
use common::{accel, home, Child};

fn boot_root(machine: MachineType) {
    let kdir = home().join("kernel/current");
    let Some(qemu) = clade_vm::qemu::qemu_binary() else {
        eprintln!("skip: no qemu-system-x86_64 (run ./x setup)");
        return;
    };
    if !kdir.join("modules/modules.dep").exists() {
        eprintln!("skip: no guest kernel with modules.dep (run ./x setup)");
        return;
    }
    let work = tempfile::Builder::new().prefix("clade-boot-test").tempdir_in("/dev/shm").unwrap();
    let w = work.path();
    let initrd = w.join("initrd.cpio");
    clade_vm::boot::build_initramfs(&kdir, Path::new("/bin/busybox"), machine, &initrd).unwrap();

    // A root filesystem made without mounting, as templates make theirs.
    let root = w.join("root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    std::fs::create_dir_all(root.join("proc")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::fs::write(
        root.join("testinit"),
        "#!/bin/busybox sh\n/bin/busybox mount -t proc proc /proc\necho \"ROOT-OK pid=$$ $(/bin/busybox cat /proc/mounts | /bin/busybox grep ' / ')\"\n/bin/busybox poweroff -f\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("testinit"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let img = w.join("root.img");
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(&root)
        .arg(&img)
        .arg("64M")
        .status()
        .unwrap();
    assert!(st.success());
    let sock = w.join("nbd.sock");
    let _server = Child(
        Command::new("qemu-nbd")
            .args(["-f", "raw", "-k"])
            .arg(&sock)
            .arg(&img)
            .spawn()
            .expect("qemu-nbd (qemu-utils) is installed by ./x setup"),
    );
    let start = Instant::now();
    while !sock.exists() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let spec = VmSpec {
        accel: accel(),
        machine,
        memory_mib: 256,
        vcpus: 1,
        kernel: kdir.join("vmlinux"),
        initrd: Some(initrd),
        append: "console=ttyS0 panic=-1 quiet clade.init=/testinit".into(),
        ram: RamBacking { path: w.join("ram"), share: true },
        disks: vec![NbdDisk { socket: sock.clone(), export: String::new(), read_only: false }],
        agent_socket: None,
        vmgenid: false,
        incoming: false,
        devstate_only: false,
        net: None,
    };
    let vm = Vm::spawn(&qemu, spec, &w.join("run")).unwrap();
    let t = Instant::now();
    let mut console = String::new();
    while t.elapsed() < Duration::from_secs(90) {
        console = vm.console();
        if console.contains("ROOT-OK") || console.contains("FAILED") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("{machine:?}: root reached in {:.2} s", t.elapsed().as_secs_f64());
    assert!(console.contains(clade_vm::boot::HANDOVER_MARKER), "initramfs did not hand over: {console}");
    let line = console.lines().find(|l| l.contains("ROOT-OK")).unwrap_or_else(|| panic!("no ROOT-OK: {console}"));
    assert!(line.contains("pid=1 "), "the root's init is not PID 1: {line}");
    assert!(line.contains("/dev/vda / ext4 rw"), "root is not the ext4 NBD disk: {line}");
}

#[test]
fn guest_boots_root_from_nbd_q35() {
    boot_root(MachineType::Q35);
}
