//! The `ct` backend on this host: cold start, mark, restore and fork with CRIU, suspend, the sibling audit and
//! failure injection. Root, namespaces and CRIU are required (tier names: `privileged`, `guest`).

use std::time::Duration;

use clade_agent::ExecSpec;
use clade_core::backend::{Identity, MarkOptions, Sandbox};
use clade_ct::{CtSandbox, FailPoint};

mod common;
use common::Env;

fn env(name: &str) -> Option<Env> {
    common::env_with(name, 512, false, |_| {})
}

fn id(name: &str) -> Identity {
    clade_core::hygiene::new_identity(&format!("{name}-{}", std::process::id()), 0)
}

fn sh(sb: &dyn Sandbox, script: &str) -> String {
    let out = sb.agent().run(ExecSpec::new(["/bin/sh", "-c", script])).expect("exec");
    assert!(out.status.success(), "{script}: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn privileged_guest_cold_start_and_exec() {
    let Some(e) = env("cold") else { return };
    let ident = id("cold");
    let sb = e.backend.cold_start_ct(&e.image, &ident).expect("cold start");
    assert_eq!(sh(&sb, "hostname"), ident.hostname);
    assert_eq!(sh(&sb, "cat /proc/1/comm"), "clade-agent");
    let procs: u32 = sh(&sb, "ls /proc | grep -c '^[0-9]'").parse().unwrap();
    assert!(procs < 10, "the sandbox sees only its own processes, not the host's ({procs})");
    let run_dir = e.home.join("run").join(&ident.sandbox_id);
    assert!(run_dir.exists());
    Box::new(sb).kill().expect("kill");
    assert!(!run_dir.exists());
}

/// /dev, /dev/shm and /run are directories of the overlay, not tmpfs mounts (CRIU would run `tar` for each at
/// every mark and restore): they start empty whatever the template's rootfs holds there, and what a sandbox
/// writes in them comes back in its siblings.
#[test]
fn privileged_guest_dev_and_run_are_overlay_dirs_hiding_the_rootfs() {
    let Some(e) = env("devrun") else { return };
    // A rootfs with leftovers in dev/ and run/ (hard-linked copy of the test rootfs).
    let rootfs = e.home.join("rootfs-with-leftovers");
    let cp = std::process::Command::new("cp").arg("-al").arg(&e.image.rootfs).arg(&rootfs).status().unwrap();
    assert!(cp.success());
    for d in ["dev", "run", "dev/shm"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
        std::fs::write(rootfs.join(d).join("leftover"), "from the rootfs").unwrap();
    }
    let image = clade_ct::testroot::image("ct-test-leftovers", rootfs, 512, false);
    let mut base = e.backend.cold_start_ct(&image, &id("devrun")).expect("cold start");
    let no_tmpfs = "awk '$9 == \"tmpfs\" {print $5}' /proc/self/mountinfo";
    assert_eq!(sh(&base, no_tmpfs), "", "no tmpfs mount in the sandbox");
    assert_eq!(sh(&base, "ls -A /dev/shm; ls -A /run; ls /dev | grep -c leftover || true"), "clade\n0");
    assert_eq!(sh(&base, "stat -c %a /dev/shm /run"), "1777\n755");
    assert_eq!(sh(&base, "echo x > /dev/null && head -c 4 /dev/zero | wc -c"), "4");
    sh(&base, "echo shm > /dev/shm/s; echo run > /run/r");
    let mark = base.mark(&MarkOptions::default()).expect("mark");
    let (sib, _) = fork(&e, &mark, "devrun-sib");
    assert_eq!(sh(&sib, "cat /dev/shm/s /run/r"), "shm\nrun");
    assert_eq!(sh(&sib, no_tmpfs), "", "no tmpfs mount in the restored sibling");
    assert_eq!(sh(&sib, "ls /dev /run | grep -c leftover || true"), "0");
    for sb in [sib, base] {
        Box::new(sb).kill().expect("kill");
    }
}

fn fork(e: &Env, mark: &clade_core::backend::MarkState, name: &str) -> (CtSandbox, Identity) {
    let ident = id(name);
    let sb = e.backend.restore_ct(mark, &ident).expect("restore");
    let r = clade_core::hygiene::apply(sb.agent(), &ident, mark.clean).expect("hygiene");
    assert!(r.hostname_set && r.machine_id_set, "{r:?}");
    (sb, ident)
}

#[test]
fn privileged_guest_mark_and_fork_two_siblings() {
    let Some(e) = env("fork") else { return };
    let mut base = e.backend.cold_start_ct(&e.image, &id("base")).expect("cold start");
    sh(&base, "echo before-mark > /root/note; mkdir -p /tmp/x; echo tmpfs > /tmp/x/t");
    // A long-lived process with state in memory survives the restore.
    sh(&base, "setsid sleep 1000 </dev/null >/dev/null 2>&1 &");
    // Pre-mark hooks run just before the dump, so what they write is in the mark; one that fails does not
    // stop the mark.
    sh(
        &base,
        "mkdir -p /etc/clade/pre-mark.d && cd /etc/clade/pre-mark.d && \
         printf '#!/bin/sh\\necho clean=$CLADE_MARK_CLEAN >> /root/pre-mark\\n' > 10-note && \
         printf '#!/bin/sh\\nexit 1\\n' > 20-fails && chmod +x 10-note 20-fails",
    );
    let mark = base.mark(&MarkOptions::default()).expect("mark");
    assert_eq!(sh(&base, "cat /root/pre-mark"), "clean=1");
    assert!(mark.pause > Duration::ZERO && mark.pause < Duration::from_secs(20), "{:?}", mark.pause);
    assert!(mark.stored_bytes > 0 && mark.logical_bytes >= mark.stored_bytes / 2, "{mark:?}");
    // The marked sandbox keeps running and answers.
    assert_eq!(sh(&base, "cat /root/note"), "before-mark");
    // One sibling eager, one lazy (CRIU lazy-pages over userfaultfd).
    e.backend.set_lazy_threshold(None);
    let (a, ia) = fork(&e, &mark, "sib-a");
    e.backend.set_lazy_threshold(Some(0));
    let (b, ib) = fork(&e, &mark, "sib-b");
    e.backend.set_lazy_threshold(None);
    // A jailed sibling restores lazily only where the host lets a user namespace open a userfaultfd
    // (vm.unprivileged_userfaultfd=1); the lazy path itself is covered unjailed in ct_lazy below.
    let lazy = b.phases.iter().any(|(k, d)| *k == "lazy" && !d.is_zero());
    assert_eq!(lazy, clade_ct::userns::userfaultfd_allowed(), "{:?}", b.phases);
    for (sb, ident) in [(&a, &ia), (&b, &ib)] {
        assert_eq!(sh(sb, "hostname"), ident.hostname);
        assert_eq!(sh(sb, "cat /etc/machine-id"), ident.machine_id);
        assert_eq!(sh(sb, "cat /root/note"), "before-mark");
        assert_eq!(sh(sb, "cat /root/pre-mark"), "clean=1", "the hook ran before the dump");
        assert_eq!(sh(sb, "cat /tmp/x/t"), "tmpfs");
        assert!(sh(sb, "ps -o comm").contains("sleep"), "the sleeper was restored");
    }
    sh(&a, "echo only-a > /root/a-file");
    assert_eq!(sh(&b, "test -e /root/a-file && echo yes || echo no"), "no");
    assert_eq!(sh(&base, "test -e /root/a-file && echo yes || echo no"), "no");
    let audit = clade_ct::audit(&a.pids(), &b.pids());
    assert_eq!(audit.shared_writable(), 0, "{audit:?}");
    assert!(audit.processes.0 >= 2 && audit.processes.1 >= 2, "{audit:?}");
    // A mark of a restored sibling restores too, with both generations of files.
    let mut a = a;
    let mark_a = a.mark(&MarkOptions::default()).expect("mark a restored sibling");
    let (c, _) = fork(&e, &mark_a, "sib-c");
    assert_eq!(sh(&c, "cat /root/note /root/a-file"), "before-mark\nonly-a");
    assert!(sh(&c, "ps -o comm").contains("sleep"));
    for sb in [a, b, c, base] {
        Box::new(sb).kill().expect("kill");
    }
}

#[test]
fn privileged_guest_suspend_restore_and_refusals() {
    let Some(e) = env("susp") else { return };
    let sb = e.backend.cold_start_ct(&e.image, &id("susp")).expect("cold start");
    sh(&sb, "echo kept > /root/state");
    // An on-restore hook that a restore of a mark declared not clean must not run.
    sh(&sb, "mkdir -p /etc/clade/on-restore.d && printf '#!/bin/sh\\necho ran > /root/hook\\n' > /etc/clade/on-restore.d/10-t && chmod +x /etc/clade/on-restore.d/10-t");
    // A process started through exec that still runs holds an agent connection: the mark is refused with the
    // reason, and the sandbox keeps running.
    let mut sb = sb;
    let busy = sb.agent().exec(ExecSpec::new(["/bin/sleep", "30"])).expect("exec");
    let err = sb.mark(&MarkOptions::default()).unwrap_err().to_string();
    assert!(err.contains("stay open") && err.contains("keeps running"), "{err}");
    assert_eq!(sh(&sb, "cat /root/state"), "kept");
    busy.signal(9).expect("kill the busy process");
    drop(busy);
    std::thread::sleep(Duration::from_millis(100));
    let run_dir = e.home.join("run").join(sb.id());
    let mark = Box::new(sb).suspend(&MarkOptions { label: None, not_clean: true, disk_only: false }).expect("suspend");
    assert!(!mark.clean);
    assert!(!run_dir.exists(), "suspend released the run dir");
    let ident = id("resumed");
    let r = e.backend.restore_ct(&mark, &ident).expect("resume");
    assert_eq!(sh(&r, "cat /root/state"), "kept");
    // Not clean: hygiene keeps the hostname and runs no hook. A ct sandbox is on the host's kernel: there is
    // no random pool of its own to reseed and no clock of its own to step (the jail refuses both).
    let rep = clade_core::hygiene::apply(r.agent(), &ident, mark.clean).expect("hygiene");
    assert!(!rep.hostname_set);
    assert_eq!(rep.on_restore_scripts, 0);
    assert_eq!(sh(&r, "cat /root/hook 2>/dev/null || echo none"), "none");
    assert!(!rep.crng_reseeded && rep.entropy_bytes == 0 && rep.clock_steps == 0 && rep.errors.is_empty(), "{rep:?}");
    assert!(rep.clock_error_ns.abs() < 50_000_000, "{rep:?}");
    Box::new(r).kill().expect("kill");
    // A mark from another CRIU, or whose trees are not in the store, is refused before anything starts.
    let mut other = mark.clone();
    other.compat.insert("criu".into(), "0.1".into());
    let err = e.backend.restore_ct(&other, &id("bad1")).unwrap_err().to_string();
    assert!(err.contains("criu=0.1"), "{err}");
    let mut broken = mark.clone();
    broken.manifests.insert("criu".into(), "00".repeat(32));
    let err = e.backend.restore_ct(&broken, &id("bad2")).unwrap_err();
    assert!(matches!(err, clade_core::backend::BackendError::Corrupt(_)), "{err}");
    assert_eq!(std::fs::read_dir(e.home.join("run")).unwrap().count(), 0, "nothing started");
}

fn leftovers(e: &Env, ident: &Identity) -> Vec<String> {
    let mut out = Vec::new();
    let run_dir = e.home.join("run").join(&ident.sandbox_id);
    if run_dir.exists() {
        out.push(format!("run dir {}", run_dir.display()));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    if mounts.contains(&ident.sandbox_id) {
        out.push("a mount".into());
    }
    for cg in ["/sys/fs/cgroup/memory/clade", "/sys/fs/cgroup/clade"] {
        if std::path::Path::new(cg).join(&ident.sandbox_id).exists() {
            out.push(format!("cgroup under {cg}"));
        }
    }
    // Processes whose root is inside this sandbox's run dir.
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(root) = std::fs::read_link(p.path().join("cwd")) {
            if root.to_string_lossy().contains(&ident.sandbox_id) {
                out.push(format!("process {:?}", p.file_name()));
            }
        }
    }
    out
}

#[test]
fn privileged_guest_failure_at_each_step_leaves_nothing() {
    let Some(e) = env("fail") else { return };
    let mut base = e.backend.cold_start_ct(&e.image, &id("fbase")).expect("cold start");
    let mark = base.mark(&MarkOptions::default()).expect("mark");
    // Restores here are lazy: the lazy-pages daemon must go with the rest.
    e.backend.set_lazy_threshold(Some(0));
    for at in FailPoint::ALL {
        e.backend.inject_failure(Some(at));
        for cold in [true, false] {
            let ident = id(&format!("f{at:?}{cold}").to_lowercase());
            let res = if cold {
                e.backend.cold_start_ct(&e.image, &ident).map(|_| ())
            } else {
                e.backend.restore_ct(&mark, &ident).map(|_| ())
            };
            let err = res.unwrap_err().to_string();
            assert!(err.contains("injected"), "{at:?} cold={cold}: {err}");
            let left = leftovers(&e, &ident);
            assert!(left.is_empty(), "{at:?} cold={cold} left {left:?}");
        }
    }
    e.backend.inject_failure(None);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(count_procs(), 0, "unreaped children");
    // A prepared restore (warm-pool member) holds its resources until dropped, and starts later.
    let ident = id("fprep");
    let p = e.backend.prepare_ct(&mark, &ident).expect("prepare");
    assert!(e.home.join("run").join(&ident.sandbox_id).exists());
    drop(p);
    assert!(leftovers(&e, &ident).is_empty(), "{:?}", leftovers(&e, &ident));
    let ident = id("fprep2");
    let p = e.backend.prepare_ct(&mark, &ident).expect("prepare");
    let sb = p.start_ct().expect("start a prepared restore");
    assert!(sb.phases.iter().any(|(k, _)| *k == "criu"));
    assert_eq!(sh(&sb, "echo up"), "up");
    Box::new(sb).kill().unwrap();
    assert!(leftovers(&e, &ident).is_empty());
    // And a restore still works afterwards (no EEXIST from leftovers).
    let ok = e.backend.restore_ct(&mark, &id("fafter")).expect("restore after failures");
    Box::new(ok).kill().unwrap();
    Box::new(base).kill().unwrap();
}

/// Our children that are zombies (the sandboxes' inits are adopted by us; one killed but never reaped shows
/// here). Other tests run in parallel in this process, so live children are not counted.
fn count_procs() -> usize {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let after = stat.rsplit_once(") ").map(|x| x.1).unwrap_or("");
            let f: Vec<&str> = after.split_whitespace().collect();
            f.get(1) == Some(&me.as_str()) && f.first() == Some(&"Z")
        })
        .count()
}

