//! `clade store`: put, get, fsck, gc and stats over the chunk store, so others can script and check it.
//! Every subcommand takes `--store DIR` (default `$CLADE_HOME/store`); `--json` prints one JSON object.

use std::path::PathBuf;

use anyhow::Context;
use clade_store::{ImageKind, ManifestId, Store, StoreConfig, TreeId};
use clap::{Args, Subcommand};

#[derive(Args, Clone)]
pub struct StoreOpt {
    /// Store directory (default: $CLADE_HOME/store, CLADE_HOME defaulting to /var/lib/clade).
    #[arg(long, global = true)]
    store: Option<PathBuf>,
    /// zstd level for new data (0 = off; default 1).
    #[arg(long, global = true)]
    zstd: Option<i32>,
}

impl StoreOpt {
    fn open(&self) -> anyhow::Result<Store> {
        let dir = self.store.clone().unwrap_or_else(|| clade_core::CladeHome::from_env().store_dir());
        let mut cfg = StoreConfig::default();
        if let Some(l) = self.zstd {
            cfg.compression_level = (l > 0).then_some(l);
        }
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
                    store
                        .get_file(&id, &a.path)
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
            let store = a.opt.open()?;
            let r = store.gc(a.dry_run)?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{}kept {} manifests, {} trees, {} leases ({} frames); deleted {} packs, repacked {}, {} frames, {} leftovers; freed {}",
                    if r.dry_run { "dry run: " } else { "" },
                    r.live_manifests,
                    r.live_trees,
                    r.live_leases,
                    r.live_frames,
                    r.packs_deleted,
                    r.packs_repacked,
                    r.frames_deleted,
                    r.leftovers_deleted,
                    mib(r.bytes_freed)
                );
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(subcommand)]
        cmd: Command,
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
        assert!(run_args(&["get", "nothex", "x", "--store", s]).is_err());
        assert!(run_args(&["put", "/nonexistent/file", "--store", s]).is_err());
    }
}
