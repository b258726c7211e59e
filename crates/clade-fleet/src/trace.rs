//! The trace: agent shapes and sessions, as JSON lines (format in `docs/fleet.md`), and the built-in generator of
//! the built-in scenario (18 retained sessions, about 6 active at a time, coding and build agents).

use std::collections::{BTreeMap, BTreeSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// A host of the fleet: what it offers and what it costs while billed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostShape {
    pub vcpus: f64,
    pub memory_gib: f64,
    pub disk_gib: f64,
    /// Dollars per host-hour, billed whether the host is empty or full.
    pub price_per_hour: f64,
}

impl HostShape {
    /// The built-in host, `general_16`: 16 vCPU, 64 GiB, 400 GiB, $0.80 per host-hour.
    pub fn seed004() -> Self {
        Self { vcpus: 16.0, memory_gib: 64.0, disk_gib: 400.0, price_per_hour: 0.80 }
    }
}

/// An agent's shape: what it requests (placement reserves this while it runs) and what it really holds in the
/// base/dirty cost formula of docs/fleet.md (the image's base memory and disk, shared by every session of that
/// image on a host, plus each session's own dirty memory and disk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentShape {
    pub name: String,
    pub vcpus: f64,
    pub memory_gib: f64,
    pub disk_gib: f64,
    /// The image's canonical memory (its base shm), held once per host while a session of it runs there.
    pub base_memory_gib: f64,
    /// Memory a session dirties (private pages) while it runs.
    pub dirty_memory_gib: f64,
    /// The image's base disk (cached once per host while a session of it runs there).
    pub base_disk_gib: f64,
    /// Disk a session dirties; kept (in the blob tier or on the host) for as long as the session is retained.
    pub dirty_disk_gib: f64,
}

impl AgentShape {
    /// The coding agent: 2 vCPU, 8 GiB, 40 GiB. The base/dirty split is the generator's assumption
    /// (a 2 GiB image working set, 1 GiB dirtied RAM, a 10 GiB image with 1 GiB dirtied).
    pub fn coding() -> Self {
        Self {
            name: "coding".into(),
            vcpus: 2.0,
            memory_gib: 8.0,
            disk_gib: 40.0,
            base_memory_gib: 2.0,
            dirty_memory_gib: 1.0,
            base_disk_gib: 10.0,
            dirty_disk_gib: 1.0,
        }
    }
    /// The build agent: 4 vCPU, 16 GiB, 120 GiB (assumed split: 4 GiB base, 4 GiB dirty RAM; 30 GiB base,
    /// 4 GiB dirty disk).
    pub fn build() -> Self {
        Self {
            name: "build".into(),
            vcpus: 4.0,
            memory_gib: 16.0,
            disk_gib: 120.0,
            base_memory_gib: 4.0,
            dirty_memory_gib: 4.0,
            base_disk_gib: 30.0,
            dirty_disk_gib: 4.0,
        }
    }
}

/// One retained session: created at `arrive_s`, deleted at `leave_s`, its user active during `active` (seconds
/// since the trace's start, sorted, disjoint, inside [arrive_s, leave_s]); idle the rest of the time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Session {
    pub id: String,
    pub shape: String,
    pub arrive_s: f64,
    pub leave_s: f64,
    #[serde(default)]
    pub active: Vec<[f64; 2]>,
}

