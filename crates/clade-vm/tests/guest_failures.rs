//! Clean failure and bad input on the `vm` backend, with real guests: a cold start or restore made to fail after
//! each step leaves no QEMU process, run dir, socket or private RAM file; a QEMU killed under a running sandbox
//! is reported with its exit status; a guest whose agent never answers is timed out, killed and reported with its
//! console; a guest that dies while booting is reported at once with its console; a restore whose device state
//! QEMU rejects fails with QEMU's own words; marks taken under another QEMU version, machine type or CPU model,
//! or whose device state or RAM fail verification, are refused before any process starts; a damaged root RAM
//! file is rebuilt from the store.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clade_agent::proto::ExecSpec;
use clade_core::backend::{Backend, BackendError, MarkOptions, MarkState, Sandbox, Shape, TemplateImage};
use clade_core::hygiene;
use clade_store::{ImageKind, Store};
use clade_vm::backend::{FailPoint, VmBackend};
use common::*;

struct Env {
    _work: tempfile::TempDir,
    w: PathBuf,
    store: Store,
    home: clade_core::CladeHome,
    backend: VmBackend,
    image: TemplateImage,
}

fn env(tag: &str) -> Option<Env> {
    let e = vm_env(&format!("clade-vmfail-{tag}"))?;
    let w = e.work.path().to_path_buf();
    let image = TemplateImage {
        name: "busybox-fail".into(),
        hash: "test".into(),
        rootfs: w.join("root"),
        disk_manifest: Some(e.disk),
        shape: Shape { memory_mib: 256, vcpus: 1, disk_gib: 1 },
        egress: false,
        no_new_privs: true,
    };
    Some(Env { _work: e.work, w, store: e.store, home: e.home, backend: e.backend, image })
}

fn ident(name: &str) -> clade_core::backend::Identity {
    hygiene::new_identity(&format!("t{}{name}", std::process::id()), 1)
}

