//! Privileged tier: real debootstrap, apt in a chroot, mkfs.ext4 and the real store and ledger. The
//! pristine debootstrap is shared with the host's `$CLADE_HOME` cache (slow only the first time, ~40 s);
//! everything else is built into a fresh temporary home.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clade_core::CladeHome;
use clade_template::{identity::tree_hash, templates_dir, Backends, Builder, TemplateError, TemplateSpec};

static SERIAL: Mutex<()> = Mutex::new(());

fn repo_templates() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../templates")
}

/// Root and the tools, or a printed reason to skip.
fn can_build() -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping: needs root (debootstrap, chroot, mounts)");
        return false;
    }
    for t in ["debootstrap", "mkfs.ext4", "chroot"] {
        if clade_template::debian::which(t).is_none() {
            eprintln!("skipping: {t} is not installed");
            return false;
        }
    }
    true
}

fn temp_home() -> (tempfile::TempDir, CladeHome) {
    let host = CladeHome::from_env();
    std::fs::create_dir_all(host.tmp_dir()).unwrap();
    // Under the host home's tmp: the same filesystem as the debootstrap cache, so copies can reflink.
    let d = tempfile::Builder::new().prefix("template-test-").tempdir_in(host.tmp_dir()).unwrap();
    let home = CladeHome::at(d.path());
    (d, home)
}

fn builder(home: &CladeHome, agent: &Path) -> Builder {
    Builder::new(home.clone())
        .debootstrap_cache(templates_dir(&CladeHome::from_env()))
        .agent(Some(agent.to_path_buf()))
        .keep_image(true)
        .on_progress(|p| eprintln!("[{:>7.2}s] {:<11} {}", p.elapsed.as_secs_f64(), p.step, p.detail))
}

