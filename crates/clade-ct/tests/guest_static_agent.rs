//! Any rootfs hosts the agent: a ct sandbox whose rootfs is busybox-static alone (no glibc, no loader, no
//! /lib at all, as in distroless or Alpine images) starts, runs commands as root and as a user from its own
//! /etc/passwd, and comes back from a mark. The agent `./x` builds is static (docs/agent.md); a dynamic one
//! fails here with `exec /usr/lib/clade/clade-agent: ENOENT`, which is the control.

use std::path::Path;

use clade_agent::ExecSpec;
use clade_core::backend::{MarkOptions, Sandbox};

mod common;

fn busybox_only_rootfs(root: &Path) {
    for d in ["bin", "etc", "proc", "dev", "run", "tmp", "root", "sys", "home/user"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let busybox = ["/bin/busybox", "/usr/bin/busybox"].into_iter().find(|p| Path::new(p).exists()).expect("busybox");
    assert_eq!(clade_core::host::elf_is_dynamic(Path::new(busybox)), Some(false), "busybox-static");
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in ["sh", "id", "ls", "cat", "echo", "sleep", "pwd", "test"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
        .unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\nuser:x:1000:\n").unwrap();
    std::os::unix::fs::chown(root.join("home/user"), Some(1000), Some(1000)).unwrap();
}

fn run(sb: &dyn Sandbox, spec: ExecSpec) -> String {
    let out = sb.agent().run(spec).expect("exec");
    assert!(out.status.success(), "{:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn privileged_guest_busybox_only_rootfs_runs_the_static_agent() {
    let Some(e) = common::env_with("static-agent", 256, false, |_| {}) else { return };
    let agent = clade_core::host::agent_binary().expect("an agent binary");
    assert_eq!(
        clade_core::host::elf_is_dynamic(&agent),
        Some(false),
        "{} is not static: ./x build and ./x test build it (RUSTFLAGS=-Ctarget-feature=+crt-static, docs/agent.md)",
        agent.display()
    );
    let rootfs = e.home.join("busybox-only");
    busybox_only_rootfs(&rootfs);
    assert!(!rootfs.join("lib").exists() && !rootfs.join("lib64").exists() && !rootfs.join("usr").exists());
    let image = clade_ct::testroot::image("busybox-only", rootfs, e.image.shape.memory_mib, false);
    let ident = clade_core::hygiene::new_identity(&format!("static-{}", std::process::id()), 0);
    let mut sb = e.backend.cold_start_ct(&image, &ident).expect("a busybox-only rootfs starts");
    assert_eq!(run(&sb, ExecSpec::new(["/bin/sh", "-c", "ls / | grep -c '^lib' || true"])), "0");
    assert_eq!(run(&sb, ExecSpec::new(["id", "-u"])), "0");
    let mut as_user = ExecSpec::new(["/bin/sh", "-c", "id -u; id -g; echo $HOME $USER"]);
    as_user.user = Some("user".into());
    assert_eq!(run(&sb, as_user.clone()), "1000\n1000\n/home/user user", "a user from the rootfs' /etc/passwd");
    let mut nobody = ExecSpec::new(["id"]);
    nobody.user = Some("nobody".into());
    let err = sb.agent().run(nobody).expect_err("no such user in this rootfs");
    assert!(err.to_string().contains("no user \"nobody\""), "{err}");

    run(&sb, ExecSpec::new(["/bin/sh", "-c", "echo kept > /root/note"]));
    let mark = sb.mark(&MarkOptions::default()).expect("mark");
    let sib_id = clade_core::hygiene::new_identity(&format!("static-sib-{}", std::process::id()), 1);
    let sib = e.backend.restore_ct(&mark, &sib_id).expect("restore");
    assert_eq!(run(&sib, ExecSpec::new(["cat", "/root/note"])), "kept");
    assert_eq!(run(&sib, as_user), "1000\n1000\n/home/user user");
    for s in [sib, sb] {
        Box::new(s).kill().expect("kill");
    }
}
