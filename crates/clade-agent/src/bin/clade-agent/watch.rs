//! Directory watches over inotify (E2B's envd `WatchDir`; docs/agent.md, "Watches"). Each watch owns an inotify
//! descriptor with one watch per directory (every subdirectory for a recursive one, those made later included);
//! its events wait in the kernel's queue until `watch_events` takes them, so an event is there as soon as the
//! change is made, whoever made it.
//!
//! The agent's own atomic writes (a temp file renamed over the target, `fsops::tmp_path`) are reported as the
//! target's: the temp file's create (unless it replaces an existing target), writes and attribute changes under
//! the target's name, the rename itself not at all. Repeats of one event in a row are one event.
//!
//! An inotify descriptor cannot be checkpointed by CRIU on an overlay: before a mark of a ct sandbox
//! (`pre_mark` with a shared kernel) every watch closes its descriptor and keeps its settings; the host's next
//! connection (it reconnects after every mark and restore) arms it again, and its next `watch_events` says
//! events may be `lost` in between (those of the moments between the hooks and the freeze).

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use clade_agent::{AgentError, Reply, WatchEvent, WatchKind};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use parking_lot::Mutex;

/// Directories a recursive watch follows at most (a runaway tree must not exhaust the user's inotify watches).
const MAX_DIRS: usize = 8192;
/// Events a watch keeps between takes before it drops the oldest and says events were lost.
const MAX_QUEUED: usize = 65_536;

#[derive(Default)]
pub struct Watches {
    next: AtomicU64,
    map: Mutex<HashMap<u64, Arc<Mutex<Watch>>>>,
}

struct Watch {
    root: PathBuf,
    recursive: bool,
    /// `None` while disarmed (after a ct mark's `pre_mark`).
    ino: Option<Inotify>,
    /// Watch descriptor -> directory relative to `root` ("" for the root).
    dirs: HashMap<WatchDescriptor, PathBuf>,
    /// Rename cookies of the agent's temp files (their `IN_MOVED_TO` half is dropped too).
    tmp_cookies: Vec<u32>,
    queued: Vec<WatchEvent>,
    lost: bool,
}

fn flags() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ONLYDIR
}

fn os_err(what: &str, path: &Path, e: nix::errno::Errno) -> AgentError {
    AgentError::os(format!("{what} {}", path.display()), &std::io::Error::from(e))
}

