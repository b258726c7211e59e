//! What E2B knows about a sandbox that the host does not: template id, metadata, start and end times,
//! what to do at the end (kill or pause), the envd access token, and the snapshots taken through the API.
//! Kept in memory, written to a JSON file after every change (temp file + rename, mode 0600) when a path is
//! given.
//!
//! Access tokens never reach that file. E2B's API hands a sandbox's `envdAccessToken` out again on every
//! connect and detail call, so the plaintext must be recoverable after a restart; a stored hash would not do.
//! Each token is therefore derived: `BLAKE3-keyed(token key, sandbox id, salt)`, where the salt (random, not
//! secret) is in the records file and the 32-byte token key is in `token.key` beside it, created 0600 in the
//! 0700 `e2b/` directory. Reading the records file alone (the attack this answers: a 0644 file of tokens that
//! gave a local user a root shell through envd) yields no token. Tokens are checked in constant time
//! ([`same_secret`]). A records file from before this scheme (plaintext `token` fields) is rewritten at
//! open: those sandboxes get new tokens, which `Sandbox.connect` returns.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
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
    /// The timeout's auto-pause keeps the filesystem alone (`autoPauseMemory: false`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_pause_disk_only: bool,
    /// The envd access token: in memory only, derived from the token key and [`Record::salt`].
    #[serde(skip)]
    pub token: String,
    /// Public input to the token's derivation (a new one rotates the token).
    #[serde(default)]
    pub salt: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
    /// Egress rules set through E2B (`allowOut` / `denyOut`, `allowInternetAccess: false` as a denial of
    /// everything): applied again after every resume, since a restored sandbox gets a fresh network.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_allow: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_deny: Vec<String>,
    /// `allowPublicTraffic: false`: requests to the sandbox's ports need its traffic access token (derived
    /// like the envd token, never stored).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub private_traffic: bool,
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
    /// The key tokens are derived with (see the module doc).
    token_key: [u8; 32],
    inner: Mutex<Saved>,
}

