//! A container's statistics, as containerd's CRI plugin reads them (`ContainerStats`, what a kubelet's summary
//! and `kubectl top` show): cgroups v1 `Metrics` in a protobuf `Any`. clade's supervisor knows a sandbox's host
//! processes and their memory ([`LiveFacts`]); the CPU time is summed over those processes
//! (`clade_core::host::cpu_seconds_with_reaped`).
//! A pod's containers share one sandbox, so each reports the pod's figures.

use clade_host::api::LiveFacts;
use containerd_shim::protos::cgroups::metrics::{CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::Message;

/// The type URL containerd registers cgroups v1 metrics under.
const METRICS_V1: &str = "io.containerd.cgroups.v1.Metrics";

/// The metrics of a sandbox's live facts, as containerd expects them.
pub fn metrics(live: &LiveFacts) -> anyhow::Result<Any> {
    // User and system time of the sandbox's host processes and of the children they reaped (a container's
    // short-lived commands count, as a cgroup counts them).
    let secs: f64 = live.pids.iter().filter_map(|p| clade_core::host::cpu_seconds_with_reaped(*p)).sum();
    let total = (secs * 1e9) as u64;
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
