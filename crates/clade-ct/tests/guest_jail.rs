//! The escape suite (docs/security.md): known ways out of a container, tried from inside a jailed cold ct
//! sandbox and a jailed **restored sibling** (what users run), each of which must be refused with the expected
//! errno; and the same probes in an unjailed sandbox (the control), where each must get through, so that a
//! probe that could not detect its escape fails the test instead of passing it. Root, namespaces and CRIU are
//! required (tier names: `privileged`, `guest`).

use std::collections::BTreeMap;

use clade_agent::ExecSpec;
use clade_core::backend::{Identity, MarkOptions, Sandbox};
use serde_json::Value;

const PROBE: &str = include_str!("probe_escape.py");
/// The pids limit of the jailed sandboxes here, and how many children the fork bomb tries.
const PIDS_MAX: u64 = 64;
const FORKS: u64 = 120;

mod common;
use common::Env;

fn env(name: &str, jail: bool) -> Option<Env> {
    common::env_with(&format!("jail-{name}"), 256, false, |cfg| {
        cfg.jail = jail;
        cfg.pids_max = PIDS_MAX;
    })
}

fn id(name: &str) -> Identity {
    clade_core::hygiene::new_identity(&format!("jail-{name}-{}", std::process::id()), 0)
}

/// A block device node this host can open (major, minor): what the mknod probe makes and opens inside. Taken
/// from /dev, since a host may itself be confined (here the disk in /proc/partitions is not openable even by
/// root, the loop devices are).
fn host_block_device() -> (u32, u32) {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let rd = std::fs::read_dir("/dev").expect("read /dev");
    let mut nodes: Vec<_> = rd.flatten().map(|e| e.path()).collect();
    nodes.sort();
    nodes
        .into_iter()
        .find_map(|p| {
            let md = std::fs::metadata(&p).ok()?;
            if !md.file_type().is_block_device() || std::fs::File::open(&p).is_err() {
                return None;
            }
            let rdev = md.rdev();
            Some((libc::major(rdev), libc::minor(rdev)))
        })
        .expect("this host has a block device node in /dev that root can open")
}

/// Why a probe's escape cannot be open on this host whatever the jail does (its control is then moot).
fn moot_here(probe: &str) -> Option<&'static str> {
    let modules_off = !host_has("/proc/modules")
        || std::fs::read_to_string("/proc/sys/kernel/modules_disabled").is_ok_and(|s| s.trim() == "1");
    match probe {
        "sysrq_trigger" if !host_has("/proc/sysrq-trigger") => Some("no /proc/sysrq-trigger (CONFIG_MAGIC_SYSRQ off)"),
        "init_module" | "finit_module" if modules_off => Some("no loadable modules in this kernel"),
        // The v1 release_agent escape needs the v1 hierarchies; on a cgroup v2 host the kernel refuses it.
        "release_agent" if clade_core::host::cgroup_version() != Some("v1") => Some("a cgroup v2 host"),
        "vsock" if !host_has_vsock() => Some("no AF_VSOCK in this kernel"),
        _ => None,
    }
}

/// Whether this host's kernel makes AF_VSOCK sockets at all.
fn host_has_vsock() -> bool {
    // SAFETY: socket(2) with integer arguments; the descriptor, if any, is closed at once.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0) };
    if fd >= 0 {
        // SAFETY: `fd` is ours and open.
        unsafe { libc::close(fd) };
    }
    fd >= 0
}

/// Masked or read-only paths this kernel has at all (a probe of a missing one answers ENOENT everywhere).
fn host_has(path: &str) -> bool {
    std::path::Path::new(path).exists()
}

fn probe(sb: &dyn Sandbox, other_pid: u32) -> BTreeMap<String, Value> {
    let (major, minor) = host_block_device();
    let args = [major.to_string(), minor.to_string(), other_pid.to_string(), FORKS.to_string()];
    let mut argv = vec!["/usr/bin/python3".to_string(), "-c".into(), PROBE.into()];
    argv.extend(args);
    let out = sb.agent().run(ExecSpec::new(argv)).expect("exec the probe");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "probe failed: {:?} {stdout} {}", out.status, String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("probe output {stdout:?}: {e}"))
}

