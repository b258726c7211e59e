//! The warm pool: supervisors that have already restored a mark, applied hygiene (each member names itself, so
//! its hostname, machine-id and entropy are its own) and paused the sandbox. A fork claims members instead of
//! starting processes, so it pays only `cont`, a clock step (the guest's clock stood still while paused) and
//! the ledger records. The guest ran only for its hygiene between the mark and the claim. Members wait in `$CLADE_HOME/run/pool/<mark>/<sandbox>.sock`; a claim renames the socket
//! (atomic: two forks never get the same member), creates the sandbox's ledger record and says `claim`; the
//! member answers with its `Ready` and becomes the sandbox's ordinary supervisor. The pool's size is kept in
//! `size` there and refilled in the background after every claim.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use clade_core::backend::Backend;
use clade_core::engine::Engine;
use clade_core::CladeHome;
use clade_ledger::{Mark, SandboxId};

use super::protocol::Ready;

pub fn pool_dir(home: &CladeHome, mark: &str) -> PathBuf {
    home.run_dir().join("pool").join(mark)
}

/// The configured size of a mark's pool (0: none).
pub fn size(home: &CladeHome, mark: &str) -> usize {
    std::fs::read_to_string(pool_dir(home, mark).join("size")).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

pub fn set_size(home: &CladeHome, mark: &str, n: usize) -> anyhow::Result<()> {
    let dir = pool_dir(home, mark);
    std::fs::create_dir_all(&dir)?;
    let tmp = dir.join("size.tmp");
    std::fs::write(&tmp, n.to_string())?;
    std::fs::rename(tmp, dir.join("size"))?;
    Ok(())
}

/// Members waiting (their sockets), and members still preparing (their pid files).
pub fn members(home: &CladeHome, mark: &str) -> (Vec<PathBuf>, usize) {
    let mut ready = Vec::new();
    let mut starting = 0;
    if let Ok(rd) = std::fs::read_dir(pool_dir(home, mark)) {
        for e in rd.flatten() {
            let p = e.path();
            match p.extension().and_then(|x| x.to_str()) {
                Some("sock") => ready.push(p),
                Some("starting") => {
                    let alive = std::fs::read_to_string(&p)
                        .ok()
                        .and_then(|s| s.trim().parse::<u32>().ok())
                        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
                    if alive {
                        starting += 1;
                    } else {
                        let _ = std::fs::remove_file(&p);
                    }
                }
                _ => {}
            }
        }
    }
    (ready, starting)
}

/// Start one member, detached.
pub fn spawn_member(home: &CladeHome, mark: &str) -> anyhow::Result<()> {
    let dir = pool_dir(home, mark);
    std::fs::create_dir_all(&dir)?;
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("pool.log"))?;
    let pid = super::spawner::spawn(home, &["--pool", "--mark", mark, "--sandbox", "-"], log)?;
    std::fs::write(dir.join(format!("{pid}.starting")), pid.to_string())?;
    Ok(())
}

/// Start members until `size` are waiting or preparing.
pub fn refill(home: &CladeHome, mark: &str) -> anyhow::Result<usize> {
    let want = size(home, mark);
    let (ready, starting) = members(home, mark);
    let have = ready.len() + starting;
    for _ in have..want {
        spawn_member(home, mark)?;
    }
    Ok(want.saturating_sub(have))
}

/// Take one waiting, live member, if any: its sandbox id and a connection to it. A member whose process is gone
/// (a host restart leaves its socket file behind) refuses the connection: its socket is removed, what it left on
/// the host taken down, and the next member tried, so a dead pool costs a fork nothing but a cold start.
pub fn take(home: &CladeHome, mark: &str) -> Option<(SandboxId, UnixStream)> {
    let (ready, _) = members(home, mark);
    for sock in ready {
        let Some(id) = sock.file_stem().and_then(|s| s.to_str()).map(str::to_string) else { continue };
        let claimed = sock.with_extension("claimed");
        if std::fs::rename(&sock, &claimed).is_err() {
            continue; // another fork took it
        }
        let conn = super::connect_unix(&claimed);
        let _ = std::fs::remove_file(&claimed);
        match conn {
            Ok(s) => return Some((SandboxId::new(id), s)),
            Err(e) => {
                // Nothing listens on its socket, so no process serves it: what it left (its cgroups, run dir, a
                // vm's RAM file) is taken down now rather than waiting for `clade audit --fix`.
                let left = crate::audit::take_down(home, &id).len();
                eprintln!(
                    "clade: pool member {id} of {mark} is gone ({e}); dropped it and took down {left} leftover(s)"
                )
            }
        }
    }
    None
}

/// Claim a taken member whose sandbox is recorded already: tell it to run, wait for its `Ready`.
pub fn claim(id: &SandboxId, mut s: UnixStream) -> anyhow::Result<Ready> {
    s.set_read_timeout(Some(CLAIM_TIMEOUT))?;
    s.write_all(b"{\"op\":\"claim\"}\n")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| anyhow!("pool member {id} answered badly ({e}): {line}"))
}

