//! The replay: every session becomes a list of stays on hosts (one stay from arrival to departure when it keeps
//! running; one stay per active spell plus its idle tail when it is suspended after `idle_after_s`), and one sweep
//! over the stays' starts and ends places each stay on a host (fullest host it fits on by requested shape, else
//! a new host) and bills every host from its opening until it has been empty for `scale_in_s`.

use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::costs::Measured;
use crate::trace::{AgentShape, HostShape, Trace};

/// What the replay assumes about the fleet (not clade's costs: those are [`Measured`]).
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    pub host: HostShape,
    /// A session idle this long is suspended (suspend-idle only).
    pub idle_after_s: f64,
    /// An empty host stays billed this long before the autoscaler removes it (and can take new stays meanwhile).
    pub scale_in_s: f64,
    /// A stay that needs a new host waits this long for it (added to a resume's wait).
    pub host_start_s: f64,
    /// Seed of the generator that draws each resume's and suspend's time from the measured samples.
    pub seed: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self { host: HostShape::seed004(), idle_after_s: 300.0, scale_in_s: 60.0, host_start_s: 0.0, seed: 4 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Every retained session keeps its sandbox running (and its requested shape reserved) until it leaves.
    KeepRunning,
    /// A session idle for `idle_after_s` is suspended; it resumes, on any host, when its user returns.
    SuspendIdle,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::KeepRunning => "keep-running",
            Policy::SuspendIdle => "suspend-idle",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(
        "shape {shape} ({vcpus} vCPU, {memory} GiB, {disk} GiB) does not fit on the host ({hv} vCPU, {hm} GiB, {hd} GiB); \
         use a larger host (--host-vcpus/--host-memory-gib/--host-disk-gib) or a smaller shape"
    )]
    DoesNotFit { shape: String, vcpus: f64, memory: f64, disk: f64, hv: f64, hm: f64, hd: f64 },
    #[error("measured costs have no {0} samples; re-measure (./x bench vm --quick, or --measure)")]
    NoSamples(&'static str),
    #[error("invalid parameter: {0}")]
    Param(String),
}

/// The cost formula terms (docs/fleet.md), in unit-hours. `requested` is the old formula (what placement reserves
/// while a sandbox runs); `base` + `dirty` the new one: an image's base memory and disk once per host that runs a
/// session of it, plus each running session's dirty memory and each retained session's dirty disk.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Terms {
    pub vcpu_h: f64,
    pub memory_requested_gib_h: f64,
    pub memory_base_gib_h: f64,
    pub memory_dirty_gib_h: f64,
    pub disk_requested_gib_h: f64,
    pub disk_base_gib_h: f64,
    pub disk_dirty_gib_h: f64,
}

/// One policy's replay.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    pub policy: Policy,
    pub host_hours: f64,
    pub cost_usd: f64,
    pub peak_hosts: usize,
    pub mean_hosts: f64,
    /// Times a user came back to an idle session.
    pub returns: usize,
    pub suspends: usize,
    /// Of those, suspends of idle residents to make room for a start that fit nowhere (idlest first).
    pub suspends_to_make_room: usize,
    pub resumes: usize,
    /// Over resumes only (0 when there were none).
    pub p50_resume_wait_ms: f64,
    pub p99_resume_wait_ms: f64,
    pub max_resume_wait_ms: f64,
    /// Over every return (0 for a session that was still running).
    pub p99_return_wait_ms: f64,
    pub bytes_suspended: f64,
    pub bytes_resumed: f64,
    pub terms: Terms,
    /// Hosts billed over time: `[t_s, hosts]` at every change (a step function).
    pub series: Vec<[f64; 2]>,
}

fn pick(rng: &mut ChaCha8Rng, v: &[f64]) -> f64 {
    v[rng.random_range(0..v.len())]
}