const EPERM: i64 = libc::EPERM as i64;
const EACCES: i64 = libc::EACCES as i64;
const EROFS: i64 = libc::EROFS as i64;
const ESRCH: i64 = libc::ESRCH as i64;

/// Probe -> the errnos the jail may answer with (any other answer, 0 included, is an escape).
fn refusals() -> Vec<(&'static str, Vec<i64>)> {
    vec![
        ("devtmpfs_mount", vec![EPERM]),
        ("cgroup_mount", vec![EPERM]),
        ("proc_mount", vec![EPERM]),
        ("release_agent", vec![EPERM]),
        // mknod itself is allowed (as Docker does); opening the node is not (nodev mounts, devices cgroup).
        ("blockdev_open", vec![EACCES, EPERM]),
        ("open_by_handle_at", vec![EPERM]),
        // Read-only /proc/sys; in the user namespace the files' owner (host root) is unmapped, so the
        // permission check may answer first.
        ("core_pattern", vec![EROFS, EACCES]),
        ("sysctl_vm", vec![EROFS, EACCES]),
        (
            "sysrq_trigger",
            if host_has("/proc/sysrq-trigger") { vec![EROFS, EACCES] } else { vec![libc::ENOENT as i64] },
        ),
        ("sys_write", vec![EROFS]),
        ("settimeofday", vec![EPERM]),
        ("adjtimex", vec![EPERM]),
        ("init_module", vec![EPERM]),
        ("finit_module", vec![EPERM]),
        ("bpf", vec![EPERM]),
        ("keyctl", vec![EPERM]),
        ("perf_event_open", vec![EPERM]),
        ("io_uring_setup", vec![EPERM]),
        ("userfaultfd", vec![EPERM]),
        ("unshare", vec![EPERM]),
        ("vsock", vec![EPERM]),
        ("ptrace_other_sandbox", vec![ESRCH]),
    ]
}

fn int(r: &BTreeMap<String, Value>, k: &str) -> i64 {
    r.get(k).and_then(Value::as_i64).unwrap_or_else(|| panic!("probe {k} missing: {r:?}"))
}

fn assert_jailed(what: &str, r: &BTreeMap<String, Value>) {
    let mut escapes = Vec::new();
    for (k, ok) in refusals() {
        let got = int(r, k);
        if !ok.contains(&got) {
            escapes.push(format!("{k}: errno {got}, want one of {ok:?}"));
        }
    }
    // The sandbox's root is not host root: uid 0 inside maps to the jail's block (crate userns).
    let map: Vec<&str> = r
        .get("uid_map")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if map != ["0", &clade_ct::userns::BASE.to_string(), &clade_ct::userns::SIZE.to_string()] {
        escapes.push(format!("uid_map {map:?}: root inside is not mapped to the jail's block"));
    }
    let mask = format!("{:016x}", clade_ct::jail::keep_mask());
    for set in ["CapBnd", "CapEff", "CapPrm"] {
        let got = r.get(&format!("status_{set}")).and_then(Value::as_str).unwrap_or("?");
        if got != mask {
            escapes.push(format!("{set} {got}, want {mask}"));
        }
    }
    for (k, want) in [("status_Seccomp", "2"), ("status_NoNewPrivs", "1"), ("cgroup", "0::/")] {
        let got = r.get(k).and_then(Value::as_str).unwrap_or("?");
        // cgroup v1 lists a line per hierarchy; each must show the sandbox's own cgroup as its root.
        let fine = if k == "cgroup" { got.lines().all(|l| l.ends_with(":/")) } else { got == want };
        if !fine {
            escapes.push(format!("{k} {got:?}, want {want:?}"));
        }
    }
    for k in ["kcore_bytes", "timer_list_bytes", "sys_firmware_entries"] {
        if int(r, k) > 0 {
            escapes.push(format!("{k}: {} (a masked path shows content)", int(r, k)));
        }
    }
    if int(r, "forked") >= PIDS_MAX as i64 {
        escapes.push(format!("forked {} children past pids.max {PIDS_MAX}", int(r, "forked")));
    }
    // Compatibility: a newer C library's calls work or fall back (ENOSYS), they are not refused (EPERM).
    // (fchmodat2 came with Linux 6.6: an older kernel answers ENOSYS itself.)
    let enosys = libc::ENOSYS as i64;
    if ![0, enosys].contains(&int(r, "fchmodat2")) || int(r, "statmount") != enosys {
        escapes.push(format!(
            "fchmodat2 {} (want 0, or ENOSYS before Linux 6.6), statmount {} (want ENOSYS)",
            int(r, "fchmodat2"),
            int(r, "statmount")
        ));
    }
    // The probe's own control: it can ptrace what it can see.
    if int(r, "ptrace_own_child") != 0 {
        escapes.push(format!(
            "ptrace of its own child failed ({}): the ptrace probe proves nothing",
            int(r, "ptrace_own_child")
        ));
    }
    assert!(escapes.is_empty(), "{what}: the jail let these through:\n  {}\nprobe: {r:?}", escapes.join("\n  "));
}

