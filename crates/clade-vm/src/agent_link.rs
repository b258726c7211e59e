//! Reaching the agent of a `vm` guest: QEMU listens on the virtio-serial port's unix socket; the guest's agent
//! may still be booting (cold start) or its port may still be reconnecting (restore). Connect and say hello until
//! it answers, each attempt bounded, the whole bounded.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use clade_agent::client::AgentClient;
use clade_agent::proto::Hello;

/// Why no hello came.
#[derive(Debug)]
pub enum NoHello {
    /// Nothing answered within this long (the guest runs but its agent is silent).
    Timeout(Duration),
    /// The guest's process ended meanwhile: why (QEMU's exit status and error text).
    Died(String),
}

/// The connected client and the agent's hello, or the time waited.
pub fn hello_until(sock: &Path, timeout: Duration) -> Result<(AgentClient, Hello), Duration> {
    hello_while(sock, timeout, || None).map_err(|e| match e {
        NoHello::Timeout(d) => d,
        NoHello::Died(_) => timeout,
    })
}

/// As [`hello_until`], giving up as soon as `died` returns why the guest's process ended (checked between
/// attempts), so a QEMU that exits during a boot or a restore is reported at once with its own words.
pub fn hello_while(
    sock: &Path,
    timeout: Duration,
    mut died: impl FnMut() -> Option<String>,
) -> Result<(AgentClient, Hello), NoHello> {
    let start = Instant::now();
    let attempt = Duration::from_secs(2).min(timeout);
    loop {
        if let Ok(s) = UnixStream::connect(sock) {
            if let Ok(killer) = s.try_clone() {
                if let Ok(client) = AgentClient::from_unix(s) {
                    let (tx, rx) = std::sync::mpsc::channel();
                    let c2 = client.clone();
                    std::thread::spawn(move || {
                        let _ = tx.send(c2.hello());
                    });
                    match rx.recv_timeout(attempt) {
                        Ok(Ok(h)) => return Ok((client, h)),
                        // A timed-out attempt: shut the socket so the waiting thread ends, and try again.
                        _ => {
                            let _ = killer.shutdown(std::net::Shutdown::Both);
                        }
                    }
                }
            }
        }
        if let Some(why) = died() {
            return Err(NoHello::Died(why));
        }
        if start.elapsed() >= timeout {
            return Err(NoHello::Timeout(start.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