/// QEMU processes whose command line names `needle` (a test's own shm dir or run dir).
fn qemus_naming(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("qemu-system") && cmd.contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// What a sandbox could leave behind: its run dir (sockets inside), its private RAM file, a QEMU.
fn leftovers(e: &Env, id: &clade_core::backend::Identity) -> Vec<String> {
    let mut left = Vec::new();
    let run = e.home.run_dir().join(&id.sandbox_id);
    if run.exists() {
        left.push(format!("run dir {}", run.display()));
    }
    let ram = e.w.join("shm/run").join(format!("{}.ram", id.sandbox_id));
    if ram.exists() {
        left.push(format!("RAM file {}", ram.display()));
    }
    // Give a killed QEMU a moment to be reaped.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let q = qemus_naming(&run.display().to_string());
        if q.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            left.push(format!("QEMU {q:?}"));
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    left
}

fn sh(s: &dyn Sandbox, script: &str) -> String {
    let out =
        s.agent().run(ExecSpec { argv: vec!["/bin/sh".into(), "-c".into(), script.into()], ..Default::default() });
    let out = out.unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A base mark (cold sandbox marked) and a mark of a clone of it (with pages of its own).
fn marks(e: &Env) -> (MarkState, MarkState) {
    let mut cold = e.backend.cold_start(&e.image, &ident("base")).unwrap();
    let base = cold.mark(&MarkOptions::default()).unwrap();
    drop(cold);
    let mut clone = e.backend.restore(&base, &ident("clone")).unwrap();
    sh(clone.as_ref(), "dd if=/dev/urandom of=/root/x bs=1k count=512 2>/dev/null; sync");
    let m = clone.mark(&MarkOptions::default()).unwrap();
    drop(clone);
    (base, m)
}

fn err_of(r: Result<Box<dyn Sandbox>, BackendError>) -> BackendError {
    match r {
        Ok(_) => panic!("expected a failure"),
        Err(e) => e,
    }
}

#[test]
fn guest_vm_failure_at_each_step_leaves_nothing() {
    let Some(e) = env("steps") else { return };
    let (_base, m) = marks(&e);
    for at in FailPoint::ALL {
        e.backend.inject_failure(Some(at));
        let id = ident(&format!("r{at:?}"));
        let err = err_of(e.backend.restore(&m, &id)).to_string();
        assert!(err.contains("injected"), "restore {at:?}: {err}");
        assert!(leftovers(&e, &id).is_empty(), "restore failing after {at:?} left {:?}", leftovers(&e, &id));
        // A cold start has no pages to write and no device state to load.
        if !matches!(at, FailPoint::Pages | FailPoint::Running) {
            let id = ident(&format!("c{at:?}"));
            let err = err_of(e.backend.cold_start(&e.image, &id)).to_string();
            assert!(err.contains("injected"), "cold start {at:?}: {err}");
            assert!(leftovers(&e, &id).is_empty(), "cold start failing after {at:?} left {:?}", leftovers(&e, &id));
        }
    }
    e.backend.inject_failure(None);
    // And the backend still works.
    let id = ident("after");
    let s = e.backend.restore(&m, &id).unwrap();
    assert_eq!(sh(s.as_ref(), "echo ok"), "ok");
    drop(s);
    assert!(leftovers(&e, &id).is_empty());
}

#[test]
fn guest_vm_bad_marks_refused_before_any_process() {
    let Some(e) = env("bad") else { return };
    let (base, m) = marks(&e);
    let shm = e.w.join("shm").display().to_string();
    let refused = |mark: &MarkState, what: &str| -> String {
        let before = qemus_naming(&shm).len();
        let id = ident(what);
        let err = err_of(e.backend.restore(mark, &id));
        assert_eq!(qemus_naming(&shm).len(), before, "{what}: a QEMU was started");
        assert!(!e.home.run_dir().join(&id.sandbox_id).exists(), "{what}: a run dir was made");
        eprintln!("{what}: {err}");
        err.to_string()
    };
    for (key, other) in [("qemu", "6.2.0"), ("machine", "microvm"), ("cpu", "host (Other CPU)"), ("accel", "kvm")] {
        let mut bad = m.clone();
        bad.compat.insert(key.into(), other.into());
        let err = refused(&bad, key);
        assert!(err.contains(&format!("{key}={other}")), "{err}");
    }
    assert!(m.compat.contains_key("cpu"), "marks record the CPU model: {:?}", m.compat);

    // Device state that is not a QEMU migration stream.
    let junk = e.store.put_bytes(&[0x5a; 4096], ImageKind::Other).unwrap().id.unwrap().to_string();
    let mut bad = m.clone();
    bad.manifests.insert("devstate_only".into(), junk.clone());
    let err = refused(&bad, "devstate");
    assert!(err.contains("not a QEMU migration stream"), "{err}");
    // RAM of the wrong size for the mark's shape.
    let small = e.store.put_bytes(&vec![1u8; 1 << 20], ImageKind::Mem).unwrap().id.unwrap().to_string();
    let mut bad = base.clone();
    bad.manifests.insert("ram_root".into(), small);
    let err = refused(&bad, "ramsize");
    assert!(err.contains("has 1048576 bytes"), "{err}");
    // A page list that points outside the guest's RAM.
    let list: Vec<u8> = [3u64, 1u64 << 40].iter().flat_map(|p| p.to_le_bytes()).collect();
    let pages = e.store.put_bytes(&list, ImageKind::Other).unwrap().id.unwrap().to_string();
    let mut bad = m.clone();
    bad.manifests.insert("ram_pages".into(), pages);
    let err = refused(&bad, "pages");
    assert!(err.contains("not an ascending list"), "{err}");
    // A mark naming what the store does not have.
    let mut bad = m.clone();
    bad.manifests.insert("ram".into(), "00".repeat(32));
    refused(&bad, "missing");

    // A root RAM file damaged on the host (truncated) is rebuilt from the store, and the restore works.
    let root = VmBackend::root_ram_file(&e.backend, &m.manifests["ram_root"]);
    std::fs::OpenOptions::new().write(true).open(&root).unwrap().set_len(4096).unwrap();
    let s = e.backend.restore(&m, &ident("healed")).unwrap();
    assert_eq!(sh(s.as_ref(), "ls /root/x"), "/root/x");
    assert_eq!(std::fs::metadata(&root).unwrap().len(), 256 << 20);
}

#[test]
fn guest_vm_dead_qemu_silent_guest_and_rejected_state_are_reported() {
    let Some(e) = env("dead") else { return };
    let (base, m) = marks(&e);

    // A QEMU killed under a running sandbox: `exited` says so with its status; killing the sandbox cleans up.
    let id = ident("killed");
    let mut s = e.backend.restore(&m, &id).unwrap();
    assert!(s.exited().is_none());
    let pid = s.pids()[0];
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let why = loop {
        if let Some(w) = s.exited() {
            break w;
        }
        assert!(Instant::now() < deadline, "QEMU {pid} killed but the sandbox does not know");
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("killed QEMU: {why}");
    assert!(why.contains("QEMU exited") && why.contains("9"), "{why}");
    s.kill().unwrap();
    assert!(leftovers(&e, &id).is_empty(), "{:?}", leftovers(&e, &id));

    // A restore whose device state QEMU rejects (a clone's device-state-only file loaded as a full stream):
    // half-way (QEMU started), reported in QEMU's words, nothing left.
    let mut bad = base.clone();
    bad.manifests.insert("devstate".into(), m.manifests["devstate_only"].clone());
    let id = ident("rejected");
    let err = err_of(e.backend.restore(&bad, &id)).to_string();
    eprintln!("rejected state: {err}");
    assert!(err.contains("QEMU said:") && err.len() > "QEMU said: ".len() + 20, "{err}");
    assert!(leftovers(&e, &id).is_empty(), "{:?}", leftovers(&e, &id));

    // A guest whose agent never answers (the "agent" is a shell sleeping): timed out, killed, console reported.
    let silent = e.w.join("silent");
    std::fs::create_dir_all(&silent).unwrap();
    let script = silent.join("sleeper");
    std::fs::write(&script, "#!/bin/sh\necho clade-test: the agent sleeps\nexec sleep 100000\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let img = silent.join("root.img");
    busybox_root_image(&silent, &script, &img, 32);
    let disk = e.store.put_file(&img, ImageKind::Disk).unwrap().id.unwrap().to_string();
    let mut image = e.image.clone();
    image.disk_manifest = Some(disk);
    e.backend.set_hello_timeout(Some(Duration::from_secs(25)));
    let id = ident("silent");
    let t = Instant::now();
    let err = err_of(e.backend.cold_start(&image, &id));
    eprintln!("silent guest after {:?}: {err}", t.elapsed());
    assert!(matches!(err, BackendError::NotReady { .. }), "{err}");
    assert!(err.to_string().contains("last console lines"), "{err}");
    assert!(leftovers(&e, &id).is_empty(), "{:?}", leftovers(&e, &id));

    // A guest that dies while booting (its root disk is not ext4): reported at once, with its console.
    let zero = e.store.put_bytes(&vec![0u8; 16 << 20], ImageKind::Disk).unwrap().id.unwrap().to_string();
    image.disk_manifest = Some(zero);
    e.backend.set_hello_timeout(Some(Duration::from_secs(100)));
    let id = ident("nodisk");
    let t = Instant::now();
    let err = err_of(e.backend.cold_start(&image, &id)).to_string();
    eprintln!("dead guest after {:?}: {err}", t.elapsed());
    assert!(err.contains("QEMU exited") && err.contains("clade-init: FAILED"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(90), "waited for the timeout although QEMU had exited");
    assert!(leftovers(&e, &id).is_empty(), "{:?}", leftovers(&e, &id));
    e.backend.set_hello_timeout(None);
}

/// A tmpfs of `mib` MiB mounted at `dir` (unmounted on drop).
struct SmallTmpfs(PathBuf);
impl SmallTmpfs {
    fn mount(dir: &Path, mib: u32) -> Option<SmallTmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .status()
            .ok()?;
        st.success().then(|| SmallTmpfs(dir.to_path_buf()))
    }
}
impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn guest_privileged_vm_full_tmpfs() {
    let Some(e) = env("full") else { return };
    let (base, _) = marks(&e);
    let Some(small) = SmallTmpfs::mount(&e.w.join("small"), 300) else {
        eprintln!("skip: cannot mount a tmpfs (not root?)");
        return;
    };
    let backend = VmBackend::open(&e.home, e.store.clone(), Some(small.0.clone())).unwrap();
    // Not enough room for a restore's RAM file to be rebuilt, or for a cold guest: refused before any process.
    let filler = small.0.join("filler");
    std::fs::write(&filler, vec![1u8; 100 << 20]).unwrap();
    let id = ident("norestore");
    let err = err_of(backend.restore(&base, &id)).to_string();
    eprintln!("restore on a full tmpfs: {err}");
    assert!(err.contains("MiB free"), "{err}");
    assert!(leftovers(&e, &id).is_empty());
    let leftover_files: Vec<_> = std::fs::read_dir(small.0.join("ram")).unwrap().flatten().collect();
    assert!(leftover_files.is_empty(), "{leftover_files:?}");
    let err = err_of(backend.cold_start(&e.image, &ident("nocold"))).to_string();
    assert!(err.contains("MiB free"), "{err}");

    // Room at the start, then the tmpfs fills under a running cold guest: its next writes to RAM kill QEMU
    // (SIGBUS), the sandbox reports it, and killing it leaves nothing.
    std::fs::remove_file(&filler).unwrap();
    let id = ident("filled");
    let mut s = backend.cold_start(&e.image, &id).unwrap();
    let used = std::fs::metadata(small.0.join("run").join(format!("{}.ram", id.sandbox_id))).unwrap();
    eprintln!("cold guest running, its RAM file {} MiB apparent", used.len() >> 20);
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "count=300"])
        .arg(format!("of={}", filler.display()))
        .status();
    let _ = s.agent().run(ExecSpec {
        // dd's buffer is guest RAM: filling it makes the guest touch pages its RAM file has no room for.
        argv: vec!["/bin/sh".into(), "-c".into(), "dd if=/dev/zero of=/dev/null bs=150M count=2".into()],
        ..Default::default()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let why = loop {
        if let Some(w) = s.exited() {
            break w;
        }
        assert!(Instant::now() < deadline, "the guest filled its RAM on a full tmpfs and QEMU still runs");
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("QEMU on a full tmpfs: {why}");
    assert!(why.contains("QEMU exited"), "{why}");
    s.kill().unwrap();
    assert!(leftovers(&e, &id).is_empty(), "{:?}", leftovers(&e, &id));
    assert!(!small.0.join("run").join(format!("{}.ram", id.sandbox_id)).exists());
}
