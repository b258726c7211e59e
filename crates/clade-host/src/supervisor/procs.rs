//! The supervisor's table of processes started through `proc_start`: one pump thread per process drains the
//! agent's events and hands each to every attached stream, so a stream that goes away (a client cut) detaches
//! without touching the process, and `proc_connect` attaches another listener to it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use base64::Engine as _;
use clade_agent::client::{AgentClient, ClientError, ProcEvent, Process};
use clade_agent::proto::{ExecSpec, PtySize};

use clade_core::ErrorKind;

use super::protocol::{ProcListing, ProcSpec, StreamEvent};

struct Entry {
    serial: u64,
    listing: ProcListing,
    subs: Vec<Sender<StreamEvent>>,
}

/// Processes started through the supervisor, by pid.
#[derive(Default)]
pub struct Procs {
    table: Mutex<HashMap<u32, Entry>>,
    serial: AtomicU64,
}

impl Procs {
    /// Start `spec` on `agent`; with `spec.stream`, also a receiver attached before any output can be lost.
    pub fn start(
        self: &Arc<Self>,
        agent: &AgentClient,
        spec: ProcSpec,
    ) -> Result<(u32, Option<Receiver<StreamEvent>>), ClientError> {
        let exec = ExecSpec {
            argv: spec.argv.clone(),
            env: spec.env.clone(),
            cwd: spec.cwd.clone(),
            user: spec.user.clone(),
            pty: spec.pty.map(|(rows, cols)| PtySize { rows, cols }),
            stdin: spec.stdin,
            tag: spec.tag.clone(),
            root: spec.root.clone(),
            caps: spec.caps.clone(),
            no_new_privs: spec.no_new_privs,
            ..Default::default()
        };
        let proc = agent.exec(exec)?;
        let pid = proc.pid;
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let (subs, rx) = if spec.stream {
            let (tx, rx) = mpsc::channel();
            (vec![tx], Some(rx))
        } else {
            (Vec::new(), None)
        };
        let listing =
            ProcListing { pid, argv: spec.argv, env: spec.env, cwd: spec.cwd, tag: spec.tag, pty: spec.pty.is_some() };
        self.table.lock().insert(pid, Entry { serial, listing, subs });
        // Output already sent by the agent waits in `proc`'s channel: nothing is lost before the pump runs.
        let me = self.clone();
        std::thread::Builder::new()
            .name(format!("proc-{pid}"))
            .spawn(move || me.pump(proc, serial))
            .map_err(ClientError::Io)?;
        Ok((pid, rx))
    }

    fn pump(&self, mut proc: Process, serial: u64) {
        let b64 = base64::engine::general_purpose::STANDARD;
        let pid = proc.pid;
        loop {
            let ev = match proc.next_event(Duration::from_secs(3600)) {
                Ok(None) => continue,
                Ok(Some(ProcEvent::Stdout(d))) => StreamEvent::Stdout { data_b64: b64.encode(d) },
                Ok(Some(ProcEvent::Stderr(d))) => StreamEvent::Stderr { data_b64: b64.encode(d) },
                Ok(Some(ProcEvent::Exit(s))) => {
                    self.finish(pid, serial, StreamEvent::Exit { code: s.code, signal: s.signal });
                    return;
                }
                Err(e) => {
                    self.finish(
                        pid,
                        serial,
                        StreamEvent::Error { kind: ErrorKind::Internal, message: format!("process {pid}: {e}") },
                    );
                    return;
                }
            };
            let mut t = self.table.lock();
            match t.get_mut(&pid) {
                Some(e) if e.serial == serial => e.subs.retain(|s| s.send(ev.clone()).is_ok()),
                _ => return, // forgotten (the sandbox was retaken): nobody listens any more
            }
        }
    }

    fn finish(&self, pid: u32, serial: u64, last: StreamEvent) {
        let mut t = self.table.lock();
        if t.get(&pid).is_some_and(|e| e.serial == serial) {
            if let Some(e) = t.remove(&pid) {
                for s in e.subs {
                    let _ = s.send(last.clone());
                }
            }
        }
    }

    /// Attach a listener to a running process (`None`: no such process, or it has exited).
    pub fn connect(&self, pid: u32) -> Option<Receiver<StreamEvent>> {
        let mut t = self.table.lock();
        let e = t.get_mut(&pid)?;
        let (tx, rx) = mpsc::channel();
        e.subs.push(tx);
        Some(rx)
    }

    pub fn contains(&self, pid: u32) -> bool {
        self.table.lock().contains_key(&pid)
    }

    pub fn list(&self) -> Vec<ProcListing> {
        let mut v: Vec<_> = self.table.lock().values().map(|e| e.listing.clone()).collect();
        v.sort_by_key(|p| p.pid);
        v
    }

    /// The sandbox ended or was replaced: every stream ends with `why`, the table empties.
    pub fn forget_all(&self, why: &str) {
        let mut t = self.table.lock();
        for (_, e) in t.drain() {
            for s in e.subs {
                let _ = s.send(StreamEvent::Error { kind: ErrorKind::Internal, message: why.to_string() });
            }
        }
    }
}
