//! One QEMU process: its command line (machine type, accelerator, RAM backing, kernel, disks, agent channel,
//! console) and its lifecycle (spawn, QMP, kill on drop). Everything the `vm` backend does to a guest goes
//! through here, so every sandbox is started the same way and nothing is left behind when one fails.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::accel::Accel;
use crate::jail::{Jailed, VmJail};
use crate::qmp::{Qmp, QmpError};

/// The machine type. `q35` has vmgenid (clones reseed their CRNG on fork) and boots reliably; `microvm` boots
/// faster but lacks vmgenid in the guest and needs `tsc_early_khz` to avoid rare hangs (docs/vm.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MachineType {
    Q35,
    Microvm,
}

/// Where guest RAM lives: a file (on tmpfs) mapped shared (the base, whose pages become the mark) or private
/// (siblings: clean pages stay shared with the file, written pages become the sibling's own).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RamBacking {
    pub path: PathBuf,
    pub share: bool,
}

/// An NBD disk served by clade-nbd on a unix socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NbdDisk {
    pub socket: PathBuf,
    pub export: String,
    pub read_only: bool,
}

/// Everything that shapes a QEMU process. Marks record the parts a restore must match (machine, memory, vcpus,
/// devices, QEMU version).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmSpec {
    pub accel: Accel,
    pub machine: MachineType,
    pub memory_mib: u32,
    pub vcpus: u32,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub append: String,
    pub ram: RamBacking,
    pub disks: Vec<NbdDisk>,
    /// Host end of the agent's virtio-serial port (a unix socket QEMU listens on).
    pub agent_socket: Option<PathBuf>,
    /// Give the guest a VM generation id (`guid=auto`), so a restored clone reseeds its CRNG (q35 only).
    pub vmgenid: bool,
    /// Start with `-incoming defer` to restore device state instead of booting.
    pub incoming: bool,
    /// The incoming state is device state alone (`xen-save-devices-state` of a clone): it has no configuration
    /// section and no vmdescription trailer, and the loader must be told so.
    pub devstate_only: bool,
    /// User-mode networking (`network = "egress"`); `None`: no network device (crate::net).
    #[serde(default)]
    pub net: Option<crate::net::UserNet>,
}