#[test]
fn privileged_guest_jail_refuses_every_escape_cold_and_restored() {
    let Some(e) = env("on", true) else { return };
    let mut cold = e.backend.cold_start_ct(&e.image, &id("cold")).expect("cold start");
    let mark =
        cold.mark(&MarkOptions { label: None, not_clean: false, disk_only: false }).expect("mark a jailed sandbox");
    assert_eq!(mark.compat.get("jail").map(String::as_str), Some(clade_ct::jail::POLICY));
    let sib_id = id("sibling");
    let sibling = e.backend.restore_ct(&mark, &sib_id).expect("restore a sibling");
    clade_core::hygiene::apply(sibling.agent(), &sib_id, mark.clean).expect("hygiene in a jailed sibling");
    let host_name = std::fs::read_to_string(format!("/proc/{}/root/etc/hostname", sibling.init_pid())).unwrap();
    assert_eq!(host_name.trim(), sib_id.hostname, "the sibling's hostname, set from the host");
    assert_jailed("cold jailed sandbox", &probe(&cold, sibling.init_pid()));
    assert_jailed("restored jailed sibling", &probe(&sibling, cold.init_pid()));
    // The host's audit (clade audit --security) finds nothing to report in either, and the control below
    // shows it does report an unjailed sandbox.
    for s in [&cold, &sibling] {
        let a = clade_ct::jail_audit::audit(s.id(), &Sandbox::pids(s));
        assert!(a.deviations.is_empty() && a.processes >= 1, "{a:?}");
    }
    // The jail survives a second generation: a mark of the sibling, restored again.
    let mut sibling = sibling;
    let mark2 =
        sibling.mark(&MarkOptions { label: None, not_clean: false, disk_only: false }).expect("mark the sibling");
    let grandchild = e.backend.restore_ct(&mark2, &id("grandchild")).expect("restore the grandchild");
    assert_jailed("restored grandchild", &probe(&grandchild, cold.init_pid()));
    for s in [Box::new(cold) as Box<dyn Sandbox>, Box::new(sibling), Box::new(grandchild)] {
        s.kill().expect("kill");
    }
}

