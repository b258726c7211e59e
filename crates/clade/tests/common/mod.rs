//! Helpers the guest tests of the `clade` binary share.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub mod hostnet;

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
    let out = clade_cmd(home, env).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The built `clade` with `CLADE_HOME=home` and `env`; where `env` names a network namespace
/// ([`hostnet::NETNS_VAR`]), the command runs in it (only its network namespace changes).
pub fn clade_cmd(home: &Path, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_clade"));
    cmd.env("CLADE_HOME", home).envs(env.iter().copied().filter(|(k, _)| *k != hostnet::NETNS_VAR));
    if let Some((_, name)) = env.iter().find(|(k, _)| *k == hostnet::NETNS_VAR) {
        let ns = std::fs::File::open(Path::new("/run/netns").join(name)).expect("the host's network namespace");
        // SAFETY: the closure runs in the forked child before exec and makes one system call (setns) on a
        // descriptor opened before the fork and owned by the closure, which the Command keeps alive.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                use std::os::fd::AsFd;
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
            });
        }
    }
    cmd
}

/// A temp home borrowing the real home's CRIU, with the `ctbox` template's ct base built on clade-ct's test
/// rootfs (busybox + the agent). `None` (and a printed reason) where CRIU is not installed.
pub fn ct_home(prefix: &str) -> Option<tempfile::TempDir> {
    use clade_core::backend::Backend;
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
    let image = clade_ct::testroot::image("ctbox", rootfs, 256, false);
    let (mark, boot) = engine.build_base(&backend as &dyn Backend, &tid, &image, &|_| Ok(())).unwrap();
    eprintln!("ct base {} built in {boot:?}", mark.id);
    Some(t)
}

/// A 3-node Garage cluster on loopback with one bucket (`clade_store::testkit`); `None` (and a printed reason)
/// where the setup did not build Garage.
pub fn garage(bucket: &str) -> Option<clade_store::testkit::Garage> {
    let bin = real_home().join("garage/bin/garage");
    if !bin.exists() {
        eprintln!("skip: {} is not installed (run ./x setup)", bin.display());
        return None;
    }
    Some(clade_store::testkit::Garage::start(&bin, bucket).expect("start a 3-node Garage cluster"))
}

/// A CLADE_HOME of its own that borrows the kernel and the accelerator probe of the real one.
pub fn vm_bare_home(prefix: &str) -> tempfile::TempDir {
    let t = tempfile::Builder::new().prefix(prefix).tempdir_in("/var/tmp").unwrap();
    std::os::unix::fs::symlink(real_home().join("kernel"), t.path().join("kernel")).unwrap();
    std::fs::create_dir_all(t.path().join("cache")).unwrap();
    let _ = std::fs::copy(real_home().join("cache/accel.json"), t.path().join("cache/accel.json"));
    t
}

/// [`vm_bare_home`] with the `busybox` template's vm base built (busybox + the agent on a 64 MiB disk, a
/// 256 MiB guest), through the engine as `clade base build` does. `None` (and a printed reason) where QEMU,
/// the guest kernel or the agent binary is missing.
pub fn vm_home(prefix: &str) -> Option<tempfile::TempDir> {
    use clade_core::backend::{Backend, Shape, TemplateImage};
    let Some(agent) = clade_vm::testkit::agent_binary() else {
        eprintln!("skip: no built clade-agent (cargo build --workspace)");
        return None;
    };
    if clade_vm::qemu::qemu_binary().is_none() || !real_home().join("kernel/current/vmlinux").exists() {
        eprintln!("skip: no QEMU or guest kernel (run ./x setup)");
        return None;
    }
    let t = vm_bare_home(prefix);
    let h = t.path();
    let home = clade_core::CladeHome::at(h);
    let engine = clade_core::engine::Engine::open(&home).unwrap();
    let img = h.join("root.img");
    let root = clade_vm::testkit::busybox_root_image(h, &agent, &img, 64).unwrap();
    let disk = engine.store.put_file(&img, clade_store::ImageKind::Disk).unwrap().id.unwrap().to_string();
    let tid = clade_ledger::TemplateId::new("tmpl-busybox");
    engine.ledger().put_template(&tid, "busybox", &serde_json::json!({})).unwrap();
    let backend = clade_vm::backend::VmBackend::open(&home, engine.store.clone(), None).unwrap();
    let image = TemplateImage {
        name: "busybox".into(),
        hash: "test".into(),
        rootfs: root,
        disk_manifest: Some(disk),
        shape: Shape { memory_mib: 256, vcpus: 1, disk_gib: 1 },
        egress: false,
        no_new_privs: true,
    };
    let (mark, boot) = engine.build_base(&backend as &dyn Backend, &tid, &image, &|_| Ok(())).unwrap();
    eprintln!("vm base {} built, cold boot {boot:?}", mark.id);
    Some(t)
}

