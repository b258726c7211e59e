//! The sibling audit: two sandboxes must have distinct PID/mount/net/IPC/UTS namespaces,
//! disjoint PIDs, and share no pipe, socket or eventfd, no regular file either has open for writing (or maps
//! shared-writable), and no lock. Character devices both have open are reported separately: every sandbox
//! binds the host's /dev/null, /dev/urandom and friends, so they are judged against a cold-pair control (the
//! control rule: tolerated only if the control pair shares the same devices and nothing else is shared).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use serde::Serialize;

const NAMESPACES: [&str; 5] = ["pid", "mnt", "net", "ipc", "uts"];

/// The audit of one pair.
#[derive(Debug, Clone, Serialize, Default)]
pub struct AuditReport {
    pub processes: (usize, usize),
    pub shared_namespaces: Vec<String>,
    pub shared_pids: Vec<u32>,
    pub shared_pipes: Vec<String>,
    pub shared_sockets: Vec<String>,
    pub shared_eventfds: Vec<String>,
    pub shared_writable_files: Vec<String>,
    pub shared_locks: Vec<String>,
    /// `chr:MAJ:MIN:path` of character devices open in both.
    pub shared_char_devices: Vec<String>,
    /// Nothing at all shared, character devices included (the strict rule).
    pub pass_literal: bool,
    /// Character devices the control pair shares, when a cold-pair control was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control_shared_char_devices: Option<Vec<String>>,
    /// The control rule, when a cold-pair control was given: nothing shared but character devices, and only
    /// those the control pair shares too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pass_control_rule: Option<bool>,
}

impl AuditReport {
    /// Everything shared other than character devices.
    pub fn shared_writable(&self) -> usize {
        self.shared_namespaces.len()
            + self.shared_pids.len()
            + self.shared_pipes.len()
            + self.shared_sockets.len()
            + self.shared_eventfds.len()
            + self.shared_writable_files.len()
            + self.shared_locks.len()
    }
}

#[derive(Default)]
struct Side {
    pids: BTreeSet<u32>,
    ns: BTreeSet<String>,
    pipes: BTreeSet<String>,
    sockets: BTreeSet<String>,
    eventfds: BTreeSet<String>,
    writable: BTreeMap<(u64, u64), String>,
    chars: BTreeSet<String>,
    inodes: BTreeSet<(u64, u64)>,
}

fn collect(pids: &[u32]) -> Side {
    let mut s = Side { pids: pids.iter().copied().collect(), ..Default::default() };
    for &pid in pids {
        for ns in NAMESPACES {
            if let Ok(l) = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")) {
                s.ns.insert(l.display().to_string());
            }
        }
        let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        for e in rd.flatten() {
            let Ok(target) = std::fs::read_link(e.path()) else { continue };
            let t = target.display().to_string();
            if t.starts_with("pipe:") {
                s.pipes.insert(t);
            } else if t.starts_with("socket:") {
                s.sockets.insert(t);
            } else if t == "anon_inode:[eventfd]" {
                let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", e.file_name().to_string_lossy()))
                    .unwrap_or_default();
                if let Some(id) = info.lines().find_map(|l| l.strip_prefix("eventfd-id:")) {
                    s.eventfds.insert(format!("eventfd:{}", id.trim()));
                }
            } else if let Ok(md) = std::fs::metadata(e.path()) {
                s.inodes.insert((md.dev(), md.ino()));
                if md.file_type().is_char_device() {
                    let rdev = md.rdev();
                    s.chars.insert(format!("chr:{}:{}:{t}", libc::major(rdev), libc::minor(rdev)));
                } else if md.is_file() {
                    let info =
                        std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", e.file_name().to_string_lossy()))
                            .unwrap_or_default();
                    let flags = info
                        .lines()
                        .find_map(|l| l.strip_prefix("flags:"))
                        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
                        .unwrap_or(0);
                    if flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32 {
                        s.writable.insert((md.dev(), md.ino()), t);
                    }
                }
            }
        }
        // Shared writable mappings of regular files.
        if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
            for l in maps.lines() {
                let f: Vec<&str> = l.split_whitespace().collect();
                if f.len() >= 6 && f[1].starts_with("rw") && f[1].ends_with('s') && f[4] != "0" {
                    if let Ok(md) = std::fs::metadata(f[5]) {
                        s.writable.insert((md.dev(), md.ino()), format!("mmap:{}", f[5]));
                    }
                }
            }
        }
    }
    s
}

