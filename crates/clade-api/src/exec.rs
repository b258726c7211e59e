//! The HTTP API's non-streamed exec, bounded in time. Such a request holds a blocking thread and buffers the
//! command's whole output until it ends, so a command that never ends held them forever (and the client, which
//! gave up long ago, learned nothing). Here it runs as a streamed process under the daemon's limit
//! (`clade serve --exec-timeout`, an hour by default: as long as the CLI waits for an answer) or a request's
//! lower `timeout_ms`; past it the process gets SIGKILL and the answer is a 504 saying so. Streamed exec
//! (`"stream": true`) has no limit: its client sees output as it comes and may hang up to detach.

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use anyhow::anyhow;

use clade_host::api::{ExecEvent, ExecOutput, ExecRequest, SandboxApi};

/// A command that outlived its limit (and was killed).
#[derive(Debug, thiserror::Error)]
#[error(
    "the command ran past its {}-second limit and was killed (SIGKILL to pid {pid}); for a longer command send \
     \"stream\": true (no limit), or a larger timeout_ms up to the daemon's --exec-timeout",
    limit.as_secs_f64()
)]
pub struct ExecTimedOut {
    pub limit: Duration,
    pub pid: u32,
}

/// The limit for one request: its `timeout_ms` when lower than the daemon's, else the daemon's (0: absent).
pub fn limit_for(req: &ExecRequest, daemon: Duration) -> Duration {
    req.timeout_ms.filter(|t| *t > 0).map(Duration::from_millis).map_or(daemon, |t| t.min(daemon))
}

/// Run `req` in `sandbox`, collecting its output, killing it past `limit`.
pub fn exec_within(
    api: &dyn SandboxApi,
    sandbox: &str,
    req: ExecRequest,
    limit: Duration,
) -> anyhow::Result<ExecOutput> {
    let events = api.exec_stream(sandbox, req)?;
    collect_within(events, limit, |pid| {
        if let Err(e) = api.proc_signal(sandbox, pid, libc_sigkill()) {
            eprintln!("clade serve: could not kill timed-out pid {pid} in {sandbox}: {e:#}");
        }
    })
}

fn libc_sigkill() -> i32 {
    nix::sys::signal::Signal::SIGKILL as i32
}

/// Gather a command's events into its output until it exits; past `limit`, call `kill` with its pid and fail
/// with [`ExecTimedOut`]. The events are read on a thread of their own (a blocking socket read cannot be
/// given a deadline from here); it ends when the killed process's stream does.
pub fn collect_within<I>(events: I, limit: Duration, kill: impl FnOnce(u32)) -> anyhow::Result<ExecOutput>
where
    I: Iterator<Item = anyhow::Result<ExecEvent>> + Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for ev in events {
            if tx.send(ev).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + limit;
    let mut out = ExecOutput { code: 0, signal: None, stdout: Vec::new(), stderr: Vec::new() };
    let mut pid = 0;
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Ok(ExecEvent::Pid(p))) => pid = p,
            Ok(Ok(ExecEvent::Stdout(d))) => out.stdout.extend_from_slice(&d),
            Ok(Ok(ExecEvent::Stderr(d))) => out.stderr.extend_from_slice(&d),
            Ok(Ok(ExecEvent::Exit { code, signal })) => {
                out.code = code;
                out.signal = signal;
                return Ok(out);
            }
            Ok(Err(e)) => return Err(e),
            Err(RecvTimeoutError::Timeout) => {
                if pid != 0 {
                    kill(pid);
                }
                return Err(anyhow!(ExecTimedOut { limit, pid }));
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(anyhow!("the command's output stream ended before its exit status (its sandbox ended?)"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_past_its_limit_is_killed_and_named() {
        // A command that prints, then never exits: the stream blocks after its first events.
        let (tx, rx) = std::sync::mpsc::channel::<anyhow::Result<ExecEvent>>();
        tx.send(Ok(ExecEvent::Pid(42))).unwrap();
        tx.send(Ok(ExecEvent::Stdout(b"partial".to_vec()))).unwrap();
        let events = std::iter::from_fn(move || rx.recv().ok());
        let killed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let k = killed.clone();
        let t = Instant::now();
        let e = collect_within(events, Duration::from_millis(200), move |p| *k.lock().unwrap() = Some(p)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(*killed.lock().unwrap(), Some(42));
        let to = e.downcast_ref::<ExecTimedOut>().expect("an ExecTimedOut");
        assert_eq!(to.pid, 42);
        assert!(e.to_string().contains("stream"), "{e}");
        drop(tx);
    }

    #[test]
    fn a_command_within_its_limit_answers_whole() {
        let evs = vec![
            Ok(ExecEvent::Pid(7)),
            Ok(ExecEvent::Stdout(b"a".to_vec())),
            Ok(ExecEvent::Stderr(b"e".to_vec())),
            Ok(ExecEvent::Stdout(b"b".to_vec())),
            Ok(ExecEvent::Exit { code: 3, signal: None }),
        ];
        let out = collect_within(evs.into_iter(), Duration::from_secs(5), |_| panic!("killed")).unwrap();
        assert_eq!((out.code, out.stdout.as_slice(), out.stderr.as_slice()), (3, &b"ab"[..], &b"e"[..]));
    }

    #[test]
    fn a_request_may_only_lower_the_daemon_limit() {
        let d = Duration::from_secs(3600);
        let mut r = ExecRequest::default();
        assert_eq!(limit_for(&r, d), d);
        r.timeout_ms = Some(1500);
        assert_eq!(limit_for(&r, d), Duration::from_millis(1500));
        r.timeout_ms = Some(10_000_000);
        assert_eq!(limit_for(&r, d), d);
    }
}
