//! Destroys established TCP connections left stale by a restore: the kernel's SOCK_DESTROY over
//! sock_diag netlink (what `ss -K` does; needs CONFIG_INET_DIAG_DESTROY and CAP_NET_ADMIN), in this
//! process. Spawning `ss` from a just-restored guest was measured at 1.0-2.3 s; this is one netlink
//! socket and a few messages.

use clade_agent::{AgentError, Reply, Response};
use nix::sys::socket::{recv, send, socket, AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const TCP_ESTABLISHED: u32 = 1;
const SOCKID_LEN: usize = 48;

fn os(ctx: &str, e: nix::errno::Errno) -> AgentError {
    AgentError::os(ctx, &e.into())
}

fn request(kind: u16, flags: u16, seq: u32, family: u8, sockid: &[u8; SOCKID_LEN]) -> Vec<u8> {
    let mut m = Vec::with_capacity(16 + 8 + SOCKID_LEN);
    m.extend_from_slice(&((16 + 8 + SOCKID_LEN) as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    // struct inet_diag_req_v2: family, protocol, ext, pad, states, then the socket id
    m.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    m.extend_from_slice(&(1u32 << TCP_ESTABLISHED).to_ne_bytes());
    m.extend_from_slice(sockid);
    m
}

fn remote_addr(family: u8, id: &[u8; SOCKID_LEN]) -> IpAddr {
    let dst = &id[20..36];
    if family == libc::AF_INET as u8 {
        IpAddr::from([dst[0], dst[1], dst[2], dst[3]])
    } else {
        let mut a = [0u8; 16];
        a.copy_from_slice(dst);
        let v6 = std::net::Ipv6Addr::from(a);
        v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6))
    }
}

/// Established sockets of one family, as (socket id) for those matching the filter.
fn dump(fd: &OwnedFd, family: u8, keep: impl Fn(IpAddr, u16) -> bool) -> Result<Vec<[u8; SOCKID_LEN]>, AgentError> {
    send(
        fd.as_raw_fd(),
        &request(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, family, &[0; SOCKID_LEN]),
        MsgFlags::empty(),
    )
    .map_err(|e| os("sock_diag dump request", e))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|e| os("sock_diag dump", e))?;
        if n == 0 {
            return Ok(out);
        }
        let mut off = 0;
        while off + 16 <= n {
            let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
            let kind = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
            if len < 16 || off + len > n {
                return Err(AgentError::Failed { detail: "sock_diag answered a truncated message".into() });
            }
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let errno = i32::from_ne_bytes([buf[off + 16], buf[off + 17], buf[off + 18], buf[off + 19]]);
                    return Err(os("sock_diag dump", nix::errno::Errno::from_raw(-errno)));
                }
                _ if len >= 16 + 4 + SOCKID_LEN => {
                    let mut id = [0u8; SOCKID_LEN];
                    id.copy_from_slice(&buf[off + 20..off + 20 + SOCKID_LEN]);
                    let sport = u16::from_be_bytes([id[0], id[1]]);
                    if keep(remote_addr(family, &id), sport) {
                        out.push(id);
                    }
                }
                _ => {}
            }
            off += (len + 3) & !3;
        }
    }
}

pub fn reset(peer: Option<&str>, keep_local_ports: &[u16]) -> Response {
    let peer: Option<IpAddr> = match peer {
        None => None,
        Some(p) => {
            Some(p.parse().map_err(|_| AgentError::BadRequest { detail: format!("{p:?} is not an IP address") })?)
        }
    };
    let matches = |remote: IpAddr, sport: u16| {
        if keep_local_ports.contains(&sport) {
            return false;
        }
        match peer {
            Some(p) => remote == p,
            None => !remote.is_loopback(),
        }
    };
    let fd = socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::NetlinkSockDiag)
        .map_err(|e| os("opening a sock_diag netlink socket", e))?;
    let mut destroyed = 0;
    let mut seq = 2;
    let mut buf = vec![0u8; 8192];
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        for id in dump(&fd, family, matches)? {
            seq += 1;
            send(
                fd.as_raw_fd(),
                &request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, seq, family, &id),
                MsgFlags::empty(),
            )
            .map_err(|e| os("SOCK_DESTROY", e))?;
            let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|e| os("SOCK_DESTROY ack", e))?;
            if n < 20 {
                continue;
            }
            let errno = -i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            match errno {
                0 => destroyed += 1,
                libc::ENOENT => {} // it closed meanwhile
                libc::EOPNOTSUPP => {
                    return Err(AgentError::Failed {
                        detail: "SOCK_DESTROY unsupported: the sandbox kernel needs CONFIG_INET_DIAG_DESTROY".into(),
                    })
                }
                e => return Err(os("SOCK_DESTROY (needs CAP_NET_ADMIN)", nix::errno::Errno::from_raw(e))),
            }
        }
    }
    Ok(Reply::NetReset { destroyed })
}