#[test]
fn privileged_guest_jail_control_unjailed_sandbox_lets_each_probe_through() {
    let Some(e) = env("off", false) else { return };
    let sb = e.backend.cold_start_ct(&e.image, &id("unjailed")).expect("cold start unjailed");
    let r = probe(&sb, std::process::id());
    let mut blind = Vec::new();
    for (k, refused) in refusals() {
        let got = int(&r, k);
        if k == "ptrace_other_sandbox" {
            continue; // namespaces are not the jail's switch: another sandbox is out of sight either way
        }
        if let Some(why) = moot_here(k) {
            eprintln!("note: {k}: {why}: the escape is closed on this host even without the jail");
            continue;
        }
        if refused.contains(&got) {
            blind.push(format!("{k}: errno {got} with the jail off"));
        }
    }
    let map: Vec<&str> = r
        .get("uid_map")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if map.get(1) != Some(&"0") {
        blind.push(format!("uid_map {map:?} with the jail off: the probe cannot tell host root"));
    }
    if int(&r, "forked") < FORKS as i64 {
        blind.push(format!("fork bomb stopped at {} with no pids limit", int(&r, "forked")));
    }
    for (k, path) in [("kcore_bytes", "/proc/kcore"), ("timer_list_bytes", "/proc/timer_list")] {
        if !host_has(path) {
            eprintln!("note: this kernel has no {path}: its mask is moot here");
            continue;
        }
        if int(&r, k) <= 0 {
            blind.push(format!("{k}: {} with nothing masked", int(&r, k)));
        }
    }
    assert!(blind.is_empty(), "probes that cannot see their escape:\n  {}\nprobe: {r:?}", blind.join("\n  "));
    let a = clade_ct::jail_audit::audit(sb.id(), &Sandbox::pids(&sb));
    for want in ["uid_map", "CapBnd", "Seccomp", "NoNewPrivs", "cgroup namespace", "/proc/sys", "pids.max"] {
        assert!(a.deviations.iter().any(|d| d.contains(want)), "the audit missed {want} in an unjailed sandbox: {a:?}");
    }
    // A jailed backend refuses a mark taken without the jail: CRIU would restore it unjailed.
    let mut sb = sb;
    let mark = sb.mark(&MarkOptions { label: None, not_clean: false, disk_only: false }).expect("mark unjailed");
    let jailed = env("on-refuses", true).expect("jailed env");
    let err =
        jailed.backend.restore_ct(&mark, &id("refused")).expect_err("an unjailed mark must be refused").to_string();
    assert!(err.contains("jail"), "{err}");
    Box::new(sb).kill().expect("kill");
}

#[test]
fn privileged_guest_jail_agent_socket_link_to_a_host_socket_is_not_followed() {
    let Some(e) = env("link", true) else { return };
    let mut sb = e.backend.cold_start_ct(&e.image, &id("link")).expect("cold start");
    let host_sock = e.home.join("host.sock");
    let listener = std::os::unix::net::UnixListener::bind(&host_sock).expect("host listener");
    listener.set_nonblocking(true).unwrap();
    let script = format!("rm -f /run/clade/agent.sock && ln -s {} /run/clade/agent.sock", host_sock.display());
    let out = sb.agent().run(ExecSpec::new(["/bin/sh", "-c", &script])).expect("exec");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Control: a path walked through /proc/PID/root follows the sandbox's link to the host's socket.
    let walked = std::os::unix::net::UnixStream::connect(format!("/proc/{}/root/run/clade/agent.sock", sb.init_pid()));
    assert!(walked.is_ok() && listener.accept().is_ok(), "control: the link must lead a path walk to the host socket");
    // The backend resolves inside the sandbox: the mark's reconnect finds no agent, and the mark is refused.
    let err = sb
        .mark(&MarkOptions { label: None, not_clean: false, disk_only: false })
        .expect_err("a mark whose agent did not answer");
    assert!(err.to_string().contains("did not answer"), "{err}");
    assert!(listener.accept().is_err(), "the supervisor connected to the host socket the sandbox pointed at");
    Box::new(sb).kill().expect("kill");
}

/// Whether the kernel tracks dirty pages, as `clade doctor` reports it (incremental ct marks need it). The test
/// that boots Debian's kernel in a vm and runs this suite there (clade-vm's `guest_ct_in_vm`) sets
/// `CLADE_EXPECT_SOFT_DIRTY=1`: that kernel has `CONFIG_MEM_SOFT_DIRTY`, so the probe must see it (the positive
/// control). Elsewhere the probe must agree with the kernel's config where `/proc/config.gz` publishes it.
#[test]
fn guest_dirty_page_tracking_is_probed_right() {
    let probed = clade_core::host::tracks_dirty_pages().expect("/proc/self/pagemap is readable");
    if std::env::var("CLADE_EXPECT_SOFT_DIRTY").as_deref() == Ok("1") {
        assert!(probed, "this kernel has CONFIG_MEM_SOFT_DIRTY, but the probe did not see a dirtied page");
        return;
    }
    let config = std::process::Command::new("sh").args(["-c", "zcat /proc/config.gz 2>/dev/null"]).output();
    match config.ok().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).filter(|c| !c.is_empty()) {
        Some(c) => assert_eq!(probed, c.contains("CONFIG_MEM_SOFT_DIRTY=y"), "probe vs /proc/config.gz"),
        None => eprintln!("skip: no /proc/config.gz to compare the probe ({probed}) with"),
    }
}

