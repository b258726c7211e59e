//! Groups of a sandbox's processes: a Kubernetes pod's containers share the pod's one sandbox
//! (docs/kubernetes.md), and containerd pauses, resumes, ends and measures them one at a time.
//!
//! A group is what one process the agent started (its leader) and its descendants make: the agent gives every
//! process a process group of its own (a session, with a terminal), which its children inherit, so the group is
//! every process of the sandbox whose process group or session inside is the leader's, plus the descendants of
//! those (a child that made a session of its own). It is read from `/proc` at each use, so nothing has to be
//! joined when a process starts; a daemon that left both (double fork and `setsid`) and was re-parented to the
//! agent is not found, as it is not by `kill` of a process group.
//!
//! The same rule serves the host (a ct sandbox's processes seen in the host's `/proc`, frozen by cgroup) and
//! the agent (its own `/proc`, a vm guest's processes stopped by signals): ids and parents are read in one
//! `/proc`, so they agree.

use std::collections::{BTreeMap, BTreeSet};

/// One process as `/proc/PID/status` shows it: its pid, process group and session inside the sandbox (the last
/// of `NSpid`, `NSpgid`, `NSsid`) and its parent's host pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    pid: u32,
    pgid: u32,
    sid: u32,
    ppid: u32,
}

fn parse_status(text: &str) -> Option<Seen> {
    let last = |key: &str| -> Option<u32> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().last()?.parse().ok()
    };
    Some(Seen { pid: last("NSpid:")?, pgid: last("NSpgid:")?, sid: last("NSsid:")?, ppid: last("PPid:")? })
}

/// The pids, among `pids` (the sandbox's, as the reader's `/proc` numbers them), of the group led by `leader`
/// (a pid inside the sandbox).
pub fn members(pids: &[u32], leader: u32) -> Vec<u32> {
    members_of(pids, &[leader])
}

/// The pids of the groups `leaders` lead (a container's process and its execs), `/proc` read once.
pub fn members_of(pids: &[u32], leaders: &[u32]) -> Vec<u32> {
    let seen: BTreeMap<u32, Seen> = pids
        .iter()
        .filter_map(|&p| Some((p, parse_status(&std::fs::read_to_string(format!("/proc/{p}/status")).ok()?)?)))
        .collect();
    let mut all: Vec<u32> = leaders.iter().flat_map(|l| group_of(&seen, *l)).collect();
    all.sort_unstable();
    all.dedup();
    all
}

fn group_of(seen: &BTreeMap<u32, Seen>, leader: u32) -> Vec<u32> {
    let mut set: BTreeSet<u32> =
        seen.iter().filter(|(_, s)| s.pid == leader || s.pgid == leader || s.sid == leader).map(|(&p, _)| p).collect();
    loop {
        let more: Vec<u32> =
            seen.iter().filter(|(p, s)| !set.contains(p) && set.contains(&s.ppid)).map(|(&p, _)| p).collect();
        if more.is_empty() {
            return set.into_iter().collect();
        }
        set.extend(more);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_gives_the_innermost_ids() {
        let text = "Name:\tsleep\nPPid:\t4100\nNSpid:\t4242\t17\nNSpgid:\t4200\t9\nNSsid:\t4000\t1\n";
        assert_eq!(parse_status(text), Some(Seen { pid: 17, pgid: 9, sid: 1, ppid: 4100 }));
        assert_eq!(parse_status("Name:\tx\n"), None);
    }

    #[test]
    fn a_group_is_its_process_groups_sessions_and_their_descendants() {
        let s = |pid, pgid, sid, ppid| Seen { pid, pgid, sid, ppid };
        let seen: BTreeMap<u32, Seen> = [
            (100, s(1, 1, 1, 50)),   // the agent
            (101, s(5, 5, 1, 100)),  // the leader
            (102, s(6, 5, 1, 101)),  // its child, same process group
            (103, s(7, 7, 7, 102)),  // a grandchild with a session of its own
            (104, s(8, 7, 7, 103)),  // and its child
            (105, s(9, 9, 1, 100)),  // another container's process
            (106, s(10, 5, 1, 100)), // the leader's child re-parented to the agent, same process group
        ]
        .into_iter()
        .collect();
        assert_eq!(group_of(&seen, 5), vec![101, 102, 103, 104, 106]);
        assert_eq!(group_of(&seen, 9), vec![105]);
        assert!(group_of(&seen, 42).is_empty());
    }
}
