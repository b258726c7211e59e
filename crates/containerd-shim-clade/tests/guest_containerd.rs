//! containerd runs OCI images as clade sandboxes through `containerd-shim-clade-v2`, driven by `ctr` as an
//! operator would: Debian's containerd, started privately; images imported from OCI archives built here.
//! A busybox-only image (no glibc: the static agent goes in) starts cold once, becomes a base, and every later
//! container of it is forked from that base; exit codes, stdout and stderr, exec into a running task, signals,
//! a shim killed mid-task (containerd reports the task gone and nothing of the sandbox is left) and an image
//! clade cannot start (a clear error) are checked.

mod common;

use std::time::Instant;

use common::{busybox_rootfs, containerd, oci_archive, Containerd, Entry};

const RUNTIME: &str = "io.containerd.clade.v2";
const IMAGE: &str = "clade.test/busybox:latest";

fn import(c: &Containerd, name: &str, entries: &[Entry]) {
    let archive = c.dir.path().join("image.tar");
    oci_archive(&archive, name, entries, &["/bin/sh"]);
    c.ctr_ok(&["image", "import", archive.to_str().unwrap()]);
}

fn out(o: &std::process::Output) -> (i32, String, String) {
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Waits for task `id` to stop, deletes it, and returns its exit status (what `ctr task rm` reports; ctr 1.6 has
/// no `task wait`).
fn stopped_with(c: &Containerd, id: &str) -> u32 {
    let t0 = Instant::now();
    while !c.ctr_ok(&["task", "ls"]).lines().any(|l| l.starts_with(id) && l.contains("STOPPED")) {
        assert!(t0.elapsed().as_secs() < 20, "task {id} did not stop: {}", c.ctr_ok(&["task", "ls"]));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (code, _, stderr) = out(&c.ctr(&["task", "rm", id]));
    assert_eq!(code, 0, "task rm {id}: {stderr}");
    stderr.split("exit code ").nth(1).map(|s| s.trim().trim_end_matches('"').parse().unwrap()).unwrap_or(0)
}

#[test]
fn guest_ctr_runs_a_busybox_image_as_clade_sandboxes() {
    let Some(c) = containerd("disabled_plugins = [\"io.containerd.grpc.v1.cri\"]") else { return };
    import(&c, IMAGE, &busybox_rootfs());

    // Cold: the image's rootfs becomes a template, booted and marked as its base; then forked.
    let t0 = Instant::now();
    let o = c.ctr(&[
        "run",
        "--rm",
        "--runtime",
        RUNTIME,
        IMAGE,
        "cold",
        "sh",
        "-c",
        "echo hi from $(hostname); echo oops >&2; exit 7",
    ]);
    let cold = t0.elapsed();
    let (code, stdout, stderr) = out(&o);
    assert_eq!(code, 7, "the container's exit code: {stdout} {stderr}\n{}", c.log_tail());
    assert!(stdout.starts_with("hi from clade-"), "stdout: {stdout:?}");
    assert!(stderr.contains("oops"), "stderr: {stderr:?}");

    // Warm: the same image content forks from its base.
    let t0 = Instant::now();
    let (code, stdout, _) =
        out(&c.ctr(&["run", "--rm", "--runtime", RUNTIME, IMAGE, "warm", "sh", "-c", "id -u; pwd; ls /usr/lib/clade"]));
    let warm = t0.elapsed();
    assert_eq!(code, 0, "{stdout}\n{}", c.log_tail());
    assert!(
        stdout.starts_with("0\n/\n") && stdout.contains("\nclade-agent\n"),
        "root, in /, with clade's agent: {stdout}"
    );
    eprintln!("ctr run: cold (template + base + fork) {cold:?}, from the base {warm:?}");
    assert!(c.sandboxes().is_empty(), "ctr run --rm leaves no sandbox: {:?}", c.sandboxes());

    // A running task: exec into it, list its processes, signal it.
    let script = "echo up > /tmp/up; trap 'exit 3' TERM; while :; do echo >> /tmp/ticks; sleep 0.1; done";
    c.ctr_ok(&["run", "-d", "--runtime", RUNTIME, IMAGE, "svc", "sh", "-c", script]);
    let (code, stdout, stderr) =
        out(&c.ctr(&["task", "exec", "--exec-id", "e1", "svc", "sh", "-c", "cat /tmp/up; echo e >&2; exit 5"]));
    assert_eq!((code, stdout.as_str(), stderr.trim()), (5, "up\n", "e"), "exec sees the task's files");
    // A terminal: `ctr task exec -t` under `script`, which gives ctr a pty of its own (30x100) whose size ctr
    // passes on through ResizePty once the process started.
    let ctr = format!(
        "stty rows 30 cols 100; ctr -a {} -n clade task exec -t --exec-id tty svc sh -c 'tty; sleep 0.5; stty size'",
        c.socket().display()
    );
    let tty = std::process::Command::new("script").args(["-qec", &ctr, "/dev/null"]).output().unwrap();
    let tty_out = String::from_utf8_lossy(&tty.stdout);
    assert!(tty.status.success() && tty_out.contains("/dev/pts/"), "a pty in the sandbox: {tty_out}");
    assert!(tty_out.contains("30 100"), "ResizePty reached the sandbox's pty: {tty_out}");
    assert!(!tty_out.contains("resize pty"), "a resize after the process ended is no error: {tty_out}");
    let ps = c.ctr_ok(&["task", "ps", "svc"]);
    // Pause freezes the sandbox: its ticking loop stands still and an exec is refused until resume. Control: the
    // same wait without the pause sees the loop tick on.
    let ticks = |c: &Containerd, n: &str| {
        let (code, out, err) = out(&c.ctr(&["task", "exec", "--exec-id", n, "svc", "sh", "-c", "wc -l < /tmp/ticks"]));
        assert_eq!(code, 0, "{err}");
        out.trim().parse::<u32>().unwrap()
    };
    let t0 = ticks(&c, "t0");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let running = ticks(&c, "t1") - t0;
    assert!(running >= 5, "the loop ticks while running: {running} in 1.5 s");
    let before = ticks(&c, "t2");
    c.ctr_ok(&["task", "pause", "svc"]);
    assert!(c.ctr_ok(&["task", "ls"]).lines().any(|l| l.starts_with("svc") && l.contains("PAUSED")));
    let (code, _, err) = out(&c.ctr(&["task", "exec", "--exec-id", "frozen", "svc", "true"]));
    assert!(code != 0 && err.contains("frozen"), "an exec into a paused task is refused: {err}");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    c.ctr_ok(&["task", "resume", "svc"]);
    let paused = ticks(&c, "t3") - before;
    assert!(paused <= 2, "the loop stood still while paused: {paused} ticks (running: {running})");
    assert!(ps.lines().count() >= 2, "task ps lists the task's process: {ps}");
    c.ctr_ok(&["task", "kill", "-s", "SIGTERM", "svc"]);
    assert_eq!(stopped_with(&c, "svc"), 3, "the task's own TERM handler exited 3");
    c.ctr_ok(&["container", "rm", "svc"]);

    // A process that dies of a signal: 128 + the signal.
    c.ctr_ok(&["run", "-d", "--runtime", RUNTIME, IMAGE, "victim", "sleep", "1000"]);
    c.ctr_ok(&["task", "kill", "-s", "SIGKILL", "victim"]);
    assert_eq!(stopped_with(&c, "victim"), 137, "SIGKILL reads as 128 + 9");
    c.ctr_ok(&["container", "rm", "victim"]);
    assert!(c.sandboxes().is_empty(), "deleted tasks leave no sandbox: {:?}", c.sandboxes());
}

#[test]
fn guest_ctr_a_killed_shim_leaves_nothing_and_a_bad_image_says_why() {
    let Some(c) = containerd("disabled_plugins = [\"io.containerd.grpc.v1.cri\"]") else { return };
    import(&c, IMAGE, &busybox_rootfs());
    c.ctr_ok(&["run", "-d", "--runtime", RUNTIME, IMAGE, "doomed", "sleep", "1000"]);
    assert_eq!(c.sandboxes().len(), 1, "one running sandbox");
    assert!(c.kill_shim("doomed"), "the shim of the task was found and killed");
    let t0 = Instant::now();
    loop {
        let tasks = c.ctr_ok(&["task", "ls"]);
        if !tasks.contains("doomed") || tasks.contains("STOPPED") {
            break;
        }
        assert!(t0.elapsed().as_secs() < 20, "containerd still reports the task running: {tasks}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // containerd runs the shim binary's `delete` for a dead shim: the sandbox is killed, the rootfs unmounted.
    let t0 = Instant::now();
    while !c.sandboxes().is_empty() || std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains("/doomed/") {
        assert!(t0.elapsed().as_secs() < 20, "the dead shim's sandbox or rootfs is still there: {:?}", c.sandboxes());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let _ = c.ctr(&["container", "rm", "doomed"]);

    // An image of one static file: no /bin, /usr or /etc; the error says what is wrong.
    import(&c, "clade.test/lonely:latest", &[Entry::File("app", b"#!/app\n".to_vec(), 0o755)]);
    let (code, _, stderr) =
        out(&c.ctr(&["run", "--rm", "--runtime", RUNTIME, "clade.test/lonely:latest", "bad", "/app"]));
    assert_ne!(code, 0);
    assert!(stderr.contains("no /bin, /usr or /etc"), "the reason reaches ctr: {stderr}");
    assert!(c.sandboxes().is_empty());
}

/// A Debian image: the `minimal` template's root filesystem exported as an OCI archive. Its content matches the
/// template, so the container forks from the template's ct base, with the template's HTTP service already up
/// (no warm-up), instead of a template of its own.
#[test]
fn guest_ctr_runs_the_minimal_templates_image_from_its_base() {
    let home = common::real_home();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_containerd-shim-clade-v2")).parent().unwrap().to_path_buf();
    let spec = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../templates/minimal");
    let Some(c) =
        Containerd::start("disabled_plugins = [\"io.containerd.grpc.v1.cri\"]", &bin, Some(home.clone()), &[])
    else {
        return;
    };
    let clade = |args: &[&str]| {
        let out = std::process::Command::new(bin.join("clade")).args(args).env("CLADE_HOME", &home).output().unwrap();
        assert!(out.status.success(), "clade {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let base = clade(&["base", "build", spec.to_str().unwrap(), "--backend", "ct", "--json"]);
    let record = clade(&["template", "build", spec.to_str().unwrap(), "--backend", "ct", "--json"]);
    let rootfs = record["record"]["rootfs"].as_str().expect("the template's rootfs").to_string();
    let archive = c.dir.path().join("minimal.tar");
    common::oci_archive_of_dir(&archive, "clade.test/minimal:latest", std::path::Path::new(&rootfs), &["/bin/bash"]);
    c.ctr_ok(&["image", "import", archive.to_str().unwrap()]);
    std::fs::remove_file(&archive).unwrap();

    let probe = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8080/').status)";
    let id = format!("minimal-{}", std::process::id());
    let before: Vec<_> = c.sandboxes().into_iter().map(|s| s["id"].clone()).collect();
    c.ctr_ok(&["run", "-d", "--runtime", RUNTIME, "clade.test/minimal:latest", &id, "sleep", "1000"]);
    let new: Vec<_> = c.sandboxes().into_iter().filter(|s| !before.contains(&s["id"])).collect();
    let (code, stdout, stderr) = out(&c.ctr(&["task", "exec", "--exec-id", "probe", &id, "python3", "-c", probe]));
    let _ = c.ctr(&["task", "kill", "-s", "SIGKILL", &id]);
    stopped_with(&c, &id);
    c.ctr_ok(&["container", "rm", &id]);
    assert_eq!(new.len(), 1, "one sandbox for the container: {new:?}");
    assert_eq!(new[0]["origin"], base["mark"], "the container forked from minimal's base");
    assert_eq!((code, stdout.trim()), (0, "200"), "the template's service answers at once: {stderr}");
}

/// The vm backend (`CLADE_SHIM_BACKEND=vm` in containerd's environment, or the annotation `clade.dev/backend`):
/// the busybox image's template gets a disk image and a vm base, and the container runs in a QEMU guest.
#[test]
fn guest_ctr_runs_an_image_on_the_vm_backend() {
    if clade_vm_missing() {
        return;
    }
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_containerd-shim-clade-v2")).parent().unwrap().to_path_buf();
    let config = "disabled_plugins = [\"io.containerd.grpc.v1.cri\"]";
    let Some(c) = Containerd::start(config, &bin, None, &[("CLADE_SHIM_BACKEND", "vm")]) else { return };
    import(&c, IMAGE, &busybox_rootfs());
    let t0 = Instant::now();
    // Volumes: a guest cannot see the host's, so they are copied in (clade-vm's volumes.rs): a read-only
    // directory with a nested file, its mode and a symbolic link (a configMap's shape), and a writable file.
    let vol = c.dir.path().join("vol");
    std::fs::create_dir_all(vol.join("sub")).unwrap();
    std::fs::write(vol.join("conf"), "from the host\n").unwrap();
    std::fs::write(vol.join("sub/deep"), "deep\n").unwrap();
    std::fs::set_permissions(vol.join("sub/deep"), std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink("conf", vol.join("link")).unwrap();
    let file = c.dir.path().join("app.conf");
    std::fs::write(&file, "setting=1\n").unwrap();
    let dir_mount = format!("type=bind,src={},dst=/data,options=rbind:ro", vol.display());
    let file_mount = format!("type=bind,src={},dst=/etc/app.conf,options=rbind:rw", file.display());
    c.ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        "--mount",
        &dir_mount,
        "--mount",
        &file_mount,
        IMAGE,
        "guest",
        "sleep",
        "1000",
    ]);
    eprintln!("vm: first container (template disk, cold boot, base mark, fork) in {:?}", t0.elapsed());
    let sh = |id: &str, script: &str| out(&c.ctr(&["task", "exec", "--exec-id", id, "guest", "sh", "-c", script]));
    let (code, stdout, stderr) = sh("v1", "cat /data/conf /data/link /data/sub/deep; ls -l /data/sub/deep");
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.starts_with("from the host\nfrom the host\ndeep\n-rw-------"),
        "the tree, its link and modes: {stdout}"
    );
    let (code, _, _) = sh("v2", "touch /data/new");
    assert_ne!(code, 0, "a read-only volume takes no write");
    let (code, stdout, stderr) = sh("v3", "echo setting=2 >> /etc/app.conf && cat /etc/app.conf");
    assert_eq!((code, stdout.as_str()), (0, "setting=1\nsetting=2\n"), "a writable volume takes writes: {stderr}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "setting=1\n", "a copy: the host's file stays as it was");
    let sandboxes = c.sandboxes();
    assert_eq!(sandboxes.len(), 1);
    assert_eq!(sandboxes[0]["backend"], "vm", "{sandboxes:?}");
    let (code, stdout, stderr) = out(&c.ctr(&["task", "exec", "--exec-id", "k", "guest", "cat", "/proc/cmdline"]));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("console="), "a kernel of its own: {stdout}");
    c.ctr_ok(&["task", "kill", "-s", "SIGKILL", "guest"]);
    assert_eq!(stopped_with(&c, "guest"), 137);
    c.ctr_ok(&["container", "rm", "guest"]);
    assert!(c.sandboxes().is_empty());
}

/// Whether QEMU or the guest kernel is missing (a printed reason): `./x setup` installs both.
fn clade_vm_missing() -> bool {
    let kernel = common::real_home().join("kernel/current/vmlinux");
    let qemu = std::process::Command::new("qemu-system-x86_64").arg("--version").output().is_ok();
    if !qemu || !kernel.exists() {
        eprintln!("skip: no QEMU or no guest kernel at {} (run ./x setup)", kernel.display());
        return true;
    }
    false
}