#[test]
fn privileged_minimal_builds_then_comes_from_cache_without_network() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !can_build() {
        return;
    }
    let (_d, home) = temp_home();
    let agent = home.root().join("fake-agent");
    std::fs::write(&agent, "#!/bin/sh\necho agent\n").unwrap();
    let spec = TemplateSpec::load(&repo_templates().join("minimal/template.toml")).unwrap();

    let t = Instant::now();
    let first = builder(&home, &agent).build(&spec, Backends::ALL).unwrap();
    eprintln!("first build: {:.1} s", t.elapsed().as_secs_f64());
    assert!(!first.rootfs_cached && !first.disk_cached);
    let r = &first.record;
    let root = &r.rootfs;
    assert!(root.join("usr/bin/python3").exists(), "python3 installed");
    assert!(root.join("usr/lib/clade/clade-agent").is_file(), "agent installed");
    assert!(root.join("etc/clade/provision.sh").is_file());
    assert!(root.join("etc/clade/services.d/10-http").is_file());
    assert!(root.join("srv/www/index.html").is_file());
    assert!(!root.join("usr/sbin/policy-rc.d").exists(), "policy-rc.d removed after apt");
    let lists: Vec<_> = std::fs::read_dir(root.join("var/lib/apt/lists"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file() && e.file_name() != "lock")
        .collect();
    assert!(lists.is_empty(), "apt lists cleaned: {lists:?}");
    assert!(clade_template::mounts_under(home.root()).is_empty(), "nothing left mounted");

    // The disk: in the store, costing about what the files do.
    let disk = r.disk.as_ref().expect("vm disk built");
    let manifest = disk.manifest.as_ref().expect("stored as a manifest");
    // A fresh store: what it holds for the image is the image's distinct non-zero blocks.
    let ratio = disk.new_bytes as f64 / r.rootfs_bytes as f64;
    eprintln!(
        "rootfs {} bytes in {} entries; image {} allocated; store: {} non-zero, {} distinct ({ratio:.3}x the files), {} in packs",
        r.rootfs_bytes, r.rootfs_entries, disk.allocated_bytes, disk.nonzero_bytes, disk.new_bytes, disk.stored_bytes
    );
    assert!(ratio <= 1.1, "the store holds {ratio:.3}x the bytes of the files");
    assert!(disk.stored_bytes <= disk.new_bytes, "packs are compressed");
    let store = clade_store::Store::open(&home.store_dir(), clade_store::StoreConfig::default()).unwrap();
    assert!(store.has_manifest(&manifest.parse().unwrap()));
    clade_template::image::fsck(disk.image.as_ref().unwrap()).unwrap();

    // The ledger knows it.
    let ledger = clade_ledger::Ledger::open(home.ledger_path()).unwrap();
    let t = ledger.template(&clade_ledger::TemplateId::new(r.hash.clone())).unwrap();
    assert_eq!(t.name, "minimal");

    // Second build: no network at all (a fresh network namespace on this thread), from the cache, < 2 s.
    let before = tree_hash(root, true).unwrap();
    let (h2, spec2, agent2) = (home.clone(), spec.clone(), agent.clone());
    let second = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare the network");
        let t = Instant::now();
        let r = builder(&h2, &agent2).build(&spec2, Backends::ALL).unwrap();
        (r, t.elapsed())
    })
    .join()
    .unwrap();
    eprintln!("second build: {:.3} s", second.1.as_secs_f64());
    assert!(second.0.rootfs_cached && second.0.disk_cached);
    assert!(second.1 < Duration::from_secs(2), "{:?}", second.1);
    assert_eq!(second.0.record.hash, r.hash);
    assert_eq!(tree_hash(root, true).unwrap(), before, "the rootfs (ct lower layer) was not written");

    // A variant with other files and the same packages: the package stage is reused (no apt, no network),
    // its rootfs is a hard-linked copy, and neither the stage nor the first rootfs changes.
    let host_templates = templates_dir(&CladeHome::from_env());
    let deboot =
        clade_template::debian::debootstrap_dir(&host_templates, "bookworm", clade_template::spec::DEFAULT_MIRROR);
    let stage = clade_template::debian::stage_dir(&host_templates, &deboot, &spec.packages);
    let stage_before = tree_hash(&stage, true).unwrap();
    let page = home.root().join("variant.html");
    std::fs::write(&page, "<title>variant</title>").unwrap();
    let mut variant = spec.clone();
    variant.name = "minimal-variant".into();
    variant.files[0].src = page;
    let t = Instant::now();
    let v = builder(&home, &agent).build(&variant, Backends::CT).unwrap();
    let variant_s = t.elapsed().as_secs_f64();
    eprintln!("variant (same packages, other files): {variant_s:.2} s");
    assert!(v.steps.iter().any(|s| s.step == "packages" && s.detail.starts_with("cached")), "{:?}", v.steps);
    assert_eq!(std::fs::read_to_string(v.record.rootfs.join("srv/www/index.html")).unwrap(), "<title>variant</title>");
    assert_eq!(tree_hash(&stage, true).unwrap(), stage_before, "the package stage was not written");
    assert_eq!(tree_hash(root, true).unwrap(), before, "the first template's rootfs was not written");
    clade_template::remove(&home, "minimal-variant").unwrap();
    assert_eq!(tree_hash(&stage, true).unwrap(), stage_before, "removing a template leaves its stage alone");

    // ls and rm.
    let all = clade_template::list(&home).unwrap();
    assert_eq!(all.len(), 1);
    let removed = clade_template::remove(&home, "minimal").unwrap();
    assert_eq!(removed.manifest.as_deref(), Some(manifest.as_str()));
    assert!(!root.exists());
    assert!(matches!(clade_template::remove(&home, "minimal"), Err(TemplateError::NotFound(_))));
}

#[test]
fn privileged_missing_package_fails_cleanly() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !can_build() {
        return;
    }
    let (d, home) = temp_home();
    let spec_path = d.path().join("bad.toml");
    std::fs::write(
        &spec_path,
        "name = \"bad\"\nbase = \"debian:bookworm\"\npackages = [\"python3\", \"clade-no-such-package\"]\n",
    )
    .unwrap();
    let spec = TemplateSpec::load(&spec_path).unwrap();
    let agent = d.path().join("bad.toml");
    let e = builder(&home, &agent).build(&spec, Backends::ALL).unwrap_err();
    assert!(matches!(&e, TemplateError::PackageNotFound { package, .. } if package == "clade-no-such-package"), "{e}");
    assert!(e.to_string().contains("clade-no-such-package"), "{e}");
    let dirs: Vec<_> = std::fs::read_dir(templates_dir(&home)).map(|rd| rd.flatten().collect()).unwrap_or_default();
    assert!(dirs.is_empty(), "the cache is untouched: {dirs:?}");
    let tmp: Vec<_> = std::fs::read_dir(home.tmp_dir()).map(|rd| rd.flatten().collect()).unwrap_or_default();
    assert!(tmp.is_empty(), "the partial build was removed: {tmp:?}");
    assert!(clade_template::mounts_under(home.root()).is_empty(), "nothing left mounted");
    assert!(std::path::Path::new("/dev/null").exists(), "the host's /dev is intact");
}
