//! The host side: [`AgentClient`] drives one agent connection from any thread.
//!
//! One reader thread demultiplexes the connection: replies go to the waiting caller by request id, file
//! bytes to the caller streaming that file, process output and exits to the [`Process`] handle by pid.
//! Callers write frames under one lock, so many requests can be in flight at once.

use crate::proto::*;
use crate::wire::{self, Chan, Kind, ReadOutcome, DATA_CHUNK, FLAG_END};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Errors of the host-side client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Writing to or connecting to the agent failed.
    #[error("agent connection: {0} (is the agent running and the socket path right?)")]
    Io(#[from] io::Error),
    /// The agent answered this request with an error.
    #[error("agent: {0}")]
    Agent(#[from] AgentError),
    /// The connection ended; every pending and later call fails with this.
    #[error("agent connection closed: {0}; reconnect to continue")]
    Closed(String),
    /// No reply in time.
    #[error("agent did not answer {op} within {ms} ms")]
    Timeout {
        /// The op.
        op: &'static str,
        /// The wait.
        ms: u64,
    },
    /// The agent replied with a reply of the wrong kind.
    #[error("unexpected reply to {op}: {got}")]
    Unexpected {
        /// The op.
        op: &'static str,
        /// What came.
        got: String,
    },
}

/// Result of client calls.
pub type Result<T> = std::result::Result<T, ClientError>;

/// Something a running process produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcEvent {
    /// Bytes on stdout (or the PTY).
    Stdout(Vec<u8>),
    /// Bytes on stderr.
    Stderr(Vec<u8>),
    /// The process exited; nothing follows.
    Exit(ExitStatus),
}

/// A finished process's collected output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// How it ended.
    pub status: ExitStatus,
    /// All of stdout.
    pub stdout: Vec<u8>,
    /// All of stderr.
    pub stderr: Vec<u8>,
}

/// The outcome of [`AgentClient::sync_clock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSync {
    /// Shifts applied.
    pub steps: u32,
    /// The guest's last measured error against the target, ns (positive: guest ahead).
    pub error_ns: i64,
    /// Round trip of the probe that measured it, ns.
    pub rtt_ns: i64,
}

enum Incoming {
    Reply(Response),
    Data(Vec<u8>),
}

enum Pending {
    Plain(Sender<Incoming>),
    Exec(Sender<Incoming>, Sender<ProcEvent>),
    Stream(SyncSender<Incoming>),
}

#[derive(Default)]
struct Routes {
    pending: HashMap<u32, Pending>,
    procs: HashMap<u32, Sender<ProcEvent>>,
    closed: Option<String>,
}

struct Shared {
    routes: Mutex<Routes>,
}

struct Inner {
    writer: Mutex<Box<dyn Write + Send>>,
    shared: Arc<Shared>,
    next_id: AtomicU32,
    timeout: Duration,
    shutdown: Option<UnixStream>,
    /// From the agent's last `hello`: it runs on the host's kernel (a ct sandbox), whose clock is not its own.
    shared_kernel: std::sync::OnceLock<bool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(s) = &self.shutdown {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A connection to one agent. Cheap to clone; all clones share the connection.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
}

/// Chunks of a file stream buffered between the reader thread and the caller (backpressure beyond).
const STREAM_DEPTH: usize = 16;
/// Default wait for a reply.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

impl AgentClient {
    /// Connects to an agent's unix socket (`ct`: `/proc/<pid>/root/run/clade/agent.sock`; `vm`: the
    /// virtio-serial chardev's socket).
    pub fn connect_unix(path: impl AsRef<Path>) -> Result<AgentClient> {
        let s = UnixStream::connect(path.as_ref())?;
        AgentClient::from_unix(s)
    }

