//! `clade gc`: retention in the ledger, then the store. Three steps, each safe to be killed after:
//! 1. the ledger's collection (one transaction) deletes the marks retention lets go and records them as
//!    *being collected*, so a fork of one meanwhile is refused with a conflict (409), not a miss;
//! 2. the manifests nothing names any more are unpublished from the store, the root RAM files of vm marks
//!    that went are unlinked (a running sibling's `MAP_PRIVATE` mapping keeps its pages: unlinking only drops
//!    the name), and the store's gc frees the packs no live manifest, tree or lease uses;
//! 3. the ledger forgets the marks being collected (from now on they are unknown: 404).
//!
//! A run killed after step 1 leaves marks "being collected" with their manifests still published; the
//! ledger keeps those marks' manifest names, so the next run unpublishes them and finishes the job.

use std::time::{Duration, Instant};

use clade_ledger::{CollectOptions, CollectReport};
use serde::Serialize;

use crate::ops::Ops;

#[derive(Debug, Serialize)]
pub struct GcOutcome {
    pub dry_run: bool,
    /// What retention kept and let go.
    pub ledger: CollectReport,
    /// Manifests and trees unpublished from the store.
    pub manifests_deleted: usize,
    /// Root RAM files unlinked, and their bytes.
    pub ram_files_deleted: usize,
    pub ram_bytes_freed: u64,
    pub store: clade_store::GcReport,
    pub took_ms: f64,
}

/// Collect the ledger's retention, then the store. `dry_run` reports what a real run would do now.
pub fn gc(ops: &Ops, dry_run: bool) -> anyhow::Result<GcOutcome> {
    let start = Instant::now();
    let engine = &ops.engine;
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
        // Root RAM files of vm marks (`ram/<manifest>.ram`; see clade-vm's backend).
        let ram = engine.home.shm_dir().join("ram").join(format!("{m}.ram"));
        if let Ok(meta) = std::fs::metadata(&ram) {
            if !dry_run {
                std::fs::remove_file(&ram)?;
            }
            ram_files_deleted += 1;
            ram_bytes_freed += meta.len();
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
    if !dry_run {
        engine.ledger().finish_collecting()?;
    }
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
                "bytes_freed": store.bytes_freed + ram_bytes_freed,
            }),
        );
    }
    Ok(GcOutcome {
        dry_run,
        ledger,
        manifests_deleted,
        ram_files_deleted,
        ram_bytes_freed,
        store,
        took_ms: took.as_secs_f64() * 1e3,
    })
}

/// `CLADE_GC_PAUSE_MS`: sleep between the ledger's collection and the store's, so a test can fork a mark
/// being collected, or kill the run there.
fn pause_for_tests() {
    if let Some(ms) = std::env::var("CLADE_GC_PAUSE_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
}
