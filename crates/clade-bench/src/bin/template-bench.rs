//! `template-bench [SPEC]`: builds a template (default `templates/minimal`) into a fresh temporary home
//! that shares the host's pristine debootstrap, then measures side by side, in one run: the cold build
//! against a cache hit, and storing the ext4 image by its data extents (`put_sparse`) against reading
//! every byte (`put_file`). Prints one JSON line per figure. Needs root (chroot, mounts).

use std::path::PathBuf;
use std::time::Instant;

use clade_core::CladeHome;
use clade_template::{image, templates_dir, Backends, Builder, TemplateSpec};

fn line(v: serde_json::Value) {
    println!("{v}");
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let spec_path = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../templates/minimal/template.toml"));
    let spec = TemplateSpec::load(&spec_path)?;
    let host = CladeHome::from_env();
    std::fs::create_dir_all(host.tmp_dir())?;
    let d = tempfile::Builder::new().prefix("template-bench-").tempdir_in(host.tmp_dir())?;
    let home = CladeHome::at(d.path());
    let builder =
        || Builder::new(home.clone()).debootstrap_cache(templates_dir(&host)).keep_image(true).use_ledger(false);

    let t = Instant::now();
    let cold = builder().build(&spec, Backends::ALL)?;
    let cold_s = t.elapsed().as_secs_f64();
    for s in &cold.steps {
        line(
            serde_json::json!({"bench": "template", "template": spec.name, "step": s.step, "at_s": s.elapsed.as_secs_f64(), "detail": s.detail}),
        );
    }
    let t = Instant::now();
    let hit = builder().build(&spec, Backends::ALL)?;
    let hit_s = t.elapsed().as_secs_f64();
    assert!(hit.rootfs_cached && hit.disk_cached);
    let r = &cold.record;
    let disk = r.disk.clone().ok_or("no disk")?;
    line(serde_json::json!({
        "bench": "template", "template": spec.name, "cold_build_s": cold_s, "cache_hit_s": hit_s,
        "ratio_hit_over_cold": hit_s / cold_s,
        "rootfs_bytes": r.rootfs_bytes, "rootfs_entries": r.rootfs_entries,
        "image_apparent_bytes": disk.apparent_bytes, "image_allocated_bytes": disk.allocated_bytes,
        "store_nonzero_bytes": disk.nonzero_bytes, "store_new_bytes": disk.new_bytes, "store_pack_bytes": disk.stored_bytes,
        "ratio_store_new_over_files": disk.new_bytes as f64 / r.rootfs_bytes as f64,
        "ratio_packs_over_files": disk.stored_bytes as f64 / r.rootfs_bytes as f64,
    }));

    // The template builder's two bars (docs/templates.md) as report figures (name, value, unit, bar, pass).
    let ratio = disk.new_bytes as f64 / r.rootfs_bytes as f64;
    line(serde_json::json!({
        "name": format!("template {}: second build of an unchanged spec (cache hit)", spec.name),
        "value": hit_s, "unit": "s", "bar": "<= 2 s", "pass": hit_s <= 2.0,
        "detail": {"cold_build_s": cold_s, "cache_hit_s": hit_s},
    }));
    line(serde_json::json!({
        "name": format!("template {}: disk image stored (new bytes) / bytes of its files", spec.name),
        "value": ratio, "unit": "x", "bar": "<= 1.1", "pass": ratio <= 1.1,
        "detail": {"rootfs_bytes": r.rootfs_bytes, "store_new_bytes": disk.new_bytes,
                   "image_allocated_bytes": disk.allocated_bytes, "store_pack_bytes": disk.stored_bytes},
    }));

    // Storing the image: data extents only vs every byte, into two fresh stores.
    let img = disk.image.ok_or("image not kept")?;
    let s1 = clade_store::Store::open(&d.path().join("store-sparse"), clade_store::StoreConfig::default())?;
    let t = Instant::now();
    let a = image::put_sparse(&s1, &img)?;
    let sparse_s = t.elapsed().as_secs_f64();
    let s2 = clade_store::Store::open(&d.path().join("store-full"), clade_store::StoreConfig::default())?;
    let t = Instant::now();
    let b = s2.put_file(&img, clade_store::ImageKind::Disk)?;
    let full_s = t.elapsed().as_secs_f64();
    line(serde_json::json!({
        "bench": "template-image-put", "image_apparent_bytes": disk.apparent_bytes,
        "put_sparse_s": sparse_s, "put_file_s": full_s, "ratio_sparse_over_full": sparse_s / full_s,
        "same_manifest": a.id == b.id,
    }));
    Ok(())
}
