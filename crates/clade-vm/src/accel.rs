//! Choosing the accelerator by a real guest boot. `/dev/kvm` existing proves little: on a paravirtual KVM
//! ("PVM") host a stock kernel dies on emulation failures (cmpxchg16b, xrstor) although the device opens. So
//! clade boots the guest kernel with a tiny busybox initramfs under `-accel kvm`, waits for its marker line on
//! the serial console, and falls back to TCG when it does not come. The result is cached per boot id (and QEMU
//! version and guest kernel), since neither changes without a reboot or a setup.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::initramfs::Initramfs;

/// Which accelerator QEMU runs guests with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    /// The QEMU arguments for this accelerator.
    pub fn qemu_args(self) -> Vec<String> {
        match self {
            Accel::Kvm => ["-accel", "kvm", "-cpu", "host"].map(String::from).to_vec(),
            Accel::Tcg => {
                // The translation cache is private to every QEMU process: its size is most of what a TCG sibling
                // costs beyond its own pages (docs/vm.md). `CLADE_TCG_TB_MIB` bounds it.
                let tb = tb_size_mib();
                let accel = if tb > 0 { format!("tcg,thread=multi,tb-size={tb}") } else { "tcg,thread=multi".into() };
                vec!["-accel".into(), accel, "-cpu".into(), tcg_cpu()]
            }
        }
    }
    /// The guest CPU model, as marks record it: TCG's `max` is what this QEMU version emulates (the version is
    /// recorded too); under KVM `host` is the host's CPU, named by its model string.
    pub fn cpu_model(self) -> String {
        match self {
            Accel::Tcg => tcg_cpu(),
            Accel::Kvm => {
                let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
                let model = info
                    .lines()
                    .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim()))
                    .unwrap_or("unknown");
                format!("host ({model})")
            }
        }
    }

    /// Words this accelerator adds to the guest kernel's command line. Under TCG: `mitigations=off`. The
    /// guest's Spectre defences guard against a CPU speculating on the guest's own instructions, and under
    /// TCG no CPU runs them: a retpoline becomes a translation-block lookup and the RSB fill on each context
    /// switch a few dozen emulated calls, protecting nothing and costing emulated work on every indirect
    /// call (docs/vm.md has the side-by-side figures). `CLADE_GUEST_MITIGATIONS=on` keeps the kernel's
    /// default. Under KVM the guest's instructions run on the host CPU, so its defaults stay.
    pub fn guest_cmdline_extra(self) -> &'static str {
        match self {
            Accel::Tcg if std::env::var("CLADE_GUEST_MITIGATIONS").as_deref() != Ok("on") => " mitigations=off",
            _ => "",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The CPU model TCG emulates (`CLADE_TCG_CPU`, default `max`). Marks record it: a mark restores only under the
/// model it was taken with.
pub fn tcg_cpu() -> String {
    std::env::var("CLADE_TCG_CPU").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "max".into())
}

/// The TCG translation cache bound in MiB (`CLADE_TCG_TB_MIB`; 0 = QEMU's default).
pub fn tb_size_mib() -> u32 {
    std::env::var("CLADE_TCG_TB_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_TB_MIB)
}

/// QEMU's default (0: no bound). Measured side by side (docs/vm.md): a bound of 8 MiB took three siblings'
/// PSS/RSS from 0.57 to 0.37 but a guest busy after its restore retranslates so much that a mark's pause went
/// from 55 to 190 ms and a retake from 391 to 795 ms. Latency wins by default; a host packing many idle TCG
/// sandboxes can set `CLADE_TCG_TB_MIB=8`. Under KVM there is no translation cache.
pub const DEFAULT_TB_MIB: u32 = 0;

/// One probe boot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BootProbe {
    pub ok: bool,
    /// Seconds from process start to the marker line (when ok).
    pub seconds: f64,
    /// Why it failed, with the console's last lines.
    pub detail: String,
}

/// The cached decision.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AccelChoice {
    pub boot_id: String,
    pub qemu_version: String,
    pub kernel: String,
    pub kvm: BootProbe,
    /// A TCG boot, so the doctor can say QEMU and the guest kernel work at all.
    pub tcg: BootProbe,
    pub chosen: Accel,
    pub reason: String,
}

/// Everything a probe needs to know about the host.
pub struct ProbeInputs<'a> {
    pub qemu: &'a Path,
    pub qemu_version: &'a str,
    /// The guest kernel to boot (the uncompressed vmlinux boots faster under TCG).
    pub kernel: &'a Path,
    pub kernel_release: &'a str,
    pub busybox: &'a Path,
    /// Where the probe's initramfs and the cached result are kept.
    pub cache_dir: &'a Path,
    pub boot_id: &'a str,
}

const MARKER: &str = "CLADE-PROBE-OK";

