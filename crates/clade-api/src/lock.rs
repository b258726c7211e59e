//! One `clade serve` per home. A second daemon on the same `$CLADE_HOME` would load the same E2B records and
//! idle settings and rewrite them under the first (each keeps its own copy in memory), and both would reap
//! the same sandboxes. So the daemon holds an exclusive `flock` on `$CLADE_HOME/serve.lock` (0600) for its
//! whole life, with its pid written in it; a second one is refused naming that pid. The kernel drops the
//! lock when the holder exits, however it exits, so a stale file never blocks a restart.

use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;

use anyhow::Context;
use clade_core::CladeHome;
use nix::fcntl::{Flock, FlockArg};

/// Held for as long as the daemon runs.
pub struct ServeLock {
    _file: Flock<std::fs::File>,
}

/// Take the home's serve lock, or say who holds it.
pub fn take(home: &CladeHome) -> anyhow::Result<ServeLock> {
    clade_core::home::private_dir(home.root())?;
    let path = home.serve_lock();
    // No truncate at open: the holder's pid must survive a refused attempt.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut f) => {
            f.set_len(0)?;
            f.rewind()?;
            write!(f, "{}", std::process::id())?;
            f.sync_all()?;
            Ok(ServeLock { _file: f })
        }
        Err((mut f, nix::errno::Errno::EWOULDBLOCK)) => {
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            let pid = pid.trim();
            let who = if pid.is_empty() { "another process".to_string() } else { format!("pid {pid}") };
            Err(anyhow::anyhow!(clade_core::OpError::new(
                clade_core::ErrorKind::Conflict,
                format!(
                    "another `clade serve` ({who}) already answers for {} (it holds {}): stop it first{}, or \
                     give this daemon its own CLADE_HOME",
                    home.root().display(),
                    path.display(),
                    if pid.is_empty() { String::new() } else { format!(" (kill {pid})") }
                ),
            )))
        }
        Err((_, e)) => Err(anyhow::anyhow!("lock {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_serve_on_one_home_is_refused_naming_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let home = CladeHome::at(dir.path());
        let first = take(&home).unwrap();
        let e = take(&home).err().expect("a second lock on the same home must fail");
        let msg = format!("{e:#}");
        assert!(msg.contains(&format!("pid {}", std::process::id())), "{msg}");
        assert_eq!(clade_host::error::kind(&e), clade_core::ErrorKind::Conflict);
        // The refused attempt left the holder's pid in place.
        assert_eq!(std::fs::read_to_string(home.serve_lock()).unwrap(), std::process::id().to_string());
        drop(first);
        let _again = take(&home).expect("the lock is free once its holder is gone");
    }
}
