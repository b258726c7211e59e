//! One host connection: decode frames, dispatch requests, write replies, events and data.
//!
//! Quick requests are answered on the reading thread (hello stays a single round trip with no thread
//! hop); anything that blocks (waits, big reads, scripts) runs on its own thread, so a slow request never
//! holds up the others. Every handler runs under `catch_unwind`: a bug becomes a typed error on that
//! request, never a dead PID 1.

use crate::{fsops, netreset, procs, ready, sys, Agent};
use clade_agent::wire::{self, BufOutcome, Chan, Header, Kind, WireError};
use clade_agent::{AgentError, Event, Reply, Request, Response, WIRE_VERSION};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The writing half of a connection, shared by every thread that answers on it.
pub struct Conn {
    w: Mutex<Out>,
    sendfile_ok: AtomicBool,
    /// The boot id as of this connection's start ([`sys::boot_id`]).
    boot_id: String,
}

/// Where a connection's answers go: the stream, and the same stream as an fd for `sendfile` (file reads skip
/// a copy through user space). Both are dropped when the host hangs up ([`Conn::close`]).
struct Out {
    w: Box<dyn Write + Send>,
    fd: Option<OwnedFd>,
}

impl Write for Out {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.w.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

impl Conn {
    pub fn new(w: Box<dyn Write + Send>, fd: Option<OwnedFd>) -> Conn {
        Conn { w: Mutex::new(Out { w, fd }), sendfile_ok: AtomicBool::new(true), boot_id: sys::boot_id() }
    }

    /// The host hung up: close the stream now, though processes started on it still hold this connection
    /// for their events (they go nowhere until a host attaches again). A sandbox holding no socket of the
    /// host's can be checkpointed (a ct mark with a background command running).
    pub fn close(&self) {
        let mut out = self.w.lock();
        out.w = Box::new(std::io::sink());
        out.fd = None;
    }

