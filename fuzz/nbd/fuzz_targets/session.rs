//! A whole server connection fed arbitrary client bytes: handshake, then transmission. The first
//! input byte picks whether the fuzzer drives the handshake itself or starts after a valid one
//! (structured replies + base:allocation, or plain), so both phases get explored. The server must
//! never panic and must always finish once the input ends.
#![no_main]

use std::sync::{Arc, OnceLock};

use clade_nbd::proto::*;
use clade_nbd::{Export, MemSnapshotter, MemSource, Server};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
}

fn opt(out: &mut Vec<u8>, o: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&o.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fn prefix(mode: u8) -> Vec<u8> {
    let mut p = Vec::new();
    if mode % 3 == 0 {
        return p;
    }
    p.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    if mode % 3 == 2 {
        opt(&mut p, OPT_STRUCTURED_REPLY, &[]);
        let mut m = 0u32.to_be_bytes().to_vec();
        m.extend_from_slice(&1u32.to_be_bytes());
        m.extend_from_slice(&15u32.to_be_bytes());
        m.extend_from_slice(b"base:allocation");
        opt(&mut p, OPT_SET_META_CONTEXT, &m);
    }
    opt(&mut p, OPT_GO, &[0, 0, 0, 0, 0, 0]);
    p
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut input = prefix(mode);
    input.extend_from_slice(rest);
    rt().block_on(async move {
        let mut img = vec![0u8; 64 << 10];
        img[..4096].fill(0x5a);
        let export = Arc::new(Export::new(Arc::new(MemSource::new("f", img)), mode & 0x80 != 0, Some(Arc::new(MemSnapshotter::default()))));
        let server = Server::new();
        server.add_export("f", export);
        let (client, srv) = tokio::io::duplex(1 << 16);
        let task = tokio::spawn(server.handle(srv));
        let (mut cr, mut cw) = tokio::io::split(client);
        let drain = tokio::spawn(async move {
            let mut sink = vec![0u8; 1 << 16];
            while let Ok(n) = cr.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        });
        let _ = cw.write_all(&input).await;
        let _ = cw.shutdown().await;
        drop(cw);
        tokio::time::timeout(std::time::Duration::from_secs(5), task).await.expect("server hung").unwrap();
        let _ = drain.await;
    });
});
