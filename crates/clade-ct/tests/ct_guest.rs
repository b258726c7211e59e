//! The `ct` backend on this host: cold start, mark, restore and fork with CRIU, suspend, the sibling audit and
//! failure injection. Root, namespaces and CRIU are required (tier names: `privileged`, `guest`).

use std::path::PathBuf;
use std::time::Duration;

use clade_agent::ExecSpec;
use clade_core::backend::{Identity, MarkOptions, Sandbox, Shape, TemplateImage};
use clade_core::CladeHome;
use clade_ct::{CtBackend, CtConfig, CtSandbox, FailPoint};

struct Env {
    backend: CtBackend,
    image: TemplateImage,
    home: PathBuf,
}

impl Drop for Env {
    fn drop(&mut self) {
        if std::env::var_os("CT_KEEP").is_none() { let _ = std::fs::remove_dir_all(&self.home); }
    }
}

fn env(name: &str) -> Option<Env> {
    let real = CladeHome::from_env();
    let cfg = match CtConfig::from_home(&real) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipping: {e}");
            return None;
        }
    };
    if !cfg.criu.exists() {
        eprintln!("skipping: no CRIU at {} (run ./x setup)", cfg.criu.display());
        return None;
    }
    let rootfs = clade_ct::testroot::ensure(&real, &cfg.agent_bin).expect("test rootfs");
    let home = real.tmp_dir().join(format!("ct-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    let h = CladeHome::at(&home);
    let store = clade_store::Store::open(&h.store_dir(), Default::default()).expect("store");
    let backend = CtBackend::new(h, store, cfg).expect("backend");
    let image = TemplateImage {
        name: "ct-test".into(),
        hash: "test".into(),
        rootfs,
        disk_manifest: None,
        shape: Shape { memory_mib: 512, vcpus: 1, disk_gib: 1 },
        egress: false,
    };
    Some(Env { backend, image, home })
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
    assert_eq!(sh(&sb, "echo $$ > /dev/null; ls /proc | grep -c '^[0-9]'").parse::<u32>().unwrap() < 10, true);
    let run_dir = e.home.join("run").join(&ident.sandbox_id);
    assert!(run_dir.exists());
    Box::new(sb).kill().expect("kill");
    assert!(!run_dir.exists());
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
    let mark = base.mark(&MarkOptions::default()).expect("mark");
    assert!(mark.pause < Duration::from_secs(2), "{:?}", mark.pause);
    assert!(mark.stored_bytes > 0 && mark.logical_bytes >= mark.stored_bytes / 2, "{mark:?}");
    // The marked sandbox keeps running and answers.
    assert_eq!(sh(&base, "cat /root/note"), "before-mark");
    let (a, ia) = fork(&e, &mark, "sib-a");
    let (b, ib) = fork(&e, &mark, "sib-b");
    for (sb, ident) in [(&a, &ia), (&b, &ib)] {
        assert_eq!(sh(sb, "hostname"), ident.hostname);
        assert_eq!(sh(sb, "cat /etc/machine-id"), ident.machine_id);
        assert_eq!(sh(sb, "cat /root/note"), "before-mark");
        assert_eq!(sh(sb, "cat /tmp/x/t"), "tmpfs");
        assert!(sh(sb, "ps -o comm").contains("sleep"), "the sleeper was restored");
    }
    sh(&a, "echo only-a > /root/a-file");
    assert_eq!(sh(&b, "test -e /root/a-file && echo yes || echo no"), "no");
    assert_eq!(sh(&base, "test -e /root/a-file && echo yes || echo no"), "no");
    let audit = clade_ct::audit(&a.pids(), &b.pids());
    assert_eq!(audit.shared_writable(), 0, "{audit:?}");
    assert!(audit.processes.0 >= 2 && audit.processes.1 >= 2, "{audit:?}");
    for sb in [a, b, base] {
        Box::new(sb).kill().expect("kill");
    }
}
