//! `clade store`: put, get, fsck, gc and stats over the chunk store, so others can script and check it.
//! Every subcommand takes `--store DIR` (default `$CLADE_HOME/store`); `--json` prints one JSON object.

use std::path::PathBuf;

use anyhow::Context;
use clade_store::{BlobConfig, ImageKind, ManifestId, Store, StoreConfig, TreeId};
use clap::{Args, Subcommand};

#[derive(Args, Clone)]
pub struct StoreOpt {
    /// Store directory (default: $CLADE_HOME/store, CLADE_HOME defaulting to /var/lib/clade).
    #[arg(long, global = true)]
    store: Option<PathBuf>,
    /// zstd level for new data (0 = off; default 1).
    #[arg(long, global = true)]
    zstd: Option<i32>,
    /// Blob tier: `file:///DIR` or `s3://BUCKET` (S3 keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY);
    /// default: the home's own (`CLADE_BLOB`, docs/roam.md).
    #[arg(long, global = true)]
    blob: Option<String>,
    /// S3 endpoint of an S3-compatible server, e.g. http://127.0.0.1:9000 (default: AWS).
    #[arg(long, global = true)]
    blob_endpoint: Option<String>,
    /// S3 region.
    #[arg(long, global = true, default_value = "us-east-1")]
    blob_region: String,
}

impl StoreOpt {
    fn blob(&self) -> anyhow::Result<Option<BlobConfig>> {
        let Some(url) = &self.blob else {
            return clade_core::CladeHome::from_env().blob_config().map_err(|e| anyhow::anyhow!(e));
        };
        if let Some(dir) = url.strip_prefix("file://") {
            return Ok(Some(BlobConfig::Local { root: PathBuf::from(dir) }));
        }
        let Some(bucket) = url.strip_prefix("s3://") else {
            anyhow::bail!("--blob {url}: use file:///DIR or s3://BUCKET");
        };
        let key =
            |name: &str| std::env::var(name).with_context(|| format!("--blob {url} needs {name} in the environment"));
        Ok(Some(BlobConfig::S3 {
            bucket: bucket.trim_end_matches('/').to_string(),
            endpoint: self.blob_endpoint.clone(),
            region: self.blob_region.clone(),
            access_key_id: key("AWS_ACCESS_KEY_ID")?,
            secret_access_key: key("AWS_SECRET_ACCESS_KEY")?,
            allow_http: self.blob_endpoint.as_deref().is_some_and(|e| e.starts_with("http://")),
        }))
    }

    fn open(&self) -> anyhow::Result<Store> {
        self.open_with(StoreConfig::default())
    }

    fn open_with(&self, mut cfg: StoreConfig) -> anyhow::Result<Store> {
        let dir = self.store.clone().unwrap_or_else(|| clade_core::CladeHome::from_env().store_dir());
        if let Some(l) = self.zstd {
            cfg.compression_level = (l > 0).then_some(l);
        }
        cfg.blob = self.blob()?;
        Store::open(&dir, cfg).with_context(|| format!("opening the store at {}", dir.display()))
    }
}

#[derive(Subcommand)]
pub enum Command {
    /// Store a file (or, with --dir, a directory tree); prints the manifest id and bytes new/deduplicated.
    Put(PutArgs),
    /// Restore a manifest into a file (or a tree into a new directory).
    Get(GetArgs),
    /// Verify every pack, object, manifest and tree; exit 1 if anything is damaged.
    Fsck(JsonArgs),
    /// Delete data no manifest, tree or lease uses.
    Gc(GcArgs),
    /// Counts and sizes.
    Stats(JsonArgs),
    /// Unpublish a manifest or tree (gc frees its data unless something else uses it).
    Rm(RmArgs),
}

#[derive(Args)]
pub struct PutArgs {
    /// File (or directory) to store.
    path: PathBuf,
    /// What the image is.
    #[arg(long, default_value = "other", value_parser = ["disk", "mem", "other"])]
    kind: String,
    /// Read and hash the whole file even if it looks unchanged since an earlier put.
    #[arg(long)]
    rehash: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    opt: StoreOpt,
}

#[derive(Args)]
pub struct GetArgs {
    /// Manifest id (or tree id, for a directory).
    id: String,
    /// Destination path (replaced atomically for a file; must not exist for a tree).
    path: PathBuf,
    #[command(flatten)]
    opt: StoreOpt,
}

#[derive(Args)]
pub struct JsonArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    opt: StoreOpt,
}

#[derive(Args)]
pub struct GcArgs {
    /// Say what would be deleted, delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Also collect the blob tier: run it on one host at a time. Other hosts' live lease records there keep
    /// what they name; expired ones (hosts that stopped beating) are deleted.
    #[arg(long = "include-blob")]
    include_blob: bool,
    /// Leave packs and temp files younger than this alone (writers in flight); default 3600.
    #[arg(long, default_value_t = 3600)]
    grace_secs: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    opt: StoreOpt,
}

