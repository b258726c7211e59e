//! `clade doctor`: what this host can run, what is missing and how to get it. It boots the guest kernel
//! under KVM to decide the accelerator (cached per boot id), runs `criu check`, and looks at the kernel
//! features the backends rely on. Exits 1 when a part that a backend needs is missing.

use std::path::Path;

use clade_core::host::{self, Check};
use clade_core::CladeHome;
use serde::Serialize;

#[derive(clap::Args, Default)]
pub struct Args {
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub json: bool,
    /// Probe KVM again instead of using the result cached for this boot.
    #[arg(long)]
    pub refresh: bool,
}

#[derive(Serialize)]
struct Report {
    clade_home: String,
    checks: Vec<Check>,
    accel: Option<clade_vm::accel::AccelChoice>,
    backends: Vec<BackendStatus>,
}

#[derive(Serialize)]
struct BackendStatus {
    backend: String,
    ready: bool,
    missing: Vec<String>,
}

const SETUP: &str = "run ./x setup";

pub fn run(args: Args) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    let mut checks = host::checks(home.root());
    let accel = vm_checks(&home, &mut checks, args.refresh);
    ct_checks(&home, &mut checks);

    let backends: Vec<BackendStatus> = ["vm", "ct"]
        .iter()
        .map(|b| {
            let missing: Vec<String> =
                checks.iter().filter(|c| !c.ok && c.needed_by.iter().any(|n| n == b)).map(|c| c.name.clone()).collect();
            BackendStatus { backend: b.to_string(), ready: missing.is_empty(), missing }
        })
        .collect();
    let all_ready = backends.iter().all(|b| b.ready);
    let report = Report { clade_home: home.root().display().to_string(), checks, accel, backends };

    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_human(&report);
    }
    Ok(if all_ready { 0 } else { 1 })
}

fn print_human(r: &Report) {
    println!("clade doctor (CLADE_HOME={})", r.clade_home);
    for c in &r.checks {
        let state = if c.ok {
            "ok"
        } else if c.needed_by.is_empty() {
            "absent"
        } else {
            "MISSING"
        };
        println!("  {state:<8} {:<12} {}", c.name, c.detail);
        if let Some(fix) = &c.fix {
            let who =
                if c.needed_by.is_empty() { String::new() } else { format!(" (needed by {})", c.needed_by.join(", ")) };
            println!("  {:<8} {:<12} -> {fix}{who}", "", "");
        }
    }
    if let Some(a) = &r.accel {
        println!("accelerator: {} ({})", a.chosen.as_str(), a.reason);
    }
    for b in &r.backends {
        if b.ready {
            println!("backend {}: ready", b.backend);
        } else {
            println!("backend {}: NOT ready, missing {}", b.backend, b.missing.join(", "));
        }
    }
}

