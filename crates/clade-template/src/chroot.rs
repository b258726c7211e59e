//! Running tools inside a root filesystem under construction: `/proc`, `/sys` and `/dev` are mounted for
//! the duration of a [`ChrootMounts`] guard and unmounted when it drops, on success, error or panic. The
//! partial build directory is only deleted by [`Scratch`] after checking that nothing is still mounted
//! under it: a recursive delete through a bind mount of `/dev` would delete the host's device nodes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::{Result, TemplateError};

/// `/proc`, `/sys` and `/dev` mounted inside a root; unmounted (lazily, innermost first) on drop.
pub struct ChrootMounts {
    mounted: Vec<PathBuf>,
}

impl ChrootMounts {
    /// Mounts proc, sysfs and a bind of the host's `/dev` under `root`. Needs root.
    pub fn mount(root: &Path) -> Result<ChrootMounts> {
        let mut g = ChrootMounts { mounted: Vec::new() };
        let none: Option<&str> = None;
        for (what, dir, fstype, flags) in [
            ("proc", "proc", Some("proc"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC),
            (
                "sysfs",
                "sys",
                Some("sysfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY,
            ),
            ("/dev", "dev", None, MsFlags::MS_BIND),
        ] {
            let target = root.join(dir);
            std::fs::create_dir_all(&target)
                .map_err(|e| TemplateError::Host(format!("cannot create {}: {e}", target.display())))?;
            mount(Some(what), &target, fstype, flags, none).map_err(|e| {
                TemplateError::Host(format!(
                    "cannot mount {what} on {}: {e} (building a template needs root)",
                    target.display()
                ))
            })?;
            g.mounted.push(target);
        }
        Ok(g)
    }
}

impl Drop for ChrootMounts {
    fn drop(&mut self) {
        for m in self.mounted.drain(..).rev() {
            if let Err(e) = umount2(&m, MntFlags::MNT_DETACH) {
                eprintln!("clade-template: cannot unmount {}: {e}; unmount it by hand", m.display());
            }
        }
    }
}

/// Mount points at or under `dir`, from `/proc/self/mountinfo`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return Vec::new() };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(&dir))
        .collect()
}

/// A temporary build directory under `$CLADE_HOME/tmp`, removed on drop unless [`Scratch::keep`] was
/// called, and never while anything is mounted under it.
pub struct Scratch {
    path: Option<PathBuf>,
}

impl Scratch {
    pub fn new(tmp_root: &Path, prefix: &str) -> Result<Scratch> {
        std::fs::create_dir_all(tmp_root)
            .map_err(|e| TemplateError::Host(format!("cannot create {}: {e}", tmp_root.display())))?;
        let d = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(tmp_root)
            .map_err(|e| TemplateError::Host(format!("cannot create a temp dir in {}: {e}", tmp_root.display())))?;
        Ok(Scratch { path: Some(d.keep()) })
    }

    pub fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new("/nonexistent"))
    }

    /// Called after the result was renamed away: removes what is left (nothing, or leftovers of a
    /// build that lost a race) through the same mount-checked path as a failure.
    pub fn done(self) {
        drop(self)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let Some(p) = self.path.take() else { return };
        for m in mounts_under(&p).into_iter().rev() {
            let _ = umount2(&m, MntFlags::MNT_DETACH);
        }
        if !mounts_under(&p).is_empty() {
            eprintln!("clade-template: {} still has mounts under it; not removing it", p.display());
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(&p) {
            eprintln!("clade-template: cannot remove the partial build {}: {e}", p.display());
        }
    }
}

/// Scratch prefixes this crate creates under `$CLADE_HOME/tmp`.
const SCRATCH_PREFIXES: [&str; 5] = ["template-", "packages-", "debootstrap-", "image-", "rm-"];

/// Removes scratch directories of builds that died (killed, power loss) and are older than `max_age`;
/// never one with a mount under it. Returns how many went. A build in flight is minutes old, so an age
/// of an hour or more cannot race one.
pub fn sweep_stale(tmp_root: &Path, max_age: std::time::Duration) -> usize {
    let Ok(rd) = std::fs::read_dir(tmp_root) else { return 0 };
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !SCRATCH_PREFIXES.iter().any(|p| name.starts_with(p)) || !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let old =
            e.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).is_some_and(|a| a >= max_age);
        if old && mounts_under(&e.path()).is_empty() && std::fs::remove_dir_all(e.path()).is_ok() {
            n += 1;
        }
    }
    n
}

/// Runs a command, capturing its output; on failure the error carries the step, the command line and the
/// last lines of output.
pub fn run(step: &str, cmd: &mut Command) -> Result<String> {
    let line = format!(
        "{} {}",
        cmd.get_program().to_string_lossy(),
        cmd.get_args().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
    );
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| TemplateError::Host(format!("{step}: cannot run `{line}`: {e}")))?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(TemplateError::Command {
            step: step.into(),
            command: line,
            status: out.status.to_string(),
            output: tail(&text, 20),
        });
    }
    Ok(text)
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether this process may mount, chroot and chown.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_removes_only_old_scratch_dirs() {
        let d = tempfile::tempdir().unwrap();
        for n in ["template-abc", "packages-x", "unrelated"] {
            std::fs::create_dir_all(d.path().join(n).join("sub")).unwrap();
        }
        assert_eq!(sweep_stale(d.path(), std::time::Duration::from_secs(3600)), 0, "fresh dirs stay");
        assert_eq!(sweep_stale(d.path(), std::time::Duration::ZERO), 2);
        assert!(d.path().join("unrelated").exists());
        assert!(!d.path().join("template-abc").exists());
    }

    #[test]
    fn scratch_is_removed_on_drop_unless_renamed_away() {
        let d = tempfile::tempdir().unwrap();
        let s = Scratch::new(d.path(), "template-").unwrap();
        std::fs::write(s.path().join("f"), "x").unwrap();
        let p = s.path().to_path_buf();
        drop(s);
        assert!(!p.exists());
        let e = run("step", Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"])).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("step") && m.contains("out") && m.contains("err") && m.contains('3'), "{m}");
    }
}