/// A whole trace: shapes by name (the built-in `coding` and `build` unless redefined), sessions, end time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trace {
    pub shapes: BTreeMap<String, AgentShape>,
    pub sessions: Vec<Session>,
    pub end_s: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("trace line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("trace: {0}")]
    Invalid(String),
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
enum Record {
    Shape(AgentShape),
    Session(Session),
    End { at_s: f64 },
}

fn finite_nonneg(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

fn check_shape(s: &AgentShape) -> Result<(), String> {
    if s.name.is_empty() {
        return Err("a shape needs a name".into());
    }
    for (what, v) in [("vcpus", s.vcpus), ("memory_gib", s.memory_gib), ("disk_gib", s.disk_gib)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!("shape {}: {what} must be a positive number, got {v}", s.name));
        }
    }
    for (what, v) in [
        ("base_memory_gib", s.base_memory_gib),
        ("dirty_memory_gib", s.dirty_memory_gib),
        ("base_disk_gib", s.base_disk_gib),
        ("dirty_disk_gib", s.dirty_disk_gib),
    ] {
        if !finite_nonneg(v) {
            return Err(format!("shape {}: {what} must be zero or more, got {v}", s.name));
        }
    }
    if s.base_memory_gib + s.dirty_memory_gib > s.memory_gib {
        return Err(format!(
            "shape {}: base_memory_gib + dirty_memory_gib ({}) exceed memory_gib ({})",
            s.name,
            s.base_memory_gib + s.dirty_memory_gib,
            s.memory_gib
        ));
    }
    if s.base_disk_gib + s.dirty_disk_gib > s.disk_gib {
        return Err(format!(
            "shape {}: base_disk_gib + dirty_disk_gib ({}) exceed disk_gib ({})",
            s.name,
            s.base_disk_gib + s.dirty_disk_gib,
            s.disk_gib
        ));
    }
    Ok(())
}

fn check_session(s: &Session) -> Result<(), String> {
    if s.id.is_empty() {
        return Err("a session needs an id".into());
    }
    if !finite_nonneg(s.arrive_s) || !s.leave_s.is_finite() || s.leave_s <= s.arrive_s {
        return Err(format!(
            "session {}: needs 0 <= arrive_s < leave_s, got arrive_s {} leave_s {}",
            s.id, s.arrive_s, s.leave_s
        ));
    }
    let mut prev_end = s.arrive_s;
    for (i, [a, b]) in s.active.iter().copied().enumerate() {
        if !(a.is_finite() && b.is_finite() && a < b) {
            return Err(format!("session {}: active period {i} [{a}, {b}] must have start < end", s.id));
        }
        if a < prev_end {
            return Err(format!(
                "session {}: active period {i} starts at {a}, before the session arrives or the previous period \
                 ends ({prev_end}); periods must be sorted and disjoint",
                s.id
            ));
        }
        if b > s.leave_s {
            return Err(format!("session {}: active period {i} ends at {b}, after leave_s {}", s.id, s.leave_s));
        }
        prev_end = b;
    }
    Ok(())
}