/// Catalogues the `ctbox` test template of a [`ct_home`] the way a build would (`templates/<hash>/template.json`
/// over the cached test rootfs), for what looks a template up on disk: the sibling audit's cold control pair.
pub fn ct_template_record(home: &Path) {
    let hash = "c7b0c7b0".repeat(8);
    let dir = home.join("templates").join(&hash);
    std::fs::create_dir_all(&dir).unwrap();
    let record = serde_json::json!({
        "name": "ctbox", "hash": hash, "built_ms": 0, "spec": "/dev/null",
        "rootfs": real_home().join("tmp/ct-test-rootfs"), "rootfs_bytes": 0, "rootfs_entries": 0,
        "memory_mib": 256, "vcpus": 1, "disk_gib": 1, "egress": false, "ready": null, "services": [],
        "provision": false, "agent": true, "disk": null,
        "identity": {"builder": 1, "name": "ctbox", "source": {"kind": "dir", "content": "test"}, "packages": [],
            "files": {}, "provision": null, "services": [], "agent": null},
    });
    std::fs::write(dir.join("template.json"), serde_json::to_vec_pretty(&record).unwrap()).unwrap();
}

/// A clade subprocess's extra environment, owned (the blob tier's variables and friends).
pub type Env = Vec<(&'static str, String)>;

/// [`clade_with`] with an owned environment.
pub fn run_env(home: &Path, env: &Env, args: &[&str]) -> (i32, String, String) {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    clade_with(home, &env, args)
}

/// Ends every sandbox of a home when dropped, so a test that fails midway leaves none running (their mounts and
/// cgroups would outlive the test's directories).
pub struct KillAllOnDrop<'a> {
    pub home: &'a Path,
    pub env: Env,
}

impl Drop for KillAllOnDrop<'_> {
    fn drop(&mut self) {
        let _ = run_env(self.home, &self.env, &["kill", "--all"]);
    }
}

/// [`run_env`] that must succeed and print JSON.
pub fn ok_env(home: &Path, env: &Env, args: &[&str]) -> serde_json::Value {
    let (code, out, err) = run_env(home, env, args);
    assert_eq!(code, 0, "clade {args:?}: {err}{out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("clade {args:?} printed no JSON ({e}): {out}"))
}

/// A shell script in a sandbox that must exit 0; its stdout, trimmed.
pub fn sh_env(home: &Path, env: &Env, sbx: &str, script: &str) -> String {
    let out = ok_env(home, env, &["exec", sbx, "--json", "--", "sh", "-c", script]);
    assert_eq!(out["code"], 0, "{script}: {out}");
    out["stdout"].as_str().unwrap_or("").trim().to_string()
}

/// The blob tier checked through a store handle of a host that holds nothing (`Store::check_blob`).
pub fn blob_check(g: &clade_store::testkit::Garage) -> clade_store::BlobCheckReport {
    let d = tempfile::tempdir().unwrap();
    let cfg = clade_store::StoreConfig { blob: Some(g.config()), ..Default::default() };
    clade_store::Store::open(d.path(), cfg).unwrap().check_blob().unwrap()
}