#[test]
fn privileged_guest_audit_against_cold_control() {
    let Some(e) = env("audit") else { return };
    let mut base = e.backend.cold_start_ct(&e.image, &id("abase")).expect("cold");
    sh(&base, "setsid python3 -c 'import fcntl,time; f=open(\"/tmp/held\",\"w\"); fcntl.lockf(f, fcntl.LOCK_EX); time.sleep(1000)' </dev/null >/dev/null 2>&1 &");
    std::thread::sleep(Duration::from_millis(400));
    let mark = base.mark(&MarkOptions::default()).expect("mark");
    let (a, _) = fork(&e, &mark, "aa");
    let (b, _) = fork(&e, &mark, "ab");
    let c1 = e.backend.cold_start_ct(&e.image, &id("ac1")).expect("cold");
    let c2 = e.backend.cold_start_ct(&e.image, &id("ac2")).expect("cold");
    let r = clade_ct::audit_with_control(&a.pids(), &b.pids(), &c1.pids(), &c2.pids());
    assert_eq!(r.pass_control_rule, Some(true), "{r:?}");
    assert!(r.processes.0 >= 2 && !r.shared_char_devices.is_empty(), "{r:?}");
    // The audit does see sharing where there is some: a sandbox against itself shares everything.
    let same = clade_ct::audit(&a.pids(), &a.pids());
    assert!(
        same.shared_namespaces.len() == 5 && !same.shared_writable_files.is_empty() && !same.shared_locks.is_empty(),
        "{same:?}"
    );
    for sb in [a, b, c1, c2, base] {
        Box::new(sb).kill().unwrap();
    }
}

