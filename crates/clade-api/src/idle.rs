//! Idle suspend (docs/fleet.md: pay for active sandboxes only). A sandbox with an idle timeout that saw
//! no exec, file or API request for that long is suspended (marked, its CPU and memory released); the next
//! request to it through the API resumes it first, so callers only notice a slower first answer.
//!
//! Activity is the newest of: the ledger's `last_active_ms` (every supervisor request touches it, so CLI and
//! E2B use count too) and this daemon's own record of requests. Timeouts persist in
//! `$CLADE_HOME/run/idle.json`, so a daemon restart keeps them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use clade_core::time::now_ms;
use clade_host::SandboxApi;

#[derive(Default, Serialize, Deserialize)]
struct Entry {
    timeout_s: u64,
    #[serde(default)]
    touched_ms: u64,
    /// Suspended by this loop (not by a user): a request resumes it.
    #[serde(default)]
    idle_suspended: bool,
}

pub struct Idle {
    path: PathBuf,
    default_s: u64,
    entries: Mutex<BTreeMap<String, Entry>>,
}

impl Idle {
    pub fn load(home: &clade_core::CladeHome, default_s: u64) -> Idle {
        let path = home.run_dir().join("idle.json");
        let entries = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        Idle { path, default_s, entries: Mutex::new(entries) }
    }

    fn save(&self, entries: &BTreeMap<String, Entry>) {
        let tmp = self.path.with_extension("json.tmp");
        if let Ok(b) = serde_json::to_vec(entries) {
            if std::fs::create_dir_all(self.path.parent().unwrap_or(std::path::Path::new("/"))).is_ok()
                && std::fs::write(&tmp, b).is_ok()
            {
                let _ = std::fs::rename(&tmp, &self.path);
            }
        }
    }

    pub fn set_timeout(&self, id: &str, secs: u64) {
        let mut e = self.entries.lock();
        let en = e.entry(id.to_string()).or_default();
        en.timeout_s = secs;
        en.touched_ms = now_ms();
        self.save(&e);
    }

    pub fn touch(&self, id: &str) {
        let mut e = self.entries.lock();
        if let Some(en) = e.get_mut(id) {
            en.touched_ms = now_ms();
            if en.idle_suspended {
                en.idle_suspended = false;
                self.save(&e);
            }
        } else if self.default_s > 0 {
            e.insert(id.to_string(), Entry { timeout_s: self.default_s, touched_ms: now_ms(), idle_suspended: false });
            self.save(&e);
        }
    }

    pub fn was_idle_suspended(&self, id: &str) -> bool {
        self.entries.lock().get(id).is_some_and(|e| e.idle_suspended)
    }

    pub fn forget(&self, id: &str) {
        let mut e = self.entries.lock();
        if e.remove(id).is_some() {
            self.save(&e);
        }
    }

    /// Sandboxes due for suspension now: running, with a timeout, idle for longer than it.
    pub(crate) fn due(&self, api: &dyn SandboxApi) -> Vec<String> {
        let now = now_ms();
        let rows = api.list().unwrap_or_default();
        let mut e = self.entries.lock();
        let mut out = Vec::new();
        for r in rows {
            let id = r.id.as_str();
            if r.state != "running" {
                continue;
            }
            if !e.contains_key(id) && self.default_s > 0 {
                e.insert(id.to_string(), Entry { timeout_s: self.default_s, touched_ms: now, idle_suspended: false });
            }
            let Some(en) = e.get(id) else { continue };
            if en.timeout_s == 0 {
                continue;
            }
            let last = en.touched_ms.max(r.last_active_ms.max(0) as u64);
            if now.saturating_sub(last) >= en.timeout_s * 1000 {
                out.push(id.to_string());
            }
        }
        out
    }

    pub(crate) fn mark_suspended(&self, id: &str) {
        let mut e = self.entries.lock();
        if let Some(en) = e.get_mut(id) {
            en.idle_suspended = true;
        }
        self.save(&e);
    }
}