impl Watch {
    /// A fresh inotify descriptor watching the root (and, recursive, every directory below it).
    fn arm(&mut self) -> Result<(), AgentError> {
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| os_err("inotify_init for", &self.root, e))?;
        self.dirs.clear();
        self.ino = Some(ino);
        self.add_tree(PathBuf::new(), false)
    }

    /// Watch `rel` (relative to the root) and, recursive, the directories below it. `found`: `rel` is a
    /// directory that just appeared, and what was made in it before its watch was added is reported as made
    /// now (a create, and a write for a file holding bytes), as a watch of it would have seen.
    fn add_tree(&mut self, rel: PathBuf, found: bool) -> Result<(), AgentError> {
        let mut stack = vec![rel];
        while let Some(rel) = stack.pop() {
            if self.dirs.len() >= MAX_DIRS {
                self.lost = true;
                return Ok(());
            }
            let abs = self.root.join(&rel);
            let Some(ino) = &self.ino else { return Ok(()) };
            match ino.add_watch(&abs, flags()) {
                Ok(wd) => {
                    self.dirs.insert(wd, rel.clone());
                }
                // A directory gone (or replaced by a file) since it was seen: nothing to watch there.
                Err(nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR) if !rel.as_os_str().is_empty() => continue,
                Err(e) => return Err(os_err("watch", &abs, e)),
            }
            if self.recursive {
                let Ok(rd) = std::fs::read_dir(&abs) else { continue };
                for e in rd.flatten() {
                    let (child, ft) = (rel.join(e.file_name()), e.file_type());
                    if found {
                        let name = child.to_string_lossy().into_owned();
                        self.push(WatchEvent { name: name.clone(), kind: WatchKind::Create });
                        if e.metadata().is_ok_and(|m| m.is_file() && m.len() > 0) {
                            self.push(WatchEvent { name, kind: WatchKind::Write });
                        }
                    }
                    if ft.is_ok_and(|t| t.is_dir()) {
                        stack.push(child);
                    }
                }
            }
        }
        Ok(())
    }

    /// Read what the kernel queued, translated and appended to `queued`.
    fn drain(&mut self) -> Result<(), AgentError> {
        loop {
            let Some(ino) = &self.ino else { return Ok(()) };
            let events = match ino.read_events() {
                Ok(ev) => ev,
                Err(nix::errno::Errno::EAGAIN) => return Ok(()),
                Err(e) => return Err(os_err("read the watch of", &self.root, e)),
            };
            if events.is_empty() {
                return Ok(());
            }
            for ev in events {
                self.take(ev)?;
            }
        }
    }

    fn take(&mut self, ev: InotifyEvent) -> Result<(), AgentError> {
        let m = ev.mask;
        if m.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            self.lost = true;
            return Ok(());
        }
        if m.contains(AddWatchFlags::IN_IGNORED) {
            self.dirs.remove(&ev.wd);
            return Ok(());
        }
        let (Some(dir), Some(name)) = (self.dirs.get(&ev.wd).cloned(), ev.name) else { return Ok(()) };
        let rel = dir.join(&name);
        let new_dir = m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO);
        if self.recursive && m.contains(AddWatchFlags::IN_ISDIR) && new_dir {
            // The directory's own event first, then what is already in it.
            let kind = if m.contains(AddWatchFlags::IN_CREATE) { WatchKind::Create } else { WatchKind::Rename };
            self.push(WatchEvent { name: rel.to_string_lossy().into_owned(), kind });
            return self.add_tree(rel, true);
        }
        let name = name.to_string_lossy().into_owned();
        let (shown, tmp) = match agent_tmp(&name) {
            Some((target, replaces)) => (dir.join(target), Some(replaces)),
            None => (rel, None),
        };
        let kind = if m.contains(AddWatchFlags::IN_CREATE) {
            if tmp == Some(true) {
                return Ok(()); // the target was there: its replacement is a write, not a create
            }
            WatchKind::Create
        } else if m.contains(AddWatchFlags::IN_MODIFY) {
            WatchKind::Write
        } else if m.contains(AddWatchFlags::IN_ATTRIB) {
            WatchKind::Chmod
        } else if m.contains(AddWatchFlags::IN_DELETE) {
            if tmp.is_some() {
                return Ok(()); // a write that failed took its temp file away
            }
            WatchKind::Remove
        } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
            if tmp.is_some() {
                self.tmp_cookies.push(ev.cookie);
                return Ok(());
            }
            WatchKind::Rename
        } else if m.contains(AddWatchFlags::IN_MOVED_TO) {
            if let Some(i) = self.tmp_cookies.iter().position(|c| *c == ev.cookie) {
                self.tmp_cookies.swap_remove(i);
                return Ok(());
            }
            WatchKind::Rename
        } else {
            return Ok(());
        };
        self.push(WatchEvent { name: shown.to_string_lossy().into_owned(), kind });
        Ok(())
    }

    /// Queue `event` unless it repeats the last one.
    fn push(&mut self, event: WatchEvent) {
        if self.queued.last() == Some(&event) {
            return;
        }
        if self.queued.len() >= MAX_QUEUED {
            self.queued.remove(0);
            self.lost = true;
        }
        self.queued.push(event);
    }
}

/// `(target, replaces)` when `name` is one of the agent's own temp files (`fsops::tmp_path`).
fn agent_tmp(name: &str) -> Option<(String, bool)> {
    let rest = name.strip_prefix('.')?;
    for (tag, replaces) in [(".clade-tmpr.", true), (".clade-tmp.", false)] {
        if let Some(i) = rest.rfind(tag) {
            let tail = &rest[i + tag.len()..];
            let numeric = tail.split('.').count() == 2 && tail.split('.').all(|p| p.parse::<u64>().is_ok());
            if numeric && i > 0 {
                return Some((rest[..i].to_string(), replaces));
            }
        }
    }
    None
}

impl Watches {
    pub fn start(&self, path: &str, recursive: bool) -> Result<Reply, AgentError> {
        let root = crate::fsops::check_path(path)?;
        if !root.exists() {
            return Err(AgentError::NotFound { path: path.into() });
        }
        if !root.is_dir() {
            return Err(AgentError::BadPath { path: path.into(), reason: "not a directory: watch a directory".into() });
        }
        let mut w = Watch {
            root,
            recursive,
            ino: None,
            dirs: HashMap::new(),
            tmp_cookies: Vec::new(),
            queued: Vec::new(),
            lost: false,
        };
        w.arm()?;
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.map.lock().insert(id, Arc::new(Mutex::new(w)));
        Ok(Reply::Watch { watch: id })
    }