    /// Connects to a socket that may not exist yet (a sandbox still booting) and waits for `hello`,
    /// retrying the connect every 5 ms, all within `timeout`. The proof that a sandbox is up.
    pub fn connect_unix_wait(path: impl AsRef<Path>, timeout: Duration) -> Result<(AgentClient, Hello)> {
        let deadline = Instant::now() + timeout;
        let client = loop {
            match UnixStream::connect(path.as_ref()) {
                Ok(s) => break AgentClient::from_unix(s)?,
                Err(e) if Instant::now() >= deadline => return Err(e.into()),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        match client.call_for(&Request::Hello, "hello", left)? {
            Reply::Hello(h) => Ok((client, h)),
            r => Err(unexpected("hello", r)),
        }
    }

    /// Wraps a connected unix stream; dropping the last clone shuts it down.
    pub fn from_unix(s: UnixStream) -> Result<AgentClient> {
        // Deeper socket buffers let bulk file data overlap with the agent's disk writes (best effort:
        // the kernel caps them at net.core.wmem_max / rmem_max).
        let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::SndBuf, &(4 << 20));
        let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::RcvBuf, &(4 << 20));
        let r = s.try_clone()?;
        let w = s.try_clone()?;
        Ok(AgentClient::build(r, w, Some(s)))
    }

    /// End the connection for every clone now (a unix stream; a no-op for other streams): the agent sees the
    /// host hang up, and the clones' pending and later calls fail as closed. A sandbox about to be checkpointed
    /// whole is then left holding no socket of the host's, whatever processes still stream through clones.
    pub fn hang_up(&self) {
        if let Some(s) = &self.inner.shutdown {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Wraps any split byte stream (e.g. a pipe pair, or a serial port opened twice).
    pub fn from_parts(r: impl Read + Send + 'static, w: impl Write + Send + 'static) -> AgentClient {
        AgentClient::build(r, w, None)
    }

    fn build(r: impl Read + Send + 'static, w: impl Write + Send + 'static, sd: Option<UnixStream>) -> AgentClient {
        let shared = Arc::new(Shared { routes: Mutex::new(Routes::default()) });
        let s2 = shared.clone();
        std::thread::Builder::new().name("clade-agent-client".into()).spawn(move || reader_loop(r, s2)).ok();
        AgentClient {
            inner: Arc::new(Inner {
                writer: Mutex::new(Box::new(w)),
                shared,
                next_id: AtomicU32::new(1),
                timeout: DEFAULT_TIMEOUT,
                shutdown: sd,
                shared_kernel: std::sync::OnceLock::new(),
            }),
        }
    }

    fn send(&self, kind: Kind, chan: Chan, flags: u8, id: u32, body: &[u8]) -> Result<()> {
        let mut w = self.inner.writer.lock();
        if body.len() < 64 * 1024 {
            w.write_all(&wire::encode(kind, chan, flags, id, body))?;
        } else {
            wire::write_frame(&mut *w, kind, chan, flags, id, body)?;
        }
        w.flush()?;
        Ok(())
    }

    fn register(&self, p: Pending) -> Result<u32> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut routes = self.inner.shared.routes.lock();
        if let Some(why) = &routes.closed {
            return Err(ClientError::Closed(why.clone()));
        }
        routes.pending.insert(id, p);
        Ok(id)
    }

    fn unregister(&self, id: u32) {
        self.inner.shared.routes.lock().pending.remove(&id);
    }

    fn send_request(&self, id: u32, req: &Request) -> Result<()> {
        let body = serde_json::to_vec(req).map_err(|e| AgentError::BadRequest { detail: e.to_string() })?;
        if let Err(e) = self.send(Kind::Request, Chan::None, 0, id, &body) {
            self.unregister(id);
            return Err(e);
        }
        Ok(())
    }

    fn closed_err(&self) -> ClientError {
        let why = self.inner.shared.routes.lock().closed.clone();
        ClientError::Closed(why.unwrap_or_else(|| "reader stopped".into()))
    }

    fn await_reply(&self, rx: &Receiver<Incoming>, id: u32, op: &'static str, wait: Duration) -> Result<Reply> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Incoming::Reply(r)) => return r.map_err(ClientError::Agent),
                Ok(Incoming::Data(_)) => continue,
                Err(RecvTimeoutError::Timeout) => {
                    self.unregister(id);
                    return Err(ClientError::Timeout { op, ms: wait.as_millis() as u64 });
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.closed_err()),
            }
        }
    }

    fn call_for(&self, req: &Request, op: &'static str, wait: Duration) -> Result<Reply> {
        let (tx, rx) = mpsc::channel();
        let id = self.register(Pending::Plain(tx))?;
        self.send_request(id, req)?;
        self.await_reply(&rx, id, op, wait)
    }