    /// Sends `n` bytes of `f` from `off` as one `Data` frame on [`Chan::File`]: `sendfile` where the
    /// stream takes it, else pread + write through `buf`. Returns the file bytes sent; if the file
    /// ended early the frame is padded with zeros (to keep the stream in step) and the count says so.
    pub fn file_chunk(&self, id: u32, f: &File, off: u64, n: usize, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut w = self.w.lock();
        w.write_all(&wire::encode_header(Kind::Data, Chan::File, 0, id, n))?;
        let mut sent = 0usize;
        let ok = self.sendfile_ok.load(Ordering::Relaxed);
        if let (Some(fd), true) = (w.fd.as_ref(), ok) {
            while sent < n {
                let mut o = (off + sent as u64) as libc::off_t;
                match nix::sys::sendfile::sendfile(fd, f, Some(&mut o), n - sent) {
                    Ok(0) => break,
                    Ok(k) => sent += k,
                    Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                    Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOSYS) if sent == 0 => {
                        self.sendfile_ok.store(false, Ordering::Relaxed);
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        let mut real = sent;
        while sent < n {
            let want = (n - sent).min(buf.len());
            let k = match f.read_at(&mut buf[..want], off + sent as u64) {
                Ok(k) => k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if k == 0 {
                buf[..want].fill(0);
                w.write_all(&buf[..want])?;
                sent += want;
                continue;
            }
            w.write_all(&buf[..k])?;
            sent += k;
            real += k;
        }
        w.flush()?;
        Ok(real)
    }

    /// Writes already-encoded frame bytes. Errors are dropped: the host went away, and the agent carries
    /// on (a new connection gets fresh replies).
    pub fn raw(&self, bytes: &[u8]) {
        let mut w = self.w.lock();
        if w.write_all(bytes).and_then(|_| w.flush()).is_err() {
            // ignored on purpose, see above
        }
    }

    pub fn reply(&self, id: u32, resp: &Response) {
        let body = serde_json::to_vec(resp).unwrap_or_else(|e| {
            format!("{{\"Err\":{{\"error\":\"failed\",\"detail\":\"encoding the reply: {e}\"}}}}").into_bytes()
        });
        self.raw(&wire::encode(Kind::Reply, Chan::None, 0, id, &body));
    }

    pub fn event(&self, pid: u32, ev: &Event) {
        if let Ok(body) = serde_json::to_vec(ev) {
            self.raw(&wire::encode(Kind::Event, Chan::None, 0, pid, &body));
        }
    }

    pub fn data(&self, chan: Chan, id: u32, bytes: &[u8], flags: u8) {
        self.raw(&wire::encode(Kind::Data, chan, flags, id, bytes));
    }
}

fn wire_error(e: &WireError) -> AgentError {
    match e {
        WireError::UnsupportedVersion { got, .. } => {
            AgentError::UnsupportedVersion { got: *got, supported: WIRE_VERSION }
        }
        other => AgentError::BadFrame { detail: other.to_string() },
    }
}

fn guarded(f: impl FnOnce() -> Response) -> Response {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(AgentError::Failed { detail: "the agent hit a bug handling this request (it keeps serving)".into() })
    })
}

/// The connection's read buffer.
const READ_BUF: usize = 64 * 1024;

/// Serves one connection until the host closes it.
pub fn serve(agent: &Arc<Agent>, r: impl Read, w: Box<dyn Write + Send>, fd: Option<OwnedFd>) {
    let conn = Arc::new(Conn::new(w, fd));
    // After a ct mark or restore (crate::watch): the host's first connection since.
    if agent.shared_kernel {
        agent.watches.rearm_all();
    }
    // One read syscall per small frame instead of three (length, header, body); under TCG each guest
    // syscall costs microseconds. Bulk data frames bigger than the buffer are read straight into place.
    let mut r = std::io::BufReader::with_capacity(READ_BUF, r);
    let mut writes: HashMap<u32, fsops::PendingWrite> = HashMap::new();
    let mut buf = Vec::new();
    loop {
        match wire::read_frame_into(&mut r, &mut buf) {
            Ok(BufOutcome::Frame(h, n)) => {
                handle(agent, &conn, &mut writes, h, &buf[..n]);
                if buf.len() > 2 * wire::DATA_CHUNK {
                    buf = Vec::new(); // an odd big frame does not pin its buffer (idle RSS)
                }
            }
            Ok(BufOutcome::Bad(e)) => conn.reply(e.id(), &Err(wire_error(&e))),
            Ok(BufOutcome::Eof) => break,
            Err(e) => {
                crate::log(&format!("connection ended: {e}"));
                break;
            }
        }
    }
    conn.close();
    for (_, w) in writes.drain() {
        w.abandon();
    }
}

fn handle(
    agent: &Arc<Agent>,
    conn: &Arc<Conn>,
    writes: &mut HashMap<u32, fsops::PendingWrite>,
    h: Header,
    body: &[u8],
) {
    let id = h.id;
    match (h.kind, h.chan) {
        (Kind::Request, _) => match Request::parse(body) {
            Ok(req) => dispatch(agent, conn, writes, id, req),
            Err(e) => conn.reply(id, &Err(e)),
        },
        (Kind::Data, Chan::File) => {
            let end = h.flags & wire::FLAG_END != 0;
            let Some(w) = writes.get_mut(&id) else { return };
            if let Err(e) = w.write(body) {
                if let Some(w) = writes.remove(&id) {
                    w.abandon();
                }
                conn.reply(id, &Err(e));
            } else if end {
                if let Some(w) = writes.remove(&id) {
                    conn.reply(id, &guarded(|| w.finish()));
                }
            }
        }
        (Kind::Data, Chan::Stdin) => {
            let end = h.flags & wire::FLAG_END != 0;
            agent.procs.write_stdin(id, body, end);
        }
        _ => conn.reply(
            id,
            &Err(AgentError::BadFrame { detail: "the agent accepts only request frames and file/stdin data".into() }),
        ),
    }
}

/// Runs a blocking request on its own thread.
fn task(conn: &Arc<Conn>, id: u32, f: impl FnOnce() -> Response + Send + 'static) {
    let c = conn.clone();
    let spawned = std::thread::Builder::new().name(format!("req-{id}")).spawn(move || {
        let resp = guarded(f);
        c.reply(id, &resp);
    });
    if let Err(e) = spawned {
        conn.reply(id, &Err(AgentError::os("starting a thread for the request", &e)));
    }
}

fn dispatch(
    agent: &Arc<Agent>,
    conn: &Arc<Conn>,
    writes: &mut HashMap<u32, fsops::PendingWrite>,
    id: u32,
    req: Request,
) {
    let a = agent.clone();
    match req {
        Request::Hello => conn.reply(id, &guarded(|| Ok(Reply::Hello(sys::hello(agent, &conn.boot_id))))),
        Request::Exec(spec) => {
            let started = catch_unwind(AssertUnwindSafe(|| procs::spawn(agent, conn, spec)))
                .unwrap_or_else(|_| Err(AgentError::Failed { detail: "the agent hit a bug starting it".into() }));
            match started {
                Ok(p) => {
                    conn.reply(id, &Ok(Reply::Started { pid: p.pid() }));
                    p.supervise();
                }
                Err(e) => conn.reply(id, &Err(e)),
            }
        }
        Request::CloseStdin { pid } => conn.reply(id, &guarded(|| agent.procs.close_stdin(pid))),
        Request::Signal { pid, signal } => conn.reply(id, &guarded(|| agent.procs.signal(pid, signal))),
        Request::SignalGroup { leader, signal } => {
            conn.reply(id, &guarded(|| agent.procs.signal_group(leader, signal)))
        }
        Request::Resize { pid, rows, cols } => conn.reply(id, &guarded(|| agent.procs.resize(pid, rows, cols))),
        Request::ListProcs => conn.reply(id, &guarded(|| Ok(Reply::Procs { procs: agent.procs.list() }))),
        Request::Wait { pid } => task(conn, id, move || a.procs.wait(pid)),
        Request::ReadFile { path } => {
            let c = conn.clone();
            task(conn, id, move || fsops::read_file(&c, id, &path));
        }
        Request::WriteFile { path, mkdirs, opts } => match fsops::PendingWrite::open(&path, opts, mkdirs) {
            Ok(w) => {
                writes.insert(id, w);
            }
            Err(e) => conn.reply(id, &Err(e)),
        },
        Request::Stat { path } => conn.reply(id, &guarded(|| fsops::stat(&path).map(Reply::Stat))),
        Request::ListDir { path, depth } => task(conn, id, move || fsops::list_dir(&path, depth)),
        Request::MkdirP { path, mode, owner } => conn.reply(id, &guarded(|| fsops::mkdir_p(&path, mode, owner))),
        Request::Remove { path, recursive } => task(conn, id, move || fsops::remove(&path, recursive)),
        Request::Rename { from, to } => conn.reply(id, &guarded(|| fsops::rename(&from, &to))),
        Request::Chmod { path, mode } => conn.reply(id, &guarded(|| fsops::chmod(&path, mode))),
        Request::Symlink { target, path } => conn.reply(id, &guarded(|| fsops::symlink(&target, &path))),
        Request::Mount { path, source, readonly } => {
            conn.reply(id, &guarded(|| fsops::mount(&path, &source, readonly)))
        }
        Request::Unmount { path } => conn.reply(id, &guarded(|| fsops::unmount(&path))),
        Request::SetIdentity(ident) => task(conn, id, move || Ok(Reply::Identity(sys::set_identity(&a, &ident)))),
        Request::WatchStart { path, recursive } => task(conn, id, move || a.watches.start(&path, recursive)),
        Request::WatchEvents { watch, wait_ms } => task(conn, id, move || a.watches.events(watch, wait_ms)),
        Request::WatchStop { watch } => conn.reply(id, &guarded(|| agent.watches.stop(watch))),
        Request::PreMark { clean } => task(conn, id, move || Ok(Reply::Hooks(sys::pre_mark(&a, clean)))),
        Request::RegisterRestoreSignal { pid, signal } => {
            conn.reply(id, &guarded(|| sys::register_restore_signal(agent, pid, signal)))
        }
        Request::ClockRead => conn.reply(id, &guarded(|| sys::clock_read().map(Reply::Clock))),
        Request::ClockShift { by_ns } => conn.reply(id, &guarded(|| sys::clock_shift(by_ns).map(Reply::Clock))),
        Request::NetReset { peer, keep_local_ports } => {
            conn.reply(id, &guarded(|| netreset::reset(peer.as_deref(), &keep_local_ports)))
        }
        Request::WriteEnv { vars } => conn.reply(id, &guarded(|| sys::write_env(agent, &vars))),
        Request::WaitReady { target, timeout_ms } => task(conn, id, move || ready::wait(&target, timeout_ms)),
    }
}