    /// The watch's events so far, waiting up to `wait_ms` for one when none are queued.
    pub fn events(&self, id: u64, wait_ms: u64) -> Result<Reply, AgentError> {
        let w = self.map.lock().get(&id).cloned().ok_or_else(|| no_watch(id))?;
        let mut w = w.lock();
        if w.ino.is_none() {
            w.arm()?;
            w.lost = true;
        }
        w.drain()?;
        if w.queued.is_empty() && wait_ms > 0 {
            if let Some(ino) = &w.ino {
                let mut fds = [nix::poll::PollFd::new(ino.as_fd(), nix::poll::PollFlags::POLLIN)];
                let ms = u16::try_from(wait_ms.min(60_000)).unwrap_or(u16::MAX);
                let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms));
            }
            w.drain()?;
        }
        let events = std::mem::take(&mut w.queued);
        let lost = std::mem::replace(&mut w.lost, false);
        Ok(Reply::WatchEvents { events, lost })
    }

    pub fn stop(&self, id: u64) -> Result<Reply, AgentError> {
        self.map.lock().remove(&id).ok_or_else(|| no_watch(id))?;
        Ok(Reply::Done)
    }

    /// Arm again every watch a mark disarmed: a host connects anew after every mark and restore, before
    /// anything else happens in the sandbox (it stood frozen or had not run).
    pub fn rearm_all(&self) {
        for w in self.map.lock().values() {
            let mut w = w.lock();
            if w.ino.is_none() {
                if let Err(e) = w.arm() {
                    crate::log(&format!("arming a watch of {} again: {e}", w.root.display()));
                }
                w.lost = true;
            }
        }
    }

    /// Close every watch's descriptor, keeping its settings (before a ct mark: CRIU cannot dump it).
    pub fn disarm_all(&self) {
        for w in self.map.lock().values() {
            let mut w = w.lock();
            // What was queued is kept; what the kernel held is read first.
            let _ = w.drain();
            w.ino = None;
            w.dirs.clear();
        }
    }
}

fn no_watch(id: u64) -> AgentError {
    AgentError::NoSuchWatch { watch: id }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_temp_names_map_to_their_targets() {
        assert_eq!(agent_tmp(".a.txt.clade-tmp.12.3"), Some(("a.txt".into(), false)));
        assert_eq!(agent_tmp(".a.txt.clade-tmpr.12.3"), Some(("a.txt".into(), true)));
        assert_eq!(agent_tmp("a.txt.clade-tmp.12.3"), None);
        assert_eq!(agent_tmp(".a.txt.clade-tmp.x.3"), None);
        assert_eq!(agent_tmp(".a.txt"), None);
    }

    #[test]
    fn a_write_through_a_temp_file_reads_as_the_targets_own() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        let ws = Watches::default();
        let Reply::Watch { watch } = ws.start(d.path().to_str().unwrap(), true).unwrap() else { panic!() };
        // A new file written as the agent writes one: temp, data, mode, rename.
        let target = d.path().join("sub/f.txt");
        let tmp = crate::fsops::tmp_path(&target);
        std::fs::write(&tmp, b"one").unwrap();
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        std::fs::rename(&tmp, &target).unwrap();
        let Reply::WatchEvents { events, lost } = ws.events(watch, 0).unwrap() else { panic!() };
        let got: Vec<_> = events.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        let want = [("sub/f.txt", WatchKind::Create), ("sub/f.txt", WatchKind::Write), ("sub/f.txt", WatchKind::Chmod)];
        assert_eq!(got, want, "lost: {lost}");
        // Replacing it: a write, no create; a plain removal is a removal.
        let tmp = crate::fsops::tmp_path(&target);
        std::fs::write(&tmp, b"two").unwrap();
        std::fs::rename(&tmp, &target).unwrap();
        std::fs::remove_file(&target).unwrap();
        let Reply::WatchEvents { events, .. } = ws.events(watch, 0).unwrap() else { panic!() };
        let got: Vec<_> = events.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        assert_eq!(got, [("sub/f.txt", WatchKind::Write), ("sub/f.txt", WatchKind::Remove)]);
        // A directory made with a file in it before the watch could follow it: both reported.
        std::fs::create_dir(d.path().join("new")).unwrap();
        std::fs::write(d.path().join("new/g"), b"x").unwrap();
        let Reply::WatchEvents { events, .. } = ws.events(watch, 0).unwrap() else { panic!() };
        let got: Vec<_> = events.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        assert_eq!(got[..3], [("new", WatchKind::Create), ("new/g", WatchKind::Create), ("new/g", WatchKind::Write)]);
        // Disarmed (a ct mark) and taken again: armed anew, and it says events may be lost.
        ws.disarm_all();
        std::fs::write(d.path().join("g"), b"x").unwrap();
        let Reply::WatchEvents { lost, .. } = ws.events(watch, 0).unwrap() else { panic!() };
        assert!(lost);
        std::fs::write(d.path().join("h"), b"x").unwrap();
        let Reply::WatchEvents { events, lost } = ws.events(watch, 100).unwrap() else { panic!() };
        assert!(!lost && events.iter().any(|e| e.name == "h" && e.kind == WatchKind::Create), "{events:?}");
        ws.stop(watch).unwrap();
        assert!(ws.events(watch, 0).is_err());
    }
}
