//! A process's stdio as containerd hands it to a shim: paths of named pipes (fifos) that containerd's client
//! reads and writes. The shim copies the sandbox process's output into the stdout and stderr fifos and what
//! arrives on the stdin fifo into the process; an empty path means that stream is not wanted.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::sync::Arc;

use clade_host::api::{ExecEvent, ExecEvents, SandboxApi};

/// Opens an output fifo. Read and write, so the open never blocks on a reader that has not opened its end yet
/// (containerd's client may open it after the task starts), and a reader that comes and goes does not end it.
pub fn open_output(path: &str) -> anyhow::Result<Option<File>> {
    if path.is_empty() {
        return Ok(None);
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("open the output pipe {path}: {e}"))?;
    Ok(Some(f))
}

/// Copies a process's events to its output fifos until it ends; returns its exit status (128 + the signal when
/// a signal ended it, as runc reports it).
pub fn copy_out(events: ExecEvents, mut stdout: Option<File>, mut stderr: Option<File>) -> u32 {
    let put = |f: &mut Option<File>, data: &[u8]| {
        if let Some(w) = f {
            if w.write_all(data).is_err() {
                *f = None;
            }
        }
    };
    for ev in events {
        match ev {
            Ok(ExecEvent::Stdout(d)) => put(&mut stdout, &d),
            Ok(ExecEvent::Stderr(d)) => put(&mut stderr, &d),
            Ok(ExecEvent::Exit { code, signal }) => {
                return signal.map_or(code, |s| 128 + s).max(0) as u32;
            }
            Ok(ExecEvent::Pid(_)) => {}
            Err(e) => {
                log::warn!("a process stream ended without its exit: {e:#}");
                return 255;
            }
        }
    }
    255
}

/// Copies the stdin fifo into the process in a thread of its own, then closes the process's stdin at the fifo's
/// end of file. Opening a fifo for reading waits for its writer, which is why this is a thread.
pub fn copy_in(api: Arc<dyn SandboxApi>, sandbox: String, pid: u32, path: String) {
    std::thread::spawn(move || {
        let Ok(mut f) = File::open(&path) else {
            let _ = api.proc_close_stdin(&sandbox, pid);
            return;
        };
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match f.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if api.proc_input(&sandbox, pid, &buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
        let _ = api.proc_close_stdin(&sandbox, pid);
    });
}
