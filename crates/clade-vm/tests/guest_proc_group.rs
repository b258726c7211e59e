//! A group of a vm guest's processes stopped, continued and killed while the rest of the guest runs
//! (`Sandbox::proc_group`: a pod member's Pause and end, docs/kubernetes.md): the agent signals the process it
//! started and its descendants; another process goes on.

mod common;

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, GroupOp, Sandbox};
use common::*;

fn sh(script: &str) -> ExecSpec {
    ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() }
}

fn read(s: &dyn Sandbox, f: &str) -> String {
    let out = s.agent().run(sh(&format!("cat /tmp/{f} 2>/dev/null || echo none"))).expect("exec");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Whether the counter in `/tmp/<f>` moved within 0.6 s (TCG is slow).
fn moved(s: &dyn Sandbox, f: &str) -> bool {
    let before = read(s, f);
    std::thread::sleep(std::time::Duration::from_millis(600));
    before != read(s, f)
}

const COUNT: &str = "i=0; while :; do i=$((i+1)); echo $i > /tmp/F; sleep 0.1; done";

#[test]
fn guest_vm_proc_group_stops_and_kills_one_group() {
    let Some(e) = vm_env("clade-vmgroup-") else { return };
    let image = e.busybox_image("busybox-group");
    let id = clade_core::hygiene::new_identity(&format!("g{}", std::process::id()), 1);
    let mut s = e.backend.cold_start(&image, &id).expect("cold start");
    let other = s.agent().exec(sh(&COUNT.replace('F', "other"))).expect("the other process");
    let mine = format!("({}) & {}", COUNT.replace('F', "child"), COUNT.replace('F', "mine"));
    let leader = s.agent().exec(sh(&mine)).expect("the group's leader");
    std::thread::sleep(std::time::Duration::from_millis(800));
    assert!(moved(s.as_ref(), "mine") && moved(s.as_ref(), "child"), "control: the group counts");

    let n = s.proc_group(leader.pid, GroupOp::Freeze).expect("freeze the group");
    assert!(n >= 2, "the leader and its child at least: {n}");
    assert!(!moved(s.as_ref(), "mine") && !moved(s.as_ref(), "child"), "stopped, its child too");
    assert!(moved(s.as_ref(), "other"), "the rest of the guest runs");
    s.proc_group(leader.pid, GroupOp::Thaw).expect("thaw");
    assert!(moved(s.as_ref(), "mine") && moved(s.as_ref(), "child"), "continued");
    s.proc_group(leader.pid, GroupOp::Kill).expect("kill");
    let status = leader.output().expect("the leader's end").status;
    assert_eq!(status.signal, Some(9), "{status:?}");
    assert!(!moved(s.as_ref(), "child"), "its child ended with it");
    assert!(moved(s.as_ref(), "other"));
    other.signal(9).expect("end the other");
    Box::new(s).kill().expect("kill");
}
