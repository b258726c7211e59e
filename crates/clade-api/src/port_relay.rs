//! A TCP connection to a port on a vm guest's own loopback, for E2B's `<port>-<id>` hosts: the host has no
//! network path into a guest (it may have no NIC at all), so the guest's agent runs `clade-agent relay PORT`
//! (docs/agent.md, "Relay") and its stdin and stdout carry the bytes. The caller gets an ordinary `TcpStream`:
//! one end of a loopback pair on the host, pumped to and from the relay process by two threads.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;

use clade_e2b::{HostError, HostResult};
use clade_host::api::{ExecEvent, ProcSpec, SandboxApi};

/// The agent's path in every template (clade-template's `AGENT_PATH`).
const AGENT: &str = "/usr/lib/clade/clade-agent";
/// How the relay processes are tagged (E2B's process list leaves them out).
pub const TAG: &str = "clade-port-relay";

/// Connect to `port` on sandbox `id`'s loopback through a relay process in it.
pub fn connect(api: &Arc<dyn SandboxApi>, id: &str, port: u16) -> HostResult<TcpStream> {
    let spec = ProcSpec {
        argv: vec![AGENT.into(), "relay".into(), port.to_string()],
        cwd: Some("/".into()),
        stdin: true,
        tag: Some(TAG.into()),
        stream: true,
        ..Default::default()
    };
    let (pid, mut events) = api.proc_start(id, spec).map_err(|e| HostError::Internal(format!("{e:#}")))?;
    // The relay says first whether it reached the port.
    let mut said = Vec::new();
    loop {
        match events.next() {
            Some(Ok(ExecEvent::Stderr(d))) => {
                said.extend_from_slice(&d);
                if said.contains(&b'\n') {
                    break;
                }
            }
            Some(Ok(ExecEvent::Stdout(_) | ExecEvent::Pid(_))) => {}
            Some(Ok(ExecEvent::Exit { .. })) | None => break,
            Some(Err(e)) => return Err(HostError::Internal(format!("port relay: {e:#}"))),
        }
    }
    let said = String::from_utf8_lossy(&said).trim().to_string();
    if said != "connected" {
        return Err(match said.strip_prefix("refused: ") {
            Some(why) => HostError::Conflict(why.to_string()),
            None => HostError::Invalid(format!(
                "the sandbox's agent cannot relay to port {port} ({said:?}): its template predates port relays; \
                 rebuild it (clade template build) or use a ct sandbox"
            )),
        });
    }
    let listener =
        TcpListener::bind(("127.0.0.1", 0)).map_err(|e| HostError::Internal(format!("a loopback listener: {e}")))?;
    let addr = listener.local_addr().map_err(|e| HostError::Internal(e.to_string()))?;
    let ours = TcpStream::connect(addr).map_err(|e| HostError::Internal(format!("a loopback pair: {e}")))?;
    let (theirs, _) = listener.accept().map_err(|e| HostError::Internal(format!("a loopback pair: {e}")))?;
    let _ = theirs.set_nodelay(true);
    let mut from_caller = theirs.try_clone().map_err(|e| HostError::Internal(e.to_string()))?;
    let (api_in, id_in) = (api.clone(), id.to_string());
    // The caller's bytes into the relay's stdin; the caller's end of output closes it.
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from_caller.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if api_in.proc_input(&id_in, pid, &buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = api_in.proc_close_stdin(&id_in, pid);
    });
    // The relay's stdout back to the caller, until the server closes (the relay then exits).
    let mut to_caller = theirs;
    std::thread::spawn(move || {
        for ev in events {
            match ev {
                Ok(ExecEvent::Stdout(d)) => {
                    if to_caller.write_all(&d).is_err() {
                        break;
                    }
                }
                Ok(ExecEvent::Exit { .. }) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let _ = to_caller.shutdown(Shutdown::Both);
    });
    Ok(ours)
}
