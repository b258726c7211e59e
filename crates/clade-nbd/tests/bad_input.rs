//! Misbehaving clients get the protocol's error and never take the server down for others; a base
//! that fails to read yields EIO for that read only.

mod common;

use std::io::{Read, Write};
use std::sync::Arc;

use clade_nbd::proto::*;
use clade_nbd::{BlockSource, Export};
use common::*;

const SIZE: usize = 1 << 20;

fn assert_still_serving(srv: &TestServer) {
    let mut c = RawClient::connect(&srv.socket, "");
    c.send(0, 0, 42, 0, 4096, &[]);
    let (err, cookie, data) = c.simple(4096);
    assert_eq!((err, cookie), (0, 42));
    assert_eq!(data, pattern(SIZE)[..4096]);
}

fn closed(s: &mut std::os::unix::net::UnixStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn out_of_range_and_unknown_commands_get_errors_and_the_connection_goes_on() {
    let srv = TestServer::start(vec![("x", mem_export(pattern(SIZE), false))]);
    let mut c = RawClient::connect(&srv.socket, "x");
    assert_eq!(c.size, SIZE as u64);
    c.send(0, 0, 1, SIZE as u64 - 10, 4096, &[]);
    assert_eq!(c.simple(0).0, EINVAL);
    c.send(0, 0, 2, u64::MAX - 1, 4096, &[]);
    assert_eq!(c.simple(0).0, EINVAL);
    c.send(0, 1, 3, SIZE as u64, 512, &[7u8; 512]);
    assert_eq!(c.simple(0).0, ENOSPC);
    c.send(0, 99, 4, 0, 0, &[]);
    assert_eq!(c.simple(0).0, EINVAL);
    c.send(1 << 9, 0, 5, 0, 512, &[]);
    assert_eq!(c.simple(0).0, EINVAL);
    // Block status without a negotiated meta context is an error too.
    c.send(0, 7, 6, 0, 4096, &[]);
    assert_eq!(c.simple(0).0, EINVAL);
    // A write larger than the maximum is refused and its payload skipped: the stream stays in sync.
    let big = vec![1u8; (MAX_PAYLOAD + 4096) as usize];
    c.send(0, 1, 7, 0, big.len() as u32, &big);
    assert_eq!(c.simple(0).0, ENOSPC);
    c.send(0, 0, 8, 0, 4096, &[]);
    let (err, cookie, data) = c.simple(4096);
    assert_eq!((err, cookie), (0, 8));
    assert_eq!(data, pattern(SIZE)[..4096]);
    assert_still_serving(&srv);
}

#[test]
fn truncated_header_and_bad_magic_end_only_that_connection() {
    let srv = TestServer::start(vec![("x", mem_export(pattern(SIZE), false))]);
    let mut other = RawClient::connect(&srv.socket, "");
    let mut c = RawClient::connect(&srv.socket, "");
    c.s.write_all(&encode_request(0, 0, 1, 0, 512)[..20]).unwrap();
    c.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(closed(&mut c.s));
    let mut c = RawClient::connect(&srv.socket, "");
    let mut bad = encode_request(0, 0, 1, 0, 512);
    bad[0] ^= 0xff;
    c.s.write_all(&bad).unwrap();
    assert!(closed(&mut c.s));
    // The connection opened before keeps working, and new ones too.
    other.send(0, 0, 9, 4096, 4096, &[]);
    assert_eq!(other.simple(4096).0, 0);
    assert_still_serving(&srv);
}

#[test]
fn handshake_in_the_wrong_order_is_refused() {
    let srv = TestServer::start(vec![("x", mem_export(pattern(SIZE), false))]);
    // A transmission request where an option belongs: the server hangs up.
    let mut s = greet(&srv.socket);
    s.write_all(&encode_request(0, 0, 1, 0, 512)).unwrap();
    assert!(closed(&mut s));
    // Unknown client flags: hang up.
    let mut s = std::os::unix::net::UnixStream::connect(&srv.socket).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&0xffu32.to_be_bytes()).unwrap();
    assert!(closed(&mut s));
    // Options with bad payloads or unknown numbers get errors and haggling continues.
    let mut s = greet(&srv.socket);
    send_opt(&mut s, OPT_SET_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(read_opt_reply(&mut s).1, REP_ERR_INVALID, "SET_META_CONTEXT before STRUCTURED_REPLY");
    send_opt(&mut s, OPT_GO, &[0, 0]);
    assert_eq!(read_opt_reply(&mut s).1, REP_ERR_INVALID);
    send_opt(&mut s, 77, &[]);
    assert_eq!(read_opt_reply(&mut s).1, REP_ERR_UNSUP);
    send_opt(&mut s, OPT_LIST, &[1]);
    assert_eq!(read_opt_reply(&mut s).1, REP_ERR_INVALID);
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"nope");
    d.extend_from_slice(&0u16.to_be_bytes());
    send_opt(&mut s, OPT_INFO, &d);
    assert_eq!(read_opt_reply(&mut s).1, REP_ERR_UNKNOWN);
    send_opt(&mut s, OPT_ABORT, &[]);
    assert_eq!(read_opt_reply(&mut s).1, REP_ACK);
    assert!(closed(&mut s));
    assert_still_serving(&srv);
}

