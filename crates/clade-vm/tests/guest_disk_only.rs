//! Disk-only marks on `vm` (E2B's filesystem-only pause), with real guests: a restore from a whole mark is the
//! same boot (same boot id, its processes), a disk-only mark boots its disk cold (the files, a new boot id, none
//! of the processes), whether taken of a running guest (which goes on) or by a suspend.

mod common;

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, MarkOptions, Sandbox};
use clade_core::hygiene;
use common::*;

fn sh(s: &dyn Sandbox, script: &str) -> String {
    let spec = ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() };
    let out = s.agent().run(spec).expect("exec");
    assert!(out.status.success(), "{script}: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn ident(name: &str) -> clade_core::backend::Identity {
    hygiene::new_identity(&format!("t{}{name}", std::process::id()), 1)
}

const BOOT_ID: &str = "cat /proc/sys/kernel/random/boot_id";
/// The test image links few busybox applets: the others are called through busybox.
const SLEEPER: &str = "for p in /proc/[0-9]*; do busybox tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done \
                       | busybox grep -c '^sleep 4242' || true";

#[test]
fn guest_vm_disk_only_marks_boot_cold() {
    let Some(e) = vm_env("clade-vmdisk-") else { return };
    let image = e.busybox_image("busybox-disk");
    let mut cold = e.backend.cold_start(&image, &ident("cold")).expect("cold start");
    let boot = sh(cold.as_ref(), BOOT_ID);
    assert_eq!(boot.len(), 36, "{boot}");
    sh(cold.as_ref(), "echo kept > /root/marker; (sleep 4242 >/dev/null 2>&1 </dev/null &)");
    assert_eq!(sh(cold.as_ref(), SLEEPER), "1");

    // A whole mark: its restore is the same boot with its processes.
    let whole = cold.mark(&MarkOptions::default()).expect("whole mark");
    assert!(!whole.boots_cold());
    let clone = e.backend.restore(&whole, &ident("whole")).expect("restore");
    assert_eq!(sh(clone.as_ref(), BOOT_ID), boot);
    assert_eq!(sh(clone.as_ref(), SLEEPER), "1");

    // A disk-only mark of the running guest: it goes on, the mark boots cold.
    let disk = cold.mark(&MarkOptions { disk_only: true, ..Default::default() }).expect("disk-only mark");
    assert!(disk.boots_cold(), "{:?}", disk.manifests);
    assert!(!disk.manifests.contains_key("ram_root"), "no RAM in a disk-only mark");
    assert_eq!(sh(cold.as_ref(), "cat /root/marker"), "kept", "the marked guest goes on");
    sh(cold.as_ref(), "echo after > /root/marker; sync");
    let booted = e.backend.restore(&disk, &ident("booted")).expect("boot the disk-only mark");
    assert_eq!(sh(booted.as_ref(), "cat /root/marker"), "kept", "the disk as marked");
    let new_boot = sh(booted.as_ref(), BOOT_ID);
    assert_ne!(new_boot, boot, "a cold boot has a new boot id");
    assert_eq!(sh(booted.as_ref(), SLEEPER), "0", "no process of the marked guest");
    assert!(e.backend.prepare(&disk, &ident("prep")).expect("prepare").is_none(), "nothing to prepare ahead");
    drop(booted);

    // A disk-only suspend of the clone: it ends; its disk boots cold.
    sh(clone.as_ref(), "echo from-clone > /root/marker");
    let suspended = clone.suspend(&MarkOptions { disk_only: true, ..Default::default() }).expect("suspend");
    assert!(suspended.boots_cold());
    let resumed = e.backend.restore(&suspended, &ident("resumed")).expect("resume");
    assert_eq!(sh(resumed.as_ref(), "cat /root/marker"), "from-clone", "what the guest wrote before");
    let resumed_boot = sh(resumed.as_ref(), BOOT_ID);
    assert!(resumed_boot != boot && resumed_boot != new_boot, "a new boot");
    assert_eq!(sh(resumed.as_ref(), SLEEPER), "0");
    drop(resumed);
    drop(cold);
}