#[derive(Args)]
pub struct RmArgs {
    /// Manifest or tree id.
    id: String,
    #[command(flatten)]
    opt: StoreOpt,
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    match cmd {
        Command::Put(a) => {
            let store = a.opt.open()?;
            let kind: ImageKind = a.kind.parse().map_err(anyhow::Error::msg)?;
            if a.path.is_dir() {
                let r = store.put_dir(&a.path).with_context(|| format!("storing {}", a.path.display()))?;
                if a.json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!("{}", r.id);
                    eprintln!(
                        "tree: {} files, {} dirs, {} others; new {}, deduplicated {}, zero {}, stored {}",
                        r.files,
                        r.dirs,
                        r.others,
                        mib(r.data.bytes_new),
                        mib(r.data.bytes_dedup),
                        mib(r.data.bytes_zero),
                        mib(r.data.bytes_stored)
                    );
                }
                return Ok(0);
            }
            let r = if a.rehash { store.put_file_rehash(&a.path, kind) } else { store.put_file(&a.path, kind) }
                .with_context(|| format!("storing {}", a.path.display()))?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("{}", r.id.map(|i| i.to_hex()).unwrap_or_default());
                eprintln!(
                    "size {}: new {}, deduplicated {}, zero {}, stored {} (manifest {} bytes){}",
                    mib(r.size),
                    mib(r.bytes_new),
                    mib(r.bytes_dedup),
                    mib(r.bytes_zero),
                    mib(r.bytes_stored),
                    r.manifest_bytes,
                    if r.unchanged_file { "; file unchanged since its last put" } else { "" }
                );
            }
            Ok(0)
        }
        Command::Get(a) => {
            let store = a.opt.open()?;
            if let Ok(id) = a.id.parse::<ManifestId>() {
                if store.has_manifest(&id) || store.tree(&TreeId(id.0)).is_err() {
                    get_file_with_progress(&store, &id, &a.path)
                        .with_context(|| format!("restoring {id} into {}", a.path.display()))?;
                    return Ok(0);
                }
            }
            let id: TreeId = a.id.parse().context("the id must be 64 hex digits (a manifest or tree id)")?;
            store.get_dir(&id, &a.path).with_context(|| format!("restoring tree {id} into {}", a.path.display()))?;
            Ok(0)
        }
        Command::Fsck(a) => {
            let store = a.opt.open()?;
            let r = store.fsck()?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{}: {} packs, {} frames, {} objects ({}), {} manifests, {} trees",
                    if r.ok { "ok" } else { "DAMAGED" },
                    r.packs,
                    r.frames,
                    r.objects,
                    mib(r.bytes),
                    r.manifests,
                    r.trees
                );
                for e in &r.errors {
                    println!("error: {e}");
                }
                for w in &r.warnings {
                    println!("warning: {w}");
                }
            }
            Ok(if r.ok { 0 } else { 1 })
        }
        Command::Gc(a) => {
            let cfg = StoreConfig { gc_grace: std::time::Duration::from_secs(a.grace_secs), ..Default::default() };
            let store = a.opt.open_with(cfg)?;
            let r = store.gc(a.dry_run)?;
            let b = if a.include_blob { Some(store.gc_blob(a.dry_run)?) } else { None };
            if a.json {
                // The local report, plus the blob tier's under "blob" when it was collected too.
                let mut v = serde_json::to_value(&r)?;
                if let (Some(b), Some(o)) = (&b, v.as_object_mut()) {
                    o.insert("blob".into(), serde_json::to_value(b)?);
                }
                println!("{v}");
            } else {
                let dry = if r.dry_run { "dry run: " } else { "" };
                println!(
                    "{dry}local: kept {} manifests, {} trees, {} leases ({} frames) in {} packs ({}; {} younger than the grace period); \
                     deleted {} packs, repacked {}, {} frames, {} leftovers, {} trash entries, {} stale leases; freed {}",
                    r.live_manifests,
                    r.live_trees,
                    r.live_leases,
                    r.live_frames,
                    r.packs_kept,
                    mib(r.bytes_kept),
                    r.packs_kept_young,
                    r.packs_deleted,
                    r.packs_repacked,
                    r.frames_deleted,
                    r.leftovers_deleted,
                    r.trash_purged,
                    r.stale_leases,
                    mib(r.bytes_freed)
                );
                if let Some(b) = &b {
                    println!(
                        "{dry}blob {}: kept {} packs ({}; {} younger than the grace period) for {} manifests, {} trees, {} leases; \
                         deleted {} packs ({} frames), {} leftovers; freed {}",
                        b.blob,
                        b.packs_kept,
                        mib(b.bytes_kept),
                        b.packs_kept_young,
                        b.live_manifests,
                        b.live_trees,
                        b.live_leases,
                        b.packs_deleted,
                        b.frames_deleted,
                        b.leftovers_deleted,
                        mib(b.bytes_freed)
                    );
                    for k in &b.deleted {
                        println!("  deleted {k}");
                    }
                    for w in &b.warnings {
                        println!("warning: {w}");
                    }
                }
            }
            Ok(0)
        }
        Command::Stats(a) => {
            let store = a.opt.open()?;
            let s = store.stats()?;
            if a.json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                println!("store {}", s.dir);
                println!(
                    "  manifests {} (logical {}, data {}), trees {}",
                    s.manifests,
                    mib(s.logical_bytes),
                    mib(s.data_bytes),
                    s.trees
                );
                println!(
                    "  unique objects {} ({}), frames {}, packs {} ({} on disk)",
                    s.objects,
                    mib(s.unique_bytes),
                    s.frames,
                    s.packs,
                    mib(s.pack_bytes)
                );
                if let Some(b) = &s.blob {
                    println!("  blob tier {b}");
                }
            }
            Ok(0)
        }
        Command::Rm(a) => {
            let store = a.opt.open()?;
            let id: ManifestId = a.id.parse().context("the id must be 64 hex digits")?;
            let removed = store.delete_manifest(&id)? || store.delete_tree(&TreeId(id.0))?;
            if !removed {
                anyhow::bail!("{} is neither a published manifest nor a tree", a.id);
            }
            Ok(0)
        }
    }
}

