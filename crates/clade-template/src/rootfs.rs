//! Filling a root filesystem: copying the source, the spec's files, the agent, the provision script and
//! the service scripts the agent runs at boot.
//!
//! A Debian rootfs starts as a hard-linked copy of its cached package stage (see `debian`), so nothing
//! here ever writes into an existing file: every destination is unlinked first and written fresh, which
//! leaves the stage's inode untouched.
//!
//! Services: the agent (PID 1) runs every executable in `/etc/clade/services.d/` in name order, each to
//! completion, and a service script is expected to start its daemon and return once it is ready. The
//! builder writes one POSIX `sh` script per service, `NN-<name>` in spec order: it starts the command under
//! `setsid` with output to `/var/log/clade/<name>.log`, then polls its readiness (a listening port read
//! from `/proc/net/tcp{,6}`, an `http://` URL, or a file) every 10 ms for up to 55 s. The same list is
//! written as JSON to `/etc/clade/services.json` for tools that want it structured.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::chroot::{is_root, run};
use crate::debian::set_mode;
use crate::error::{IoCtx, Result, TemplateError};
use crate::oci::resolve_in;
use crate::spec::{FileEntry, Ready, Service};

/// Where the agent binary goes in every rootfs.
pub const AGENT_PATH: &str = "/usr/lib/clade/clade-agent";
/// Where the provision script goes; the base build runs it in the booted sandbox.
pub const PROVISION_PATH: &str = "/etc/clade/provision.sh";
/// The service scripts the agent runs at boot.
pub const SERVICES_DIR: &str = "/etc/clade/services.d";

/// Copies the contents of `src` into `dst` (created), preserving everything (`cp -a`, reflinks where the
/// filesystem has them).
pub fn copy_tree(step: &str, src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst).ctx("create", dst)?;
    // A cached stage reached through a symlink (a home borrowing another's cache): copy what it points to,
    // not the link (`cp -a` never follows it).
    let src = std::fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf());
    let src = src.as_path();
    let mut c = Command::new("cp");
    c.arg("-a").arg("--reflink=auto").arg("-T").arg(src).arg(dst);
    run(step, &mut c).map(|_| ())
}

/// A copy of `src` at `dst` whose files are hard links to `src`'s (`cp -al`): directories are new, file
/// contents shared. Only for sources that are never written again.
pub fn link_tree(step: &str, src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst).ctx("create", dst)?;
    let mut c = Command::new("cp");
    c.arg("-a").arg("-l").arg("-T").arg(src).arg(dst);
    run(step, &mut c).map(|_| ())
}

/// The host path of `dest` (absolute, inside the sandbox) under `root`, creating its parents.
fn place(root: &Path, dest: &str) -> Result<PathBuf> {
    let rel = Path::new(dest.trim_start_matches('/'));
    let p = resolve_in(root, rel)
        .ok_or_else(|| TemplateError::Host(format!("{dest}: too many symlinks in the root filesystem")))?;
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).ctx("create", parent)?;
    }
    Ok(p)
}

/// Installs one regular file (following a symlinked source), owned by root, with `mode`.
fn install_file(src: &Path, root: &Path, dest: &str, mode: u32) -> Result<()> {
    let p = fresh(root, dest)?;
    std::fs::copy(src, &p).ctx("copy to", &p)?;
    set_mode(&p, mode)?;
    if is_root() {
        std::os::unix::fs::lchown(&p, Some(0), Some(0)).ctx("chown", &p)?;
    }
    Ok(())
}

/// `place`, then unlinks whatever non-directory is there (never write through a hard link into the stage).
fn fresh(root: &Path, dest: &str) -> Result<PathBuf> {
    let p = place(root, dest)?;
    match std::fs::symlink_metadata(&p) {
        Ok(m) if m.is_dir() => {
            Err(TemplateError::Host(format!("{dest} is a directory in the root filesystem; cannot put a file there")))
        }
        Ok(_) => std::fs::remove_file(&p).ctx("unlink", &p).map(|_| p),
        Err(_) => Ok(p),
    }
}

/// Writes a new file at `dest` in `root`.
pub fn write_file(root: &Path, dest: &str, text: &str, mode: u32) -> Result<()> {
    let p = fresh(root, dest)?;
    std::fs::write(&p, text).ctx("write", &p)?;
    set_mode(&p, mode)
}

/// Copies the spec's `files` into `root`: files with their permission bits, directories recursively
/// (symlinks kept), all owned by root.
pub fn install_files(root: &Path, files: &[FileEntry]) -> Result<()> {
    for f in files {
        let md = std::fs::metadata(&f.src).ctx("stat", &f.src)?;
        if md.is_dir() {
            let p = place(root, &f.dest)?;
            let mut c = Command::new("cp");
            c.args(["-R", "-P", "--preserve=mode,timestamps,links", "--remove-destination", "-T"]).arg(&f.src).arg(&p);
            run(&format!("files: {}", f.dest), &mut c)?;
        } else {
            install_file(&f.src, root, &f.dest, md.mode() & 0o7777)?;
        }
    }
    Ok(())
}

pub fn install_agent(root: &Path, agent: &Path) -> Result<()> {
    install_file(agent, root, AGENT_PATH, 0o755)
}

pub fn install_provision(root: &Path, script: &Path) -> Result<()> {
    install_file(script, root, PROVISION_PATH, 0o755)
}