/// The records or the token key could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("E2B state {}: {source} (check the owner and mode of clade's e2b/ directory)", path.display())]
pub struct StateError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Compares two secrets (API keys, access tokens) in time that depends on their lengths only, not on where
/// they first differ: a remote guesser learns nothing from how long a refusal took. `subtle` is the
/// RustCrypto/dalek constant-time crate, kept by people whose job is exactly this.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// Writes `bytes` to `path` through a temp file made 0600 (never world-readable, not even for a moment).
fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The token key beside `records` (`token.key`): read, or made once (32 random bytes, hex, 0600).
fn load_token_key(records: &std::path::Path) -> Result<[u8; 32], StateError> {
    let path = records.with_file_name("token.key");
    let err = |source| StateError { path: path.clone(), source };
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let mut key = [0u8; 32];
            hex::decode_to_slice(s.trim(), &mut key).map_err(|e| {
                err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("not 64 hex digits ({e}); remove it to make a new key (every sandbox's token changes)"),
                ))
            })?;
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut key = [0u8; 32];
            getrandom::getrandom(&mut key).map_err(|e| err(std::io::Error::other(e.to_string())))?;
            write_private(&path, hex::encode(key).as_bytes()).map_err(err)?;
            Ok(key)
        }
        Err(e) => Err(err(e)),
    }
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
    /// Load from `path` (a missing file starts empty; an unreadable or malformed one too, as before), with the
    /// token key beside it; `None`: memory only, with a key of this process's own.
    pub fn open(path: Option<PathBuf>) -> Result<State, StateError> {
        let token_key = match &path {
            Some(p) => load_token_key(p)?,
            None => {
                let mut k = [0u8; 32];
                getrandom::getrandom(&mut k).map_err(|e| StateError {
                    path: PathBuf::from("(memory)"),
                    source: std::io::Error::other(e.to_string()),
                })?;
                k
            }
        };
        let raw = path.as_ref().and_then(|p| std::fs::read(p).ok());
        let mut saved = raw.as_deref().and_then(|b| serde_json::from_slice::<Saved>(b).ok()).unwrap_or_default();
        let mut legacy = raw.as_deref().is_some_and(|b| String::from_utf8_lossy(b).contains("\"token\""));
        let state = State { path, token_key, inner: Mutex::new(Saved::default()) };
        for r in saved.sandboxes.values_mut() {
            if r.salt.is_empty() {
                r.salt = random_hex(16);
                legacy = true;
            }
            r.token = state.token_for(&r.id, &r.salt);
        }
        if legacy {
            // Plaintext tokens of an older clade leave the disk now, not at the next change.
            state.save(&saved);
        }
        *state.inner.lock() = saved;
        Ok(state)
    }

    /// A new salt and the token it gives `id`.
    pub fn issue_token(&self, id: &str) -> (String, String) {
        let salt = random_hex(16);
        let token = self.token_for(id, &salt);
        (salt, token)
    }

    fn token_for(&self, id: &str, salt: &str) -> String {
        let mut h = blake3::Hasher::new_keyed(&self.token_key);
        h.update(b"clade e2b envd access token\0");
        h.update(id.as_bytes());
        h.update(b"\0");
        h.update(salt.as_bytes());
        hex::encode(&h.finalize().as_bytes()[..16])
    }

    /// The token requests to a private sandbox's ports carry (`e2b-traffic-access-token`).
    pub fn traffic_token(&self, r: &Record) -> String {
        self.token_for(&format!("traffic\0{}", r.id), &r.salt)
    }

    /// Whether `given` is `id`'s access token (constant time).
    pub fn token_ok(&self, id: &str, given: Option<&str>) -> bool {
        let Some(r) = self.get(id) else { return false };
        let given = given.unwrap_or("");
        !given.is_empty() && same_secret(given.as_bytes(), r.token.as_bytes())
    }

    fn save(&self, s: &Saved) {
        let Some(p) = &self.path else { return };
        if let Err(e) = write_private(p, &serde_json::to_vec_pretty(s).unwrap_or_default()) {
            // The records are a cache of the host's truth: serving goes on, a restart forgets what was lost.
            eprintln!("e2b: could not save {}: {e}", p.display());
        }
    }

    pub fn get(&self, id: &str) -> Option<Record> {
        self.inner.lock().sandboxes.get(id).cloned()
    }

    pub fn all(&self) -> Vec<Record> {
        self.inner.lock().sandboxes.values().cloned().collect()
    }

    pub fn put(&self, r: Record) {
        let mut s = self.inner.lock();
        s.sandboxes.insert(r.id.clone(), r);
        self.save(&s);
    }

    pub fn update(&self, id: &str, f: impl FnOnce(&mut Record)) -> Option<Record> {
        let mut s = self.inner.lock();
        let r = s.sandboxes.get_mut(id)?;
        f(r);
        let out = r.clone();
        self.save(&s);
        Some(out)
    }

    pub fn remove(&self, id: &str) {
        let mut s = self.inner.lock();
        if s.sandboxes.remove(id).is_some() {
            self.save(&s);
        }
    }

    pub fn put_snapshot(&self, r: SnapshotRecord) {
        let mut s = self.inner.lock();
        s.snapshots.insert(r.id.clone(), r);
        self.save(&s);
    }

    pub fn snapshots(&self) -> Vec<SnapshotRecord> {
        let mut v: Vec<_> = self.inner.lock().snapshots.values().cloned().collect();
        v.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        v
    }

    pub fn remove_snapshot(&self, id: &str) -> bool {
        let mut s = self.inner.lock();
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

    fn record(s: &State, id: &str) -> Record {
        let (salt, token) = s.issue_token(id);
        Record {
            id: id.into(),
            template_id: "minimal".into(),
            alias: None,
            metadata: BTreeMap::new(),
            started_ms: 1,
            end_ms: 2,
            auto_pause: false,
            auto_pause_disk_only: false,
            token,
            salt,
            cpu_count: 1,
            memory_mb: 256,
            disk_mb: 2048,
            egress_allow: vec![],
            egress_deny: vec![],
            private_traffic: false,
        }
    }

    fn mode(p: &std::path::Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_records_file_holds_no_token_and_is_0600() {
        let dir = std::env::temp_dir().join(format!("clade-e2b-state-{}", random_hex(6)));
        let p = dir.join("sandboxes.json");
        let s = State::open(Some(p.clone())).unwrap();
        let r = record(&s, "sb-1");
        assert_eq!(r.token.len(), 32);
        s.put(r.clone());
        let on_disk = std::fs::read_to_string(&p).unwrap();
        assert!(on_disk.contains("sb-1") && !on_disk.contains(&r.token), "{on_disk}");
        assert_eq!(mode(&p), 0o600);
        assert_eq!(mode(&dir.join("token.key")), 0o600);
        // The same token after a restart (E2B hands it out again on connect), checked whole.
        let again = State::open(Some(p.clone())).unwrap();
        assert_eq!(again.get("sb-1").unwrap().token, r.token);
        assert!(again.token_ok("sb-1", Some(&r.token)));
        assert!(!again.token_ok("sb-1", Some(&r.token[..31])));
        assert!(!again.token_ok("sb-1", Some("")));
        assert!(!again.token_ok("sb-1", None));
        assert!(!again.token_ok("sb-2", Some(&r.token)));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn plaintext_tokens_of_an_older_clade_leave_the_disk_at_open() {
        let dir = std::env::temp_dir().join(format!("clade-e2b-state-{}", random_hex(6)));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("sandboxes.json");
        let old = r#"{"sandboxes":{"sb-1":{"id":"sb-1","template_id":"t","started_ms":1,"end_ms":2,
            "token":"0123456789abcdef0123456789abcdef","cpu_count":1,"memory_mb":1,"disk_mb":1}}}"#;
        std::fs::write(&p, old).unwrap();
        let s = State::open(Some(p.clone())).unwrap();
        let on_disk = std::fs::read_to_string(&p).unwrap();
        assert!(!on_disk.contains("0123456789abcdef"), "{on_disk}");
        let t = s.get("sb-1").unwrap().token;
        assert!(t.len() == 32 && t != "0123456789abcdef0123456789abcdef");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"ab"));
        assert!(!same_secret(b"", b"a"));
        assert!(same_secret(b"", b""));
    }

    #[test]
    fn state_survives_a_reopen() {
        let dir = std::env::temp_dir().join(format!("clade-e2b-state-{}", random_hex(6)));
        let p = dir.join("e2b.json");
        let s = State::open(Some(p.clone())).unwrap();
        let r = Record {
            id: "sb-1".into(),
            template_id: "minimal".into(),
            alias: None,
            metadata: [("k".to_string(), "v".to_string())].into(),
            started_ms: 1,
            end_ms: 2,
            auto_pause: true,
            auto_pause_disk_only: false,
            token: String::new(),
            salt: String::new(),
            cpu_count: 1,
            memory_mb: 256,
            disk_mb: 2048,
            egress_allow: vec![],
            egress_deny: vec!["0.0.0.0/0".into()],
            private_traffic: true,
        };
        let (salt, token) = s.issue_token("sb-1");
        let r = Record { salt, token, ..r };
        s.put(r.clone());
        s.put_snapshot(SnapshotRecord { id: "mk-1".into(), sandbox: "sb-1".into(), names: vec![], created_ms: 3 });
        let again = State::open(Some(p)).unwrap();
        assert_eq!(again.get("sb-1"), Some(r));
        assert_eq!(again.snapshots().len(), 1);
        let _ = std::fs::remove_dir_all(dir);
    }
}