impl VmSpec {
    /// The QEMU arguments for this spec, with the QMP socket and console log in `run_dir`.
    pub fn args(&self, run_dir: &Path) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        let mut machine = match self.machine {
            MachineType::Q35 => "q35,memory-backend=mem,smbus=off,vmport=off,sata=off,usb=off,graphics=off".to_string(),
            MachineType::Microvm => {
                "microvm,acpi=on,memory-backend=mem,pit=off,pic=off,rtc=on,isa-serial=on".to_string()
            }
        };
        if self.devstate_only {
            machine.push_str(",suppress-vmdesc=on");
        }
        a.extend(["-machine".to_string(), machine]);
        a.extend(self.accel.qemu_args());
        let mem = format!(
            "memory-backend-file,id=mem,size={}M,mem-path={},share={},prealloc=off",
            self.memory_mib,
            self.ram.path.display(),
            if self.ram.share { "on" } else { "off" }
        );
        a.extend(["-m".into(), format!("{}M", self.memory_mib), "-object".into(), mem]);
        a.extend(["-smp".into(), self.vcpus.to_string()]);
        a.extend(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"].map(String::from));
        a.extend(["-kernel".into(), self.kernel.display().to_string()]);
        if let Some(i) = &self.initrd {
            a.extend(["-initrd".into(), i.display().to_string()]);
        }
        a.extend(["-append".into(), self.append.clone()]);
        a.extend(["-serial".into(), format!("file:{}", run_dir.join("console.log").display())]);
        a.extend(["-qmp".into(), format!("unix:{},server=on,wait=off", run_dir.join("qmp.sock").display())]);
        let (blk, serial_bus) = match self.machine {
            MachineType::Q35 => ("virtio-blk-pci", "virtio-serial-pci"),
            MachineType::Microvm => ("virtio-blk-device", "virtio-serial-device"),
        };
        for (i, d) in self.disks.iter().enumerate() {
            a.push("-blockdev".into());
            a.push(format!(
                "driver=nbd,node-name=disk{i},server.type=unix,server.path={},export={},read-only={}",
                d.socket.display(),
                d.export,
                if d.read_only { "on" } else { "off" }
            ));
            a.extend(["-device".into(), format!("{blk},drive=disk{i},id=vd{i}")]);
        }
        if let Some(sock) = &self.agent_socket {
            // ioeventfd=off: the guest's queue notify is handled on the vCPU thread at once instead of being
            // handed to the main loop through an eventfd (a host thread wakeup per kick). Under TCG that took the
            // agent's hello round trip p50 from ~230 to ~130 us and halved QEMU's CPU per round trip (docs/agent.md).
            let opts = if self.accel == Accel::Tcg && self.machine == MachineType::Q35 { ",ioeventfd=off" } else { "" };
            a.extend(["-device".into(), format!("{serial_bus},id=vser0{opts}")]);
            a.extend(["-chardev".into(), format!("socket,id=agent,path={},server=on,wait=off", sock.display())]);
            a.extend([
                "-device".into(),
                format!("virtserialport,bus=vser0.0,chardev=agent,name={}", clade_agent::VM_PORT_NAME),
            ]);
        }
        if let Some(net) = &self.net {
            a.extend(net.qemu_args(self.machine));
        }
        if self.vmgenid && self.machine == MachineType::Q35 {
            a.extend(["-device".into(), "vmgenid,guid=auto".into()]);
        }
        if self.incoming {
            a.extend(["-incoming".into(), "defer".into()]);
        }
        if self.devstate_only {
            a.extend(["-global", "migration.send-configuration=off"].map(String::from));
        }
        a
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot start QEMU {qemu}: {source}")]
    Spawn { qemu: String, source: std::io::Error },
    #[error("run dir {0}: {1}")]
    RunDir(String, std::io::Error),
    #[error("jail: {0}")]
    Jail(String),
    #[error("the sandbox's network namespace {0}: {1} (was its network released meanwhile?)")]
    Netns(String, std::io::Error),
    #[error("{source}; QEMU said: {stderr}")]
    Qmp { source: QmpError, stderr: String },
}

/// A running QEMU process. Dropping it kills the process and removes its run dir, so an error anywhere leaves no
/// orphan process or socket behind.
pub struct Vm {
    child: Child,
    pub qmp: Qmp,
    pub run_dir: PathBuf,
    pub spec: VmSpec,
    keep_run_dir: bool,
    /// Released (cgroup removed, uid freed) only after the process is dead: see Drop.
    jailed: Option<Jailed>,
}

impl Vm {
    /// Start QEMU for `spec` with its sockets and console in `run_dir` (created) and connect QMP. Unjailed: QEMU
    /// runs as the caller (root). The backend always uses [`Vm::spawn_jailed`]; this is for low-level tests.
    pub fn spawn(qemu: &Path, spec: VmSpec, run_dir: &Path) -> Result<Vm, VmError> {
        Self::start(qemu, spec, run_dir, None)
    }

    /// Start QEMU as [`Vm::spawn`] does, in `jail` (crate::jail): its own uid (claimed now, freed when the Vm is
    /// dropped), chrooted into `<run_dir>/jail`, under its seccomp filter, in its own mount namespace and
    /// cgroup, with a bounding set of three capabilities.
    pub fn spawn_jailed(qemu: &Path, spec: VmSpec, run_dir: &Path, jail: &VmJail) -> Result<Vm, VmError> {
        Self::start(qemu, spec, run_dir, Some(jail))
    }

