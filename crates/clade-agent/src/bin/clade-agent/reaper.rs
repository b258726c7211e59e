//! The one place that waits for children.
//!
//! As PID 1 the agent must reap every zombie (orphans are reparented to it), yet the process table and
//! the service runner need the exit status of their own children. So nothing calls `waitpid` except this
//! thread: it notices a zombie with `waitid(P_ALL, WNOWAIT)` (without reaping it), then takes the spawn
//! lock in write mode before reaping. `std::process::Command::spawn` holds the read side, so a spawn
//! whose exec failed reaps its own child (as std requires) before we can steal it.

use clade_agent::ExitStatus;
use nix::errno::Errno;
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::process::{Child, Command};
use std::sync::RwLock;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    wanted: HashSet<i32>,
    exited: HashMap<i32, ExitStatus>,
    children: u64,
}

/// Child reaper shared by the whole agent.
#[derive(Default)]
pub struct Reaper {
    state: Mutex<State>,
    cv: Condvar,
    spawn_lock: RwLock<()>,
}

impl Reaper {
    /// Spawns `cmd` and registers its pid so its exit status is kept for [`Reaper::wait`].
    pub fn spawn(&self, cmd: &mut Command) -> std::io::Result<Child> {
        let _g = self.spawn_lock.read().unwrap_or_else(|p| p.into_inner());
        let child = cmd.spawn()?;
        let mut st = self.state.lock();
        st.wanted.insert(child.id() as i32);
        st.children += 1;
        drop(st);
        self.cv.notify_all();
        Ok(child)
    }

    /// Waits for a registered child's exit; `None` after `timeout`.
    pub fn wait(&self, pid: u32, timeout: Option<Duration>) -> Option<ExitStatus> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.state.lock();
        loop {
            if let Some(s) = st.exited.remove(&(pid as i32)) {
                return Some(s);
            }
            match deadline {
                None => self.cv.wait(&mut st),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.cv.wait_for(&mut st, left);
                }
            }
        }
    }

    /// Forgets a child whose status nobody will collect (e.g. after a timeout and a kill).
    pub fn forget(&self, pid: u32) {
        let mut st = self.state.lock();
        if st.exited.remove(&(pid as i32)).is_none() {
            st.wanted.remove(&(pid as i32));
        }
    }

    /// The reaping loop; never returns.
    pub fn run(&self) -> ! {
        loop {
            match waitid(Id::All, WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
                Ok(ws) => {
                    let Some(pid) = ws.pid() else { continue };
                    let _w = self.spawn_lock.write().unwrap_or_else(|p| p.into_inner());
                    if let Ok(ws) = waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                        self.record(pid, ws);
                    }
                }
                Err(Errno::EINTR) => {}
                Err(_) => {
                    // No children at all (ECHILD): sleep until a spawn says there is one.
                    let mut st = self.state.lock();
                    let seen = st.children;
                    self.cv.wait_while_for(&mut st, |s| s.children == seen, Duration::from_millis(500));
                }
            }
        }
    }

    fn record(&self, pid: Pid, ws: WaitStatus) {
        let status = match ws {
            WaitStatus::Exited(_, code) => ExitStatus { code: Some(code), signal: None },
            WaitStatus::Signaled(_, sig, _) => ExitStatus { code: None, signal: Some(sig as i32) },
            _ => return,
        };
        let mut st = self.state.lock();
        if st.wanted.remove(&pid.as_raw()) {
            st.exited.insert(pid.as_raw(), status);
            drop(st);
            self.cv.notify_all();
        }
    }
}
