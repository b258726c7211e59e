//! clade-agent as PID 1 of a real QEMU guest, reached over virtio-serial: boot through clade's initramfs, say
//! hello, run a command, write and read a file; then mark the guest (device state, RAM file) and talk to the same
//! agent again in a clone.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use clade_agent::client::AgentClient;
use clade_agent::proto::ExecSpec;
use clade_vm::machine::{MachineType, NbdDisk, RamBacking, Vm, VmSpec};

mod common;
use common::*;

/// Say hello through the backend's own retrying connect, failing the test after `timeout`.
fn hello_until(sock: &Path, timeout: Duration) -> (AgentClient, clade_agent::proto::Hello) {
    clade_vm::agent_link::hello_until(sock, timeout)
        .unwrap_or_else(|w| panic!("agent never answered hello on {} ({w:?})", sock.display()))
}

#[test]
fn guest_agent_answers_over_virtio_serial_and_survives_a_clone() {
    let kdir = home().join("kernel/current");
    let (Some(qemu), Some(agent)) = (clade_vm::qemu::qemu_binary(), agent_binary()) else {
        eprintln!("skip: no qemu-system-x86_64 or no built clade-agent (run ./x setup; cargo build --workspace)");
        return;
    };
    let work = tempfile::Builder::new().prefix("clade-agent-vm").tempdir_in("/dev/shm").unwrap();
    let w = work.path();
    let initrd = w.join("initrd.cpio");
    clade_vm::boot::build_initramfs(&kdir, Path::new("/bin/busybox"), MachineType::Q35, &initrd).unwrap();
    let img = w.join("root.img");
    busybox_root_image(w, &agent, &img, 64);
    let nbd = w.join("nbd.sock");
    let _server = Child(Command::new("qemu-nbd").args(["-t", "-f", "raw", "-k"]).arg(&nbd).arg(&img).spawn().unwrap());
    let t = Instant::now();
    while !nbd.exists() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let ram = w.join("base.ram");
    let spec = |agent_sock: PathBuf, share: bool, incoming: bool| VmSpec {
        accel: accel(),
        machine: MachineType::Q35,
        memory_mib: 256,
        vcpus: 1,
        kernel: kdir.join("vmlinux"),
        initrd: Some(initrd.clone()),
        append: format!(
            "console=ttyS0 panic=-1 quiet {}=virtio:/dev/virtio-ports/{}",
            clade_agent::CMDLINE_KEY,
            clade_agent::VM_PORT_NAME
        ),
        ram: RamBacking { path: ram.clone(), share },
        disks: vec![NbdDisk { socket: nbd.clone(), export: String::new(), read_only: false }],
        agent_socket: Some(agent_sock),
        vmgenid: true,
        incoming,
        devstate_only: false,
        net: None,
    };
    let boot = Instant::now();
    let base_sock = w.join("base-agent.sock");
    let mut base = Vm::spawn(&qemu, spec(base_sock.clone(), true, false), &w.join("base")).unwrap();
    let (client, hello) = hello_until(&base_sock, Duration::from_secs(90));
    eprintln!("cold boot to agent hello: {:.2} s ({hello:?})", boot.elapsed().as_secs_f64());
    assert_eq!(hello.role, "init");
    let out = client
        .run(ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), "echo hi $$".into()], ..Default::default() })
        .unwrap();
    assert_eq!(out.status.code, Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("hi "), "{:?}", out);
    client.write_file_bytes("/root/note", b"written before the mark", None).unwrap();
    drop(client);

    let state = w.join("base.state");
    let saved = clade_vm::templating::save_device_state(&mut base, &state).unwrap();
    eprintln!("mark: {saved:?}");
    drop(base);

    let clone_sock = w.join("clone-agent.sock");
    let t = Instant::now();
    let (_clone, stats) =
        clade_vm::templating::restore(&qemu, spec(clone_sock.clone(), false, true), &state, &w.join("clone")).unwrap();
    let (client, h2) = hello_until(&clone_sock, Duration::from_secs(30));
    eprintln!("clone: {stats:?}, restore to hello {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    assert_eq!(h2.boot_id, hello.boot_id, "a clone is the same boot, restored");
    assert!(h2.uptime_ms >= hello.uptime_ms);
    assert_eq!(client.read_file_vec("/root/note").unwrap(), b"written before the mark");
}
