//! Prometheus metrics at `/metrics` (prometheus-client, the text exposition format): operation latencies as
//! histograms by operation and outcome, requests by route and status, and, read at scrape time, sandboxes by
//! state and the store's sizes and frame-cache hit rate.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use clade_host::SandboxApi;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub method: String,
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

pub struct Metrics {
    registry: Registry,
    ops: Family<OpLabels, Histogram>,
    requests: Family<RouteLabels, Counter>,
    sandboxes: Family<StateLabels, Gauge>,
    store_bytes: Family<KindLabels, Gauge>,
    cache_hit_ratio: Gauge<f64, AtomicU64>,
    idle_suspends: Counter,
}

fn latency_histogram() -> Histogram {
    // 1 ms to about 65 s: a claimed pool member answers in milliseconds, a cold vm boot in seconds.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17))
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("clade");
        let ops = Family::<OpLabels, Histogram>::new_with_constructor(latency_histogram as fn() -> Histogram);
        let requests = Family::<RouteLabels, Counter>::default();
        let sandboxes = Family::<StateLabels, Gauge>::default();
        let store_bytes = Family::<KindLabels, Gauge>::default();
        let cache_hit_ratio = Gauge::<f64, AtomicU64>::default();
        let idle_suspends = Counter::default();
        registry.register("operation_duration_seconds", "Sandbox operation latency", ops.clone());
        registry.register("http_requests", "HTTP requests by route and status", requests.clone());
        registry.register("sandboxes", "Sandboxes by state (from the ledger)", sandboxes.clone());
        registry.register("store_bytes", "Chunk store sizes: logical, unique, packed", store_bytes.clone());
        registry.register(
            "store_cache_hit_ratio",
            "Frame cache hits / lookups in this process",
            cache_hit_ratio.clone(),
        );
        registry.register("idle_suspends", "Sandboxes suspended for being idle", idle_suspends.clone());
        Metrics { registry, ops, requests, sandboxes, store_bytes, cache_hit_ratio, idle_suspends }
    }

    pub fn op(&self, op: &str, ok: bool, took: Duration) {
        let outcome = if ok { "ok" } else { "error" }.to_string();
        self.ops.get_or_create(&OpLabels { op: op.into(), outcome }).observe(took.as_secs_f64());
    }

    pub fn request(&self, method: &str, route: &str, status: u16) {
        self.requests.get_or_create(&RouteLabels { method: method.into(), route: route.into(), status }).inc();
    }

    pub fn idle_suspended(&self) {
        self.idle_suspends.inc();
    }

    /// The text exposition, with the gauges read now.
    pub fn render(&self, api: &dyn SandboxApi, store: Option<&clade_store::Store>) -> String {
        let mut counts = std::collections::BTreeMap::<String, i64>::new();
        for s in ["starting", "running", "suspended", "failed", "lost"] {
            counts.insert(s.into(), 0);
        }
        if let Ok(rows) = api.list() {
            for r in rows {
                *counts.entry(r.state).or_default() += 1;
            }
        }
        for (state, n) in counts {
            self.sandboxes.get_or_create(&StateLabels { state }).set(n);
        }
        if let Some(Ok(s)) = store.map(|s| s.stats()) {
            for (kind, v) in [("logical", s.logical_bytes), ("unique", s.unique_bytes), ("packed", s.pack_bytes)] {
                self.store_bytes.get_or_create(&KindLabels { kind: kind.into() }).set(v as i64);
            }
            let lookups = s.cache_hits + s.cache_misses;
            self.cache_hit_ratio.set(if lookups == 0 { 0.0 } else { s.cache_hits as f64 / lookups as f64 });
        }
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