    /// Sends any request and waits for its reply (the typed methods below are shorthands).
    pub fn call(&self, req: &Request) -> Result<Reply> {
        self.call_for(req, "request", self.inner.timeout)
    }

    /// `hello`: proves the agent is up and says which boot and generation it is.
    pub fn hello(&self) -> Result<Hello> {
        match self.call_for(&Request::Hello, "hello", self.inner.timeout)? {
            Reply::Hello(h) => {
                let _ = self.inner.shared_kernel.set(h.shared_kernel);
                Ok(h)
            }
            r => Err(unexpected("hello", r)),
        }
    }

    /// Whether the agent runs on the host's kernel (a ct sandbox), from its last `hello` (asked if none yet).
    pub fn shared_kernel(&self) -> Result<bool> {
        match self.inner.shared_kernel.get() {
            Some(s) => Ok(*s),
            None => Ok(self.hello()?.shared_kernel),
        }
    }

    /// Starts a process; its output and exit arrive on the returned handle.
    pub fn exec(&self, spec: ExecSpec) -> Result<Process> {
        let (tx, rx) = mpsc::channel();
        let (ptx, prx) = mpsc::channel();
        let id = self.register(Pending::Exec(tx, ptx))?;
        self.send_request(id, &Request::Exec(spec))?;
        match self.await_reply(&rx, id, "exec", self.inner.timeout)? {
            Reply::Started { pid } => Ok(Process { pid, client: self.clone(), events: prx, exit: None }),
            r => Err(unexpected("exec", r)),
        }
    }

    /// Runs a process to its end and collects its output.
    pub fn run(&self, spec: ExecSpec) -> Result<Output> {
        self.exec(spec)?.output()
    }

    /// Lists the processes the agent started.
    pub fn list_procs(&self) -> Result<Vec<ProcInfo>> {
        match self.call_for(&Request::ListProcs, "list_procs", self.inner.timeout)? {
            Reply::Procs { procs } => Ok(procs),
            r => Err(unexpected("list_procs", r)),
        }
    }

    /// Waits for a process (started by any connection) to exit.
    pub fn wait(&self, pid: u32, timeout: Duration) -> Result<ExitStatus> {
        match self.call_for(&Request::Wait { pid }, "wait", timeout)? {
            Reply::Exited(s) => Ok(s),
            r => Err(unexpected("wait", r)),
        }
    }

    fn done(&self, req: Request, op: &'static str) -> Result<()> {
        match self.call_for(&req, op, self.inner.timeout)? {
            Reply::Done => Ok(()),
            r => Err(unexpected(op, r)),
        }
    }

    /// Sends a signal to a process the agent started.
    pub fn signal(&self, pid: u32, signal: i32) -> Result<()> {
        self.done(Request::Signal { pid, signal }, "signal")
    }

    /// Sends `signal` to the group of processes `leader` leads (`Request::SignalGroup`): how many it reached.
    pub fn signal_group(&self, leader: u32, signal: i32) -> Result<u32> {
        match self.call(&Request::SignalGroup { leader, signal })? {
            Reply::Signalled { processes } => Ok(processes),
            other => Err(unexpected("signal_group", other)),
        }
    }

    /// Writes bytes to a process's stdin (the process must have been started with `stdin: true` or a PTY).
    pub fn write_stdin(&self, pid: u32, data: &[u8]) -> Result<()> {
        for chunk in data.chunks(DATA_CHUNK) {
            self.send(Kind::Data, Chan::Stdin, 0, pid, chunk)?;
        }
        Ok(())
    }

    /// Closes a process's stdin.
    pub fn close_stdin(&self, pid: u32) -> Result<()> {
        self.done(Request::CloseStdin { pid }, "close_stdin")
    }

    /// Resizes a process's PTY.
    pub fn resize(&self, pid: u32, rows: u16, cols: u16) -> Result<()> {
        self.done(Request::Resize { pid, rows, cols }, "resize")
    }