/// Nearest-rank percentile (`q` in 0..=1) of `v`; 0 for an empty list.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// What happens, in the order it is handled at one instant: frees first, so a start can take a freed slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    SuspendDone,
    Leave,
    UserIdle,
    IdleTimeout(u64),
    Arrive,
    UserActive,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    t: f64,
    ev: Ev,
    seq: u64,
    session: usize,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    // Reversed: BinaryHeap is a max-heap, the earliest event must come out first.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.t.total_cmp(&self.t).then_with(|| o.ev.cmp(&self.ev)).then_with(|| o.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Default)]
struct SessionState {
    host: Option<usize>,
    placed_at: f64,
    active: bool,
    idle_since: f64,
    epoch: u64,
    /// Resident while its suspend finishes.
    suspending: bool,
    /// The user came back at this time while the suspend was finishing: resume once it has.
    back_during_suspend: Option<f64>,
    left: bool,
}

struct Host {
    used: [f64; 3],
    residents: Vec<usize>,
    opened: f64,
    empty_since: Option<f64>,
    closed: Option<f64>,
    /// Residents per shape, and since when the shape has been present (for the base terms).
    shapes: BTreeMap<String, (usize, f64)>,
}

fn demand(s: &AgentShape) -> [f64; 3] {
    [s.vcpus, s.memory_gib, s.disk_gib]
}

const EPS: f64 = 1e-9;

struct Sim<'a> {
    trace: &'a Trace,
    costs: &'a Measured,
    p: &'a Params,
    policy: Policy,
    cap: [f64; 3],
    rng: ChaCha8Rng,
    heap: std::collections::BinaryHeap<Event>,
    seq: u64,
    st: Vec<SessionState>,
    hosts: Vec<Host>,
    open: usize,
    peak: usize,
    series: Vec<[f64; 2]>,
    terms: Terms,
    returns: usize,
    suspends: usize,
    resumes: usize,
    preempted: usize,
    return_waits: Vec<f64>,
    resume_waits: Vec<f64>,
}