/// Parses a trace: one JSON object per line (`kind` = `shape`, `session` or `end`); blank lines and lines starting
/// with `#` are skipped. Every problem names its line and what to change.
pub fn parse_trace(text: &str) -> Result<Trace, TraceError> {
    let mut shapes: BTreeMap<String, AgentShape> =
        [AgentShape::coding(), AgentShape::build()].into_iter().map(|s| (s.name.clone(), s)).collect();
    let mut sessions: Vec<(usize, Session)> = Vec::new();
    let mut end: Option<f64> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let t = raw.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let err = |message: String| TraceError::Line { line, message };
        let rec: Record = serde_json::from_str(t).map_err(|e| {
            err(format!("{e} (each line is one JSON object with \"kind\": \"shape\", \"session\" or \"end\")"))
        })?;
        match rec {
            Record::Shape(s) => {
                check_shape(&s).map_err(err)?;
                shapes.insert(s.name.clone(), s);
            }
            Record::Session(s) => {
                check_session(&s).map_err(err)?;
                sessions.push((line, s));
            }
            Record::End { at_s } => {
                if !(at_s.is_finite() && at_s > 0.0) {
                    return Err(err(format!("end: at_s must be a positive number, got {at_s}")));
                }
                if end.replace(at_s).is_some() {
                    return Err(err("a second end line; give at most one".into()));
                }
            }
        }
    }
    if sessions.is_empty() {
        return Err(TraceError::Invalid("no sessions (add lines with \"kind\": \"session\")".into()));
    }
    let mut ids = BTreeSet::new();
    for (line, s) in &sessions {
        if !shapes.contains_key(&s.shape) {
            return Err(TraceError::Line {
                line: *line,
                message: format!(
                    "session {}: unknown shape {:?} (known: {}; define it with a \"kind\": \"shape\" line)",
                    s.id,
                    s.shape,
                    shapes.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        if !ids.insert(s.id.clone()) {
            return Err(TraceError::Line { line: *line, message: format!("session id {} appears twice", s.id) });
        }
    }
    let last_leave = sessions.iter().map(|(_, s)| s.leave_s).fold(0.0, f64::max);
    let end_s = match end {
        Some(e) if e < last_leave => {
            return Err(TraceError::Invalid(format!(
                "end at_s {e} is before the last session leaves ({last_leave}); raise it or drop the end line"
            )))
        }
        Some(e) => e,
        None => last_leave,
    };
    Ok(Trace { shapes, sessions: sessions.into_iter().map(|(_, s)| s).collect(), end_s })
}

impl Trace {
    /// The trace as JSON lines that [`parse_trace`] reads back (shapes first, then sessions, then the end).
    pub fn to_jsonl(&self) -> String {
        let mut out = String::new();
        for s in self.shapes.values() {
            let mut v = serde_json::to_value(s).unwrap_or_default();
            v["kind"] = "shape".into();
            out.push_str(&v.to_string());
            out.push('\n');
        }
        for s in &self.sessions {
            let mut v = serde_json::to_value(s).unwrap_or_default();
            v["kind"] = "session".into();
            out.push_str(&v.to_string());
            out.push('\n');
        }
        out.push_str(&serde_json::json!({"kind": "end", "at_s": self.end_s}).to_string());
        out.push('\n');
        out
    }

    /// Mean number of sessions whose user is active, over the trace.
    pub fn mean_active(&self) -> f64 {
        let busy: f64 = self.sessions.iter().flat_map(|s| s.active.iter()).map(|[a, b]| b - a).sum();
        busy / self.end_s
    }
}

/// Parameters of the built-in scenario (`seed004`).
#[derive(Debug, Clone, Serialize)]
pub struct Seed004 {
    /// Coding sessions and build sessions retained (default: 18 retained, 6 per node).
    pub coding: usize,
    pub build: usize,
    /// Length of the trace (a working day).
    pub hours: f64,
    /// Mean length of an active period and of an idle period (exponential); the active fraction is
    /// active / (active + idle): 20 and 40 minutes give 1/3, i.e. 6 of 18 active on average.
    pub active_mean_min: f64,
    pub idle_mean_min: f64,
    /// `true` (the default): exactly `active / (active + idle)` of each shape's sessions are active at every
    /// moment; when a user's spell ends, another idle session of the same shape takes its turn. `false`: every user
    /// alternates on their own, so the number active fluctuates around that fraction.
    pub fixed_concurrency: bool,
    /// The random generator's seed (ChaCha8): the same seed gives the same trace on every machine.
    pub seed: u64,
}

impl Default for Seed004 {
    fn default() -> Self {
        Self {
            coding: 12,
            build: 6,
            hours: 8.0,
            active_mean_min: 20.0,
            idle_mean_min: 40.0,
            fixed_concurrency: true,
            seed: 4,
        }
    }
}

fn exp_sample(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    let u: f64 = rng.random::<f64>();
    -mean * (1.0 - u).ln()
}

/// The built-in scenario: `coding + build` sessions retained for the whole day (interleaved two coding, one build,
/// the order that packs six to a node), each alternating exponential active and idle periods
/// (at least one minute each) from a random phase.
pub fn seed004(p: &Seed004) -> Trace {
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let end_s = p.hours * 3600.0;
    let n = p.coding + p.build;
    let mut shapes_seq = Vec::with_capacity(n);
    let (mut c, mut b) = (0, 0);
    while c + b < n {
        for want in ["coding", "coding", "build"] {
            if want == "coding" && c < p.coding {
                shapes_seq.push("coding");
                c += 1;
            } else if want == "build" && b < p.build {
                shapes_seq.push("build");
                b += 1;
            } else if c < p.coding {
                shapes_seq.push("coding");
                c += 1;
            } else if b < p.build {
                shapes_seq.push("build");
                b += 1;
            }
        }
    }
    shapes_seq.truncate(n);
    let (act, idle) = (p.active_mean_min * 60.0, p.idle_mean_min * 60.0);
    let duty = act / (act + idle);
    let mut active: Vec<Vec<[f64; 2]>> = vec![Vec::new(); n];
    if p.fixed_concurrency {
        for class in ["coding", "build"] {
            let members: Vec<usize> = (0..n).filter(|i| shapes_seq[*i] == class).collect();
            let seats = ((members.len() as f64) * duty).round() as usize;
            rotate(&mut rng, &members, seats, act, end_s, &mut active);
        }
    } else {
        for spells in active.iter_mut() {
            let mut t = 0.0;
            let mut is_active = rng.random::<f64>() < duty;
            while t < end_s {
                let len = exp_sample(&mut rng, if is_active { act } else { idle }).max(60.0);
                let stop = (t + len).min(end_s);
                if is_active {
                    spells.push([round1(t), round1(stop)]);
                }
                t = stop;
                is_active = !is_active;
            }
        }
    }
    let sessions = shapes_seq
        .iter()
        .zip(active)
        .enumerate()
        .map(|(i, (shape, active))| Session {
            id: format!("s{:02}", i + 1),
            shape: shape.to_string(),
            arrive_s: 0.0,
            leave_s: end_s,
            active,
        })
        .collect();
    let shapes = [AgentShape::coding(), AgentShape::build()].into_iter().map(|s| (s.name.clone(), s)).collect();
    Trace { shapes, sessions, end_s }
}

/// `seats` turns passed around `members`: each seat's user is active for an exponential spell (at least a minute),
/// then a random idle member takes the seat. Spells land in `out[member]`, sorted.
fn rotate(rng: &mut ChaCha8Rng, members: &[usize], seats: usize, mean_s: f64, end_s: f64, out: &mut [Vec<[f64; 2]>]) {
    let seats = seats.min(members.len());
    if seats == 0 {
        return;
    }
    let mut pool: Vec<usize> = members.to_vec();
    // (member, spell start, spell end) per seat.
    let mut held: Vec<(usize, f64, f64)> = Vec::with_capacity(seats);
    for _ in 0..seats {
        let m = pool.swap_remove(rng.random_range(0..pool.len()));
        held.push((m, 0.0, exp_sample(rng, mean_s).max(60.0)));
    }
    loop {
        let (j, _) = held.iter().enumerate().min_by(|a, b| a.1 .2.total_cmp(&b.1 .2)).expect("seats > 0");
        let (m, start, stop) = held[j];
        let stop = stop.min(end_s);
        out[m].push([round1(start), round1(stop)]);
        if stop >= end_s {
            held.remove(j);
            if held.is_empty() {
                break;
            }
            continue;
        }
        // The next user is one who is idle now (not the one just leaving, unless nobody else is).
        let next = if pool.is_empty() { m } else { pool.swap_remove(rng.random_range(0..pool.len())) };
        if next != m {
            pool.push(m);
        }
        held[j] = (next, stop, stop + exp_sample(rng, mean_s).max(60.0));
    }
    for spells in out.iter_mut() {
        spells.sort_by(|a, b| a[0].total_cmp(&b[0]));
        // A seat handed straight back to the same user continues that user's spell.
        let mut merged: Vec<[f64; 2]> = Vec::with_capacity(spells.len());
        for sp in spells.drain(..) {
            match merged.last_mut() {
                Some(last) if sp[0] <= last[1] => last[1] = last[1].max(sp[1]),
                _ => merged.push(sp),
            }
        }
        *spells = merged;
    }
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed004_is_deterministic_and_round_trips() {
        let a = seed004(&Seed004::default());
        let b = seed004(&Seed004::default());
        assert_eq!(a, b);
        assert_eq!(a.sessions.len(), 18);
        assert_eq!(a.sessions.iter().filter(|s| s.shape == "build").count(), 6);
        // About 6 of 18 active on average (1/3 duty cycle), within sampling noise.
        let m = a.mean_active();
        assert!((4.0..8.0).contains(&m), "mean active {m}");
        let back = parse_trace(&a.to_jsonl()).unwrap();
        assert_eq!(back, a);
        let other = seed004(&Seed004 { seed: 5, ..Default::default() });
        assert_ne!(other.sessions, a.sessions);
    }

    #[test]
    fn parses_custom_shapes_comments_and_end() {
        let t = parse_trace(
            "# a tiny trace\n\n\
             {\"kind\":\"shape\",\"name\":\"tiny\",\"vcpus\":1,\"memory_gib\":1,\"disk_gib\":1,\"base_memory_gib\":0.5,\"dirty_memory_gib\":0.1,\"base_disk_gib\":0.5,\"dirty_disk_gib\":0.1}\n\
             {\"kind\":\"session\",\"id\":\"a\",\"shape\":\"tiny\",\"arrive_s\":0,\"leave_s\":100,\"active\":[[0,10],[50,60]]}\n\
             {\"kind\":\"session\",\"id\":\"b\",\"shape\":\"coding\",\"arrive_s\":5,\"leave_s\":50}\n\
             {\"kind\":\"end\",\"at_s\":200}\n",
        )
        .unwrap();
        assert_eq!(t.sessions.len(), 2);
        assert_eq!(t.end_s, 200.0);
        assert!(t.shapes.contains_key("tiny") && t.shapes.contains_key("build"));
    }

    fn err_of(text: &str) -> String {
        parse_trace(text).unwrap_err().to_string()
    }

    #[test]
    fn rejects_bad_input_with_line_and_reason() {
        let s = |extra: &str| format!("{{\"kind\":\"session\",\"id\":\"a\",\"shape\":\"coding\",{extra}}}");
        let e = err_of("not json\n");
        assert!(e.contains("line 1") && e.contains("JSON object"), "{e}");
        let e = err_of(&format!("{}\n", s("\"arrive_s\":10,\"leave_s\":5")));
        assert!(e.contains("line 1") && e.contains("arrive_s < leave_s"), "{e}");
        let e = err_of(&format!("\n{}\n", s("\"arrive_s\":0,\"leave_s\":50,\"active\":[[10,20],[15,30]]")));
        assert!(e.contains("line 2") && e.contains("sorted and disjoint"), "{e}");
        let e = err_of(&format!("{}\n", s("\"arrive_s\":0,\"leave_s\":50,\"active\":[[10,60]]")));
        assert!(e.contains("after leave_s"), "{e}");
        let e = err_of("{\"kind\":\"session\",\"id\":\"a\",\"shape\":\"gpu\",\"arrive_s\":0,\"leave_s\":5}\n");
        assert!(e.contains("unknown shape \"gpu\"") && e.contains("coding"), "{e}");
        let e = err_of(&format!("{}\n{}\n", s("\"arrive_s\":0,\"leave_s\":5"), s("\"arrive_s\":0,\"leave_s\":5")));
        assert!(e.contains("line 2") && e.contains("twice"), "{e}");
        let e = err_of(&format!("{}\n", s("\"arrive_s\":0,\"leave_s\":5,\"colour\":1")));
        assert!(e.contains("unknown field"), "{e}");
        let e = err_of("{\"kind\":\"shape\",\"name\":\"x\",\"vcpus\":0,\"memory_gib\":1,\"disk_gib\":1,\"base_memory_gib\":0,\"dirty_memory_gib\":0,\"base_disk_gib\":0,\"dirty_disk_gib\":0}\n");
        assert!(e.contains("vcpus must be a positive number"), "{e}");
        let e = err_of(&format!("{}\n{{\"kind\":\"end\",\"at_s\":2}}\n", s("\"arrive_s\":0,\"leave_s\":5")));
        assert!(e.contains("before the last session leaves"), "{e}");
        let e = err_of("# only a comment\n");
        assert!(e.contains("no sessions"), "{e}");
    }
}
