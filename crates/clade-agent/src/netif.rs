//! Bringing the loopback interface up, shared by the agent (init of a vm guest) and the ct backend (which does
//! it in the sandbox's init before the jail takes CAP_NET_ADMIN away; the agent then finds it up).

use std::os::fd::AsRawFd;

const SIOCGIFFLAGS: u64 = 0x8913;
const SIOCSIFFLAGS: u64 = 0x8914;

#[repr(C)]
struct IfreqFlags {
    name: [u8; 16],
    flags: libc::c_short,
    pad: [u8; 22],
}

/// Brings `lo` up (SIOCSIFFLAGS on a datagram socket) unless it is up already, which needs no privilege.
pub fn loopback_up() -> std::io::Result<()> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").or_else(|_| std::net::UdpSocket::bind("[::]:0"))?;
    let mut ifr = IfreqFlags { name: [0; 16], flags: 0, pad: [0; 22] };
    ifr.name[..2].copy_from_slice(b"lo");
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of a `struct ifreq`-sized buffer we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), SIOCGIFFLAGS as _, &mut ifr) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let up = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    if ifr.flags & (libc::IFF_UP as libc::c_short) != 0 {
        return Ok(());
    }
    ifr.flags |= up;
    // SAFETY: as above; SIOCSIFFLAGS only reads the buffer.
    if unsafe { libc::ioctl(sock.as_raw_fd(), SIOCSIFFLAGS as _, &ifr) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
