//! Reaching the agent of a `vm` guest: QEMU listens on the virtio-serial port's unix socket; the guest's agent
//! may still be booting (cold start) or its port may still be reconnecting (restore). Connect and say hello until
//! it answers, each attempt bounded, the whole bounded.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use clade_agent::client::AgentClient;
use clade_agent::proto::Hello;

/// The connected client and the agent's hello, or the time waited.
pub fn hello_until(sock: &Path, timeout: Duration) -> Result<(AgentClient, Hello), Duration> {
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
        if start.elapsed() >= timeout {
            return Err(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
