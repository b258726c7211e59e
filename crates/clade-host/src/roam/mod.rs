//! Roaming: a suspended sandbox leaves this host through the shared blob tier and resumes on another
//! (docs/roam.md). `push` makes the blob tier hold everything its head mark needs (manifests, trees, packs,
//! and the lower layers that live in this home) plus a small state record and an ownership marker, then this
//! host forgets the sandbox. `pull` on another host takes ownership, names the lower layers as store trees
//! (mounted lazily at restore, clade_ct::lower), and records
//! the sandbox, its branch and its head mark in that host's ledger as suspended: `clade resume` then restores
//! it there, reading objects from the blob tier on first use (the vm disk through the NBD server, lazily) and
//! leaving them in the local caches.
//!
//! Blob keys: `roam/sandboxes/<id>/record.json` (what the other ledger needs) and
//! `roam/sandboxes/<id>/owner.json` (`{"host", "state": "pushed"|"taken"}`): a sandbox taken by one host
//! cannot be pulled by another until that host pushes it again; [`owner`] makes the taking exclusive.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use clade_core::engine::{from_ledger, Engine};
use clade_core::time::now_ms;
use clade_ledger::{BranchId, Mark, NewBranch, NewMark, NewSandbox, RetentionPolicy, SandboxId, SandboxState};

use clade_store::TreeId;
use serde::{Deserialize, Serialize};

use crate::backends::footprint;
use crate::error::{check_id, conflict, invalid, not_found};

mod hosts;
mod owner;

pub use hosts::{beat, beat_every, list as hosts, Beat, HostRow};
use hosts::{need_blob, roots_of};
use owner::{read_owner, write_owner};
pub use owner::{take, Owner, CLAIM_TTL};

/// What another host's ledger needs to resume the sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub format: u32,
    pub sandbox: String,
    pub backend: clade_ledger::Backend,
    pub branch: String,
    pub origin_mark: Option<String>,
    /// The branch's head, the state to resume.
    pub mark: Mark,
    /// Lower layers of a ct mark: those that lived in the pushing home travel as trees.
    pub lowers: Vec<Lower>,
    /// Bytes the mark describes (all its images and trees, lower layers included).
    pub full_bytes: u64,
    pub pushed_by: String,
    pub pushed_ms: u64,
    /// The packs (ids) the mark's frames live in: a host taking it loads their indexes without listing the
    /// tier (`Store::load_blob_packs`). Empty in records of older pushes.
    #[serde(default)]
    pub packs: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lower {
    /// The path on the pushing host.
    pub path: String,
    /// Its tree in the store, when it lived in the pushing home; `None`: an installed path every host has.
    pub tree: Option<String>,
}

/// A push of a suspended sandbox to the blob tier.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PushOutcome {
    pub sandbox: String,
    pub mark: clade_ledger::MarkId,
    /// The blob tier's URL.
    pub blob: String,
    /// This host's name.
    pub host: String,
    pub full_bytes: u64,
    pub packs: usize,
    pub packs_uploaded: usize,
    pub bytes_uploaded: u64,
    pub push_ms: f64,
}

/// A pull of a pushed sandbox into this host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PullOutcome {
    pub sandbox: String,
    pub mark: clade_ledger::MarkId,
    pub blob: String,
    pub host: String,
    /// The host that pushed it.
    pub from: String,
    pub full_bytes: u64,
    pub pull_ms: f64,
    /// Bytes this process read from the tier: the pull's own, and within a resume also its backend's
    /// fetch-ahead and the heartbeat after it.
    pub blob_bytes: u64,
}

/// A sandbox in the blob tier and who has it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoamRow {
    pub sandbox: String,
    /// `None` when its owner record is missing (a push cut short before it was written).
    pub owner: Option<Owner>,
}

fn record_key(sbx: &str) -> String {
    format!("sandboxes/{sbx}/record.json")
}

