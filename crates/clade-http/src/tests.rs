//! The doors' rules, and the connection loop's deadline against real sockets on 127.0.0.1.

use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::doors::{check, host_ok, tcp_hosts, Refusal};
use crate::{serve, Limits};

#[test]
fn host_door() {
    let h = vec!["127.0.0.1:9".to_string(), "localhost:9".to_string()];
    assert!(host_ok(&h, Some("127.0.0.1:9")));
    assert!(host_ok(&h, Some("LOCALHOST:9")));
    assert!(host_ok(&h, Some("49983-sbx1.localhost:9")));
    assert!(!host_ok(&h, Some("evil.example:9")));
    assert!(!host_ok(&h, Some("localhost.evil.example:9")));
    assert!(!host_ok(&h, Some("x.localhost.evil.example:9")));
    assert!(!host_ok(&h, Some("x.localhost:10")));
    assert!(!host_ok(&h, None));
    let unix = vec!["localhost".to_string()];
    assert!(host_ok(&unix, None) && host_ok(&unix, Some("localhost")));
    let any = tcp_hosts("0.0.0.0:7".parse().unwrap());
    assert!(host_ok(&any, Some("127.0.0.1:7")) && host_ok(&any, Some("[::1]:7")));
}

#[test]
fn origin_door() {
    let hosts = vec!["localhost:9".to_string()];
    let mut h = HeaderMap::new();
    h.insert("host", "localhost:9".parse().unwrap());
    assert_eq!(check(&hosts, &h), Ok(()));
    h.insert("origin", "http://evil.example".parse().unwrap());
    assert_eq!(check(&hosts, &h), Err(Refusal::Origin));
}

async fn server(limits: Limits) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let r = axum::Router::new().route("/", axum::routing::get(|| async { "hi" }));
    tokio::spawn(serve(l, r, limits));
    addr
}

/// Reads until the server closes; how long that took (None: still open after `patience`).
async fn closed_within(s: &mut tokio::net::TcpStream, patience: Duration) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = vec![0u8; 4096];
    let r = tokio::time::timeout(patience, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // hyper may answer 408 before closing
            }
        }
    })
    .await;
    r.ok().map(|()| t.elapsed())
}

#[tokio::test]
async fn a_partial_request_head_is_closed_within_the_deadline() {
    let addr = server(Limits { header_read: Duration::from_secs(1) }).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").await.unwrap();
    let took = closed_within(&mut s, Duration::from_secs(10)).await;
    assert!(took.is_some(), "a connection sending half a request head was still open after 10 s");
}

#[tokio::test]
async fn a_silent_or_half_h2_connection_is_closed_too() {
    let addr = server(Limits { header_read: Duration::from_secs(1) }).await;
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert!(closed_within(&mut silent, Duration::from_secs(10)).await.is_some(), "silent connection kept");
    assert!(closed_within(&mut half, Duration::from_secs(10)).await.is_some(), "half a preface kept");
}

#[tokio::test]
async fn a_whole_request_is_answered_over_http1_and_a_slow_one_is_not_cut_early() {
    let addr = server(Limits { header_read: Duration::from_secs(3) }).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.write_all(b"Connection: close\r\n\r\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200") && out.ends_with("hi"), "{out}");
}
