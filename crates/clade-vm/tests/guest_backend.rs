//! The `vm` backend end to end with a real guest: a template disk in the store served by clade-nbd, a cold
//! start to the agent, a mark of the cold sandbox (which runs on), three siblings restored with hygiene (distinct
//! hostnames and machine-ids, the marked file present, each one's writes its own), a mark of a sibling (its
//! diverged pages only) and a child restored from it.

mod common;

use std::time::{Duration, Instant};

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, MarkOptions, Shape, TemplateImage};
use clade_core::hygiene;

fn sh(sbx: &dyn clade_core::backend::Sandbox, script: &str) -> String {
    let out = sbx
        .agent()
        .run(ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() })
        .unwrap();
    assert_eq!(out.status.code, Some(0), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn guest_vm_backend_cold_mark_fork_and_mark_a_clone() {
    let Some(common::VmEnv { work, store: _, home, shm: _, backend, disk }) = common::vm_env("clade-vmbackend") else {
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
    let t = Instant::now();
    let mut cold = backend.cold_start(&image, &hygiene::new_identity(&format!("t{tag}cold"), 0)).unwrap();
    let cold_s = t.elapsed().as_secs_f64();
    sh(cold.as_ref(), "echo before-mark > /root/marked");
    let mark = cold.mark(&MarkOptions::default()).unwrap();
    eprintln!(
        "cold start {cold_s:.2} s; mark of the cold sandbox: pause {:?}, stored {} KiB",
        mark.pause,
        mark.stored_bytes >> 10
    );
    // It runs on after its mark, with its state.
    assert_eq!(sh(cold.as_ref(), "cat /root/marked"), "before-mark");

    let mut sibs = Vec::new();
    for i in 0..3 {
        let id = hygiene::new_identity(&format!("t{tag}s{i}"), 1);
        let t = Instant::now();
        let s = backend.restore(&mark, &id).unwrap();
        let restored = t.elapsed();
        let h = hygiene::apply(s.agent(), &id, true).unwrap();
        eprintln!(
            "sibling {i}: restore to hello {:?}, hygiene {:?} (clock error {} us)",
            restored,
            h.took,
            h.clock_error_ns / 1000
        );
        assert!(h.hostname_set && h.machine_id_set, "{h:?}");
        sibs.push((s, id));
    }
    let names: Vec<String> = sibs.iter().map(|(s, _)| sh(s.as_ref(), "hostname")).collect();
    for (i, (s, id)) in sibs.iter().enumerate() {
        assert_eq!(names[i], id.hostname);
        assert_eq!(sh(s.as_ref(), "cat /etc/machine-id"), id.machine_id);
        assert_eq!(sh(s.as_ref(), "cat /root/marked"), "before-mark");
    }
    assert!(names[0] != names[1] && names[1] != names[2]);
    sh(
        sibs[0].0.as_ref(),
        "echo mine > /root/own; dd if=/dev/urandom of=/root/blob bs=1k count=2048 2>/dev/null; sync",
    );
    assert_eq!(sh(sibs[1].0.as_ref(), "cat /root/own 2>/dev/null || echo absent"), "absent");
    let (pss, rss) = sibs.iter().fold((0, 0), |(p, r), (s, _)| {
        let (a, b) = clade_core::host::pss_rss(s.pids()[0]).unwrap();
        (p + a, r + b)
    });
    eprintln!("3 siblings: PSS/RSS = {:.2}", pss as f64 / rss as f64);

    // A mark of a clone: its diverged pages and disk blocks only.
    let blob_sum = sh(sibs[0].0.as_ref(), "od -An -tx1 /root/blob | head -c 200");
    let m2 = sibs[0].0.mark(&MarkOptions::default()).unwrap();
    eprintln!("mark of a sibling: pause {:?}, stored {} KiB", m2.pause, m2.stored_bytes >> 10);
    assert!(m2.pause < Duration::from_secs(2));
    assert_eq!(sh(sibs[0].0.as_ref(), "cat /root/own"), "mine", "sibling runs on after its mark");
    let id = hygiene::new_identity(&format!("t{tag}child"), 2);
    let child = backend.restore(&m2, &id).unwrap();
    hygiene::apply(child.agent(), &id, true).unwrap();
    assert_eq!(sh(child.as_ref(), "cat /root/own"), "mine");
    assert_eq!(sh(child.as_ref(), "od -An -tx1 /root/blob | head -c 200"), blob_sum);
    assert_eq!(sh(child.as_ref(), "hostname"), id.hostname);

    let pids: Vec<u32> = sibs.iter().flat_map(|(s, _)| s.pids()).chain(child.pids()).chain(cold.pids()).collect();
    drop(sibs);
    drop(child);
    drop(cold);
    std::thread::sleep(Duration::from_millis(100));
    for p in pids {
        assert!(!std::path::Path::new(&format!("/proc/{p}")).exists(), "QEMU {p} left running");
    }
    for i in 0..3 {
        assert!(!home.run_dir().join(format!("t{tag}s{i}")).exists(), "run dir left behind");
    }
}
