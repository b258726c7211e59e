//! Paths inside a sandbox, resolved the way the sandbox itself would see them, never the host's way.
//!
//! The host reaches a sandbox's files through `/proc/<init>/root`, but a path walked from there follows the
//! sandbox's symlinks with the *host's* root: a sandbox that replaces `/run/clade/agent.sock` with a link to
//! `/run/some-host.sock` would have the supervisor connect to that host socket. Everything here opens with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` under the sandbox's root directory, so `..` and absolute
//! links stay inside it and `/proc/self/...` links are refused; a unix socket is then reached through its
//! `O_PATH` descriptor (`/proc/self/fd/N`), which names the very inode that was resolved.

use std::os::fd::{AsRawFd, OwnedFd};

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// Open `path` (absolute, as the sandbox sees it) inside the root of the sandbox whose init is `pid`.
pub fn open(pid: u32, path: &str, flags: OFlags) -> std::io::Result<OwnedFd> {
    let root = rustix::fs::open(
        format!("/proc/{pid}/root"),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let rel = path.trim_start_matches('/');
    let fd = rustix::fs::openat2(
        &root,
        rel,
        flags | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )?;
    Ok(fd)
}

/// Connect to the unix socket at `path` inside the sandbox; refuses anything that is not a socket there.
pub fn connect_unix(pid: u32, path: &str) -> std::io::Result<std::os::unix::net::UnixStream> {
    let fd = open(pid, path, OFlags::PATH)?;
    let st = rustix::fs::fstat(&fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{path} in sandbox {pid} is not a socket"),
        ));
    }
    std::os::unix::net::UnixStream::connect(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Read a (small) file inside the sandbox, as the sandbox sees it.
pub fn read_to_string(pid: u32, path: &str) -> std::io::Result<String> {
    let fd = open(pid, path, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK)?;
    let st = rustix::fs::fstat(&fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{path} is not a regular file")));
    }
    std::io::read_to_string(std::fs::File::from(fd))
}
