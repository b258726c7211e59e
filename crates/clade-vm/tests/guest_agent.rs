//! clade-agent as PID 1 of a real QEMU guest, reached over virtio-serial: boot through clade's initramfs, say
//! hello, run a command, write and read a file; then mark the guest (device state, RAM file) and talk to the same
//! agent again in a clone.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use clade_agent::client::AgentClient;
use clade_agent::proto::ExecSpec;
use clade_vm::accel::Accel;
use clade_vm::machine::{MachineType, NbdDisk, RamBacking, Vm, VmSpec};

fn home() -> PathBuf {
    PathBuf::from(std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into()))
}

fn accel() -> Accel {
    std::fs::read(home().join("cache/accel.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .map(|v| if v["chosen"] == "kvm" { Accel::Kvm } else { Accel::Tcg })
        .unwrap_or(Accel::Tcg)
}

/// The agent binary built next to this test (`cargo build --workspace` puts it in the target dir).
fn agent_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_AGENT_BIN") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?; // target/debug/deps -> target/debug
    let p = dir.join("clade-agent");
    p.exists().then_some(p)
}

struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Copy `bin` and the shared libraries `ldd` names into `root`.
fn install_with_libs(bin: &Path, root: &Path, dest: &str) {
    let target = root.join(dest.trim_start_matches('/'));
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    std::fs::copy(bin, &target).unwrap();
    let out = Command::new("ldd").arg(bin).output().unwrap();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line.split_whitespace().find(|w| w.starts_with('/'));
        if let Some(p) = path {
            let t = root.join(p.trim_start_matches('/'));
            std::fs::create_dir_all(t.parent().unwrap()).unwrap();
            std::fs::copy(p, &t).unwrap();
        }
    }
}

/// Say hello, giving up after `timeout` (the guest may still be booting).
fn hello_until(sock: &Path, timeout: Duration) -> (AgentClient, clade_agent::proto::Hello) {
    let start = Instant::now();
    loop {
        if let Ok(s) = UnixStream::connect(sock) {
            let killer = s.try_clone().unwrap();
            let client = AgentClient::from_unix(s).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let c2 = client.clone();
            std::thread::spawn(move || {
                let _ = tx.send(c2.hello());
            });
            match rx.recv_timeout(Duration::from_secs(3)) {
                Ok(Ok(h)) => return (client, h),
                _ => {
                    let _ = killer.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        assert!(start.elapsed() < timeout, "agent never answered hello on {}", sock.display());
        std::thread::sleep(Duration::from_millis(50));
    }
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
    let root = w.join("root");
    for d in ["bin", "dev", "proc", "sys", "run", "tmp", "etc", "root"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/hostname")).unwrap();
    install_with_libs(&agent, &root, clade_vm::boot::AGENT_PATH);
    let img = w.join("root.img");
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(&root)
        .arg(&img)
        .arg("64M")
        .status()
        .unwrap();
    assert!(st.success());
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