#[test]
fn privileged_guest_mark_refused_for_io_uring_sandbox_keeps_running() {
    let Some(e) = env("uring") else { return };
    let mut sb = e.backend.cold_start_ct(&e.image, &id("uring")).expect("cold start");
    // io_uring_setup(8, params) through ctypes: CRIU cannot dump an io_uring.
    let py = "import ctypes,time; p=ctypes.create_string_buffer(120); fd=ctypes.CDLL(None).syscall(425, 8, p); \
              open('/tmp/uring','w').write(str(fd)); time.sleep(1000)";
    sh(&sb, &format!("setsid python3 -c \"{py}\" </dev/null >/dev/null 2>&1 &"));
    let t0 = std::time::Instant::now();
    while sh(&sb, "cat /tmp/uring 2>/dev/null || true").is_empty() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let fd: i32 = sh(&sb, "cat /tmp/uring").parse().unwrap_or(-1);
    if fd < 0 {
        eprintln!("skipping: io_uring_setup is not available in this kernel");
        return;
    }
    let err = sb.mark(&MarkOptions::default()).unwrap_err().to_string();
    assert!(err.contains("criu dump failed") && err.contains("Error"), "{err}");
    assert!(err.contains("keeps running"), "{err}");
    assert!(sh(&sb, "ps -o comm").contains("python3"), "the process survived the failed dump");
    assert_eq!(sh(&sb, "echo alive"), "alive");
    Box::new(sb).kill().expect("kill");
}

