//! A host directory shown in a vm guest (`Sandbox::bind`: a Kubernetes volume, docs/kubernetes.md) is a copy
//! (crates/clade-vm/src/backend/volumes.rs): the guest sees the tree, its modes and links, read-only where
//! asked, and not what the host changes afterwards; a mark keeps it, so a sibling has it too.

mod common;

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, MarkOptions, Sandbox};
use common::*;

fn sh(s: &dyn Sandbox, script: &str) -> (i32, String) {
    let spec = ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() };
    let out = s.agent().run(spec).expect("exec");
    (out.status.code.unwrap_or(-1), String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn guest_vm_volume_is_a_copy_kept_by_a_mark() {
    let Some(e) = vm_env("clade-vmvol-") else { return };
    let image = e.busybox_image("busybox-vol");
    let tag = std::process::id();
    let mut s = e.backend.cold_start(&image, &clade_core::hygiene::new_identity(&format!("v{tag}"), 1)).expect("boot");
    let vol = e.work.path().join("vol");
    std::fs::create_dir_all(vol.join("sub")).unwrap();
    std::fs::write(vol.join("sub/key"), "value").unwrap();
    std::os::unix::fs::symlink("sub/key", vol.join("key")).unwrap();
    // Control: nothing there before the bind.
    assert_ne!(sh(s.as_ref(), "cat /vol/key").0, 0);
    s.bind(&vol, "/vol", true).expect("bind a host directory read-only");
    assert_eq!(sh(s.as_ref(), "cat /vol/key /vol/sub/key"), (0, "valuevalue".into()), "the tree and its link");
    assert_ne!(sh(s.as_ref(), "echo x > /vol/new").0, 0, "read-only");
    std::fs::write(vol.join("sub/key"), "changed on the host").unwrap();
    assert_eq!(sh(s.as_ref(), "cat /vol/key").1, "value", "a copy: a later change on the host is not seen");
    // Too large for a guest's memory: refused, naming the limit.
    let big = e.work.path().join("big");
    std::fs::create_dir(&big).unwrap();
    std::fs::File::create(big.join("f")).unwrap().set_len(65 << 20).unwrap();
    let err = s.bind(&big, "/big", false).expect_err("a volume over the limit");
    assert!(err.to_string().contains("at most 64 MiB"), "{err}");
    // A copy that fails after its stage was filled (a directory volume onto a path that is a file) leaves no
    // stage mounted: the only copy in the guest is the first volume's.
    let stages = |s: &dyn Sandbox| sh(s, "grep -c ' /run/clade/volumes/' /proc/mounts").1;
    assert_eq!(stages(s.as_ref()), "1", "the first volume's stage");
    sh(s.as_ref(), "echo not-a-dir > /notdir");
    let err = s.bind(&vol, "/notdir/below", false).expect_err("a mount point under a file");
    assert!(err.to_string().contains("/notdir/below"), "{err}");
    assert_eq!(stages(s.as_ref()), "1", "the failed copy's stage is gone");

    let mark = s.mark(&MarkOptions::default()).expect("a mark with the volume mounted");
    let sib = e.backend.restore(&mark, &clade_core::hygiene::new_identity(&format!("v{tag}s"), 2)).expect("restore");
    assert_eq!(sh(sib.as_ref(), "cat /vol/key").1, "value", "the sibling has the copy");
    assert_ne!(sh(sib.as_ref(), "echo x > /vol/new").0, 0, "still read-only");
    for sb in [sib, s] {
        sb.kill().expect("kill");
    }
}