/// `get_file`, with progress for a large image (typically pulled from the blob tier): the bytes written so far
/// are the blocks of the store's temp file beside the destination (`.clade-get.<pid>.*`), against the image's
/// non-zero bytes.
fn get_file_with_progress(store: &Store, id: &ManifestId, dest: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let total: u64 = store.manifest(id).map(|m| m.extents.iter().map(|x| u64::from(x.len)).sum()).unwrap_or(0);
    if total < 64 << 20 {
        return Ok(store.get_file(id, dest)?);
    }
    let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let prefix = format!(".clade-get.{}.", std::process::id());
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut bar = super::progress::Bytes::new(&format!("pulling {}", &id.to_string()[..12]), total);
    let out = std::thread::scope(|scope| {
        let work = scope.spawn(|| {
            let r = store.get_file(id, dest);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            r
        });
        while !done.load(std::sync::atomic::Ordering::Relaxed) {
            let written: u64 = std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum();
            bar.set(written);
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        work.join().unwrap_or_else(|_| Err(clade_store::StoreError::Invalid("the get thread panicked".into())))
    });
    bar.finish(out.is_ok());
    Ok(out?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(subcommand)]
        cmd: Command,
    }

    fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                out.extend(walk(&e.path()));
            } else {
                out.push(e.path());
            }
        }
        out
    }

    fn run_args(args: &[&str]) -> anyhow::Result<i32> {
        let t = T::try_parse_from(std::iter::once("store").chain(args.iter().copied()))?;
        run(t.cmd)
    }

    #[test]
    fn put_get_fsck_gc_stats_rm_through_the_cli() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path().join("s");
        let s = s.to_str().unwrap();
        let f = d.path().join("img");
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&f, &data).unwrap();
        assert_eq!(run_args(&["put", f.to_str().unwrap(), "--kind", "mem", "--store", s]).unwrap(), 0);
        let store = Store::open(std::path::Path::new(s), StoreConfig::default()).unwrap();
        let id = store.manifests().unwrap()[0];
        let out = d.path().join("out");
        assert_eq!(run_args(&["get", &id.to_hex(), out.to_str().unwrap(), "--store", s]).unwrap(), 0);
        assert_eq!(std::fs::read(&out).unwrap(), data);
        assert_eq!(run_args(&["fsck", "--json", "--store", s]).unwrap(), 0);
        assert_eq!(run_args(&["stats", "--store", s]).unwrap(), 0);
        assert_eq!(run_args(&["rm", &id.to_hex(), "--store", s]).unwrap(), 0);
        assert_eq!(run_args(&["gc", "--dry-run", "--json", "--store", s]).unwrap(), 0);
        // With a blob tier (a directory here): put writes through, gc collects both tiers.
        let blob = format!("file://{}", d.path().join("blob").display());
        let s = d.path().join("s2");
        let s = s.to_str().unwrap();
        assert_eq!(run_args(&["put", f.to_str().unwrap(), "--kind", "mem", "--store", s, "--blob", &blob]).unwrap(), 0);
        assert!(!walk(&d.path().join("blob/packs")).is_empty(), "packs written through to the blob tier");
        assert_eq!(run_args(&["rm", &id.to_hex(), "--store", s, "--blob", &blob]).unwrap(), 0);
        assert!(walk(&d.path().join("blob/manifests")).is_empty(), "rm unpublishes in the blob tier too");
        assert!(run_args(&["gc", "--include-blob", "--store", s]).is_err(), "no blob tier given: a clear error");
        let args = ["gc", "--include-blob", "--grace-secs", "0", "--json", "--store", s, "--blob", &blob];
        assert_eq!(run_args(&args).unwrap(), 0);
        let left: Vec<_> = walk(&d.path().join("blob/packs"));
        assert!(left.is_empty(), "blob packs of the removed image collected: {left:?}");
        assert!(run_args(&["put", "x", "--store", s, "--blob", "ftp://nope"]).is_err());
        assert!(run_args(&["get", "nothex", "x", "--store", s]).is_err());
        assert!(run_args(&["put", "/nonexistent/file", "--store", s]).is_err());
    }
}
