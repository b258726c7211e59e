//! `clade gc`: retention in the ledger, then the store. Three steps, each safe to be killed after:
//! 1. the ledger's collection (one transaction) deletes the marks retention lets go and records them as
//!    *being collected*, so a fork of one meanwhile is refused with a conflict (409), not a miss;
//! 2. the manifests nothing names any more are unpublished from the store, the root RAM files of vm marks
//!    that went are unlinked (a running sibling's `MAP_PRIVATE` mapping keeps its pages: unlinking only drops
//!    the name), and the store's gc frees the packs no live manifest, tree or lease uses;
//! 3. the host caches laid out from trees no mark names any more (each backend's `Footprint::tree_caches`:
//!    the `ct` backend's uppers and CRIU images under `$CLADE_HOME/cache/<kind>/<tree>`) are removed;
//! 4. the ledger forgets the marks being collected (from now on they are unknown: 404).
//!
//! A run killed after step 1 leaves marks "being collected" with their manifests still published; the
//! ledger keeps those marks' manifest names, so the next run unpublishes them and finishes the job.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use clade_ledger::{CollectOptions, CollectReport};
use serde::{Deserialize, Serialize};

use clade_core::engine::Engine;

#[derive(Debug, Serialize, Deserialize)]
pub struct GcOutcome {
    pub dry_run: bool,
    /// What retention kept and let go.
    pub ledger: CollectReport,
    /// Manifests and trees unpublished from the store.
    pub manifests_deleted: usize,
    /// Root RAM files unlinked, and their bytes.
    pub ram_files_deleted: usize,
    pub ram_bytes_freed: u64,
    /// Host cache directories of trees no mark names (ct uppers and images), and their bytes.
    pub cache_dirs_deleted: usize,
    pub cache_bytes_freed: u64,
    /// Warm-pool members of marks that are gone (or being collected), ended: no claim can come for them.
    pub pool_members_ended: usize,
    pub store: clade_store::GcReport,
    pub took_ms: f64,
}

/// Collect the ledger's retention, then the store. `dry_run` reports what a real run would do now.
pub fn gc(engine: &Engine, dry_run: bool) -> anyhow::Result<GcOutcome> {
    let start = Instant::now();
    let ledger = engine.ledger().collect(&CollectOptions { dry_run, branch: None })?;
    pause_for_tests();
    // Manifests no mark names: this run's, and any a run killed mid-way left published.
    let mut unreferenced: Vec<String> = ledger.unreferenced_manifests.iter().map(|m| m.as_str().to_string()).collect();
    if !dry_run {
        unreferenced.extend(engine.ledger().collecting_manifests()?.into_iter().map(|m| m.as_str().to_string()));
        unreferenced.sort();
        unreferenced.dedup();
    }
    let mut manifests_deleted = 0;
    let mut ram_files_deleted = 0;
    let mut ram_bytes_freed = 0;
    for m in &unreferenced {
        // Host files derived from the manifest (a vm mark's root RAM file).
        for f in crate::backends::footprints().iter().flat_map(|fp| fp.derived_files(&engine.home, m)) {
            if let Ok(meta) = std::fs::metadata(&f) {
                if !dry_run {
                    std::fs::remove_file(&f)?;
                }
                ram_files_deleted += 1;
                ram_bytes_freed += meta.len();
            }
        }
        if dry_run {
            manifests_deleted += 1;
            continue;
        }
        // A mark names images (manifests) and directories (trees, the ct backend's CRIU images and upper);
        // both share one id space, so try each.
        if let Ok(id) = m.parse::<clade_store::ManifestId>() {
            if engine.store.delete_manifest(&id)? || engine.store.delete_tree(&clade_store::TreeId(id.0))? {
                manifests_deleted += 1;
            }
        }
    }
    let store = engine.store.gc(dry_run)?;
    // The live set as of now; a dry run's ledger still names the marks it would delete, so leave those out.
    let mut live: BTreeSet<String> = engine.ledger().live_manifests()?.iter().map(|m| m.as_str().to_string()).collect();
    if dry_run {
        for m in &unreferenced {
            live.remove(m);
        }
    }
    let (cache_dirs_deleted, cache_bytes_freed) = sweep_tree_caches(&engine.home.cache_dir(), &live, dry_run)?;
    if !dry_run {
        engine.ledger().finish_collecting()?;
    }
    let pool_members_ended = sweep_pools(engine, dry_run);
    let took = start.elapsed();
    if !dry_run {
        engine.op(
            "gc",
            None,
            None,
            took,
            None,
            serde_json::json!({
                "marks_deleted": ledger.deleted.len(), "manifests_deleted": manifests_deleted,
                "bytes_freed": store.bytes_freed + ram_bytes_freed + cache_bytes_freed,
                "cache_dirs_deleted": cache_dirs_deleted, "pool_members_ended": pool_members_ended,
            }),
        );
    }
    Ok(GcOutcome {
        dry_run,
        ledger,
        manifests_deleted,
        ram_files_deleted,
        ram_bytes_freed,
        cache_dirs_deleted,
        cache_bytes_freed,
        pool_members_ended,
        store,
        took_ms: took.as_secs_f64() * 1e3,
    })
}