    /// Streams a file's contents into `sink`; returns the byte count.
    pub fn read_file(&self, path: &str, sink: &mut dyn Write) -> Result<u64> {
        let (tx, rx) = mpsc::sync_channel(STREAM_DEPTH);
        let id = self.register(Pending::Stream(tx))?;
        self.send_request(id, &Request::ReadFile { path: path.into() })?;
        loop {
            match rx.recv_timeout(self.inner.timeout) {
                Ok(Incoming::Data(d)) => {
                    if let Err(e) = sink.write_all(&d) {
                        self.unregister(id);
                        return Err(e.into());
                    }
                }
                Ok(Incoming::Reply(r)) => {
                    return match r? {
                        Reply::Bytes { n } => Ok(n),
                        r => Err(unexpected("read_file", r)),
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.unregister(id);
                    return Err(ClientError::Timeout { op: "read_file", ms: self.inner.timeout.as_millis() as u64 });
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.closed_err()),
            }
        }
    }

    /// Reads a whole file into memory.
    pub fn read_file_vec(&self, path: &str) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        self.read_file(path, &mut v)?;
        Ok(v)
    }

    /// Creates or atomically replaces `path` with everything `src` yields; returns the byte count.
    pub fn write_file(&self, path: &str, src: &mut dyn Read, mode: Option<u32>, mkdirs: bool) -> Result<u64> {
        self.write_file_with(path, src, &WriteOptions::mode(mode), mkdirs)
    }

