//! A container's statistics, as containerd's CRI plugin reads them (`ContainerStats`, what a kubelet's summary
//! and `kubectl top` show): cgroups v1 `Metrics` in a protobuf `Any`. clade's supervisor knows a sandbox's host
//! processes and their memory ([`LiveFacts`]); the CPU time is summed over those processes
//! (`clade_core::host::cpu_seconds_with_reaped`).
//! A pod's containers share one sandbox: its sandbox container reports the sandbox's figures, and each member
//! those of its own processes (the groups its init and execs lead, `clade_core::procgroup`), as a runc
//! container reports its cgroup's.

use clade_host::api::LiveFacts;
use containerd_shim::protos::cgroups::metrics::{CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::Message;

/// The type URL containerd registers cgroups v1 metrics under.
const METRICS_V1: &str = "io.containerd.cgroups.v1.Metrics";

/// The metrics of a sandbox's live facts, as containerd expects them.
pub fn metrics(live: &LiveFacts) -> anyhow::Result<Any> {
    encode(&live.pids, live.pss, live.rss)
}

/// The metrics of a pod member: the processes of the groups `leaders` (pids inside the sandbox) lead, among the
/// sandbox's host processes `pids`, their memory as PSS and RSS.
pub fn member_metrics(pids: &[u32], leaders: &[u32]) -> anyhow::Result<Any> {
    let mine = clade_core::procgroup::members_of(pids, leaders);
    let (pss, rss) =
        mine.iter().filter_map(|p| clade_core::host::pss_rss(*p)).fold((0, 0), |(a, b), (pss, rss)| (a + pss, b + rss));
    encode(&mine, pss, rss)
}

fn encode(pids: &[u32], pss: u64, rss: u64) -> anyhow::Result<Any> {
    // User and system time of the host processes and of the children they reaped (a container's short-lived
    // commands count, as a cgroup counts them).
    let secs: f64 = pids.iter().filter_map(|p| clade_core::host::cpu_seconds_with_reaped(*p)).sum();
    let total = (secs * 1e9) as u64;
    let m = Metrics {
        pids: Some(PidsStat { current: pids.len() as u64, ..Default::default() }).into(),
        cpu: Some(CPUStat { usage: Some(CPUUsage { total, ..Default::default() }).into(), ..Default::default() })
            .into(),
        memory: Some(MemoryStat {
            rss,
            // PSS: the sandbox's fair share of memory its siblings share with it (docs/scale.md).
            usage: Some(MemoryEntry { usage: pss, ..Default::default() }).into(),
            ..Default::default()
        })
        .into(),
        ..Default::default()
    };
    Ok(Any { type_url: METRICS_V1.into(), value: m.write_to_bytes()?, ..Default::default() })
}
