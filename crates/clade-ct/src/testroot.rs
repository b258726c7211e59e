//! A small root filesystem for tests and the bench, built once and cached: busybox-static, the host's python3
//! with its standard library, and the shared libraries the glibc agent and python need (from `ldd`). Real
//! templates come from clade-template; this one needs nothing but what `./x setup` installed.

use std::path::{Path, PathBuf};
use std::process::Command;

const DONE: &str = ".clade-testroot-v2";

/// A template image of the test rootfs (`hash = "test"`, no disk manifest, 1 vCPU): what tests and benches
/// start ct sandboxes from.
pub fn image(name: &str, rootfs: PathBuf, memory_mib: u32, egress: bool) -> clade_core::backend::TemplateImage {
    clade_core::backend::TemplateImage {
        name: name.into(),
        hash: "test".into(),
        rootfs,
        disk_manifest: None,
        shape: clade_core::backend::Shape { memory_mib, vcpus: 1, disk_gib: 1 },
        egress,
        no_new_privs: true,
    }
}

/// The cached test rootfs under `$CLADE_HOME/tmp/ct-test-rootfs`, built on first use (a few seconds).
pub fn ensure(home: &clade_core::CladeHome, agent_bin: &Path) -> Result<PathBuf, String> {
    let dest = home.tmp_dir().join("ct-test-rootfs");
    if dest.join(DONE).exists() {
        return Ok(dest);
    }
    // Tests of one binary run in parallel and may all find it missing: each builds its own temp (unique per
    // thread), the first rename wins and the others drop theirs.
    let tmp = clade_core::home::temp_beside(&dest);
    build(&tmp, agent_bin).inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })?;
    if dest.exists() && !dest.join(DONE).exists() {
        let _ = std::fs::remove_dir_all(&dest); // an older layout, or one cut short
    }
    if let Err(e) = std::fs::rename(&tmp, &dest) {
        let _ = std::fs::remove_dir_all(&tmp);
        if !dest.join(DONE).exists() {
            return Err(format!("rename into {}: {e}", dest.display()));
        }
    }
    Ok(dest)
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn copy_libs(root: &Path, bin: &Path) -> Result<(), String> {
    let text = run(Command::new("ldd").arg(bin))?;
    for l in text.lines() {
        let path = l.split_whitespace().find(|w| w.starts_with('/'));
        if let Some(p) = path {
            let dest = root.join(p.trim_start_matches('/'));
            if let Some(d) = dest.parent() {
                std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
            }
            run(Command::new("cp").arg("-L").arg(p).arg(&dest))?;
        }
    }
    Ok(())
}

fn build(root: &Path, agent_bin: &Path) -> Result<(), String> {
    for d in ["bin", "sbin", "usr/bin", "usr/lib", "etc", "proc", "dev", "run", "tmp", "root", "sys", "var/tmp"] {
        std::fs::create_dir_all(root.join(d)).map_err(|e| format!("create {d}: {e}"))?;
    }
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .ok_or("busybox-static is not installed: run ./x setup")?;
    run(Command::new("cp").arg(busybox).arg(root.join("bin/busybox")))?;
    let list = run(Command::new(busybox).arg("--list"))?;
    for applet in list.lines().map(str::trim).filter(|a| !a.is_empty() && *a != "busybox") {
        let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(applet));
    }
    copy_libs(root, agent_bin)?;
    let py = Path::new("/usr/bin/python3.11");
    if py.exists() {
        run(Command::new("cp").arg(py).arg(root.join("usr/bin/python3")))?;
        copy_libs(root, py)?;
        let stdlib = root.join("usr/lib/python3.11");
        run(Command::new("cp").args(["-a", "/usr/lib/python3.11"]).arg(&stdlib))?;
        // Extension modules' own libraries (libffi for ctypes, libssl, ...).
        if let Ok(rd) = std::fs::read_dir(stdlib.join("lib-dynload")) {
            for e in rd.flatten() {
                let _ = copy_libs(root, &e.path());
            }
        }
        for junk in [
            "test",
            "idlelib",
            "tkinter",
            "ensurepip",
            "lib2to3",
            "site-packages",
            "dist-packages",
            "config-3.11-x86_64-linux-gnu",
        ] {
            let _ = std::fs::remove_dir_all(stdlib.join(junk));
        }
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").map_err(|e| e.to_string())?;
    std::fs::write(root.join("etc/group"), "root:x:0:\n").map_err(|e| e.to_string())?;
    std::fs::write(root.join("etc/hostname"), "template\n").map_err(|e| e.to_string())?;
    std::fs::write(root.join(DONE), "").map_err(|e| e.to_string())?;
    Ok(())
}