fn vm_checks(home: &CladeHome, checks: &mut Vec<Check>, refresh: bool) -> Option<clade_vm::accel::AccelChoice> {
    let vm = &["vm"];
    let qemu = clade_vm::qemu::qemu_binary();
    let version = qemu.as_deref().and_then(clade_vm::qemu::qemu_version);
    match (&qemu, &version) {
        (Some(q), Some(v)) => checks.push(Check::ok("qemu", format!("{} {v}", q.display()))),
        _ => checks.push(Check::missing("qemu", "qemu-system-x86_64 not found", SETUP).needed_by(vm)),
    }
    let typical_id = format!("sb-{}", "0".repeat(32));
    match clade_vm::backend::check_socket_room(home, &typical_id) {
        Ok(()) => {
            checks.push(Check::ok("home-path", format!("{} leaves room for QEMU's sockets", home.root().display())))
        }
        Err(e) => checks.push(Check::missing("home-path", e, "set CLADE_HOME to a shorter path").needed_by(vm)),
    }
    let kdir = home.kernel_dir();
    let release = std::fs::read_to_string(kdir.join("release")).map(|s| s.trim().to_string()).ok();
    let kernel = kdir.join("vmlinux");
    match &release {
        Some(r) if kernel.is_file() => checks.push(Check::ok("guest-kernel", format!("{r} at {}", kdir.display()))),
        _ => checks.push(
            Check::missing("guest-kernel", format!("no guest kernel at {}", kdir.display()), SETUP).needed_by(vm),
        ),
    }
    let busybox = Path::new("/bin/busybox");
    if busybox.is_file() {
        checks.push(Check::ok("busybox", busybox.display().to_string()));
    } else {
        checks.push(Check::missing("busybox", "no /bin/busybox", SETUP).needed_by(vm));
    }
    let (Some(q), Some(v), Some(r)) = (qemu, version, release) else {
        return None;
    };
    if !busybox.is_file() {
        return None;
    }
    let boot_id = host::boot_id();
    let cache = home.cache_dir();
    let inputs = clade_vm::accel::ProbeInputs {
        qemu: &q,
        qemu_version: &v,
        kernel: &kernel,
        kernel_release: &r,
        busybox,
        cache_dir: &cache,
        boot_id: &boot_id,
    };
    match clade_vm::accel::choose(&inputs, refresh) {
        Ok(choice) => {
            if choice.kvm.ok {
                checks.push(Check::ok("kvm", format!("a guest booted under KVM in {:.2} s", choice.kvm.seconds)));
            } else {
                checks.push(Check::missing(
                    "kvm",
                    format!("KVM cannot run the guest: {}", choice.kvm.detail),
                    "none needed: clade uses TCG (slower); on a host with working KVM this check passes",
                ));
            }
            if choice.tcg.ok {
                checks.push(Check::ok("tcg", format!("a guest booted under TCG in {:.2} s", choice.tcg.seconds)));
            } else {
                checks.push(
                    Check::missing("tcg", format!("QEMU could not boot the guest: {}", choice.tcg.detail), SETUP)
                        .needed_by(if choice.kvm.ok { &[] } else { vm }),
                );
            }
            Some(choice)
        }
        Err(e) => {
            checks.push(
                Check::missing("accel", format!("probe failed: {e}"), "check that CLADE_HOME is writable")
                    .needed_by(vm),
            );
            None
        }
    }
}

fn ct_checks(home: &CladeHome, checks: &mut Vec<Check>) {
    let ct = &["ct"];
    // The jail (docs/security.md): without these a ct sandbox would not start (unless explicitly unjailed).
    for (name, r) in clade_ct::jail::host_support() {
        checks.push(match r {
            Ok(found) => Check::ok(name, found),
            Err((what, fix)) => Check::missing(name, what, fix).needed_by(ct),
        });
    }
    if std::env::var(clade_ct::jail::UNJAILED_ENV).as_deref() == Ok("1") {
        checks.push(
            Check::missing(
                "jail",
                format!("{}=1: ct sandboxes run UNJAILED (their root is host root)", clade_ct::jail::UNJAILED_ENV),
                format!("unset {}", clade_ct::jail::UNJAILED_ENV),
            )
            .needed_by(ct),
        );
    } else {
        checks.push(Check::ok("jail", format!("ct sandboxes are jailed (policy {})", clade_ct::jail::POLICY)));
    }
    let bin = clade_ct::criu::criu_binary(home);
    match clade_ct::criu::criu_version(&bin) {
        Some(v) => checks.push(Check::ok("criu", format!("{} {v}", bin.display()))),
        None => {
            checks.push(Check::missing("criu", format!("no working CRIU at {}", bin.display()), SETUP).needed_by(ct));
            return;
        }
    }
    let (ok, text) = clade_ct::criu::criu_check(&bin);
    checks.push(match clade_ct::criu::scans_page_maps(&bin) {
        Some(true) => Check::ok("pagemap-scan", "PAGEMAP_SCAN: a ct mark skips empty address space"),
        _ => Check::missing(
            "pagemap-scan",
            "CRIU has no PAGEMAP_SCAN here (Linux < 6.7): a ct mark reads every mapping's page map entry by entry, \
             so a browser's or JVM's large address-space reservations add seconds to its pause",
            "Linux 6.7 or later (Debian trixie's 6.12) for short marks of browsers",
        ),
    });
    if ok {
        checks.push(Check::ok("criu-check", "criu check: looks good"));
    } else {
        let last = text.lines().last().unwrap_or("").to_string();
        checks.push(
            Check::missing(
                "criu-check",
                format!("criu check failed: {last}"),
                "see `criu check` output; a newer kernel or CRIU may be needed",
            )
            .needed_by(ct),
        );
    }
}