/// End the warm pools of marks the ledger no longer has (or is collecting): a fork of such a mark is refused,
/// so their members would wait for ever, each holding a restored sandbox. Returns the members ended (in a dry
/// run, the members that would be).
fn sweep_pools(engine: &clade_core::engine::Engine, dry_run: bool) -> usize {
    use crate::supervisor::pool;
    let mut ended = 0;
    let Ok(rd) = std::fs::read_dir(engine.home.run_dir().join("pool")) else { return 0 };
    for e in rd.flatten() {
        let mark = e.file_name().to_string_lossy().into_owned();
        let gone = {
            let l = engine.ledger();
            matches!(l.mark(&clade_ledger::MarkId::new(mark.clone())), Err(clade_ledger::LedgerError::NotFound { .. }))
                || matches!(l.collecting(&mark), Ok(Some(_)))
        };
        if !gone {
            continue;
        }
        if dry_run {
            ended += pool::members(&engine.home, &mark).0.len();
            continue;
        }
        ended += pool::drain(&engine.home, &mark);
        // Members still preparing find the size gone and end on their own; the directory goes once empty.
        let _ = std::fs::remove_file(e.path().join("pool.log"));
        let _ = std::fs::remove_dir(e.path());
    }
    ended
}

/// A half-laid-out cache (`<tree>.tmp<pid>-<n>`) older than this belongs to a restore that died.
const TEMP_AGE: Duration = Duration::from_secs(3600);

/// Remove (or, in a dry run, count) the cache directories of trees `live` does not name, and temp directories
/// left by dead restores. Each is renamed aside first, so a restore never sees half of one under its name: a
/// restore copying from it at that moment fails cleanly, and none can start (its mark is gone or collecting).
fn sweep_tree_caches(cache: &Path, live: &BTreeSet<String>, dry_run: bool) -> anyhow::Result<(usize, u64)> {
    let (mut dirs, mut bytes) = (0, 0);
    // The per-host caches restores lay out from a mark's trees, named by the tree's id (ct uppers and images).
    for kind in crate::backends::footprints().iter().flat_map(|fp| fp.tree_caches()) {
        let Ok(rd) = std::fs::read_dir(cache.join(kind)) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let stale = match name.split_once(".tmp") {
                Some(_) => e
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| SystemTime::now().duration_since(t).unwrap_or_default() > TEMP_AGE),
                None if name.starts_with(".gc-") => true,
                // A layout's note of the files it left lazy (`<tree>.lazy`) goes with its tree.
                None => !live.contains(name.strip_suffix(".lazy").unwrap_or(&name)),
            };
            if !stale {
                continue;
            }
            dirs += usize::from(!name.ends_with(".lazy"));
            bytes += dir_bytes(&e.path());
            if dry_run {
                continue;
            }
            let aside = cache.join(kind).join(format!(".gc-{}", name.trim_start_matches(".gc-")));
            if aside != e.path() {
                std::fs::rename(e.path(), &aside)?;
            }
            if std::fs::symlink_metadata(&aside)?.is_dir() {
                std::fs::remove_dir_all(&aside)?;
            } else {
                std::fs::remove_file(&aside)?;
            }
        }
    }
    // The layouts' lock files (`.locks/<kind>-<tree>`), once their tree is not live.
    if !dry_run {
        if let Ok(rd) = std::fs::read_dir(cache.join(".locks")) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.rsplit_once('-').is_some_and(|(_, tree)| !live.contains(tree)) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
    Ok((dirs, bytes))
}

/// Bytes of the regular files under `p` (symlinks not followed); also the bench's store footprint.
pub fn dir_bytes(p: &Path) -> u64 {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            std::fs::read_dir(p).map(|rd| rd.flatten().map(|e| dir_bytes(&e.path())).sum()).unwrap_or(0)
        }
        Ok(m) if m.is_file() => m.len(),
        _ => 0,
    }
}

/// `CLADE_GC_PAUSE_MS`: sleep between the ledger's collection and the store's, so a test can fork a mark
/// being collected, or kill the run there.
fn pause_for_tests() {
    if let Some(ms) = std::env::var("CLADE_GC_PAUSE_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_caches_keep_what_a_mark_names_and_young_temps() {
        let dir = tempfile::tempdir().unwrap();
        let uppers = dir.path().join("ct-uppers");
        for d in ["live", "dead", "live.tmp7-1", "dead.tmp7-2", ".gc-half"] {
            std::fs::create_dir_all(uppers.join(d)).unwrap();
            std::fs::write(uppers.join(d).join("f"), b"1234").unwrap();
        }
        // Notes of the files a layout left lazy (clade-ct's lazy_upper) go with their layout.
        for f in ["live.lazy", "dead.lazy"] {
            std::fs::write(uppers.join(f), b"ab").unwrap();
        }
        // A temp of a restore that died an hour ago, beside one still being laid out.
        let old = nix::sys::time::TimeVal::new(1_000_000, 0);
        nix::sys::stat::utimes(&uppers.join("dead.tmp7-2"), &old, &old).unwrap();
        let live: BTreeSet<String> = ["live".to_string()].into();
        let want = (3, 14);
        assert_eq!(
            sweep_tree_caches(dir.path(), &live, true).unwrap(),
            want,
            "dry run: dead (and its note), old temp, aside"
        );
        assert_eq!(std::fs::read_dir(&uppers).unwrap().count(), 7, "a dry run removes nothing");
        assert_eq!(sweep_tree_caches(dir.path(), &live, false).unwrap(), want);
        let mut left: Vec<String> = std::fs::read_dir(&uppers)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, vec!["live", "live.lazy", "live.tmp7-1"]);
    }
}