/// The cached choice when it is still valid, else probe (two boots, a few seconds) and cache.
/// `CLADE_ACCEL=kvm|tcg` overrides the choice but the probe results are still reported.
pub fn choose(inp: &ProbeInputs, refresh: bool) -> std::io::Result<AccelChoice> {
    let cache = inp.cache_dir.join("accel.json");
    let mut choice = match (refresh, read_cache(&cache)) {
        (false, Some(c))
            if c.boot_id == inp.boot_id && c.qemu_version == inp.qemu_version && c.kernel == inp.kernel_release =>
        {
            c
        }
        _ => {
            let c = probe(inp)?;
            let tmp = cache.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_vec_pretty(&c).map_err(std::io::Error::other)?)?;
            std::fs::rename(tmp, &cache)?;
            c
        }
    };
    match std::env::var("CLADE_ACCEL").as_deref() {
        Ok("kvm") => {
            choice.chosen = Accel::Kvm;
            choice.reason = "forced by CLADE_ACCEL=kvm".into();
        }
        Ok("tcg") => {
            choice.chosen = Accel::Tcg;
            choice.reason = "forced by CLADE_ACCEL=tcg".into();
        }
        _ => {}
    }
    Ok(choice)
}

fn read_cache(path: &Path) -> Option<AccelChoice> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

fn probe(inp: &ProbeInputs) -> std::io::Result<AccelChoice> {
    std::fs::create_dir_all(inp.cache_dir)?;
    let initrd = inp.cache_dir.join("probe-initramfs.cpio");
    let mut img = Initramfs::new();
    img.dir("bin").dir("proc").host_file("bin/busybox", inp.busybox)?;
    img.file(
        "init",
        0o755,
        format!("#!/bin/busybox sh\n/bin/busybox echo {MARKER}\n/bin/busybox poweroff -f\n").as_bytes(),
    );
    img.write_to(&initrd)?;

    let kvm = if !Path::new("/dev/kvm").exists() {
        BootProbe { ok: false, seconds: 0.0, detail: "no /dev/kvm".into() }
    } else if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        BootProbe { ok: false, seconds: 0.0, detail: format!("cannot open /dev/kvm: {e}") }
    } else {
        boot(inp, &initrd, Accel::Kvm, Duration::from_secs(15))
    };
    let tcg = boot(inp, &initrd, Accel::Tcg, Duration::from_secs(60));
    let (chosen, reason) = if kvm.ok {
        (Accel::Kvm, format!("a guest booted under KVM in {:.2} s", kvm.seconds))
    } else {
        (Accel::Tcg, format!("KVM did not boot a guest ({}); using TCG", first_line(&kvm.detail)))
    };
    Ok(AccelChoice {
        boot_id: inp.boot_id.into(),
        qemu_version: inp.qemu_version.into(),
        kernel: inp.kernel_release.into(),
        kvm,
        tcg,
        chosen,
        reason,
    })
}

/// The reason part of a probe's detail, without the console lines.
fn first_line(s: &str) -> &str {
    s.split(';').next().unwrap_or("")
}

/// Boot the probe guest once and wait for its marker on the serial console.
fn boot(inp: &ProbeInputs, initrd: &PathBuf, accel: Accel, timeout: Duration) -> BootProbe {
    let start = Instant::now();
    let mut cmd = Command::new(inp.qemu);
    cmd.args(accel.qemu_args())
        .args(["-machine", "q35", "-m", "128", "-smp", "1", "-nodefaults", "-no-user-config"])
        .args(["-display", "none", "-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(inp.kernel)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", "console=ttyS0 rdinit=/init panic=-1 quiet"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return BootProbe { ok: false, seconds: 0.0, detail: format!("cannot start {}: {e}", inp.qemu.display()) }
        }
    };
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let tx2 = tx.clone();
    std::thread::spawn(move || pump(&mut stdout, tx));
    std::thread::spawn(move || pump(&mut stderr, tx2));
    let mut console = Vec::new();
    let mut ok = false;
    let mut secs = 0.0;
    while let Some(left) = timeout.checked_sub(start.elapsed()) {
        match rx.recv_timeout(left) {
            Ok(chunk) => {
                console.extend_from_slice(&chunk);
                if String::from_utf8_lossy(&console).contains(MARKER) {
                    ok = true;
                    secs = start.elapsed().as_secs_f64();
                    break;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => break,
            // Both pipes closed: QEMU exited.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = child.kill();
    let status = child.wait().ok();
    let detail = if ok {
        String::new()
    } else {
        let text = String::from_utf8_lossy(&console);
        let tail: Vec<&str> = text.lines().rev().take(6).collect();
        let why = if start.elapsed() >= timeout {
            format!("no marker within {} s", timeout.as_secs())
        } else {
            format!("QEMU exited ({}) before the marker", status.map(|s| s.to_string()).unwrap_or_default())
        };
        format!("{why}; last console lines: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | "))
    };
    BootProbe { ok, seconds: secs, detail }
}

fn pump(r: &mut impl Read, tx: std::sync::mpsc::Sender<Vec<u8>>) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = r.read(&mut buf) {
        if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_tcg_guest_boots_without_spectre_defences() {
        assert_eq!(Accel::Kvm.guest_cmdline_extra(), "");
        if std::env::var_os("CLADE_GUEST_MITIGATIONS").is_none() {
            assert_eq!(Accel::Tcg.guest_cmdline_extra(), " mitigations=off");
        }
    }
}
