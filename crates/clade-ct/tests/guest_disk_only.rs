//! Disk-only marks on `ct` (E2B's filesystem-only pause) and the sandbox's own boot id: a restore from a whole
//! mark continues the same boot (same boot id, its processes), a disk-only mark boots the disk cold (the
//! files, a new boot id, none of the processes). Jailed and unjailed; root, namespaces and CRIU are required.

use clade_agent::ExecSpec;
use clade_core::backend::{Identity, MarkOptions, Sandbox};

mod common;

fn id(name: &str) -> Identity {
    clade_core::hygiene::new_identity(&format!("disk-{name}-{}", std::process::id()), 0)
}

fn sh(sb: &dyn Sandbox, script: &str) -> String {
    let out = sb.agent().run(ExecSpec::new(["/bin/sh", "-c", script])).expect("exec");
    assert!(out.status.success(), "{script}: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

const BOOT_ID: &str = "cat /proc/sys/kernel/random/boot_id";
/// A process the sandbox started and left running, found by its command line.
const SLEEPER: &str =
    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 4242' || true";

fn host_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim().to_string()
}

fn disk_only_boots_cold(jail: bool) {
    let tag = if jail { "jailed" } else { "unjailed" };
    let Some(e) = common::env_with(&format!("disk-{tag}"), 256, false, |cfg| cfg.jail = jail) else { return };
    let mut base = e.backend.cold_start_ct(&e.image, &id(&format!("{tag}-base"))).expect("cold start");
    let boot = sh(&base, BOOT_ID);
    assert_eq!(boot.len(), 36, "a uuid: {boot}");
    assert_ne!(boot, host_boot_id(), "the sandbox has its own boot id, not the host kernel's");
    let cold2 = e.backend.cold_start_ct(&e.image, &id(&format!("{tag}-cold2"))).expect("second cold start");
    assert_ne!(sh(&cold2, BOOT_ID), boot, "every cold start is a boot of its own");
    Box::new(cold2).kill().expect("kill");
    let write = sh(&base, "echo 1 > /proc/sys/kernel/random/boot_id 2>&1; echo $?");
    assert_ne!(write.lines().last(), Some("0"), "the boot id is read-only inside: {write}");
    sh(&base, "echo kept > /root/marker; mkdir -p /home/user; echo deep > /home/user/f; rm -f /etc/hostname");
    sh(&base, "setsid sleep 4242 >/dev/null 2>&1 < /dev/null &");
    assert_eq!(sh(&base, SLEEPER), "1");

    // A whole mark: its restore continues the boot (same id) with its processes.
    let whole = base.mark(&MarkOptions::default()).expect("whole mark");
    assert!(!whole.boots_cold());
    let sib = e.backend.restore_ct(&whole, &id(&format!("{tag}-whole"))).expect("restore");
    assert_eq!(sh(&sib, BOOT_ID), boot, "a restore from memory is the same boot");
    assert_eq!(sh(&sib, SLEEPER), "1", "and has the marked processes");
    Box::new(sib).kill().expect("kill");

    // A disk-only mark of the running sandbox: it goes on; the mark's sandbox boots cold.
    let disk = base.mark(&MarkOptions { disk_only: true, ..Default::default() }).expect("disk-only mark");
    assert!(disk.boots_cold(), "{:?}", disk.manifests);
    assert!(!disk.manifests.contains_key("criu"), "no CRIU images in a disk-only mark");
    assert_eq!(sh(&base, "cat /root/marker"), "kept", "the marked sandbox goes on");
    sh(&base, "echo after > /root/marker");
    let mut booted = e.backend.restore_ct(&disk, &id(&format!("{tag}-booted"))).expect("boot the disk-only mark");
    assert_eq!(sh(&booted, "cat /root/marker /home/user/f"), "kept\ndeep", "the files as marked");
    assert!(sh(&booted, "ls /etc/hostname 2>&1 || true").contains("No such file"), "a deletion stays deleted");
    let new_boot = sh(&booted, BOOT_ID);
    assert_ne!(new_boot, boot, "a cold boot has a new boot id");
    assert_eq!(new_boot.len(), 36);
    assert_eq!(sh(&booted, SLEEPER), "0", "no process of the marked sandbox");
    assert_eq!(sh(&booted, "cat /proc/1/comm"), "clade-agent");
    assert_eq!(sh(&booted, "ls -A /run"), "clade", "/run starts empty, as at a boot");
    // Its own mark and restore work as for any sandbox (the boot id bind included).
    let again = booted.mark(&MarkOptions::default()).expect("mark the booted sandbox");
    let sib = e.backend.restore_ct(&again, &id(&format!("{tag}-again"))).expect("restore");
    assert_eq!(sh(&sib, BOOT_ID), new_boot);
    for sb in [sib, booted] {
        Box::new(sb).kill().expect("kill");
    }

    // A disk-only suspend: the processes end, the disk as they left it boots cold.
    sh(&base, "head -c 33554432 /dev/urandom > /root/big");
    let suspended = Box::new(base).suspend(&MarkOptions { disk_only: true, ..Default::default() }).expect("suspend");
    assert!(suspended.boots_cold());
    let resumed = e.backend.restore_ct(&suspended, &id(&format!("{tag}-resumed"))).expect("resume");
    assert_eq!(sh(&resumed, "cat /root/marker"), "after", "what was written before the suspend");
    let resumed_boot = sh(&resumed, BOOT_ID);
    assert!(resumed_boot != boot && resumed_boot != new_boot, "a new boot");
    assert_eq!(sh(&resumed, SLEEPER), "0");
    // The upper copied onto the sandbox's tmpfs at the boot (32 MiB of it in /root/big) is charged to the
    // sandbox's memory cgroup, not to the process that booted it.
    let charged = resumed.cgroup_memory().expect("the sandbox's memory usage");
    assert!(charged >= 32 << 20, "the boot's upper is charged to the sandbox: {} MiB", charged >> 20);
    // A disk-only mark has nothing to prepare ahead (a warm pool restores it whole).
    use clade_core::backend::Backend;
    assert!(e.backend.prepare(&suspended, &id(&format!("{tag}-prep"))).expect("prepare").is_none());
    Box::new(resumed).kill().expect("kill");
    let _ = std::fs::remove_dir_all(&e.home);
}

#[test]
fn privileged_guest_disk_only_marks_boot_cold_jailed() {
    disk_only_boots_cold(true);
}

#[test]
fn privileged_guest_disk_only_marks_boot_cold_unjailed() {
    disk_only_boots_cold(false);
}
