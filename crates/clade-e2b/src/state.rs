//! What E2B knows about a sandbox that the host does not: template id, metadata, start and end times,
//! what to do at the end (kill or pause), the envd access token, and the snapshots taken through the API.
//! Kept in memory, written to a JSON file after every change (temp file + rename) when a path is given.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub id: String,
    pub template_id: String,
    #[serde(default)]
    pub alias: Option<String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    pub started_ms: u64,
    pub end_ms: u64,
    /// Pause (not kill) when the timeout passes.
    #[serde(default)]
    pub auto_pause: bool,
    pub token: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub id: String,
    pub sandbox: String,
    #[serde(default)]
    pub names: Vec<String>,
    pub created_ms: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    sandboxes: BTreeMap<String, Record>,
    #[serde(default)]
    snapshots: BTreeMap<String, SnapshotRecord>,
}

pub struct State {
    path: Option<PathBuf>,
    inner: Mutex<Saved>,
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A random token of `bytes` bytes, hex.
pub fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    if getrandom::getrandom(&mut b).is_err() {
        // Without the kernel's RNG, fall back to the clock: still unique, not secret. Say so in the token.
        return format!("weak{:x}", now_ms());
    }
    hex::encode(b)
}

impl State {
    /// Load from `path` (a missing or unreadable file starts empty).
    pub fn open(path: Option<PathBuf>) -> State {
        let saved = path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice::<Saved>(&b).ok())
            .unwrap_or_default();
        State { path, inner: Mutex::new(saved) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Saved> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn save(&self, s: &Saved) {
        let Some(p) = &self.path else { return };
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension("tmp");
        if std::fs::write(&tmp, serde_json::to_vec_pretty(s).unwrap_or_default()).is_ok() {
            let _ = std::fs::rename(tmp, p);
        }
    }

    pub fn get(&self, id: &str) -> Option<Record> {
        self.lock().sandboxes.get(id).cloned()
    }

    pub fn all(&self) -> Vec<Record> {
        self.lock().sandboxes.values().cloned().collect()
    }

    pub fn put(&self, r: Record) {
        let mut s = self.lock();
        s.sandboxes.insert(r.id.clone(), r);
        self.save(&s);
    }

    pub fn update(&self, id: &str, f: impl FnOnce(&mut Record)) -> Option<Record> {
        let mut s = self.lock();
        let r = s.sandboxes.get_mut(id)?;
        f(r);
        let out = r.clone();
        self.save(&s);
        Some(out)
    }

    pub fn remove(&self, id: &str) {
        let mut s = self.lock();
        if s.sandboxes.remove(id).is_some() {
            self.save(&s);
        }
    }

    pub fn put_snapshot(&self, r: SnapshotRecord) {
        let mut s = self.lock();
        s.snapshots.insert(r.id.clone(), r);
        self.save(&s);
    }

    pub fn snapshots(&self) -> Vec<SnapshotRecord> {
        let mut v: Vec<_> = self.lock().snapshots.values().cloned().collect();
        v.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        v
    }

    pub fn remove_snapshot(&self, id: &str) -> bool {
        let mut s = self.lock();
        let had = s.snapshots.remove(id).is_some();
        if had {
            self.save(&s);
        }
        had
    }
}

/// RFC 3339 in UTC with milliseconds, from unix milliseconds.
pub fn rfc3339(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem % 3600 / 60, rem % 60, ms % 1000)
}

/// RFC 3339 with nanoseconds (protobuf's Timestamp in JSON).
pub fn rfc3339_ns(ns: i64) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let frac = ns.rem_euclid(1_000_000_000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{frac:09}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339_ns(1_700_000_000_000_000_001), "2023-11-14T22:13:20.000000001Z");
    }

    #[test]
    fn state_survives_a_reopen() {
        let dir = std::env::temp_dir().join(format!("clade-e2b-state-{}", random_hex(6)));
        let p = dir.join("e2b.json");
        let s = State::open(Some(p.clone()));
        let r = Record {
            id: "sb-1".into(),
            template_id: "minimal".into(),
            alias: None,
            metadata: [("k".to_string(), "v".to_string())].into(),
            started_ms: 1,
            end_ms: 2,
            auto_pause: true,
            token: random_hex(16),
            cpu_count: 1,
            memory_mb: 256,
            disk_mb: 2048,
        };
        s.put(r.clone());
        s.put_snapshot(SnapshotRecord { id: "mk-1".into(), sandbox: "sb-1".into(), names: vec![], created_ms: 3 });
        let again = State::open(Some(p));
        assert_eq!(again.get("sb-1"), Some(r));
        assert_eq!(again.snapshots().len(), 1);
        let _ = std::fs::remove_dir_all(dir);
    }
}
