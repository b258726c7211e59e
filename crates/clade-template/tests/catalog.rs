//! Unit tier: the whole builder flow on a `from = "dir:..."` template for the ct backend (no root, no
//! network, no mkfs), with a real ledger: cache hits, the rootfs left untouched, failed builds leaving
//! nothing behind, `ls`, and `rm` refused while the ledger has a base of the template.

use std::path::Path;

use clade_core::CladeHome;
use clade_ledger::{Backend, Ledger, NewBranch, NewMark, RetentionPolicy, TemplateId};
use clade_template::{identity::tree_hash, templates_dir, Backends, Builder, TemplateError, TemplateSpec};

fn write(p: &Path, text: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

fn setup() -> (tempfile::TempDir, CladeHome, TemplateSpec) {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("tpl");
    write(&src.join("root/bin/hello"), "#!/bin/sh\necho hello\n");
    write(&src.join("root/etc/os-release"), "ID=test\n");
    write(&src.join("motd"), "welcome\n");
    write(
        &src.join("template.toml"),
        "name = \"dirtpl\"\nfrom = \"dir:root\"\nfiles = { \"/etc/motd\" = \"motd\" }\n\
         services = [{ name = \"svc\", command = \"sleep 1000\", ready = { file = \"/tmp/x\" } }]\n",
    );
    let spec = TemplateSpec::load(&src.join("template.toml")).unwrap();
    let home = CladeHome::at(d.path().join("home"));
    (d, home, spec)
}

fn builder(home: &CladeHome) -> Builder {
    Builder::new(home.clone()).use_store(false)
}

#[test]
fn dir_template_builds_caches_and_lists() {
    let (_d, home, spec) = setup();
    let first = builder(&home).build(&spec, Backends::CT).unwrap();
    assert!(!first.rootfs_cached);
    let root = &first.record.rootfs;
    assert_eq!(std::fs::read_to_string(root.join("etc/motd")).unwrap(), "welcome\n");
    assert!(root.join("bin/hello").is_file());
    assert!(root.join("etc/clade/services.d/10-svc").is_file());
    assert!(root.join("etc/clade/template.json").is_file());
    assert!(first.record.disk.is_none(), "ct only: no disk");
    let before = tree_hash(root, true).unwrap();

    let second = builder(&home).build(&spec, Backends::CT).unwrap();
    assert!(second.rootfs_cached);
    assert_eq!(second.record.hash, first.record.hash);
    assert_eq!(tree_hash(root, true).unwrap(), before, "a cached build does not write the rootfs");

    let all = clade_template::list(&home).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(clade_template::find(&home, &first.record.hash[..10]).unwrap().name, "dirtpl");
    assert!(matches!(clade_template::find(&home, "nope"), Err(TemplateError::NotFound(_))));

    // The ledger recorded it under its hash.
    let l = Ledger::open(home.ledger_path()).unwrap();
    assert_eq!(l.template(&TemplateId::new(first.record.hash.clone())).unwrap().name, "dirtpl");
}

#[test]
fn changed_file_makes_a_new_template() {
    let (d, home, spec) = setup();
    let a = builder(&home).build(&spec, Backends::CT).unwrap();
    write(&d.path().join("tpl/motd"), "changed\n");
    let spec = TemplateSpec::load(&spec.path).unwrap();
    let b = builder(&home).build(&spec, Backends::CT).unwrap();
    assert_ne!(a.record.hash, b.record.hash);
    assert!(!b.rootfs_cached);
    assert_eq!(std::fs::read_to_string(b.record.rootfs.join("etc/motd")).unwrap(), "changed\n");
    assert_eq!(std::fs::read_to_string(a.record.rootfs.join("etc/motd")).unwrap(), "welcome\n");
}

#[test]
fn failed_build_leaves_no_trace() {
    let (d, home, _) = setup();
    write(&d.path().join("tpl/bad.toml"), "name = \"bad\"\nfrom = \"dir:root\"\npackages = [\"python3\"]\n");
    let spec = TemplateSpec::load(&d.path().join("tpl/bad.toml")).unwrap();
    let e = builder(&home).build(&spec, Backends::CT).unwrap_err();
    assert!(e.to_string().contains("apt-get"), "{e}");
    let dirs: Vec<_> = std::fs::read_dir(templates_dir(&home)).map(|r| r.flatten().collect()).unwrap_or_default();
    assert!(dirs.is_empty(), "{dirs:?}");
    let tmp: Vec<_> = std::fs::read_dir(home.tmp_dir()).map(|r| r.flatten().collect()).unwrap_or_default();
    assert!(tmp.is_empty(), "{tmp:?}");
}

#[test]
fn rm_is_refused_while_a_base_needs_the_template() {
    let (_d, home, spec) = setup();
    let built = builder(&home).build(&spec, Backends::CT).unwrap();
    let l = Ledger::open(home.ledger_path()).unwrap();
    let branch = l
        .create_branch(&NewBranch { id: None, name: None, parent_mark: None, policy: RetentionPolicy::KEEP_ALL })
        .unwrap();
    let mark = l
        .add_mark(&NewMark {
            id: None,
            branch: branch.id.clone(),
            label: Some("base".into()),
            parent: None,
            backend: Backend::Ct,
            manifests: Default::default(),
            logical_bytes: 0,
            stored_bytes: 0,
            pause_ms: None,
            timings: serde_json::json!({}),
            pinned: false,
            clean: true,
        })
        .unwrap();
    let tid = TemplateId::new(built.record.hash.clone());
    l.put_base(&tid, Backend::Ct, &mark.id).unwrap();
    let e = clade_template::remove(&home, "dirtpl").unwrap_err();
    assert!(matches!(e, TemplateError::InUse(_)), "{e}");
    assert!(e.to_string().contains("base"), "{e}");
    assert!(built.record.rootfs.is_dir(), "refused: nothing removed");
    l.remove_base(&tid, Backend::Ct).unwrap();
    let r = clade_template::remove(&home, "dirtpl").unwrap();
    assert_eq!(r.hash, built.record.hash);
    assert!(!built.record.rootfs.exists());
    assert!(clade_template::list(&home).unwrap().is_empty());
}

/// A `docker save` tarball with two layers (the second whiting out a file of the first), built here.
fn docker_save(path: &Path) {
    fn entry(b: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(0o755);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        b.append_data(&mut h, name, data).unwrap();
    }
    let mut l1 = tar::Builder::new(Vec::new());
    entry(&mut l1, "bin/sh-like", b"#!/bin/true\n");
    entry(&mut l1, "etc/old.conf", b"old\n");
    let mut l2 = tar::Builder::new(Vec::new());
    entry(&mut l2, "etc/.wh.old.conf", b"");
    entry(&mut l2, "etc/new.conf", b"new\n");
    let mut outer = tar::Builder::new(Vec::new());
    entry(
        &mut outer,
        "manifest.json",
        br#"[{"Config":"c.json","RepoTags":["x:1"],"Layers":["1/layer.tar","2/layer.tar"]}]"#,
    );
    entry(&mut outer, "1/layer.tar", &l1.into_inner().unwrap());
    entry(&mut outer, "2/layer.tar", &l2.into_inner().unwrap());
    std::fs::write(path, outer.into_inner().unwrap()).unwrap();
}

#[test]
fn oci_archive_template_builds_with_whiteouts_applied() {
    let d = tempfile::tempdir().unwrap();
    docker_save(&d.path().join("image.tar"));
    write(&d.path().join("template.toml"), "name = \"fromoci\"\nfrom = \"oci-archive:image.tar\"\n");
    let spec = TemplateSpec::load(&d.path().join("template.toml")).unwrap();
    let home = CladeHome::at(d.path().join("home"));
    let r = builder(&home).build(&spec, Backends::CT).unwrap();
    let root = &r.record.rootfs;
    assert!(root.join("bin/sh-like").is_file());
    assert!(!root.join("etc/old.conf").exists(), "whited out by the second layer");
    assert_eq!(std::fs::read_to_string(root.join("etc/new.conf")).unwrap(), "new\n");
    assert!(r.steps.iter().any(|s| s.step == "source" && s.detail.starts_with("2 layers")), "{:?}", r.steps);
    let tmp: Vec<_> = std::fs::read_dir(home.tmp_dir()).map(|r| r.flatten().collect()).unwrap_or_default();
    assert!(tmp.is_empty(), "the unpacked archive is gone: {tmp:?}");
    // A different archive is a different template.
    let mut h2 = spec.clone();
    std::fs::write(d.path().join("image2.tar"), b"not the same").unwrap();
    h2.source = clade_template::Source::OciArchive { path: d.path().join("image2.tar") };
    let a = clade_template::Identity::of(&spec, None).unwrap().hash();
    let b = clade_template::Identity::of(&h2, None).unwrap().hash();
    assert_ne!(a, b);
}