impl<'a> Sim<'a> {
    fn shape(&self, s: usize) -> &'a AgentShape {
        &self.trace.shapes[&self.trace.sessions[s].shape]
    }

    fn at(&mut self, t: f64, ev: Ev, session: usize) {
        self.seq += 1;
        self.heap.push(Event { t, ev, seq: self.seq, session });
    }

    fn mark_series(&mut self, t: f64) {
        let n = self.open as f64;
        match self.series.last_mut() {
            Some(last) if (last[0] - t).abs() < EPS => last[1] = n,
            _ => self.series.push([t, n]),
        }
    }

    /// Hosts whose scale-in delay ran out by `upto` are released (in time order).
    fn close_due(&mut self, upto: f64) {
        let mut due: Vec<(f64, usize)> = self
            .hosts
            .iter()
            .enumerate()
            .filter(|(_, h)| h.closed.is_none())
            .filter_map(|(i, h)| h.empty_since.map(|e| (e + self.p.scale_in_s, i)))
            .filter(|(t, _)| *t <= upto)
            .collect();
        due.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (t, i) in due {
            self.hosts[i].closed = Some(t);
            self.open -= 1;
            self.mark_series(t);
        }
    }

    fn fits(&self, h: &Host, d: [f64; 3]) -> bool {
        h.used.iter().zip(d).zip(self.cap).all(|((u, x), c)| u + x <= c + EPS)
    }

    fn fullness(&self, h: &Host) -> f64 {
        h.used.iter().zip(self.cap).map(|(u, c)| u / c).sum()
    }

    /// Takes session `s` off its host at `t`, adding its residence to the terms.
    fn free(&mut self, s: usize, t: f64) {
        let Some(hi) = self.st[s].host.take() else { return };
        let shape = self.shape(s);
        let d = demand(shape);
        let dur_h = (t - self.st[s].placed_at) / 3600.0;
        self.terms.vcpu_h += shape.vcpus * dur_h;
        self.terms.memory_requested_gib_h += shape.memory_gib * dur_h;
        self.terms.memory_dirty_gib_h += shape.dirty_memory_gib * dur_h;
        self.terms.disk_requested_gib_h += shape.disk_gib * dur_h;
        let h = &mut self.hosts[hi];
        for (u, x) in h.used.iter_mut().zip(d) {
            *u = (*u - x).max(0.0);
        }
        h.residents.retain(|r| *r != s);
        if let Some(e) = h.shapes.get_mut(&shape.name) {
            e.0 -= 1;
            if e.0 == 0 {
                let base_h = (t - e.1) / 3600.0;
                self.terms.memory_base_gib_h += shape.base_memory_gib * base_h;
                self.terms.disk_base_gib_h += shape.base_disk_gib * base_h;
            }
        }
        if h.residents.is_empty() {
            h.empty_since = Some(t);
        }
    }

    /// The host where suspending the fewest idle residents (idlest first) makes room for `d`, with those residents.
    fn room_by_suspending(&self, d: [f64; 3]) -> Option<(usize, Vec<usize>)> {
        let mut best: Option<(usize, Vec<usize>)> = None;
        for (hi, h) in self.hosts.iter().enumerate().filter(|(_, h)| h.closed.is_none()) {
            let mut idle: Vec<usize> =
                h.residents.iter().copied().filter(|r| !self.st[*r].active && !self.st[*r].suspending).collect();
            idle.sort_by(|a, b| self.st[*a].idle_since.total_cmp(&self.st[*b].idle_since).then(a.cmp(b)));
            let mut used = h.used;
            let mut chosen = Vec::new();
            for r in idle {
                if used.iter().zip(d).zip(self.cap).all(|((u, x), c)| u + x <= c + EPS) {
                    break;
                }
                for (u, x) in used.iter_mut().zip(demand(self.shape(r))) {
                    *u -= x;
                }
                chosen.push(r);
            }
            let fits = used.iter().zip(d).zip(self.cap).all(|((u, x), c)| u + x <= c + EPS);
            if fits && !chosen.is_empty() && best.as_ref().is_none_or(|(_, b)| chosen.len() < b.len()) {
                best = Some((hi, chosen));
            }
        }
        best
    }

    /// Puts session `s` on a host at `t`. `wait_ms`: the user is waiting (a resume), for this long so far.
    fn place(&mut self, s: usize, t: f64, wait_ms: Option<f64>) {
        let d = demand(self.shape(s));
        let mut extra_ms = 0.0;
        let fitting = self
            .hosts
            .iter()
            .enumerate()
            .filter(|(_, h)| h.closed.is_none() && self.fits(h, d))
            .max_by(|a, b| self.fullness(a.1).total_cmp(&self.fullness(b.1)).then(b.0.cmp(&a.0)))
            .map(|(i, _)| i);
        let hi = match fitting {
            Some(i) => i,
            None => match (self.policy, self.room_by_suspending(d)) {
                (Policy::SuspendIdle, Some((hi, victims))) => {
                    // Make room: suspend the idlest residents now; the newcomer waits for their suspends.
                    for v in victims {
                        extra_ms += pick(&mut self.rng, &self.costs.suspend_ms);
                        self.suspends += 1;
                        self.preempted += 1;
                        self.st[v].epoch += 1;
                        self.free(v, t);
                    }
                    hi
                }
                _ => {
                    self.hosts.push(Host {
                        used: [0.0; 3],
                        residents: Vec::new(),
                        opened: t,
                        empty_since: None,
                        closed: None,
                        shapes: BTreeMap::new(),
                    });
                    self.open += 1;
                    self.peak = self.peak.max(self.open);
                    self.mark_series(t);
                    extra_ms += self.p.host_start_s * 1e3;
                    self.hosts.len() - 1
                }
            },
        };
        let name = self.shape(s).name.clone();
        let h = &mut self.hosts[hi];
        for (u, x) in h.used.iter_mut().zip(d) {
            *u += x;
        }
        h.residents.push(s);
        h.empty_since = None;
        let e = h.shapes.entry(name).or_insert((0, t));
        if e.0 == 0 {
            e.1 = t;
        }
        e.0 += 1;
        self.st[s].host = Some(hi);
        self.st[s].placed_at = t;
        if let Some(w) = wait_ms {
            self.return_waits.push(w + extra_ms);
            self.resume_waits.push(w + extra_ms);
        }
    }

    fn handle(&mut self, e: Event) {
        let s = e.session;
        if self.st[s].left {
            return;
        }
        let t = e.t;
        match e.ev {
            Ev::Arrive => {
                self.place(s, t, None);
                self.st[s].idle_since = t;
                self.arm_idle_timer(s, t);
            }
            Ev::UserActive => {
                if t > self.trace.sessions[s].arrive_s {
                    self.returns += 1;
                }
                self.st[s].active = true;
                self.st[s].epoch += 1;
                let counted = t > self.trace.sessions[s].arrive_s;
                if self.st[s].suspending {
                    // Back before the suspend finished: wait for it, then resume (on SuspendDone).
                    self.resumes += 1;
                    self.st[s].back_during_suspend = Some(t);
                } else if self.st[s].host.is_some() {
                    if counted {
                        self.return_waits.push(0.0);
                    }
                } else {
                    self.resumes += 1;
                    let w = pick(&mut self.rng, &self.costs.resume_ms);
                    self.place(s, t, Some(w));
                }
            }
            Ev::UserIdle => {
                self.st[s].active = false;
                self.st[s].idle_since = t;
                self.st[s].epoch += 1;
                self.arm_idle_timer(s, t);
            }
            Ev::IdleTimeout(epoch) => {
                let st = &self.st[s];
                if epoch == st.epoch && !st.active && !st.suspending && st.host.is_some() {
                    self.suspends += 1;
                    self.st[s].suspending = true;
                    let took = pick(&mut self.rng, &self.costs.suspend_ms) / 1e3;
                    self.at(t + took, Ev::SuspendDone, s);
                }
            }
            Ev::SuspendDone => {
                self.st[s].suspending = false;
                self.free(s, t);
                if let Some(back) = self.st[s].back_during_suspend.take() {
                    let waited_ms = (t - back) * 1e3;
                    let w = waited_ms + pick(&mut self.rng, &self.costs.resume_ms);
                    self.place(s, t, Some(w));
                }
            }
            Ev::Leave => {
                self.free(s, t);
                self.st[s].left = true;
            }
        }
    }

    fn arm_idle_timer(&mut self, s: usize, t: f64) {
        if self.policy == Policy::SuspendIdle {
            let epoch = self.st[s].epoch;
            self.at(t + self.p.idle_after_s, Ev::IdleTimeout(epoch), s);
        }
    }
}