/// `[jail] no_new_privs = false` (E2B's base template, for `sudo`): a setuid-root program run by uid 1000 gains
/// root inside the sandbox, yet the jail holds: seccomp still filters (mode 2), the capability sets stay the
/// policy's, the sandbox's root is still an unprivileged host uid, and the audit passes. Control: the same
/// program in a default sandbox (no_new_privs set) runs as 1000, so the test can tell the two apart.
#[test]
fn privileged_guest_jail_no_new_privs_off_lets_setuid_gain_only_the_sandbox_root() {
    let Some(e) = env("nnp", true) else { return };
    let run_as_1000 = |sb: &dyn Sandbox| -> String {
        // python keeps the euid a setuid bit gives (busybox would drop it for its applets).
        let setup = "cp /usr/bin/python3 /usr/bin/suid-python3 && chown 0:0 /usr/bin/suid-python3 \
                     && chmod 4755 /usr/bin/suid-python3";
        let out = sb.agent().run(ExecSpec::new(["/bin/sh", "-c", setup])).expect("exec");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let mut spec = ExecSpec::new(["/usr/bin/suid-python3", "-c", "import os; print(os.geteuid())"]);
        spec.uid = Some(1000);
        spec.gid = Some(1000);
        let out = sb.agent().run(spec).expect("exec as 1000");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    // Control: the default jail.
    let sb = e.backend.cold_start_ct(&e.image, &id("nnp-on")).expect("cold start");
    assert_eq!(run_as_1000(&sb), "1000", "control: with no_new_privs the setuid bit must be ignored");
    let a = clade_ct::jail_audit::audit(sb.id(), &Sandbox::pids(&sb));
    assert!(a.no_new_privs && a.deviations.is_empty(), "{:?}", a.deviations);
    Box::new(sb).kill().expect("kill");

    let image = clade_core::backend::TemplateImage { no_new_privs: false, ..e.image.clone() };
    let sb = e.backend.cold_start_ct(&image, &id("nnp-off")).expect("cold start without no_new_privs");
    assert_eq!(run_as_1000(&sb), "0", "without no_new_privs a setuid-root program runs as the sandbox's root");
    let a = clade_ct::jail_audit::audit(sb.id(), &Sandbox::pids(&sb));
    assert!(!a.no_new_privs, "the audit reports the template's choice");
    assert!(a.deviations.is_empty(), "the rest of the jail holds: {:?}", a.deviations);
    assert_eq!(a.status.get("Seccomp"), Some(&vec!["2".to_string()]), "seccomp still filters every process");
    assert!(!a.uid_map.starts_with("0 0 "), "the sandbox's root is not host root: {}", a.uid_map);
    // And the gain is only the sandbox's root: the escape probes are refused as in any jailed sandbox.
    let mut r = probe(&sb, std::process::id());
    assert_eq!(r.get("status_NoNewPrivs").and_then(Value::as_str), Some("0"), "the probe sees the flag off");
    // Every other part of the jail is the policy's.
    r.insert("status_NoNewPrivs".into(), Value::String("1".into()));
    assert_jailed("no_new_privs off", &r);
    // A restored sibling keeps the flag as its base had it (CRIU restores it per task).
    let mut sb = sb;
    let mark = sb.mark(&MarkOptions { label: None, not_clean: false, disk_only: false }).expect("mark");
    let sib = e.backend.restore_ct(&mark, &id("nnp-sib")).expect("restore");
    let mut spec = ExecSpec::new(["/usr/bin/suid-python3", "-c", "import os; print(os.geteuid())"]);
    (spec.uid, spec.gid) = (Some(1000), Some(1000));
    let out = sib.agent().run(spec).expect("exec in the sibling");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0", "the sibling's setuid program gains its root");
    let a = clade_ct::jail_audit::audit(sib.id(), &Sandbox::pids(&sib));
    assert!(!a.no_new_privs && a.deviations.is_empty(), "{:?}", a.deviations);
    for s in [Box::new(sb) as Box<dyn Sandbox>, Box::new(sib)] {
        s.kill().expect("kill");
    }
}
