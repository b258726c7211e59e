//! The `--port` channel (vm: a virtio-serial char device) emulated by a raw-mode PTY: the agent opens
//! the slave path as it would /dev/virtio-ports/clade, the test drives the master through the client.

mod common;

use clade_agent::{AgentClient, ExecSpec};
use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
use std::fs::File;
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn serves_over_a_char_device() {
    let pty = nix::pty::openpty(None, None).unwrap();
    let mut t = tcgetattr(&pty.slave).unwrap();
    cfmakeraw(&mut t);
    tcsetattr(&pty.slave, SetArg::TCSANOW, &t).unwrap();
    let path = std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&pty.slave))).unwrap();
    let mut child =
        Command::new(common::agent_bin()).arg("serve").arg("--port").arg(&path).stdin(Stdio::null()).spawn().unwrap();
    let master = File::from(pty.master);
    let c = AgentClient::from_parts(master.try_clone().unwrap(), master);
    // the agent may not have opened the port yet: the first hello can be lost on a PTY, so retry
    let mut hello = None;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let id_probe = c.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(id_probe.hello());
        });
        if let Ok(Ok(h)) = rx.recv_timeout(Duration::from_millis(500)) {
            hello = Some(h);
            break;
        }
    }
    let h = hello.expect("no hello over the port");
    assert_eq!(h.role, "serve");
    let out = c.run(ExecSpec::new(["/bin/sh", "-c", "head -c 200000 /dev/zero; echo done >&2"])).unwrap();
    assert_eq!(out.stdout.len(), 200_000);
    assert_eq!(out.stderr, b"done\n");
    let _ = child.kill();
    let _ = child.wait();
}