/// Replays `trace` under one policy.
pub fn simulate(trace: &Trace, costs: &Measured, p: &Params, policy: Policy) -> Result<PolicyReport, SimError> {
    for (what, v) in [("idle_after_s", p.idle_after_s), ("scale_in_s", p.scale_in_s), ("host_start_s", p.host_start_s)]
    {
        if !(v.is_finite() && v >= 0.0) {
            return Err(SimError::Param(format!("{what} must be zero or more, got {v}")));
        }
    }
    if !(p.host.price_per_hour.is_finite() && p.host.price_per_hour >= 0.0) {
        return Err(SimError::Param(format!(
            "price per host-hour must be zero or more, got {}",
            p.host.price_per_hour
        )));
    }
    let cap = [p.host.vcpus, p.host.memory_gib, p.host.disk_gib];
    for s in trace.shapes.values().filter(|s| trace.sessions.iter().any(|x| x.shape == s.name)) {
        if demand(s).iter().zip(cap).any(|(d, c)| *d > c + EPS) {
            return Err(SimError::DoesNotFit {
                shape: s.name.clone(),
                vcpus: s.vcpus,
                memory: s.memory_gib,
                disk: s.disk_gib,
                hv: cap[0],
                hm: cap[1],
                hd: cap[2],
            });
        }
    }
    if policy == Policy::SuspendIdle {
        if costs.resume_ms.is_empty() {
            return Err(SimError::NoSamples("resume"));
        }
        if costs.suspend_ms.is_empty() {
            return Err(SimError::NoSamples("suspend"));
        }
    }
    let mut sim = Sim {
        trace,
        costs,
        p,
        policy,
        cap,
        rng: ChaCha8Rng::seed_from_u64(p.seed),
        heap: Default::default(),
        seq: 0,
        st: trace.sessions.iter().map(|_| SessionState::default()).collect(),
        hosts: Vec::new(),
        open: 0,
        peak: 0,
        series: Vec::new(),
        terms: Terms::default(),
        returns: 0,
        suspends: 0,
        resumes: 0,
        preempted: 0,
        return_waits: Vec::new(),
        resume_waits: Vec::new(),
    };
    for (i, s) in trace.sessions.iter().enumerate() {
        sim.at(s.arrive_s, Ev::Arrive, i);
        for [a, b] in &s.active {
            sim.at(*a, Ev::UserActive, i);
            if *b < s.leave_s {
                sim.at(*b, Ev::UserIdle, i);
            }
        }
        sim.at(s.leave_s, Ev::Leave, i);
    }
    while let Some(e) = sim.heap.pop() {
        // Hosts whose scale-in delay ran out strictly before this event are gone; one emptied exactly now may be
        // reused by a start at the same instant.
        sim.close_due(e.t - EPS);
        sim.handle(e);
    }
    sim.close_due(f64::INFINITY);
    let host_hours: f64 = sim.hosts.iter().map(|h| (h.closed.unwrap_or(trace.end_s) - h.opened) / 3600.0).sum();
    let mut terms = sim.terms;
    // Retained sessions keep their dirty disk whether running or suspended.
    terms.disk_dirty_gib_h =
        trace.sessions.iter().map(|s| trace.shapes[&s.shape].dirty_disk_gib * (s.leave_s - s.arrive_s) / 3600.0).sum();
    let suspend_bytes = costs.suspend_bytes.unwrap_or(0.0);
    let resume_bytes = costs.resume_bytes_or_suspend().unwrap_or(0.0);
    Ok(PolicyReport {
        policy,
        host_hours,
        cost_usd: host_hours * p.host.price_per_hour,
        peak_hosts: sim.peak,
        mean_hosts: host_hours / (trace.end_s / 3600.0),
        returns: sim.returns,
        suspends: sim.suspends,
        suspends_to_make_room: sim.preempted,
        resumes: sim.resumes,
        p50_resume_wait_ms: percentile(&sim.resume_waits, 0.5),
        p99_resume_wait_ms: percentile(&sim.resume_waits, 0.99),
        max_resume_wait_ms: sim.resume_waits.iter().copied().fold(0.0, f64::max),
        p99_return_wait_ms: percentile(&sim.return_waits, 0.99),
        bytes_suspended: sim.suspends as f64 * suspend_bytes,
        bytes_resumed: sim.resumes as f64 * resume_bytes,
        terms,
        series: sim.series,
    })
}