/// This home's host id (`$CLADE_HOME/host-id`, made once).
pub fn host_id(engine: &Engine) -> anyhow::Result<String> {
    let p = engine.home.root().join("host-id");
    if let Ok(s) = std::fs::read_to_string(&p) {
        if !s.trim().is_empty() {
            return Ok(s.trim().to_string());
        }
    }
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))?;
    let id = format!("host-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>());
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, &id).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, &p)?;
    Ok(id)
}

/// A lower layer of this home as a store tree. An overlay's lower layers never change while a mark names them
/// (a template's root file system and the agent's cache are named by content or version, and a rebuild makes
/// a new directory), so the tree stored for a directory (its path, inode and modification time) is
/// remembered in `cache/layer-trees/` and reused while the store holds it: a second push does not walk the
/// whole root file system again. Stored locally through a deferred handle: push_roots uploads it with the
/// rest, several packs at once.
fn layer_as_tree(engine: &Engine, dir: &Path) -> anyhow::Result<TreeId> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(dir).with_context(|| format!("lower layer {}", dir.display()))?;
    let name = format!("{}@{}.{}", dir.display(), md.ino(), md.mtime_nsec() + md.mtime() * 1_000_000_000);
    let memo = engine.home.root().join("cache/layer-trees").join(name.trim_start_matches('/').replace('/', "%"));
    if let Some(t) = std::fs::read_to_string(&memo).ok().and_then(|s| s.trim().parse::<TreeId>().ok()) {
        if engine.store.has_tree(&t) {
            return Ok(t);
        }
    }
    let r = engine.store.deferred().put_dir(dir).with_context(|| format!("store lower layer {}", dir.display()))?;
    if let Some(parent) = memo.parent() {
        std::fs::create_dir_all(parent)?;
        let tmp = memo.with_extension("tmp");
        std::fs::write(&tmp, r.id.to_string())?;
        std::fs::rename(&tmp, &memo)?;
    }
    Ok(r.id)
}

/// Run `a` on a thread of its own while `b` runs here: two round trips through the blob tier's quorum at once.
pub(crate) fn at_once<A: Send, B>(a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B) -> anyhow::Result<(A, B)> {
    std::thread::scope(|s| {
        let a = s.spawn(a);
        let b = b();
        Ok((a.join().map_err(|_| anyhow::anyhow!("a blob request thread panicked"))?, b))
    })
}

