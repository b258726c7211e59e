//! `clade ... | head`: the reader goes away before clade has written everything. clade must end quietly
//! (status 141, as a tool killed by SIGPIPE), not panic with a backtrace.

use std::io::Read;
use std::process::{Command, Stdio};

#[test]
fn a_closed_stdout_ends_the_cli_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(["completions", "bash"]) // ~100 KB: more than a pipe holds
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    out.read_exact(&mut first).unwrap();
    drop(out);
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(141), "status {status:?}, stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
}