/// `/proc/locks` entries held by `pids` or on a file they have open (flock locks name the pid that took them,
/// which may have exited), as `lock:MAJ:MIN:INO` keys.
fn locks_of(text: &str, pids: &BTreeSet<u32>, inodes: &BTreeSet<(u64, u64)>) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let pid: u32 = f.get(4)?.parse().ok()?;
            let mut parts = f.get(5)?.split(':');
            let (maj, min, ino) = (parts.next()?, parts.next()?, parts.next()?);
            let dev = libc::makedev(u32::from_str_radix(maj, 16).ok()?, u32::from_str_radix(min, 16).ok()?);
            let ino: u64 = ino.parse().ok()?;
            (pids.contains(&pid) || inodes.contains(&(dev, ino))).then(|| format!("lock:{maj}:{min}:{ino}"))
        })
        .collect()
}

fn inter<T: Ord + Clone>(a: &BTreeSet<T>, b: &BTreeSet<T>) -> Vec<T> {
    a.intersection(b).cloned().collect()
}

/// Audit two sandboxes given their host pids (e.g. [`clade_core::backend::Sandbox::pids`]).
pub fn audit(a: &[u32], b: &[u32]) -> AuditReport {
    let (sa, sb) = (collect(a), collect(b));
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let (la, lb) = (locks_of(&locks, &sa.pids, &sa.inodes), locks_of(&locks, &sb.pids, &sb.inodes));
    let wa: BTreeSet<(u64, u64)> = sa.writable.keys().copied().collect();
    let wb: BTreeSet<(u64, u64)> = sb.writable.keys().copied().collect();
    // A file one side writes and the other merely has open is shared too.
    let mut shared_w: BTreeSet<(u64, u64)> = wa.intersection(&sb.inodes).copied().collect();
    shared_w.extend(wb.intersection(&sa.inodes).copied());
    let mut r = AuditReport {
        processes: (a.len(), b.len()),
        shared_namespaces: inter(&sa.ns, &sb.ns),
        shared_pids: inter(&sa.pids, &sb.pids),
        shared_pipes: inter(&sa.pipes, &sb.pipes),
        shared_sockets: inter(&sa.sockets, &sb.sockets),
        shared_eventfds: inter(&sa.eventfds, &sb.eventfds),
        shared_writable_files: shared_w
            .iter()
            .map(|k| sa.writable.get(k).or_else(|| sb.writable.get(k)).cloned().unwrap_or_default())
            .collect(),
        shared_locks: inter(&la, &lb),
        shared_char_devices: inter(&sa.chars, &sb.chars),
        ..Default::default()
    };
    r.pass_literal = r.shared_writable() == 0 && r.shared_char_devices.is_empty() && !a.is_empty() && !b.is_empty();
    r
}

/// Audit a pair against a cold-pair control: the control rule passes when nothing but character devices is shared and
/// the control pair shares at least the same devices (restore introduced none).
pub fn audit_with_control(a: &[u32], b: &[u32], cold_a: &[u32], cold_b: &[u32]) -> AuditReport {
    let mut r = audit(a, b);
    let control = audit(cold_a, cold_b);
    let ctl: BTreeSet<&String> = control.shared_char_devices.iter().collect();
    let introduced = r.shared_char_devices.iter().any(|d| !ctl.contains(d));
    r.pass_control_rule = Some(r.shared_writable() == 0 && !introduced && !a.is_empty() && !b.is_empty());
    r.control_shared_char_devices = Some(control.shared_char_devices);
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_locks() {
        let text = "1: POSIX  ADVISORY  WRITE 42 00:1f:1234 0 EOF\n2: FLOCK  ADVISORY  WRITE 7 08:02:99 0 EOF\n";
        let pids = [42u32].into_iter().collect();
        let l = super::locks_of(text, &pids, &Default::default());
        assert_eq!(l.into_iter().collect::<Vec<_>>(), vec!["lock:00:1f:1234".to_string()]);
        let by_inode = [(libc::makedev(8, 2), 99u64)].into_iter().collect();
        let l = super::locks_of(text, &Default::default(), &by_inode);
        assert_eq!(l.into_iter().collect::<Vec<_>>(), vec!["lock:08:02:99".to_string()]);
    }

    #[test]
    fn a_process_shares_everything_with_itself() {
        let me = [std::process::id()];
        let r = super::audit(&me, &me);
        assert!(!r.pass_literal);
        assert_eq!(r.shared_pids, vec![std::process::id()]);
        assert_eq!(r.shared_namespaces.len(), 5);
        assert!(super::audit(&[], &me).shared_writable() == 0);
    }
}
