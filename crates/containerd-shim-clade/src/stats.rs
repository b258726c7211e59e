//! A container's statistics, as containerd's CRI plugin reads them (`ContainerStats`, what a kubelet's summary
//! and `kubectl top` show): cgroups v1 `Metrics` in a protobuf `Any`. clade's supervisor knows a sandbox's host
//! processes and their memory ([`LiveFacts`]); the CPU time is summed from those processes' `/proc/<pid>/stat`.
//! A pod's containers share one sandbox, so each reports the pod's figures.

use clade_host::api::LiveFacts;
use containerd_shim::protos::cgroups::metrics::{CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::Message;

/// The type URL containerd registers cgroups v1 metrics under.
const METRICS_V1: &str = "io.containerd.cgroups.v1.Metrics";

/// User + system CPU time of a host process and of its children it reaped (a container's short-lived commands
/// count, as a cgroup counts them), in nanoseconds (`None` once it is gone).
fn cpu_ns(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces, so split after its closing parenthesis): state is
    // field 3; utime, stime, cutime and cstime are fields 14 to 17, in clock ticks.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks = (11..15).map(|i| f.get(i).and_then(|v| v.parse::<u64>().ok())).sum::<Option<u64>>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().filter(|h| *h > 0).unwrap_or(100);
    Some(ticks * 1_000_000_000 / hz as u64)
}

/// The metrics of a sandbox's live facts, as containerd expects them.
pub fn metrics(live: &LiveFacts) -> anyhow::Result<Any> {
    let total: u64 = live.pids.iter().filter_map(|p| cpu_ns(*p)).sum();
    let m = Metrics {
        pids: Some(PidsStat { current: live.pids.len() as u64, ..Default::default() }).into(),
        cpu: Some(CPUStat { usage: Some(CPUUsage { total, ..Default::default() }).into(), ..Default::default() })
            .into(),
        memory: Some(MemoryStat {
            rss: live.rss,
            // PSS: the sandbox's fair share of memory its siblings share with it (docs/scale.md).
            usage: Some(MemoryEntry { usage: live.pss, ..Default::default() }).into(),
            ..Default::default()
        })
        .into(),
        ..Default::default()
    };
    Ok(Any { type_url: METRICS_V1.into(), value: m.write_to_bytes()?, ..Default::default() })
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_has_used_cpu() {
        let me = std::process::id();
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(30) {}
        assert!(super::cpu_ns(me).unwrap() > 0);
        assert_eq!(super::cpu_ns(u32::MAX), None);
    }
}