    /// [`AgentClient::write_file`] with an owner and extended attributes too.
    pub fn write_file_with(&self, path: &str, src: &mut dyn Read, opts: &WriteOptions, mkdirs: bool) -> Result<u64> {
        let (tx, rx) = mpsc::channel();
        let id = self.register(Pending::Plain(tx))?;
        self.send_request(id, &Request::WriteFile { path: path.into(), mkdirs, opts: opts.clone() })?;
        let mut buf = vec![0u8; DATA_CHUNK];
        loop {
            // The agent answers early on a refused path: stop sending then.
            if let Ok(Incoming::Reply(r)) = rx.try_recv() {
                return match r? {
                    Reply::Bytes { n } => Ok(n),
                    r => Err(unexpected("write_file", r)),
                };
            }
            let n = match src.read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.unregister(id);
                    return Err(e.into());
                }
            };
            let flags = if n == 0 { FLAG_END } else { 0 };
            self.send(Kind::Data, Chan::File, flags, id, &buf[..n])?;
            if n == 0 {
                break;
            }
        }
        match self.await_reply(&rx, id, "write_file", self.inner.timeout)? {
            Reply::Bytes { n } => Ok(n),
            r => Err(unexpected("write_file", r)),
        }
    }

    /// Writes a whole buffer as a file (its chunks go out straight from `data`, no copy).
    pub fn write_file_bytes(&self, path: &str, data: &[u8], mode: Option<u32>) -> Result<u64> {
        let (tx, rx) = mpsc::channel();
        let id = self.register(Pending::Plain(tx))?;
        self.send_request(
            id,
            &Request::WriteFile { path: path.into(), mkdirs: false, opts: WriteOptions::mode(mode) },
        )?;
        for chunk in data.chunks(DATA_CHUNK) {
            if let Ok(Incoming::Reply(r)) = rx.try_recv() {
                return match r? {
                    Reply::Bytes { n } => Ok(n),
                    r => Err(unexpected("write_file", r)),
                };
            }
            self.send(Kind::Data, Chan::File, 0, id, chunk)?;
        }
        self.send(Kind::Data, Chan::File, FLAG_END, id, &[])?;
        match self.await_reply(&rx, id, "write_file", self.inner.timeout)? {
            Reply::Bytes { n } => Ok(n),
            r => Err(unexpected("write_file", r)),
        }
    }

    /// `stat` (does not follow a final symlink).
    pub fn stat(&self, path: &str) -> Result<FileStat> {
        match self.call_for(&Request::Stat { path: path.into() }, "stat", self.inner.timeout)? {
            Reply::Stat(s) => Ok(s),
            r => Err(unexpected("stat", r)),
        }
    }

    /// Lists a directory down to `depth` levels.
    pub fn list_dir(&self, path: &str, depth: u32) -> Result<Vec<DirEntry>> {
        match self.call_for(&Request::ListDir { path: path.into(), depth }, "list_dir", self.inner.timeout)? {
            Reply::Dir { entries } => Ok(entries),
            r => Err(unexpected("list_dir", r)),
        }
    }

    /// `mkdir -p`.
    pub fn mkdir_p(&self, path: &str, mode: Option<u32>) -> Result<()> {
        self.mkdir_p_owned(path, mode, None)
    }

    /// `mkdir -p`, the directories it creates owned by `owner`.
    pub fn mkdir_p_owned(&self, path: &str, mode: Option<u32>, owner: Option<FileOwner>) -> Result<()> {
        self.done(Request::MkdirP { path: path.into(), mode, owner }, "mkdir_p")
    }

    /// Removes a path (directories only with `recursive`).
    pub fn remove(&self, path: &str, recursive: bool) -> Result<()> {
        self.done(Request::Remove { path: path.into(), recursive }, "remove")
    }

    /// Renames a path.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.done(Request::Rename { from: from.into(), to: to.into() }, "rename")
    }

    /// Watches a directory (inotify in the agent; its subdirectories too when `recursive`): the watch's id.
    pub fn watch_start(&self, path: &str, recursive: bool) -> Result<u64> {
        match self.call_for(&Request::WatchStart { path: path.into(), recursive }, "watch_start", self.inner.timeout)? {
            Reply::Watch { watch } => Ok(watch),
            r => Err(unexpected("watch_start", r)),
        }
    }

    /// A watch's events since the last call, waiting up to `wait` for one when none are queued; `true` when
    /// some may be missing before them.
    pub fn watch_events(&self, watch: u64, wait: Duration) -> Result<(Vec<WatchEvent>, bool)> {
        let req = Request::WatchEvents { watch, wait_ms: wait.as_millis() as u64 };
        match self.call_for(&req, "watch_events", self.inner.timeout + wait)? {
            Reply::WatchEvents { events, lost } => Ok((events, lost)),
            r => Err(unexpected("watch_events", r)),
        }
    }

    /// Ends a watch.
    pub fn watch_stop(&self, watch: u64) -> Result<()> {
        self.done(Request::WatchStop { watch }, "watch_stop")
    }

    /// Changes permission bits.
    pub fn chmod(&self, path: &str, mode: u32) -> Result<()> {
        self.done(Request::Chmod { path: path.into(), mode }, "chmod")
    }

    /// Creates a symbolic link at `path` pointing at `target`.
    pub fn symlink(&self, target: &str, path: &str) -> Result<()> {
        self.done(Request::Symlink { target: target.into(), path: path.into() }, "symlink")
    }

    /// Mounts `source` at `path` (`Request::Mount`), read-only when asked.
    pub fn mount(&self, path: &str, source: MountSource, readonly: bool) -> Result<()> {
        self.done(Request::Mount { path: path.into(), source, readonly }, "mount")
    }

    /// Detaches the mount at `path` and those below it (`Request::Unmount`).
    pub fn unmount(&self, path: &str) -> Result<()> {
        self.done(Request::Unmount { path: path.into() }, "unmount")
    }

    /// Makes the sandbox a distinct machine after a restore or fork.
    pub fn set_identity(&self, id: Identity) -> Result<IdentityReport> {
        match self.call_for(&Request::SetIdentity(id), "set_identity", self.inner.timeout)? {
            Reply::Identity(r) => Ok(r),
            r => Err(unexpected("set_identity", r)),
        }
    }

    /// Runs the sandbox's `pre-mark.d` hooks; call it just before a mark.
    pub fn pre_mark(&self, clean: bool) -> Result<HookReport> {
        match self.call_for(&Request::PreMark { clean }, "pre_mark", self.inner.timeout)? {
            Reply::Hooks(r) => Ok(r),
            r => Err(unexpected("pre_mark", r)),
        }
    }

    /// Registers a sandbox process to be signalled by `set_identity { signal_registered: true }`.
    pub fn register_restore_signal(&self, pid: u32, signal: i32) -> Result<()> {
        self.done(Request::RegisterRestoreSignal { pid, signal }, "register_restore_signal")
    }

    /// Reads the sandbox's clocks.
    pub fn clock_read(&self) -> Result<ClockReading> {
        match self.call_for(&Request::ClockRead, "clock_read", self.inner.timeout)? {
            Reply::Clock(c) => Ok(c),
            r => Err(unexpected("clock_read", r)),
        }
    }

    /// Moves the sandbox's wall clock by `by_ns` against its own reading.
    pub fn clock_shift(&self, by_ns: i64) -> Result<ClockReading> {
        match self.call_for(&Request::ClockShift { by_ns }, "clock_shift", self.inner.timeout)? {
            Reply::Clock(c) => Ok(c),
            r => Err(unexpected("clock_shift", r)),
        }
    }

    /// Probes and shifts the sandbox's wall clock until it reads within 3 ms of this host's clock plus
    /// `offset_ns` (at most 4 shifts). Each probe is the best of three round trips.
    ///
    /// An agent on the host's kernel (a ct sandbox) shares this host's clock: it is probed, never shifted (the
    /// sandbox may not set the host's clock, and what a probe measures there is only the round trip's noise).
    pub fn sync_clock(&self, offset_ns: i64) -> Result<ClockSync> {
        const WITHIN_NS: i64 = 3_000_000;
        let shared = self.shared_kernel()?;
        let mut steps = 0;
        loop {
            let (err, rtt) = self.probe_clock(offset_ns, 3)?;
            if err.abs() <= WITHIN_NS || steps == 4 || shared {
                return Ok(ClockSync { steps, error_ns: err, rtt_ns: rtt });
            }
            self.clock_shift(-err)?;
            steps += 1;
        }
    }

    /// The sandbox clock's error against this host's clock plus `offset_ns`, from the shortest of `n`
    /// round trips: (error ns, round trip ns).
    pub fn probe_clock(&self, offset_ns: i64, n: u32) -> Result<(i64, i64)> {
        let mut best: Option<(i64, i64)> = None;
        for _ in 0..n.max(1) {
            let h0 = host_now_ns();
            let g = self.clock_read()?.realtime_ns;
            let h1 = host_now_ns();
            let err = g - (h0 + (h1 - h0) / 2 + offset_ns);
            let better = match best {
                None => true,
                Some((_, rtt)) => h1 - h0 < rtt,
            };
            if better {
                best = Some((err, h1 - h0));
            }
        }
        Ok(best.unwrap_or((0, 0)))
    }

    /// Destroys established TCP connections to `peer` (all non-loopback ones if `None`), keeping those on
    /// `keep_local_ports`; returns how many were destroyed.
    pub fn net_reset(&self, peer: Option<std::net::IpAddr>, keep_local_ports: &[u16]) -> Result<u32> {
        let req = Request::NetReset { peer: peer.map(|p| p.to_string()), keep_local_ports: keep_local_ports.to_vec() };
        match self.call_for(&req, "net_reset", self.inner.timeout)? {
            Reply::NetReset { destroyed } => Ok(destroyed),
            r => Err(unexpected("net_reset", r)),
        }
    }

    /// Writes the env file and the profile script.
    pub fn write_env(&self, vars: std::collections::BTreeMap<String, String>) -> Result<()> {
        self.done(Request::WriteEnv { vars }, "write_env")
    }

    /// Waits until `target` is ready; returns the milliseconds waited.
    pub fn wait_ready(&self, target: ReadyTarget, timeout: Duration) -> Result<u64> {
        let req = Request::WaitReady { target, timeout_ms: timeout.as_millis() as u64 };
        match self.call_for(&req, "wait_ready", timeout + Duration::from_secs(5))? {
            Reply::Ready { waited_ms } => Ok(waited_ms),
            r => Err(unexpected("wait_ready", r)),
        }
    }

    /// Sends a raw frame (for tests of the agent's bad-input handling) and waits for the reply to `id`.
    pub fn raw_call(&self, frame: &[u8], id: u32, wait: Duration) -> Result<Reply> {
        let (tx, rx) = mpsc::channel();
        self.inner.shared.routes.lock().pending.insert(id, Pending::Plain(tx));
        {
            let mut w = self.inner.writer.lock();
            w.write_all(frame)?;
            w.flush()?;
        }
        self.await_reply(&rx, id, "raw", wait)
    }
}