/// Single-quotes `s` for `sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The boot script for one service.
pub fn service_script(s: &Service) -> String {
    let log = format!("/var/log/clade/{}.log", s.name);
    let mut out = format!(
        "#!/bin/sh\n# clade service {name:?}: written by the template builder, run by clade-agent at boot.\n\
         mkdir -p /var/log/clade\n\
         if command -v setsid >/dev/null 2>&1; then S=setsid; else S=; fi\n\
         $S /bin/sh -c {cmd} </dev/null >>{log} 2>&1 &\n",
        name = s.name,
        cmd = sh_quote(&s.command),
        log = sh_quote(&log),
    );
    let check = match &s.ready {
        None => return out + "exit 0\n",
        Some(Ready::Port(p)) => format!(
            "grep -qE '^ *[0-9]+: [0-9A-F]+:{p:04X} [0-9A-F]+:[0-9A-F]+ 0A ' /proc/net/tcp /proc/net/tcp6 2>/dev/null"
        ),
        Some(Ready::File(f)) => format!("[ -e {} ]", sh_quote(f)),
        Some(Ready::Url(u)) => {
            let u = sh_quote(u);
            format!(
                "{{ if command -v curl >/dev/null 2>&1; then curl -fsS -o /dev/null {u}; \
                 elif command -v wget >/dev/null 2>&1; then wget -q -O /dev/null {u}; \
                 else python3 -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' {u}; fi; }} >/dev/null 2>&1"
            )
        }
    };
    out.push_str(&format!(
        "i=0\nuntil {check}; do\n  i=$((i+1))\n  if [ \"$i\" -gt 5500 ]; then echo \"service {name}: not ready after 55 s\" >&2; exit 1; fi\n  sleep 0.01\ndone\nexit 0\n",
        name = s.name
    ));
    out
}

/// Writes `/etc/clade/services.d/NN-<name>` for every service (replacing any the source had) and
/// `/etc/clade/services.json`.
pub fn install_services(root: &Path, services: &[Service]) -> Result<()> {
    if services.is_empty() {
        return Ok(());
    }
    for (i, s) in services.iter().enumerate() {
        write_file(root, &format!("{SERVICES_DIR}/{:02}-{}", (i + 1) * 10, s.name), &service_script(s), 0o755)?;
    }
    let json = serde_json::to_string_pretty(services).unwrap_or_default();
    write_file(root, "/etc/clade/services.json", &json, 0o644)?;
    Ok(())
}

/// Regular-file bytes and entry count of a tree (symlinks not followed, hard links counted once).
pub fn tree_size(root: &Path) -> (u64, u64) {
    let mut seen = std::collections::HashSet::new();
    let (mut bytes, mut entries) = (0u64, 0u64);
    for e in walkdir::WalkDir::new(root).follow_links(false).into_iter().flatten() {
        entries += 1;
        if let Ok(m) = e.metadata() {
            if m.is_file() && (m.nlink() == 1 || seen.insert((m.dev(), m.ino()))) {
                bytes += m.len();
            }
        }
    }
    (bytes, entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_sh(script: &str) -> std::process::Output {
        Command::new("sh").arg("-c").arg(script).output().unwrap()
    }

    #[test]
    fn service_scripts_start_and_wait() {
        let d = tempfile::tempdir().unwrap();
        let flag = d.path().join("flag");
        let s = Service {
            name: "flag".into(),
            command: format!("sleep 0.2; echo 'it'\\''s up' > {}", flag.display()),
            ready: Some(Ready::File(flag.display().to_string())),
        };
        let script = service_script(&s).replace("/var/log/clade", &d.path().display().to_string());
        let t = std::time::Instant::now();
        let out = run_sh(&script);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(t.elapsed() >= std::time::Duration::from_millis(200), "the script waited for readiness");
        assert_eq!(std::fs::read_to_string(&flag).unwrap(), "it's up\n");
    }

    #[test]
    fn port_probe_matches_proc_net_tcp() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let s = Service { name: "p".into(), command: "true".into(), ready: Some(Ready::Port(port)) };
        let script = service_script(&s).replace("/var/log/clade", "/tmp");
        let check = script.lines().find(|l| l.starts_with("until ")).unwrap();
        let probe = check.trim_start_matches("until ").trim_end_matches("; do");
        assert!(run_sh(probe).status.success(), "{probe} did not see port {port}");
        drop(l);
        assert!(!run_sh(probe).status.success(), "{probe} saw a closed port");
    }

    #[test]
    fn files_and_services_land_in_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir_all(root.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", root.join("var/run")).unwrap();
        let src = d.path().join("hello.sh");
        std::fs::write(&src, "echo hi").unwrap();
        set_mode(&src, 0o750).unwrap();
        std::fs::create_dir_all(d.path().join("tree/sub")).unwrap();
        std::fs::write(d.path().join("tree/sub/f"), "f").unwrap();
        let files = vec![
            FileEntry { dest: "/opt/a/hello.sh".into(), src: src.clone() },
            FileEntry { dest: "/var/run/x".into(), src: src.clone() },
            FileEntry { dest: "/srv/tree".into(), src: d.path().join("tree") },
        ];
        install_files(&root, &files).unwrap();
        let m = std::fs::metadata(root.join("opt/a/hello.sh")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o750);
        assert!(root.join("run/x").is_file(), "an absolute symlink in the root resolves inside it");
        assert_eq!(std::fs::read_to_string(root.join("srv/tree/sub/f")).unwrap(), "f");
        let svcs = vec![
            Service { name: "a".into(), command: "true".into(), ready: None },
            Service { name: "b".into(), command: "true".into(), ready: Some(Ready::Port(80)) },
        ];
        install_services(&root, &svcs).unwrap();
        let names: Vec<String> = std::fs::read_dir(root.join("etc/clade/services.d"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        assert_eq!(names, vec!["10-a", "20-b"]);
        let (bytes, _) = tree_size(&root);
        assert!(bytes > 14, "{bytes}");
    }
}
