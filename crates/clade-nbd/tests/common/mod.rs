//! Shared helpers for the integration tests: a server on a temporary unix socket, tool lookup,
//! and a tiny hand-written NBD client for the bad-input tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

pub mod guest;

use clade_nbd::control::{control_path, serve_control};
use clade_nbd::proto::*;
use clade_nbd::{BlockSource, Export, MemSnapshotter, MemSource, Server};

pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub server: Arc<Server>,
    rt: tokio::runtime::Runtime,
}

impl TestServer {
    /// Starts a server with the given exports; the first is the default.
    pub fn start(exports: Vec<(&str, Arc<Export>)>) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbd.sock");
        let server = Server::new();
        for (name, e) in exports {
            server.add_export(name, e);
        }
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        {
            let _g = rt.enter();
            let l = Server::bind_unix(&socket).unwrap();
            let c = Server::bind_unix(&control_path(&socket)).unwrap();
            rt.spawn(server.clone().serve_unix(l));
            rt.spawn(serve_control(server.clone(), c));
        }
        TestServer { dir, socket, server, rt }
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    pub fn uri_named(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }
}

/// A writable in-memory export with a MemSnapshotter.
pub fn mem_export(data: Vec<u8>, read_only: bool) -> Arc<Export> {
    let base: Arc<dyn BlockSource> = Arc::new(MemSource::new("base", data));
    Arc::new(Export::new(base, read_only, Some(Arc::new(MemSnapshotter::default()))))
}

/// Deterministic pseudo-random bytes with a zero hole in the middle.
pub fn pattern(len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push((x >> 24) as u8);
    }
    let (a, b) = (len / 4, len / 2);
    v[a..b].fill(0);
    v
}

/// The path of `tool`, or None (the caller prints why it skips).
pub fn tool(name: &str) -> Option<PathBuf> {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (!p.is_empty()).then(|| PathBuf::from(p))
}

/// Runs a command, returning (success, stdout + stderr).
pub fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().expect("spawn");
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), s)
}

/// A minimal blocking NBD client: fixed newstyle, NBD_OPT_GO, optional structured replies.
pub struct RawClient {
    pub s: UnixStream,
    pub size: u64,
    pub flags: u16,
}

pub fn send_opt(s: &mut UnixStream, opt: u32, data: &[u8]) {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).unwrap();
}

/// Reads one option reply: (option, reply type, payload).
pub fn read_opt_reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u64::from_be_bytes(h[0..8].try_into().unwrap()), OPT_REPLY_MAGIC);
    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let rep = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    let mut p = vec![0u8; len as usize];
    s.read_exact(&mut p).unwrap();
    (opt, rep, p)
}

/// Connects and reads the greeting, sending client flags; returns the stream ready for options.
pub fn greet(path: &Path) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    assert_eq!(u64::from_be_bytes(g[0..8].try_into().unwrap()), NBDMAGIC);
    assert_eq!(u64::from_be_bytes(g[8..16].try_into().unwrap()), IHAVEOPT);
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    s
}

impl RawClient {
    pub fn connect(path: &Path, name: &str) -> RawClient {
        let mut s = greet(path);
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        send_opt(&mut s, OPT_GO, &d);
        let (mut size, mut flags) = (0, 0);
        loop {
            let (_, rep, p) = read_opt_reply(&mut s);
            match rep {
                REP_INFO if u16::from_be_bytes([p[0], p[1]]) == INFO_EXPORT => {
                    size = u64::from_be_bytes(p[2..10].try_into().unwrap());
                    flags = u16::from_be_bytes([p[10], p[11]]);
                }
                REP_INFO => {}
                REP_ACK => break,
                other => panic!("GO failed: {other:#x} {}", String::from_utf8_lossy(&p)),
            }
        }
        RawClient { s, size, flags }
    }

    pub fn send(&mut self, flags: u16, cmd: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = encode_request(flags, cmd, cookie, offset, len).to_vec();
        b.extend_from_slice(payload);
        self.s.write_all(&b).unwrap();
    }

    /// Reads a simple reply: (error, cookie), then `data_len` bytes of data if error == 0.
    pub fn simple(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), SIMPLE_REPLY_MAGIC);
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let mut d = vec![0u8; if err == 0 { data_len } else { 0 }];
        self.s.read_exact(&mut d).unwrap();
        (err, cookie, d)
    }
}
