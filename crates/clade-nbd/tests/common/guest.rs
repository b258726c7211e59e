//! Booting a QEMU guest (TCG) on an NBD export: a busybox initramfs with the virtio and ext4
//! modules, a serial console captured line by line, and a minimal QMP client.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KDIR: &str = "/var/lib/clade/kernel/current";
/// Load order for q35 + virtio-blk-pci (docs/vm.md: q35's module order).
const MODULES: &[&str] = &[
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_pci_legacy_dev.ko",
    "drivers/virtio/virtio_pci_modern_dev.ko",
    "drivers/virtio/virtio_pci.ko",
    "drivers/block/virtio_blk.ko",
    "lib/crc16.ko",
    "fs/mbcache.ko",
    "fs/jbd2/jbd2.ko",
    "crypto/crc32c_generic.ko",
    "fs/ext4/ext4.ko",
];

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.list); do insmod /mod/$m || echo "INSMOD-FAILED $m"; done
phase=$(sed -n 's/.* phase=\([a-z]*\).*/\1/p' /proc/cmdline)
i=0; while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /mnt
case $phase in
fsck)
  e2fsck -fy /dev/vda; echo "FSCK1=$?"
  e2fsck -fn /dev/vda; echo "FSCK2=$?"
  ;;
*)
  mount -t ext4 /dev/vda /mnt || echo "MOUNT-FAILED"
  . /phase-$phase.sh
  ;;
esac
echo "PHASE-DONE"
poweroff -f
"#;

/// The kernel to boot (uncompressed ELF if present: it boots faster under TCG), or None.
pub fn kernel() -> Option<PathBuf> {
    ["vmlinux", "vmlinuz"].iter().map(|k| Path::new(KDIR).join(k)).find(|p| p.exists())
}

/// Builds an initramfs in `dir` with the given phase scripts (name, body); returns its path.
pub fn initramfs(dir: &Path, phases: &[(&str, &str)]) -> PathBuf {
    let root = dir.join("initrd");
    for d in ["bin", "proc", "sys", "dev", "mod", "lib64", "lib/x86_64-linux-gnu", "sbin"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/usr/bin/busybox", root.join("bin/busybox")).unwrap();
    let mut list = String::new();
    for m in MODULES {
        let name = Path::new(m).file_name().unwrap();
        std::fs::copy(Path::new(KDIR).join("modules/kernel").join(m), root.join("mod").join(name)).unwrap();
        list.push_str(&format!("{}\n", name.to_string_lossy()));
    }
    std::fs::write(root.join("modules.list"), list).unwrap();
    write_exec(&root.join("init"), INIT);
    for (name, body) in phases {
        std::fs::write(root.join(format!("phase-{name}.sh")), body).unwrap();
    }
    // e2fsck and its libraries, so the guest can check its own filesystem.
    if let Ok(e2) = which("e2fsck") {
        std::fs::copy(&e2, root.join("sbin/e2fsck")).unwrap();
        let out = Command::new("ldd").arg(&e2).output().unwrap();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let path = line.split_whitespace().find(|w| w.starts_with('/'));
            if let Some(p) = path {
                let dst = root.join(p.trim_start_matches('/'));
                std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
                std::fs::copy(p, dst).unwrap();
            }
        }
    }
    let img = dir.join("initrd.cpio");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("cd {} && find . | cpio -o -H newc --quiet > {}", root.display(), img.display()))
        .status()
        .unwrap();
    assert!(status.success(), "cpio failed");
    img
}

fn which(name: &str) -> Result<PathBuf, ()> {
    super::tool(name).ok_or(())
}

fn write_exec(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, body).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A running guest with its console lines.
pub struct Guest {
    child: Child,
    pub console: Arc<Mutex<Vec<String>>>,
    pub qmp: PathBuf,
}

impl Guest {
    /// Boots `phase` with the disk on the NBD socket `nbd`.
    pub fn boot(dir: &Path, kernel: &Path, initrd: &Path, nbd: &Path, phase: &str) -> Guest {
        let qmp = dir.join(format!("qmp-{phase}.sock"));
        let mut child = Command::new("qemu-system-x86_64")
            .args(["-machine", "q35", "-accel", "tcg,thread=multi", "-cpu", "max", "-m", "256", "-smp", "1"])
            .args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio"])
            .arg("-kernel")
            .arg(kernel)
            .arg("-initrd")
            .arg(initrd)
            .args(["-append", &format!("console=ttyS0 panic=-1 loglevel=4 phase={phase}")])
            .arg("-blockdev")
            .arg(format!("driver=nbd,server.type=unix,server.path={},node-name=d0", nbd.display()))
            .args(["-device", "virtio-blk-pci,drive=d0"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("qemu-system-x86_64");
        let console = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let c2 = console.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("guest: {line}");
                c2.lock().unwrap().push(line);
            }
        });
        Guest { child, console, qmp }
    }

    /// Waits for a console line containing `marker`; panics with the console after `timeout`.
    pub fn wait_for(&self, marker: &str, timeout: Duration) -> String {
        let t = Instant::now();
        loop {
            if let Some(l) = self.console.lock().unwrap().iter().find(|l| l.contains(marker)) {
                return l.clone();
            }
            assert!(t.elapsed() < timeout, "no {marker:?} on the console in {timeout:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The first console line starting with `prefix`, without it.
    pub fn value(&self, prefix: &str) -> Option<String> {
        self.console.lock().unwrap().iter().find_map(|l| l.trim().strip_prefix(prefix).map(str::to_owned))
    }

    /// Whether QEMU has exited already.
    pub fn exited(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_some()
    }

    /// Waits for QEMU to exit (the guest powers off).
    pub fn wait_exit(&mut self, timeout: Duration) {
        let t = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(t.elapsed() < timeout, "guest did not power off");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends one QMP command and returns its reply line.
    /// Sends one QMP command (idempotent ones: `stop`, `quit`, queries) and returns its reply line. Under load
    /// QEMU 7.2 here now and then closes a fresh QMP connection right after its greeting (seen as a broken pipe
    /// on the first command; not understood): the whole exchange is retried on a new connection for up to
    /// 2 s, and if QEMU has exited meanwhile the panic says so with its status and the console.
    pub fn qmp(&mut self, cmd: &str) -> String {
        let mut last = String::new();
        for _ in 0..20 {
            match qmp_once(&self.qmp, cmd) {
                Ok(reply) => return reply,
                Err(e) => last = e,
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(500)); // the console reader's last lines
                panic!(
                    "QEMU exited ({status}) before QMP answered; console:\n{}",
                    self.console.lock().unwrap().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("QMP {cmd} failed 20 times, last: {last}");
    }
}

/// One QMP exchange on a new connection: greeting, `qmp_capabilities`, `cmd`; the reply line to `cmd`.
fn qmp_once(path: &Path, cmd: &str) -> Result<String, String> {
    let s = UnixStream::connect(path).map_err(|e| format!("connect: {e}"))?;
    let mut w = s.try_clone().map_err(|e| e.to_string())?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    if r.read_line(&mut line).map_err(|e| format!("greeting: {e}"))? == 0 {
        return Err("closed before the greeting".into());
    }
    for c in [r#"{"execute":"qmp_capabilities"}"#, cmd] {
        writeln!(w, "{c}").map_err(|e| format!("send {c}: {e}"))?;
        loop {
            line.clear();
            if r.read_line(&mut line).map_err(|e| format!("reply to {c}: {e}"))? == 0 {
                return Err(format!("closed before the reply to {c}"));
            }
            if !line.contains("\"event\"") {
                break;
            }
        }
    }
    Ok(line)
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
