//! Helpers the guest tests of the `clade` binary share.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The installed home whose kernel, CRIU and caches the tests borrow (`CLADE_TEST_HOME`, else /var/lib/clade).
pub fn real_home() -> PathBuf {
    PathBuf::from(std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into()))
}

/// Runs the built `clade` with `CLADE_HOME=home`: exit code, stdout, stderr.
pub fn clade(home: &Path, args: &[&str]) -> (i32, String, String) {
    clade_with(home, &[], args)
}

/// [`clade`] with more environment variables.
pub fn clade_with(home: &Path, env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(args)
        .env("CLADE_HOME", home)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A temp home borrowing the real home's CRIU, with the `ctbox` template's ct base built on clade-ct's test
/// rootfs (busybox + the agent). `None` (and a printed reason) where CRIU is not installed.
pub fn ct_home(prefix: &str) -> Option<tempfile::TempDir> {
    use clade_core::backend::{Backend, Shape, TemplateImage};
    let real = clade_core::CladeHome::at(real_home());
    let cfg = match clade_ct::CtConfig::from_home(&real) {
        Ok(c) if c.criu.exists() => c,
        Ok(c) => {
            eprintln!("skip: no CRIU at {} (run ./x setup)", c.criu.display());
            return None;
        }
        Err(e) => {
            eprintln!("skip: {e}");
            return None;
        }
    };
    let t = tempfile::Builder::new().prefix(prefix).tempdir_in("/var/tmp").unwrap();
    std::os::unix::fs::symlink(real.root().join("criu"), t.path().join("criu")).unwrap();
    let home = clade_core::CladeHome::at(t.path());
    let engine = clade_core::engine::Engine::open(&home).unwrap();
    let rootfs = clade_ct::testroot::ensure(&real, &cfg.agent_bin).expect("test rootfs");
    let tid = clade_ledger::TemplateId::new("tmpl-ctbox");
    engine.ledger().put_template(&tid, "ctbox", &serde_json::json!({})).unwrap();
    let backend = clade_ct::CtBackend::new(home.clone(), engine.store.clone(), cfg).unwrap();
    let image = TemplateImage {
        name: "ctbox".into(),
        hash: "test".into(),
        rootfs,
        disk_manifest: None,
        shape: Shape { memory_mib: 256, vcpus: 1, disk_gib: 1 },
        egress: false,
    };
    let (mark, boot) = engine.build_base(&backend as &dyn Backend, &tid, &image, &|_| Ok(())).unwrap();
    eprintln!("ct base {} built in {boot:?}", mark.id);
    Some(t)
}
