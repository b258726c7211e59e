//! `clade-agent relay PORT`: one TCP connection to the sandbox's own loopback, carried over this process's
//! stdin and stdout. The host starts it through the agent like any process to reach a port inside a sandbox it
//! has no network path to (a vm guest: E2B's `<port>-<id>` hosts; docs/agent.md, "Relay"). It says on stderr
//! whether the connection was made (`connected`, or `refused: ...` and exit 3) before any byte flows; it ends
//! when the server closes its side.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

/// Exit status when nothing listens on the port.
pub const REFUSED: i32 = 3;

pub fn run(port: &str) -> i32 {
    let Ok(port) = port.parse::<u16>() else {
        eprintln!("refused: {port:?} is not a port number");
        return 2;
    };
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let sock = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("refused: port is not open: {port} in sandbox ({e})");
            return REFUSED;
        }
    };
    eprintln!("connected");
    let _ = sock.set_nodelay(true);
    let Ok(mut to_server) = sock.try_clone() else { return 1 };
    // The client's bytes to the server; its end of input ends our writing half.
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        let stdin = std::io::stdin();
        let mut stdin = stdin.lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to_server.shutdown(Shutdown::Write);
    });
    // The server's bytes to the client, until it closes.
    let mut from_server = sock;
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from_server.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if out.write_all(&buf[..n]).and_then(|_| out.flush()).is_err() {
                    break;
                }
            }
        }
    }
    0
}
