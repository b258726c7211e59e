//! The jail of the `vm` backend's QEMUs (docs/vm.md, "The jail"), asserted from the host on real guests started
//! through the backend: each QEMU's uid is its own non-zero one from the range, with no capabilities, a bounding
//! set of three, seccomp filter mode and no_new_privs, its root is its jail directory, its mount namespace is
//! not the host's, it is in its cgroup with the guest's limits, and its command line carries the `-sandbox`
//! options. Escape probes, each with a control that proves the probe can see an open succeed: as a sandbox's
//! uid, another sandbox's RAM file and `/proc/PID/mem` cannot be opened (EACCES), as root they can. A mark of a
//! sibling (device state written inside the jail) and a child restored from it still work, another sandbox's
//! mount is not copied into a QEMU's mount namespace, and dropping the sandboxes frees their uids and cgroups.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, MarkOptions, Sandbox, Shape, TemplateImage};
use clade_core::hygiene;
use clade_vm::jail::{SANDBOX_OPTS, UID_BASE, UID_SLOTS};
use common::*;

fn sh(sbx: &dyn Sandbox, script: &str) -> String {
    let out = sbx
        .agent()
        .run(ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() })
        .unwrap();
    assert_eq!(out.status.code, Some(0), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A field of /proc/PID/status.
fn status(pid: u32, key: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// Open `path` for reading in a child process running as `uid` (gid the same, no supplementary groups;
/// `None`: as root): `Ok` when the open succeeded, else the shell's error text.
fn open_as(uid: Option<u32>, path: &Path) -> Result<(), String> {
    let mut c = Command::new("/bin/busybox");
    c.args(["sh", "-c", "exec 3< \"$1\"", "sh"]).arg(path).current_dir("/");
    if let Some(u) = uid {
        // std's Command drops supplementary groups (setgroups(0)) and calls setgid, then setuid, in the child.
        std::os::unix::process::CommandExt::uid(&mut c, u);
        std::os::unix::process::CommandExt::gid(&mut c, u);
    }
    let out = c.output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Unmounts a test mount on drop.
struct Unmount(std::path::PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Everything asserted of one jailed QEMU; returns its uid.
fn assert_jailed(pid: u32, run_dir: &Path, id: &str, memory_mib: u32) -> u32 {
    let uids: Vec<u32> = status(pid, "Uid").split_whitespace().map(|u| u.parse().unwrap()).collect();
    let uid = uids[0];
    assert!(uids.iter().all(|&u| u == uid), "real, effective, saved and fs uid are one: {uids:?}");
    assert!((UID_BASE..UID_BASE + UID_SLOTS).contains(&uid), "uid {uid} is in the sandbox range");
    let gids: Vec<u32> = status(pid, "Gid").split_whitespace().map(|u| u.parse().unwrap()).collect();
    assert!(gids.iter().all(|&g| g == uid), "gid = uid: {gids:?}");
    assert_eq!(status(pid, "Groups"), uid.to_string(), "its own group alone (QEMU's -runas sets it)");
    assert_eq!(status(pid, "CapEff"), "0000000000000000");
    assert_eq!(status(pid, "CapPrm"), "0000000000000000");
    assert_eq!(status(pid, "CapInh"), "0000000000000000");
    assert_eq!(status(pid, "CapAmb"), "0000000000000000");
    // CAP_SETGID (6), CAP_SETUID (7), CAP_SYS_CHROOT (18): the bounding set only matters at exec, which the
    // seccomp filter refuses (spawn=deny) and no_new_privs would strip anyway.
    assert_eq!(status(pid, "CapBnd"), format!("{:016x}", (1u64 << 6) | (1 << 7) | (1 << 18)));
    assert_eq!(status(pid, "Seccomp"), "2", "seccomp filter mode");
    assert_eq!(status(pid, "NoNewPrivs"), "1");
    let jail = run_dir.join("qemu/jail");
    assert_eq!(std::fs::read_link(format!("/proc/{pid}/root")).unwrap(), jail, "root is the jail");
    assert_eq!(std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap(), jail, "cwd is the jail");
    let m = std::fs::metadata(&jail).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (0, uid, 0o770), "jail dir root:sandbox-gid 0770");
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap(),
        std::fs::read_link("/proc/self/ns/mnt").unwrap(),
        "QEMU has its own mount namespace"
    );
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap(),
        "a QEMU without egress has its own (empty) network namespace"
    );
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let after = |flag: &str| args.iter().position(|a| a == flag).map(|i| args[i + 1].clone());
    assert_eq!(after("-sandbox").as_deref(), Some(SANDBOX_OPTS));
    assert_eq!(SANDBOX_OPTS, "on,obsolete=deny,spawn=deny,resourcecontrol=deny");
    assert_eq!(after("-runas"), Some(format!("{uid}:{uid}")));
    assert_eq!(after("-chroot").map(std::path::PathBuf::from), Some(jail));
    // Its cgroup, with the guest's limits.
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let want = format!("/clade/{id}");
    assert!(cg.lines().any(|l| l.ends_with(&want)), "QEMU {pid} is in {want}: {cg}");
    let limits = clade_vm::jail::limits_for_guest(memory_mib, 1, accel());
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let mem = if v2 {
        format!("/sys/fs/cgroup/clade/{id}/memory.max")
    } else {
        format!("/sys/fs/cgroup/memory/clade/{id}/memory.limit_in_bytes")
    };
    assert_eq!(std::fs::read_to_string(mem).unwrap().trim(), limits.memory_bytes.to_string());
    let pids = if v2 {
        format!("/sys/fs/cgroup/clade/{id}/pids.max")
    } else {
        format!("/sys/fs/cgroup/pids/clade/{id}/pids.max")
    };
    assert_eq!(std::fs::read_to_string(pids).unwrap().trim(), "512");
    uid
}

#[test]
fn guest_vm_jail_uids_caps_seccomp_chroot_and_escape_probes() {
    let Some(common::VmEnv { work, store: _, home, shm, backend, disk }) = common::vm_env("clade-vmjail") else {
        return;
    };
    let w = work.path();
    // Directories any uid may pass through, so that the probes below meet the RAM files' own modes (clade's
    // real RAM directories are 0700 on top of that).
    use std::os::unix::fs::PermissionsExt;
    for d in [w.to_path_buf(), shm.clone(), shm.join("run"), shm.join("ram")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    let shape = Shape { memory_mib: 256, vcpus: 1, disk_gib: 1 };
    let image = TemplateImage {
        name: "busybox-test".into(),
        hash: "test".into(),
        rootfs: w.join("root"),
        disk_manifest: Some(disk),
        shape: shape.clone(),
        egress: false,
        no_new_privs: true,
    };
    let tag = std::process::id();
    let run = |id: &str| home.run_dir().join(id);

    // A cold sandbox: jailed, and its private RAM file is root's 0600.
    let a_id = format!("t{tag}jaila");
    let mut a = backend.cold_start(&image, &hygiene::new_identity(&a_id, 0)).unwrap();
    sh(a.as_ref(), "echo before-mark > /root/marked");
    let a_pid = a.pids()[0];
    let a_uid = assert_jailed(a_pid, &run(&a_id), &a_id, shape.memory_mib);
    let cold_ram = shm.join("run").join(format!("{a_id}.ram"));
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&cold_ram).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600), "a cold RAM file is root's, 0600");
    }
    let probe = open_as(Some(a_uid), &cold_ram);
    assert!(probe.as_ref().is_err_and(|e| e.contains("Permission denied")), "as its own QEMU's uid: {probe:?}");
    assert_eq!(open_as(None, &cold_ram), Ok(()), "control: root opens it");

    // Its mark; it runs on as a clone (a new QEMU, jailed again) and two siblings are restored.
    let mark = a.mark(&MarkOptions::default()).unwrap();
    let a_pid = a.pids()[0];
    let a_uid = assert_jailed(a_pid, &run(&a_id), &a_id, shape.memory_mib);
    // Another sandbox's mount under the RAM dir (as a lazy RAM mount would be): QEMUs started while it exists
    // must not hold a copy of it in their mount namespaces.
    let other = shm.join("lazy").join(format!("t{tag}other"));
    std::fs::create_dir_all(&other).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&other).status().unwrap();
    assert!(mounted.success());
    let _unmount = Unmount(other.clone());
    let mut sibs = Vec::new();
    for i in 0..2 {
        let id = hygiene::new_identity(&format!("t{tag}jail{i}"), 1);
        let s = backend.restore(&mark, &id).unwrap();
        hygiene::apply(s.agent(), &id, true).unwrap();
        assert_eq!(sh(s.as_ref(), "cat /root/marked"), "before-mark");
        let uid = assert_jailed(s.pids()[0], &run(&id.sandbox_id), &id.sandbox_id, shape.memory_mib);
        sibs.push((s, id, uid));
    }
    let (b_uid, c_uid) = (sibs[0].2, sibs[1].2);
    let mounts_of = |pid: Option<u32>| {
        let mut c = Command::new("nsenter");
        if let Some(p) = pid {
            c.arg(format!("--mount=/proc/{p}/ns/mnt"));
        }
        let out = c.args(["--", "cat", "/proc/self/mountinfo"]).output().unwrap();
        assert!(out.status.success(), "nsenter: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let needle = format!(" {} ", other.display());
    assert!(mounts_of(None).contains(&needle), "control: the host has the mount");
    assert!(!mounts_of(Some(sibs[0].0.pids()[0])).contains(&needle), "B's QEMU holds no copy of the mount");
    assert!(a_uid != b_uid && b_uid != c_uid && a_uid != c_uid, "one uid per sandbox: {a_uid} {b_uid} {c_uid}");
    for u in [a_uid, b_uid, c_uid] {
        assert!(
            home.run_dir().join(clade_vm::backend::UIDS_DIR).join((u - UID_BASE).to_string()).exists(),
            "slot of {u} claimed"
        );
    }

    // Escape probes as sibling B's uid against A, each with its control as root.
    let root_ram = std::fs::read_to_string(format!("/proc/{a_pid}/maps"))
        .unwrap()
        .lines()
        .find_map(|l| l.split_whitespace().nth(5).filter(|p| p.ends_with(".ram")).map(std::path::PathBuf::from))
        .expect("A maps its RAM file");
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&root_ram).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o600), "{} is root's, 0600", root_ram.display());
    }
    let probe = open_as(Some(b_uid), &root_ram);
    assert!(probe.as_ref().is_err_and(|e| e.contains("Permission denied")), "B's uid opens A's RAM: {probe:?}");
    assert_eq!(open_as(None, &root_ram), Ok(()), "control: root opens A's RAM file");
    let mem = std::path::PathBuf::from(format!("/proc/{a_pid}/mem"));
    let probe = open_as(Some(b_uid), &mem);
    assert!(probe.as_ref().is_err_and(|e| e.contains("Permission denied")), "B's uid opens A's memory: {probe:?}");
    assert_eq!(open_as(None, &mem), Ok(()), "control: root opens A's /proc/PID/mem");
    let probe = open_as(Some(b_uid), &run(&a_id).join("qemu/jail"));
    assert!(probe.is_err(), "B's uid cannot enter A's jail: {probe:?}");

    // A mark of a sibling (device state written inside its jail, taken out by the host) and its child.
    sh(sibs[0].0.as_ref(), "echo mine > /root/own; sync");
    let m2 = sibs[0].0.mark(&MarkOptions::default()).unwrap();
    assert_eq!(sh(sibs[0].0.as_ref(), "cat /root/own"), "mine", "the sibling runs on after its mark");
    let jail_b = run(&sibs[0].1.sandbox_id).join("qemu/jail");
    assert_eq!(std::fs::read_dir(&jail_b).unwrap().count(), 0, "nothing is left in B's jail");
    let child_id = hygiene::new_identity(&format!("t{tag}jailchild"), 2);
    let child = backend.restore(&m2, &child_id).unwrap();
    hygiene::apply(child.agent(), &child_id, true).unwrap();
    assert_eq!(sh(child.as_ref(), "cat /root/own"), "mine");
    let child_uid = assert_jailed(child.pids()[0], &run(&child_id.sandbox_id), &child_id.sandbox_id, 256);
    assert!(![a_uid, b_uid, c_uid].contains(&child_uid));

    // Dropping them kills the QEMUs, frees their uids and removes their cgroups.
    let pids: Vec<u32> = sibs.iter().flat_map(|(s, _, _)| s.pids()).chain(child.pids()).chain(a.pids()).collect();
    let ids: Vec<String> = sibs
        .iter()
        .map(|(_, id, _)| id.sandbox_id.clone())
        .chain([child_id.sandbox_id.clone(), a_id.clone()])
        .collect();
    drop(sibs);
    drop(child);
    drop(a);
    std::thread::sleep(Duration::from_millis(100));
    for p in pids {
        assert!(!Path::new(&format!("/proc/{p}")).exists(), "QEMU {p} left running");
    }
    for u in [a_uid, b_uid, c_uid, child_uid] {
        assert!(
            !home.run_dir().join(clade_vm::backend::UIDS_DIR).join((u - UID_BASE).to_string()).exists(),
            "uid {u} freed"
        );
        assert!(!clade_vm::jail::uid_in_use(u), "no process runs as {u}");
    }
    for id in ids {
        for c in ["memory", "pids", "cpu"] {
            let d = Path::new("/sys/fs/cgroup").join(c).join("clade").join(&id);
            assert!(!d.exists(), "cgroup {} removed", d.display());
        }
        assert!(!Path::new("/sys/fs/cgroup/clade").join(&id).exists());
    }
}