/// Ask every waiting member of a mark's pool to end, and forget the pool's size.
pub fn drain(home: &CladeHome, mark: &str) -> usize {
    let _ = std::fs::remove_file(pool_dir(home, mark).join("size"));
    let mut n = 0;
    while let Some((_, mut s)) = take(home, mark) {
        let _ = s.write_all(b"{\"op\":\"drain\"}\n");
        n += 1;
    }
    n
}

/// The member's side: prepare, wait for a claim, then run as the sandbox's supervisor.
pub fn run_member(engine: Engine, backend: Arc<dyn Backend>, mark: Mark) -> anyhow::Result<()> {
    let home = engine.home.clone();
    let dir = pool_dir(&home, mark.id.as_str());
    let starting = dir.join(format!("{}.starting", std::process::id()));
    let _cleanup = RemoveOnDrop(starting.clone());
    let stop = super::server::stop_flag()?;
    if size(&home, mark.id.as_str()) == 0 {
        return Ok(()); // drained before this member started
    }
    let id = SandboxId::generate();
    let prepared = engine.prepare(backend.as_ref(), &id, &mark, 1)?.ok_or_else(|| {
        anyhow!(
            "no warm pool of {}: a disk-only mark boots cold, and a backend whose restores are not split has none",
            mark.id
        )
    })?;
    // Restore, apply hygiene and pause now, so a claim only continues the guest and steps its clock.
    let warm = engine.warm(prepared, crate::base::base_readiness(&engine, &mark))?;
    let tmp = dir.join(format!("{id}.bind"));
    let listener = super::bind_unix(&tmp)?;
    let published = dir.join(format!("{id}.sock"));
    std::fs::rename(&tmp, &published)?;
    drop(_cleanup);
    // A drain that ran while this member prepared saw no socket to end. `drain` forgets the size first and
    // then takes the sockets; a member publishes first and then reads the size: so either the drain takes
    // this socket, or this member sees the size gone and withdraws (unless a fork or the drain took it in
    // between: then the accept below serves that claim or drain).
    if size(&home, mark.id.as_str()) == 0 && std::fs::remove_file(&published).is_ok() {
        return Ok(());
    }
    // Wait for one claim (or a drain, or a signal).
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let stream = loop {
        if stop.load(Ordering::Relaxed) {
            let _ = std::fs::remove_file(&published);
            return Ok(());
        }
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        if !matches!(poll(&mut fds, PollTimeout::from(500u16)), Ok(n) if n > 0) {
            continue;
        }
        if let Ok((s, _)) = listener.accept() {
            break s;
        }
    };
    let mut line = String::new();
    BufReader::new(stream.try_clone()?).read_line(&mut line)?;
    if !line.contains("\"claim\"") {
        return Ok(()); // drained
    }
    let mut out = stream;
    let restored = match engine.claim_warm(warm, &id, &mark) {
        Ok(r) => r,
        Err(e) => {
            let _ = engine.ledger().set_sandbox_state(&id, clade_ledger::SandboxState::Failed, Some(&e.to_string()));
            let r = Ready {
                ok: false,
                sandbox: id.to_string(),
                error: Some(e.to_string()),
                pid: std::process::id(),
                ..Ready::default()
            };
            let _ = writeln!(out, "{}", serde_json::to_string(&r)?);
            return Err(e.into());
        }
    };
    let ready = super::server::ready_of(&id, &restored);
    // The control socket must exist before the claimer hears `ready`.
    let sup = super::sup_dir(&home, id.as_str());
    std::fs::create_dir_all(&sup)?;
    let reply = serde_json::to_string(&ready)?;
    let notify = move || {
        let _ = writeln!(out, "{reply}");
    };
    super::server::serve_restored_then(engine, backend, id, restored, 1, &stop, notify)
}

struct RemoveOnDrop(PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// How long a fork waits for a claimed member.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_drops_dead_members_and_hands_out_live_ones() {
        // A home as long as a test's temp home, and ids as long as real ones: the member sockets' paths are
        // past what `sun_path` holds.
        let tmp = tempfile::Builder::new().prefix("clade-pool-unit").tempdir_in("/var/tmp").unwrap();
        let home = CladeHome::at(tmp.path());
        let mark = format!("mk-{}", "a".repeat(32));
        let (dead, alive) = (format!("sb-{}", "d".repeat(32)), format!("sb-{}", "e".repeat(32)));
        let dir = pool_dir(&home, &mark);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(dir.join(format!("{dead}.sock")).as_os_str().len() > 107, "{}", dir.display());
        // A member whose process died: its socket file stays, nobody listens.
        drop(super::super::bind_unix(&dir.join(format!("{dead}.sock"))).unwrap());
        assert!(take(&home, &mark).is_none(), "a dead member was handed out");
        assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "the dead member's socket was left");
        // A live one is taken once, and its socket leaves the pool.
        let live = super::super::bind_unix(&dir.join(format!("{alive}.sock"))).unwrap();
        let (id, _conn) = take(&home, &mark).expect("the live member");
        assert_eq!(id.as_str(), alive);
        assert!(live.accept().is_ok());
        assert!(take(&home, &mark).is_none());
    }
}