fn unexpected(op: &'static str, r: Reply) -> ClientError {
    ClientError::Unexpected { op, got: format!("{r:?}") }
}

fn host_now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as i64).unwrap_or(0)
}

/// A process started through [`AgentClient::exec`].
pub struct Process {
    /// Its pid in the sandbox.
    pub pid: u32,
    client: AgentClient,
    events: Receiver<ProcEvent>,
    exit: Option<ExitStatus>,
}

impl Process {
    /// The next output or the exit; `Ok(None)` once the exit was returned, or after `timeout`.
    pub fn next_event(&mut self, timeout: Duration) -> Result<Option<ProcEvent>> {
        if self.exit.is_some() {
            return Ok(None);
        }
        match self.events.recv_timeout(timeout) {
            Ok(ev) => {
                if let ProcEvent::Exit(s) = ev {
                    self.exit = Some(s);
                }
                Ok(Some(ev))
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.client.closed_err()),
        }
    }

    /// Writes to its stdin.
    pub fn write_stdin(&self, data: &[u8]) -> Result<()> {
        self.client.write_stdin(self.pid, data)
    }

    /// Closes its stdin.
    pub fn close_stdin(&self) -> Result<()> {
        self.client.close_stdin(self.pid)
    }

    /// Sends it a signal.
    pub fn signal(&self, signal: i32) -> Result<()> {
        self.client.signal(self.pid, signal)
    }