#[test]
fn privileged_guest_established_tcp_is_dumped_and_comes_back_closed() {
    let Some(e) = env("tcp") else { return };
    let mut base = e.backend.cold_start_ct(&e.image, &id("tcp")).expect("cold start");
    // One process holds both ends of an established loopback connection; after a restore it reports what a
    // read on its client end gives, into /tmp/after.
    let py = r#"
import socket, time, os, signal
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind(('127.0.0.1', 7000)); l.listen()
c = socket.create_connection(('127.0.0.1', 7000)); s, _ = l.accept()
open('/tmp/connected', 'w').write('yes')
def probe(*_):
    try:
        c.settimeout(1); c.send(b'x'); r = s.recv(1)
        open('/tmp/after', 'w').write('open:' + r.decode())
    except Exception as ex:
        open('/tmp/after', 'w').write('closed:' + type(ex).__name__)
signal.signal(signal.SIGUSR1, probe)
while True: time.sleep(1)
"#;
    base.agent().write_file_bytes("/root/tcp.py", py.as_bytes(), Some(0o644)).expect("write");
    sh(&base, "setsid python3 /root/tcp.py </dev/null >/tmp/tcp.log 2>&1 &");
    let t0 = std::time::Instant::now();
    while sh(&base, "cat /tmp/connected 2>/dev/null || true").is_empty() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mark = base.mark(&MarkOptions::default()).expect("mark with an established connection");
    let (sib, _) = fork(&e, &mark, "tcp-sib");
    sh(&sib, "kill -USR1 $(pidof python3)");
    let t0 = std::time::Instant::now();
    while sh(&sib, "cat /tmp/after 2>/dev/null || true").is_empty() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = sh(&sib, "cat /tmp/after");
    assert!(after.starts_with("closed:"), "restored connection should be closed: {after}");
    // The original keeps its connection.
    sh(&base, "kill -USR1 $(pidof python3)");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(sh(&base, "cat /tmp/after"), "open:x");
    for sb in [sib, base] {
        Box::new(sb).kill().expect("kill");
    }
}

/// The lazy restore (CRIU lazy-pages over userfaultfd) where it runs on every host: unjailed, as a jailed
/// sibling's tasks may open a userfaultfd only where the host allows it in a user namespace.
#[test]
fn privileged_guest_lazy_restore_unjailed() {
    let Some(e) = common::env_with("lazy", 256, false, |c| c.jail = false) else { return };
    let mut base = e.backend.cold_start_ct(&e.image, &id("lzbase")).expect("cold start");
    sh(&base, "echo lazy-note > /root/note");
    let mark = base.mark(&MarkOptions::default()).expect("mark");
    e.backend.set_lazy_threshold(Some(0));
    let (sib, _) = fork(&e, &mark, "lzsib");
    assert!(sib.phases.iter().any(|(k, d)| *k == "lazy" && !d.is_zero()), "{:?}", sib.phases);
    assert_eq!(sh(&sib, "cat /root/note"), "lazy-note");
    for sb in [sib, base] {
        Box::new(sb).kill().expect("kill");
    }
}