#[test]
fn structured_replies_and_block_status_by_hand() {
    let srv = TestServer::start(vec![("x", mem_export(pattern(SIZE), false))]);
    let mut s = greet(&srv.socket);
    send_opt(&mut s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(read_opt_reply(&mut s).1, REP_ACK);
    let mut d = 0u32.to_be_bytes().to_vec();
    d.extend_from_slice(&1u32.to_be_bytes());
    d.extend_from_slice(&15u32.to_be_bytes());
    d.extend_from_slice(b"base:allocation");
    send_opt(&mut s, OPT_SET_META_CONTEXT, &d);
    let (_, rep, p) = read_opt_reply(&mut s);
    assert_eq!(rep, REP_META_CONTEXT);
    assert_eq!(&p[4..], b"base:allocation");
    assert_eq!(read_opt_reply(&mut s).1, REP_ACK);
    send_opt(&mut s, OPT_GO, &[0, 0, 0, 0, 0, 0]);
    while read_opt_reply(&mut s).1 != REP_ACK {}
    // Block status over the zero quarter [SIZE/4, SIZE/2) and what follows it.
    s.write_all(&encode_request(0, 7, 5, (SIZE / 4) as u64, (SIZE / 2) as u32)).unwrap();
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), STRUCTURED_REPLY_MAGIC);
    assert_eq!(u16::from_be_bytes([h[6], h[7]]), REPLY_TYPE_BLOCK_STATUS);
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    let ext: Vec<(u32, u32)> = body[4..]
        .chunks(8)
        .map(|c| (u32::from_be_bytes(c[0..4].try_into().unwrap()), u32::from_be_bytes(c[4..8].try_into().unwrap())))
        .collect();
    assert_eq!(ext, vec![((SIZE / 4) as u32, STATE_HOLE | STATE_ZERO), ((SIZE / 4) as u32, 0)]);
    // An out-of-range read gets a structured error chunk.
    s.write_all(&encode_request(0, 0, 6, SIZE as u64, 1)).unwrap();
    s.read_exact(&mut h).unwrap();
    assert_eq!(u16::from_be_bytes([h[6], h[7]]), REPLY_TYPE_ERROR);
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    assert_eq!(u32::from_be_bytes(body[0..4].try_into().unwrap()), EINVAL);
}

/// A base whose second MiB fails its hash, like a corrupt store object.
struct Corrupt(Vec<u8>);
impl BlockSource for Corrupt {
    fn size(&self) -> u64 {
        self.0.len() as u64
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        if off < 2 * SIZE as u64 && off + buf.len() as u64 > SIZE as u64 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "object 1234abcd failed its hash check"));
        }
        buf.copy_from_slice(&self.0[off as usize..off as usize + buf.len()]);
        Ok(())
    }
    fn id(&self) -> String {
        "corrupt".into()
    }
}

#[test]
fn a_failing_base_read_is_eio_for_that_read_only() {
    let e = Arc::new(Export::new(Arc::new(Corrupt(pattern(4 * SIZE))), false, None));
    let srv = TestServer::start(vec![("c", e)]);
    let mut c = RawClient::connect(&srv.socket, "c");
    c.send(0, 0, 1, SIZE as u64 + 4096, 4096, &[]);
    assert_eq!(c.simple(4096).0, EIO);
    // A partial write into the bad range needs the base block: EIO too, nothing half-written.
    c.send(0, 1, 2, SIZE as u64 + 10, 10, &[1u8; 10]);
    assert_eq!(c.simple(0).0, EIO);
    c.send(0, 0, 3, 0, 4096, &[]);
    let (err, _, data) = c.simple(4096);
    assert_eq!(err, 0);
    assert_eq!(data, pattern(4 * SIZE)[..4096]);
}