    /// Resizes its PTY.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        self.client.resize(self.pid, rows, cols)
    }

    /// Collects everything until it exits.
    pub fn output(mut self) -> Result<Output> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        loop {
            match self.events.recv() {
                Ok(ProcEvent::Stdout(d)) => stdout.extend_from_slice(&d),
                Ok(ProcEvent::Stderr(d)) => stderr.extend_from_slice(&d),
                Ok(ProcEvent::Exit(status)) => {
                    self.exit = Some(status);
                    return Ok(Output { status, stdout, stderr });
                }
                Err(_) => return Err(self.client.closed_err()),
            }
        }
    }
}

fn reader_loop(mut r: impl Read, shared: Arc<Shared>) {
    let why = loop {
        let f = match wire::read_frame(&mut r) {
            Ok(ReadOutcome::Frame(f)) => f,
            Ok(ReadOutcome::Bad(e)) => {
                if let Some(p) = shared.routes.lock().pending.remove(&e.id()) {
                    let err = Err(AgentError::BadFrame { detail: e.to_string() });
                    deliver(p, err);
                }
                continue;
            }
            Ok(ReadOutcome::Eof) => break "the agent closed the connection".to_string(),
            Err(e) => break format!("reading from the agent: {e}"),
        };
        let id = f.header.id;
        match (f.header.kind, f.header.chan) {
            (Kind::Reply, _) => {
                let resp: Response = serde_json::from_slice(&f.body)
                    .unwrap_or_else(|e| Err(AgentError::BadFrame { detail: format!("undecodable reply: {e}") }));
                let mut routes = shared.routes.lock();
                let Some(p) = routes.pending.remove(&id) else { continue };
                if let (Pending::Exec(_, ptx), Ok(Reply::Started { pid })) = (&p, &resp) {
                    routes.procs.insert(*pid, ptx.clone());
                }
                drop(routes);
                deliver(p, resp);
            }
            (Kind::Data, Chan::File) => {
                let tx = match shared.routes.lock().pending.get(&id) {
                    Some(Pending::Stream(tx)) => tx.clone(),
                    _ => continue,
                };
                let _ = tx.send(Incoming::Data(f.body));
            }
            (Kind::Data, chan @ (Chan::Stdout | Chan::Stderr)) => {
                if f.body.is_empty() {
                    continue;
                }
                if let Some(tx) = shared.routes.lock().procs.get(&id) {
                    let ev = if chan == Chan::Stdout { ProcEvent::Stdout(f.body) } else { ProcEvent::Stderr(f.body) };
                    let _ = tx.send(ev);
                }
            }
            (Kind::Event, _) => {
                if let Ok(Event::Exit { pid, status }) = serde_json::from_slice::<Event>(&f.body) {
                    if let Some(tx) = shared.routes.lock().procs.remove(&pid) {
                        let _ = tx.send(ProcEvent::Exit(status));
                    }
                }
            }
            _ => {}
        }
    };
    let mut routes = shared.routes.lock();
    routes.closed = Some(why);
    routes.pending.clear();
    routes.procs.clear();
}

fn deliver(p: Pending, resp: Response) {
    match p {
        Pending::Plain(tx) | Pending::Exec(tx, _) => {
            let _ = tx.send(Incoming::Reply(resp));
        }
        Pending::Stream(tx) => {
            let _ = tx.send(Incoming::Reply(resp));
        }
    }
}