    fn start(qemu: &Path, spec: VmSpec, run_dir: &Path, jail: Option<&VmJail>) -> Result<Vm, VmError> {
        let dir_err = |e| VmError::RunDir(run_dir.display().to_string(), e);
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(run_dir).map_err(dir_err)?;
        let stderr_path = run_dir.join("qemu.stderr");
        let stderr = std::fs::File::create(&stderr_path).map_err(dir_err)?;
        let mut cmd = Command::new(qemu);
        cmd.args(spec.args(run_dir)).stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr);
        // Jailed, a booting guest waits (`-S`) for QMP's `cont`: QEMU 7.2 starts the vCPUs before it chroots and
        // drops to the sandbox's uid, and answers QMP only from its main loop, after both. So no guest
        // instruction runs while QEMU is still uid 0. (A restore waits on `-incoming defer` anyway.)
        let hold = jail.is_some() && !spec.incoming;
        if hold {
            cmd.arg("-S");
        }
        // The sandbox's own network namespace (a guest with egress): slirp's sockets are made there.
        if let Some(ns) = spec.net.as_ref().and_then(|n| n.netns.as_ref()) {
            let f = std::fs::File::open(ns).map_err(|e| VmError::Netns(ns.display().to_string(), e))?;
            crate::jail::join_netns(&mut cmd, f);
        }
        let jailed = match jail {
            Some(j) => {
                let mut needs: Vec<&Path> = vec![&spec.ram.path, &spec.kernel, run_dir];
                needs.extend(spec.initrd.as_deref());
                needs.extend(spec.disks.iter().map(|d| d.socket.as_path()));
                needs.extend(spec.agent_socket.as_deref());
                Some(crate::jail::prepare(j, run_dir, &needs, spec.net.is_some(), &mut cmd).map_err(VmError::Jail)?)
            }
            None => None,
        };
        let child = cmd.spawn().map_err(|e| VmError::Spawn { qemu: qemu.display().to_string(), source: e })?;
        if let Some(j) = &jailed {
            if let Err(e) = j.enter_cgroup(child.id()) {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(run_dir);
                return Err(VmError::Jail(e));
            }
        }
        let connected = Qmp::connect(&run_dir.join("qmp.sock"), Duration::from_secs(10)).and_then(|mut qmp| {
            if hold {
                qmp.execute("cont", serde_json::json!({}))?;
            }
            Ok(qmp)
        });
        match connected {
            Ok(qmp) => Ok(Vm { child, qmp, run_dir: run_dir.to_path_buf(), spec, keep_run_dir: false, jailed }),
            Err(source) => {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
                let _ = std::fs::remove_dir_all(run_dir);
                Err(VmError::Qmp { source, stderr: stderr.trim().to_string() })
            }
        }
    }

    /// What this QEMU's jail holds (uid, chroot, cgroup); `None` when it was started unjailed.
    pub fn jailed(&self) -> Option<&Jailed> {
        self.jailed.as_ref()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Wrap a QMP error with what QEMU wrote on stderr (its own error text).
    pub fn qmp_error(&mut self, source: QmpError) -> VmError {
        // Give a dying QEMU a moment to finish writing its reason.
        std::thread::sleep(Duration::from_millis(20));
        let stderr = std::fs::read_to_string(self.run_dir.join("qemu.stderr")).unwrap_or_default();
        VmError::Qmp { source, stderr: stderr.trim().to_string() }
    }

    /// `Some(why)` once the QEMU process has exited: its exit status and what it wrote on stderr (QEMU's own
    /// error text). `None` while it runs.
    pub fn exited(&mut self) -> Option<String> {
        let status = match self.child.try_wait() {
            Ok(Some(s)) => s,
            Ok(None) => return None,
            Err(e) => return Some(format!("QEMU {} cannot be waited for: {e}", self.child.id())),
        };
        let stderr = std::fs::read_to_string(self.run_dir.join("qemu.stderr")).unwrap_or_default();
        let tail: Vec<&str> = stderr.trim().lines().rev().take(6).collect();
        let said = if tail.is_empty() {
            "nothing on stderr".to_string()
        } else {
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        };
        Some(format!("QEMU exited ({status}); QEMU said: {said}"))
    }

    /// The last `n` lines of the serial console, joined with ` | `.
    pub fn console_tail(&self, n: usize) -> String {
        let c = self.console();
        let lines: Vec<&str> = c.lines().rev().take(n).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// The serial console so far.
    pub fn console(&self) -> String {
        std::fs::read_to_string(self.run_dir.join("console.log")).unwrap_or_default()
    }

    /// Keep the run dir after drop (for debugging a failure).
    pub fn keep_run_dir(&mut self) {
        self.keep_run_dir = true;
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.keep_run_dir {
            let _ = std::fs::remove_dir_all(&self.run_dir);
        }
        // The process is reaped: its cgroup can go and its uid can be given to another sandbox.
        self.jailed = None;
    }
}