/// What the jail costs (docs/vm.md, "The jail"): 3 cold boots and 3 restores jailed and 3 each unjailed,
/// interleaved, to the agent's hello. Ignored by default (about a minute under TCG): `cargo test -p clade-vm
/// --test guest_vm_jail -- --ignored --nocapture`.
#[test]
#[ignore]
fn guest_vm_jail_cost_cold_and_restore() {
    let Some(common::VmEnv { work, store: _, home: _, shm: _, backend, disk }) = common::vm_env("clade-vmjailcost")
    else {
        return;
    };
    let w = work.path();
    let image = TemplateImage {
        name: "busybox-test".into(),
        hash: "test".into(),
        rootfs: w.join("root"),
        disk_manifest: Some(disk),
        shape: Shape { memory_mib: 256, vcpus: 1, disk_gib: 1 },
        egress: false,
        no_new_privs: true,
    };
    let tag = std::process::id();
    let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
    let (mut cold, mut restore) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    let mut mark = None;
    for i in 0..3 {
        for (k, jailed) in [(0, true), (1, false)] {
            backend.set_jailed(jailed);
            let t = std::time::Instant::now();
            let mut s = backend.cold_start(&image, &hygiene::new_identity(&format!("t{tag}c{i}{k}"), 0)).unwrap();
            cold[k].push(ms(t));
            if mark.is_none() {
                mark = Some(s.mark(&MarkOptions::default()).unwrap());
            }
        }
    }
    let mark = mark.unwrap();
    for i in 0..3 {
        for (k, jailed) in [(0, true), (1, false)] {
            backend.set_jailed(jailed);
            let t = std::time::Instant::now();
            let s = backend.restore(&mark, &hygiene::new_identity(&format!("t{tag}r{i}{k}"), 1)).unwrap();
            restore[k].push(ms(t));
            drop(s);
        }
    }
    let med = |v: &Vec<f64>| {
        let mut v = v.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (what, r) in [("cold boot to hello", &cold), ("restore to hello", &restore)] {
        eprintln!(
            "{what}: jailed {:?} ms (median {:.0}), unjailed {:?} ms (median {:.0}), ratio {:.3}",
            r[0].iter().map(|x| x.round()).collect::<Vec<_>>(),
            med(&r[0]),
            r[1].iter().map(|x| x.round()).collect::<Vec<_>>(),
            med(&r[1]),
            med(&r[0]) / med(&r[1])
        );
    }
}