/// Milliseconds since `start`, for progress lines.
fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// Push a suspended sandbox to the blob tier and forget it here.
pub fn push(engine: &Engine, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<PushOutcome> {
    check_id(sandbox)?;
    let tier = need_blob(engine)?;
    let me = host_id(engine)?;
    let start = Instant::now();
    let id = SandboxId::new(sandbox);
    let rec = engine.ledger().sandbox(&id).map_err(|_| not_found(format!("no sandbox {sandbox} on this host")))?;
    if rec.state != SandboxState::Suspended {
        return Err(conflict(format!(
            "sandbox {sandbox} is {}: `clade suspend {sandbox}` first (only a suspended sandbox can move)",
            rec.state.as_str()
        )));
    }
    let head = engine
        .ledger()
        .head(&rec.branch)?
        .ok_or_else(|| not_found(format!("sandbox {sandbox} has no mark to push")))?;
    let (mans, mut trees, mut full) = roots_of(engine, &head)?;
    // The roots in flight are leased in the blob tier before anything is uploaded (the lower layers are stored
    // locally first, uploading nothing), so no host's blob gc frees the packs this push uploads before the
    // roots naming them.
    let lease = |trees: &[TreeId]| -> Vec<clade_store::Root> {
        mans.iter()
            .copied()
            .map(clade_store::Root::Manifest)
            .chain(trees.iter().copied().map(clade_store::Root::Tree))
            .collect()
    };
    // Layers in this home (a ct mark's overlay lowers) travel as trees; installed paths elsewhere must exist on
    // every host.
    let fp = footprint(from_ledger(head.backend));
    let mut lowers = Vec::new();
    if let Some(l) = fp.layers_role().and_then(|role| head.manifests.get(role)) {
        for path in l.as_str().split(':').filter(|p| !p.is_empty()) {
            let tree = if let Some(t) = fp.layer_tree(path) {
                // Already a tree (the sandbox came from another host before).
                trees.push(t);
                full += engine.store.tree(&t)?.manifests().map(|m| m.size).sum::<u64>();
                Some(t.to_string())
            } else if Path::new(path).starts_with(engine.home.root()) {
                progress(&format!("push [{:.0} ms]: lower layer {path}", ms(start)));
                let t = layer_as_tree(engine, Path::new(path))?;
                full += engine.store.tree(&t)?.manifests().map(|m| m.size).sum::<u64>();
                trees.push(t);
                Some(t.to_string())
            } else {
                None
            };
            lowers.push(Lower { path: path.to_string(), tree });
        }
    }
    progress(&format!(
        "push [{:.0} ms]: {} manifests, {} trees of mark {} to {tier}",
        ms(start),
        mans.len(),
        trees.len(),
        head.id
    ));
    // The owner record is read while the lease goes up (each a round trip through the store's quorum): a lease
    // written for a push that is then refused only keeps its roots until the next beat.
    // Meanwhile the packs the tier lacks go up (`Store::push_packs`, which also finds the packs the record
    // names; those of a push that is then refused are left to the blob gc).
    let (both, packed) = at_once(
        || at_once(|| read_owner(&engine.store, sandbox), || beat(engine, &me, &lease(&trees))),
        || engine.store.push_packs(&mans, &trees),
    )?;
    let (owner, leased) = both?;
    let packed = packed?;
    if let Some(o) = owner? {
        if o.state == "taken" && o.host != me {
            return Err(conflict(format!("sandbox {sandbox} in {tier} is owned by host {} (it took it)", o.host)));
        }
    }
    leased?;
    let record = Record {
        format: 1,
        sandbox: sandbox.to_string(),
        backend: rec.backend,
        branch: rec.branch.as_str().to_string(),
        origin_mark: rec.origin_mark.as_ref().map(|m| m.as_str().to_string()),
        mark: head.clone(),
        lowers,
        full_bytes: full,
        pushed_by: me.clone(),
        pushed_ms: now_ms(),
        packs: packed.packs().iter().map(|p| p.to_hex()).collect(),
    };
    // The state record goes up beside the data: no host pulls before the owner record says `pushed`, which is
    // written once both are up (a record left by a push that failed names a mark no owner record offers).
    let record = serde_json::to_vec_pretty(&record)?;
    // The packs that were in the tier already are asked for again now that the lease is up (push_finish).
    let (put, rep) = at_once(
        || engine.store.blob_put_meta(&record_key(sandbox), record),
        || engine.store.push_finish(packed, true),
    )?;
    put?;
    let rep = rep?;
    progress(&format!(
        "push [{:.0} ms]: {} packs ({} uploaded, {} bytes), {} roots uploaded",
        ms(start),
        rep.packs,
        rep.packs_uploaded,
        rep.bytes_uploaded,
        rep.roots_uploaded
    ));
    // The heartbeat, without the sandbox, goes up with the owner record (each a round trip through the store's
    // quorum).
    let (owned, beaten) = at_once(
        || write_owner(&engine.store, sandbox, &me, "pushed"),
        || hosts::beat_without(engine, &me, &[], Some(sandbox)),
    )?;
    owned?;
    // This host forgets the sandbox; its branch and head stay (pinned) so local gc never unpublishes objects
    // another host now resumes from (delete_manifest unpublishes in the blob tier too).
    {
        let l = engine.ledger();
        l.pin(&head.id, true)?;
        l.set_sandbox_state(&id, SandboxState::Dead, Some(&format!("pushed to {tier}")))?;
        l.remove_sandbox(&id)?;
    }
    if let Err(e) = beaten {
        progress(&format!("push [{:.0} ms]: warning: heartbeat: {e:#}", ms(start)));
    }
    let took = start.elapsed();
    engine.op("push", None, Some(&head.id), took, None, serde_json::json!({"sandbox": sandbox, "report": rep}));
    Ok(PushOutcome {
        sandbox: sandbox.to_string(),
        mark: head.id,
        blob: tier,
        host: me,
        full_bytes: full,
        packs: rep.packs,
        packs_uploaded: rep.packs_uploaded,
        bytes_uploaded: rep.bytes_uploaded,
        push_ms: took.as_secs_f64() * 1e3,
    })
}

/// [`pull`] when the blob tier holds a pushed record of `sandbox`; `None` when it holds none. The heartbeat that
/// leases the pulled mark's roots is left to the caller ([`beat_here`]): a resume writes it while the sandbox
/// restores, as reading the mark's trees for it takes a few round trips to the tier.
///
/// `ahead` is handed the mark's state once the record is read and before the take: a resume starts its backend's
/// fetch-ahead there, so the mark's data comes from the tier while the take's round trips run.
pub fn pull_if_pushed(
    engine: &Engine,
    sandbox: &str,
    progress: &mut dyn FnMut(&str),
    ahead: &mut dyn FnMut(clade_core::backend::MarkState, Vec<clade_store::PackId>),
) -> anyhow::Result<Option<PullOutcome>> {
    check_id(sandbox)?;
    let Some(record) = engine.store.blob_get_meta(&record_key(sandbox))? else { return Ok(None) };
    take_into_ledger(engine, sandbox, Some(record), progress, ahead).map(Some)
}

/// This host's heartbeat and lease records, written now (after a pull: see [`pull_if_pushed`]).
pub fn beat_here(engine: &Engine) -> anyhow::Result<()> {
    let me = host_id(engine)?;
    beat(engine, &me, &[]).map(|_| ())
}

/// Take a pushed sandbox from the blob tier into this host's ledger, suspended, ready for `clade resume`.
pub fn pull(engine: &Engine, sandbox: &str, progress: &mut dyn FnMut(&str)) -> anyhow::Result<PullOutcome> {
    let start = Instant::now();
    let out = take_into_ledger(engine, sandbox, None, progress, &mut |_, _| {})?;
    if let Err(e) = beat_here(engine) {
        progress(&format!("pull [{:.0} ms]: warning: heartbeat: {e:#}", ms(start)));
    }
    Ok(out)
}

/// [`pull`] but for the heartbeat.
/// `record`: the state record's bytes when the caller read them already.
fn take_into_ledger(
    engine: &Engine,
    sandbox: &str,
    record: Option<Vec<u8>>,
    progress: &mut dyn FnMut(&str),
    ahead: &mut dyn FnMut(clade_core::backend::MarkState, Vec<clade_store::PackId>),
) -> anyhow::Result<PullOutcome> {
    check_id(sandbox)?;
    let tier = need_blob(engine)?;
    let me = host_id(engine)?;
    let start = Instant::now();
    let fetched_before = clade_store::Store::blob_fetched().0;
    let id = SandboxId::new(sandbox);
    if let Ok(rec) = engine.ledger().sandbox(&id) {
        return Err(conflict(format!("sandbox {sandbox} is already on this host ({})", rec.state.as_str())));
    }
    let bytes = match record {
        Some(b) => b,
        None => engine
            .store
            .blob_get_meta(&record_key(sandbox))?
            .ok_or_else(|| not_found(format!("no sandbox {sandbox} in {tier} (push it from its host first)")))?,
    };
    let record: Record = serde_json::from_slice(&bytes).context("the blob tier's state record does not parse")?;
    if record.format != 1 {
        return Err(invalid(format!("state record format {} is newer than this clade knows", record.format)));
    }
    let mut mark = record.mark.clone();
    let fp = footprint(from_ledger(record.backend));
    if let (false, Some(role)) = (record.lowers.is_empty(), fp.layers_role()) {
        // Layers that lived in the pushing home are named as trees: a restore here mounts them lazily (the ct
        // backend's lower layers), fetching only the files the sandbox reads.
        let mut names = Vec::new();
        for l in &record.lowers {
            match &l.tree {
                // Already named as a tree (of whichever form the backend gave it): kept as it is.
                Some(t) if fp.layer_tree(&l.path).is_some_and(|p| p.to_string() == *t) => names.push(l.path.clone()),
                Some(t) => names.push(
                    fp.tree_layer(&t.parse().map_err(|_| anyhow::anyhow!("the record's tree {t} is no tree id"))?),
                ),
                None if Path::new(&l.path).is_dir() => names.push(l.path.clone()),
                None => {
                    return Err(not_found(format!(
                        "the mark's lower layer {} is not on this host (install the template here)",
                        l.path
                    )))
                }
            }
        }
        progress(&format!("pull [{:.0} ms]: lower layers {}", ms(start), names.join(":")));
        mark.manifests.insert(role.into(), clade_ledger::ManifestId::new(names.join(":")));
    }
    match read_owner(&engine.store, sandbox)? {
        Some(o) if o.state == "taken" && o.host != me => return Err(owner::taken_by(sandbox, &o)),
        None => return Err(conflict(format!("sandbox {sandbox} in {tier} has no owner record; push it again"))),
        _ => {}
    }
    // Fetched ahead while the take runs (a refused take leaves its layout to gc), from the pack indexes the
    // record names.
    if let Ok(state) = engine.mark_state(&mark) {
        ahead(state, record.packs.iter().filter_map(|p| p.parse().ok()).collect());
    }
    // Exactly one of the hosts taking it at once wins; the others are refused, naming it.
    owner::take(&engine.store, sandbox, &me, owner::patience())?;
    progress(&format!(
        "pull [{:.0} ms]: {sandbox} (mark {}) from {tier}, pushed by {}, taken",
        ms(start),
        record.mark.id,
        record.pushed_by
    ));
    record_locally(engine, &record, &mark)?;
    let took = start.elapsed();
    engine.op("pull", Some(&id), Some(&mark.id), took, None, serde_json::json!({"from": record.pushed_by}));
    Ok(PullOutcome {
        sandbox: sandbox.to_string(),
        mark: mark.id,
        blob: tier,
        host: me,
        from: record.pushed_by,
        full_bytes: record.full_bytes,
        pull_ms: took.as_secs_f64() * 1e3,
        blob_bytes: clade_store::Store::blob_fetched().0 - fetched_before,
    })
}

/// The sandbox, its branch and head mark in this ledger (the branch and mark may be here already: the
/// sandbox left this host once and comes back).
fn record_locally(engine: &Engine, r: &Record, mark: &Mark) -> anyhow::Result<()> {
    let l = engine.ledger();
    let branch = BranchId::new(r.branch.clone());
    if l.branch(&branch).is_err() {
        l.create_branch(&NewBranch {
            id: Some(branch.clone()),
            name: None,
            parent_mark: None,
            policy: RetentionPolicy::KEEP_ALL,
        })?;
    }
    if l.mark(&mark.id).is_err() {
        l.add_mark(&NewMark {
            id: Some(mark.id.clone()),
            branch: branch.clone(),
            label: mark.label.clone(),
            parent: None,
            backend: mark.backend,
            manifests: mark.manifests.clone(),
            logical_bytes: mark.logical_bytes,
            stored_bytes: mark.stored_bytes,
            pause_ms: mark.pause_ms,
            timings: mark.timings.clone(),
            pinned: true,
            clean: mark.clean,
        })?;
    }
    l.set_head(&branch, &mark.id)?;
    l.create_sandbox(&NewSandbox {
        id: Some(SandboxId::new(r.sandbox.clone())),
        backend: r.backend,
        branch,
        origin_mark: Some(mark.id.clone()),
        supervisor_pid: None,
        host: None,
    })?;
    l.set_sandbox_state(&SandboxId::new(r.sandbox.clone()), SandboxState::Suspended, None)?;
    Ok(())
}

/// The sandboxes in the blob tier, with their owners.
pub fn list(engine: &Engine) -> anyhow::Result<Vec<RoamRow>> {
    need_blob(engine)?;
    let mut out = Vec::new();
    for k in engine.store.blob_list_meta("sandboxes")? {
        let Some(sbx) = k.strip_prefix("sandboxes/").and_then(|s| s.strip_suffix("/owner.json")) else { continue };
        let o = read_owner(&engine.store, sbx)?;
        out.push(RoamRow { sandbox: sbx.to_string(), owner: o });
    }
    Ok(out)
}