/// A benchmark-style figure: the number, its bar, whether it passed.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    pub name: String,
    pub value: f64,
    pub unit: String,
    pub bar: String,
    pub pass: bool,
}

/// Both policies over the same trace and costs.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub params: Params,
    pub sessions: usize,
    pub mean_active: f64,
    pub hours: f64,
    pub costs: Measured,
    pub cost_sources: BTreeMap<String, String>,
    pub keep_running: PolicyReport,
    pub suspend_idle: PolicyReport,
    /// suspend-idle host-hours / keep-running host-hours.
    pub host_hours_ratio: f64,
    pub figure: Figure,
}

pub fn compare(trace: &Trace, costs: &Measured, p: &Params) -> Result<Comparison, SimError> {
    let keep = simulate(trace, costs, p, Policy::KeepRunning)?;
    let susp = simulate(trace, costs, p, Policy::SuspendIdle)?;
    let ratio = if keep.host_hours > 0.0 { susp.host_hours / keep.host_hours } else { f64::NAN };
    Ok(Comparison {
        params: p.clone(),
        sessions: trace.sessions.len(),
        mean_active: trace.mean_active(),
        hours: trace.end_s / 3600.0,
        cost_sources: costs.source_notes(),
        costs: costs.clone(),
        figure: Figure {
            name: format!("fleet suspend-idle / keep-running host-hours ({} resume costs)", costs.backend),
            value: ratio,
            unit: "ratio".into(),
            bar: "<= 0.5".into(),
            pass: ratio <= 0.5,
        },
        keep_running: keep,
        suspend_idle: susp,
        host_hours_ratio: ratio,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{parse_trace, seed004, Seed004, Session};

    fn costs(resume: &[f64], suspend: &[f64]) -> Measured {
        Measured {
            backend: "test".into(),
            resume_ms: resume.to_vec(),
            suspend_ms: suspend.to_vec(),
            suspend_bytes: Some(1e6),
            resume_bytes: None,
            sources: Default::default(),
        }
    }

    fn params(idle_after: f64, scale_in: f64) -> Params {
        Params { idle_after_s: idle_after, scale_in_s: scale_in, ..Params::default() }
    }

    fn session(id: &str, shape: &str, leave: f64, active: &[[f64; 2]]) -> Session {
        Session { id: id.into(), shape: shape.into(), arrive_s: 0.0, leave_s: leave, active: active.to_vec() }
    }

    fn trace(sessions: Vec<Session>) -> Trace {
        let text: String = sessions
            .iter()
            .map(|s| {
                let mut v = serde_json::to_value(s).unwrap();
                v["kind"] = "session".into();
                v.to_string() + "\n"
            })
            .collect();
        parse_trace(&text).unwrap()
    }

    #[test]
    fn keep_running_bills_every_retained_sessions_host() {
        // 18 always-idle sessions (12 coding, 6 build, interleaved): 6 per host by requested shape -> 3 hosts for
        // the whole hour, whatever their activity.
        let t = seed004(&Seed004 { hours: 1.0, ..Default::default() });
        let r = simulate(&t, &costs(&[500.0], &[100.0]), &params(300.0, 0.0), Policy::KeepRunning).unwrap();
        assert_eq!(r.peak_hosts, 3);
        assert!((r.host_hours - 3.0).abs() < 1e-6, "{}", r.host_hours);
        assert!((r.cost_usd - 2.4).abs() < 1e-6);
        assert_eq!((r.suspends, r.resumes, r.p99_resume_wait_ms), (0, 0, 0.0));
        // Requested terms: 12 * 2 + 6 * 4 vCPU for one hour, 12 * 8 + 6 * 16 GiB.
        assert!((r.terms.vcpu_h - 48.0).abs() < 1e-6);
        assert!((r.terms.memory_requested_gib_h - 192.0).abs() < 1e-6);
        // Base memory once per host per image: each of 3 hosts runs both images.
        assert!((r.terms.memory_base_gib_h - 3.0 * (2.0 + 4.0)).abs() < 1e-6, "{:?}", r.terms);
        assert_eq!(r.series.first(), Some(&[0.0, 3.0]));
        assert_eq!(r.series.last(), Some(&[3600.0, 0.0]));
    }

    #[test]
    fn suspend_idle_bills_active_sessions_plus_resume_costs() {
        // Two coding sessions over 10 000 s; a is active [0, 1000] and [5000, 6000], b never.
        let t = trace(vec![
            session("a", "coding", 10_000.0, &[[0.0, 1000.0], [5000.0, 6000.0]]),
            session("b", "coding", 10_000.0, &[]),
        ]);
        let c = costs(&[2000.0], &[10_000.0]); // 2 s resume, 10 s suspend
        let r = simulate(&t, &c, &params(100.0, 0.0), Policy::SuspendIdle).unwrap();
        // a: resident [0, 1000 + 100 + 10], resumes at 5000 (2 s wait), resident [5000, 6110]. b: [0, 110].
        // One host is enough: billed [0, 1110] and [5000, 6110].
        assert_eq!(r.peak_hosts, 1);
        assert!((r.host_hours - 2220.0 / 3600.0).abs() < 1e-6, "{}", r.host_hours);
        assert_eq!((r.suspends, r.resumes, r.returns), (3, 1, 1));
        assert_eq!(r.p99_resume_wait_ms, 2000.0);
        assert_eq!(r.bytes_suspended, 3e6);
        assert_eq!(r.bytes_resumed, 1e6);
        assert_eq!(r.series, vec![[0.0, 1.0], [1110.0, 0.0], [5000.0, 1.0], [6110.0, 0.0]]);
        // Longer suspends cost host time: the same trace with a 100 s suspend bills 3 * 90 s more.
        let slow = simulate(&t, &costs(&[2000.0], &[100_000.0]), &params(100.0, 0.0), Policy::SuspendIdle).unwrap();
        assert!((slow.host_hours - r.host_hours - 180.0 / 3600.0).abs() < 1e-6, "{}", slow.host_hours);
        // The keep-running arm bills the whole 10 000 s.
        let keep = simulate(&t, &c, &params(100.0, 0.0), Policy::KeepRunning).unwrap();
        assert!((keep.host_hours - 10_000.0 / 3600.0).abs() < 1e-6);
        assert_eq!(keep.returns, 1);
    }

    #[test]
    fn a_return_during_the_suspend_waits_for_it_and_keeps_the_host() {
        let t = trace(vec![session("a", "coding", 1000.0, &[[0.0, 100.0], [205.0, 300.0]])]);
        // Suspend starts at 200, ends at 210; the user is back at 205: waits 5 s + 1 s resume.
        let r = simulate(&t, &costs(&[1000.0], &[10_000.0]), &params(100.0, 0.0), Policy::SuspendIdle).unwrap();
        assert_eq!(r.p99_resume_wait_ms, 6000.0);
        assert_eq!(r.resumes, 1);
        assert!((r.host_hours - 410.0 / 3600.0).abs() < 1e-6, "{}", r.host_hours);
        // [0, 410]: 300 + 100 + 10
    }

    #[test]
    fn scale_in_and_host_start_are_billed_and_waited() {
        let t = trace(vec![session("a", "coding", 10_000.0, &[[0.0, 1000.0], [5000.0, 6000.0]])]);
        let c = costs(&[1000.0], &[0.0]);
        let mut p = params(0.0, 600.0);
        p.host_start_s = 30.0;
        let r = simulate(&t, &c, &p, Policy::SuspendIdle).unwrap();
        // Stays [0, 1000] and [5000, 6000]; each emptied host stays 600 s: billed 1600 + 1600.
        assert!((r.host_hours - 3200.0 / 3600.0).abs() < 1e-6, "{}", r.host_hours);
        assert_eq!(r.p99_resume_wait_ms, 31_000.0);
        // A scale-in window that covers the gap keeps the host: no new host, no host start.
        p.scale_in_s = 5000.0;
        let r = simulate(&t, &c, &p, Policy::SuspendIdle).unwrap();
        assert_eq!(r.p99_resume_wait_ms, 1000.0);
        assert!((r.host_hours - 11_000.0 / 3600.0).abs() < 1e-6, "{}", r.host_hours);
    }

    #[test]
    fn refuses_what_cannot_fit_or_be_measured() {
        let t = trace(vec![session("a", "build", 100.0, &[])]);
        let mut p = Params::default();
        p.host.disk_gib = 100.0;
        let e = simulate(&t, &costs(&[1.0], &[1.0]), &p, Policy::KeepRunning).unwrap_err().to_string();
        assert!(e.contains("build") && e.contains("does not fit"), "{e}");
        let e = simulate(&t, &costs(&[], &[1.0]), &Params::default(), Policy::SuspendIdle).unwrap_err().to_string();
        assert!(e.contains("no resume samples"), "{e}");
        let e = simulate(&t, &costs(&[1.0], &[1.0]), &params(-1.0, 0.0), Policy::SuspendIdle).unwrap_err();
        assert!(e.to_string().contains("idle_after_s"));
    }

    #[test]
    fn seed004_suspend_idle_needs_at_most_half_the_host_hours() {
        // With second-scale suspend/resume costs, as clade measures them.
        let t = seed004(&Seed004::default());
        let c = compare(&t, &costs(&[400.0, 500.0, 1200.0], &[100.0, 150.0]), &Params::default()).unwrap();
        assert_eq!(c.keep_running.peak_hosts, 3);
        assert!(c.host_hours_ratio <= 0.5, "ratio {}", c.host_hours_ratio);
        assert!(c.figure.pass);
        // Resumes wait for a measured resume, plus a measured suspend when room had to be made.
        let s = &c.suspend_idle;
        assert!(s.resumes > 50 && s.suspends >= s.resumes, "{} resumes, {} suspends", s.resumes, s.suspends);
        assert!(s.p99_resume_wait_ms >= 400.0 && s.p99_resume_wait_ms <= 1200.0 + 150.0, "{}", s.p99_resume_wait_ms);
        // The new formula's memory term is far below the requested one.
        let st = &s.terms;
        assert!(st.memory_base_gib_h + st.memory_dirty_gib_h < c.keep_running.terms.memory_requested_gib_h / 4.0);
        // Independent users (the active count fluctuates around 6) need more hosts, still fewer than keep-running.
        let r = seed004(&Seed004 { fixed_concurrency: false, ..Default::default() });
        let cr = compare(&r, &costs(&[400.0, 500.0, 1200.0], &[100.0, 150.0]), &Params::default()).unwrap();
        assert!(cr.host_hours_ratio > c.host_hours_ratio && cr.host_hours_ratio < 0.9, "{}", cr.host_hours_ratio);
    }

    #[test]
    fn a_full_host_suspends_its_idlest_resident_to_make_room() {
        // Host of 4 vCPU: two coding sessions fill it. c arrives later while a and b idle (idle_after is long):
        // the idlest (a, idle since 10) is suspended for c instead of a new host; c waits for that suspend.
        let t = trace(vec![
            session("a", "coding", 1000.0, &[[0.0, 10.0]]),
            session("b", "coding", 1000.0, &[[0.0, 20.0]]),
            Session { id: "c".into(), shape: "coding".into(), arrive_s: 100.0, leave_s: 1000.0, active: vec![] },
        ]);
        let mut p = params(10_000.0, 0.0);
        p.host.vcpus = 4.0;
        let r = simulate(&t, &costs(&[700.0], &[300.0]), &p, Policy::SuspendIdle).unwrap();
        assert_eq!(r.peak_hosts, 1);
        assert_eq!((r.suspends, r.suspends_to_make_room), (1, 1));
        // Keep-running opens a second host for c.
        let k = simulate(&t, &costs(&[700.0], &[300.0]), &p, Policy::KeepRunning).unwrap();
        assert_eq!(k.peak_hosts, 2);
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert_eq!(percentile(&[], 0.99), 0.0);
    }
}
