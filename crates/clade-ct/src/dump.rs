//! `criu dump` of a sandbox: the overlay upper is copied by CRIU's `post-dump` action script while the tasks
//! are still frozen (the upper then matches the memory image exactly), and the pause is read back from CRIU's
//! own `stats-dump` (frozen time), not guessed from the wall clock.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Where CRIU looks for the inodes of inotify/fanotify watches (measured with Chromium here: docs/ct.md, the browser workload).
pub const IRMAP_SCAN_PATHS: [&str; 1] = ["/usr/share/zoneinfo"];

/// CRIU's key of a jailed sandbox's /sys (an external mount).
pub const SYSFS_KEY: &str = "clade-sys";

/// One dump's inputs.
pub struct DumpSpec<'a> {
    pub criu: &'a Path,
    pub pid: u32,
    /// Empty image directory to create.
    pub images: PathBuf,
    /// The live upper, and where the frozen copy goes (must not exist).
    pub upper: PathBuf,
    pub upper_copy: PathBuf,
    pub leave_running: bool,
    pub log: PathBuf,
    /// The inode of the sandbox's network namespace when clade made it (egress, crate::net): CRIU leaves it
    /// out of the images and a restore is handed a fresh one.
    pub external_net: Option<u64>,
    /// Run CRIU in this process's network namespace, which it then leaves out of the images (a jailed
    /// sandbox's: crate::userns).
    pub join_netns: Option<u32>,
    /// Pre-dump first with memory tracking, so that the frozen dump copies only what changed since (only where
    /// the kernel tracks dirty pages: `clade_core::host::tracks_dirty_pages`).
    pub predump: bool,
}

/// What a dump took.
#[derive(Debug, Clone, Copy)]
pub struct DumpTimes {
    /// Tasks frozen (CRIU's frozen_time when it could be read, else the whole dump), the pre-dump's short freeze
    /// included.
    pub frozen: Duration,
    /// The pre-dump's own freeze, when there was one.
    pub pre_frozen: Option<Duration>,
    /// Of the dump's freeze, the time CRIU spent reading the tasks' memory and writing it out (its memdump and
    /// memwrite times), when its stats could be read: what a pre-dump can take out of the pause.
    pub memory: Option<Duration>,
    pub wall: Duration,
}

/// Runs CRIU's `action` (`dump` or `pre-dump`) on the sandbox with the options both share (external mounts and
/// network namespace, cgroups left alone, the irmap paths), in the sandbox's network namespace when jailed.
fn criu_run(
    spec: &DumpSpec,
    action: &str,
    images: &Path,
    log: &Path,
    extra: &[std::ffi::OsString],
) -> Result<Duration, String> {
    let mut cmd = Command::new(spec.criu);
    cmd.arg(action)
        .arg("-t")
        .arg(spec.pid.to_string())
        .arg("-D")
        .arg(images)
        .arg("-o")
        .arg(log)
        .args(["--external", "mnt[]", "--file-locks"])
        // Restores put the tasks into a cgroup of their own (crate::resources) and tell CRIU to leave cgroups
        // alone, so the dump need not read the hierarchies' properties either (15-25 ms of the frozen time here).
        .arg("--manage-cgroups=ignore")
        // Inotify watches (Chromium watches the time zone database) are dumped as file handles, which an
        // overlay without nfs_export cannot open again: CRIU then finds the watched inode by scanning paths.
        .args(IRMAP_SCAN_PATHS.iter().flat_map(|p| ["--irmap-scan-path", p]))
        .args(extra);
    if std::env::var_os("CLADE_CRIU_VERBOSE").is_some() {
        // Timestamped debug log (where a pause goes); off by default, the log is then a few lines.
        cmd.arg("-v4");
    }
    if spec.join_netns.is_some() {
        // A restored user namespace may not mount sysfs for a network namespace it does not own: /sys is
        // dumped as external and a restore binds a sysfs the host mounted (crate::restore).
        cmd.arg("--external").arg(format!("mnt[/sys]:{SYSFS_KEY}"));
    }
    if let Some(ino) = spec.external_net {
        cmd.arg("--external").arg(format!("net[{ino}]:{}", crate::net::EXT_KEY));
    }
    let netns = match spec.join_netns {
        Some(pid) => Some(
            std::fs::File::open(format!("/proc/{pid}/ns/net"))
                .map_err(|e| format!("open the network namespace of {pid}: {e}"))?,
        ),
        None => None,
    };
    let netns_fd = netns.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    let kdat = crate::criu::kdat_dir().ok();
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure only makes system calls (setns, unshare, mount) on data prepared before the fork;
        // `netns_fd` stays open (held by `netns`) until the command has run.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(fd) = netns_fd {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                match &kdat {
                    Some(k) => crate::criu::private_run(k),
                    None => Ok(()),
                }
            });
        }
    }
    let t0 = Instant::now();
    let out = cmd.output().map_err(|e| format!("run {}: {e}", spec.criu.display()))?;
    let wall = t0.elapsed();
    drop(netns);
    if !out.status.success() {
        return Err(format!("criu {action} failed ({}): {}", out.status, log_tail_or(log, &out.stderr)));
    }
    Ok(wall)
}

/// The pre-dump's directory beside a dump's images; after the dump it becomes the images' `parent`.
fn pre_dir(images: &Path) -> PathBuf {
    images.with_extension("pre")
}

pub fn dump(spec: &DumpSpec) -> Result<DumpTimes, String> {
    std::fs::create_dir_all(&spec.images).map_err(|e| format!("create {}: {e}", spec.images.display()))?;
    // Incremental (docs/ct.md, "Incremental marks"): a pre-dump copies every page while the tasks run again (read
    // mode: frozen only to find the pages, then read with process_vm_readv) and resets the kernel's soft-dirty
    // bits; the dump then copies only the pages written since, taking the rest from its parent images.
    let mut pre_frozen = None;
    let mut extra: Vec<std::ffi::OsString> = Vec::new();
    if spec.predump {
        let pre = pre_dir(&spec.images);
        std::fs::create_dir_all(&pre).map_err(|e| format!("create {}: {e}", pre.display()))?;
        let mode = std::env::var("CLADE_CT_PREDUMP_MODE").unwrap_or_else(|_| "read".into());
        let pre_log = spec.log.with_extension("pre.log");
        let pre_args: Vec<std::ffi::OsString> =
            ["--track-mem".to_string(), format!("--pre-dump-mode={mode}")].into_iter().map(Into::into).collect();
        match criu_run(spec, "pre-dump", &pre, &pre_log, &pre_args) {
            Ok(wall) => {
                pre_frozen = Some(frozen_time(&pre.join("stats-dump")).unwrap_or(wall));
                // Relative to the images directory, which is `pre`'s sibling.
                let parent = Path::new("..").join(pre.file_name().unwrap_or_default());
                extra.extend(["--track-mem", "--prev-images-dir"].map(Into::into));
                extra.push(parent.into());
            }
            // The tasks run on after a failed pre-dump: a full dump still makes the mark, only slower.
            Err(e) => {
                eprintln!("clade-ct: pre-dump failed, the mark copies every page while frozen: {e}");
                let _ = std::fs::remove_dir_all(&pre);
            }
        }
    }
    let script = spec.images.with_extension("post-dump.sh");
    let text = format!(
        "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\nexec cp -a '{}' '{}'\n",
        spec.upper.display(),
        spec.upper_copy.display()
    );
    write_exec(&script, &text)?;
    extra.extend(["--network-lock", "skip", "--tcp-established", "--ghost-limit", "64M"].map(Into::into));
    extra.push("--action-script".into());
    extra.push(script.clone().into());
    if spec.leave_running {
        extra.push("--leave-running".into());
    }
    let dumped = criu_run(spec, "dump", &spec.images, &spec.log, &extra);
    let _ = std::fs::remove_file(&script);
    let wall = dumped?;
    if !spec.upper_copy.exists() {
        return Err("criu dump did not run the post-dump script (the upper was not copied)".into());
    }
    if pre_frozen.is_some() {
        // One self-contained image tree for the store: the `parent` link CRIU made becomes the directory itself.
        let link = spec.images.join("parent");
        std::fs::remove_file(&link).map_err(|e| format!("remove {}: {e}", link.display()))?;
        std::fs::rename(pre_dir(&spec.images), &link)
            .map_err(|e| format!("move the pre-dump under {}: {e}", link.display()))?;
    }
    let frozen = frozen_time(&spec.images.join("stats-dump")).unwrap_or(wall);
    // CRIU's own stats (freezing, frozen, memdump, memwrite times, pages) kept beside the log, where a slow pause
    // can be taken apart afterwards (the images themselves go into the store and are removed).
    let _ = std::fs::copy(spec.images.join("stats-dump"), spec.log.with_extension("stats"));
    let memory = memory_time(&spec.images.join("stats-dump"));
    Ok(DumpTimes { frozen: frozen + pre_frozen.unwrap_or_default(), pre_frozen, memory, wall })
}

fn write_exec(path: &Path, text: &str) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

/// The error lines of a CRIU log (or its last lines), for an error message a user can act on.
pub fn log_tail(log: &Path) -> String {
    log_tail_or(log, b"")
}

/// [`log_tail`], or where CRIU wrote no log (it failed before opening it: a bad option, an image or work
/// directory it could not open), what it printed on its standard error.
pub fn log_tail_or(log: &Path, stderr: &[u8]) -> String {
    let printed = String::from_utf8_lossy(stderr);
    let printed = printed.trim();
    let said = if printed.is_empty() { String::new() } else { format!("; it printed: {printed}") };
    let text = match std::fs::read_to_string(log) {
        Ok(t) if t.trim().is_empty() => return format!("CRIU wrote nothing to its log {}{said}", log.display()),
        Ok(t) => t,
        Err(e) => return format!("CRIU left no readable log ({}: {e}){said}", log.display()),
    };
    let errs: Vec<&str> = text.lines().filter(|l| l.contains("Error") || l.contains("error")).collect();
    let lines: Vec<&str> =
        if errs.is_empty() { text.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect() } else { errs };
    let joined = lines.iter().rev().take(6).rev().cloned().collect::<Vec<_>>().join(" | ");
    format!("{joined} (full log: {})", log.display())
}

/// `stats-dump`: magic (u32), stats magic (u32), then one length-prefixed `stats_entry { dump_stats_entry dump =
/// 1 }` whose field 2 is frozen_time in microseconds (3 memdump_time, 4 memwrite_time).
fn dump_stat(path: &Path, field: u64) -> Option<Duration> {
    let b = std::fs::read(path).ok()?;
    let len = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?) as usize;
    let entry = b.get(12..12 + len)?;
    let dump = field_bytes(entry, 1)?;
    let us = field_varint(dump, field)?;
    Some(Duration::from_micros(us))
}

fn frozen_time(path: &Path) -> Option<Duration> {
    dump_stat(path, 2)
}

fn memory_time(path: &Path) -> Option<Duration> {
    Some(dump_stat(path, 3)? + dump_stat(path, 4)?)
}

fn varint(b: &[u8], i: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*i)?;
        *i += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Walk a protobuf message: `f(field, wire type, value or length, start)` for each field.
fn walk(b: &[u8], mut f: impl FnMut(u64, u64, u64, usize) -> bool) -> Option<()> {
    let mut i = 0;
    while i < b.len() {
        let key = varint(b, &mut i)?;
        let (field, wt) = (key >> 3, key & 7);
        match wt {
            0 => {
                let v = varint(b, &mut i)?;
                if f(field, 0, v, i) {
                    return Some(());
                }
            }
            2 => {
                let l = varint(b, &mut i)? as usize;
                if f(field, 2, l as u64, i) {
                    return Some(());
                }
                i = i.checked_add(l)?;
            }
            5 => i += 4,
            1 => i += 8,
            _ => return None,
        }
    }
    Some(())
}

fn field_varint(b: &[u8], want: u64) -> Option<u64> {
    let mut out = None;
    walk(b, |f, wt, v, _| {
        if f == want && wt == 0 {
            out = Some(v);
            true
        } else {
            false
        }
    })?;
    out
}

fn field_bytes(b: &[u8], want: u64) -> Option<&[u8]> {
    let mut out = None;
    walk(b, |f, wt, l, start| {
        if f == want && wt == 2 {
            out = Some((start, l as usize));
            true
        } else {
            false
        }
    })?;
    let (s, l) = out?;
    b.get(s..s + l)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_frozen_time() {
        // dump_stats_entry { freezing_time = 1: 10, frozen_time = 2: 150000, memdump_time = 3: 20,
        // memwrite_time = 4: 5 }
        let dump = [0x08, 10, 0x10, 0xf0, 0x93, 0x09, 0x18, 20, 0x20, 5];
        let mut entry = vec![0x0a, dump.len() as u8];
        entry.extend_from_slice(&dump);
        let mut file = vec![0u8; 8];
        file.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        file.extend_from_slice(&entry);
        let dir = std::env::temp_dir().join(format!("clade-ct-stats-{}", std::process::id()));
        std::fs::write(&dir, &file).unwrap();
        assert_eq!(super::frozen_time(&dir), Some(std::time::Duration::from_micros(150_000)));
        assert_eq!(super::memory_time(&dir), Some(std::time::Duration::from_micros(25)));
        std::fs::write(&dir, [1, 2, 3]).unwrap();
        assert_eq!(super::frozen_time(&dir), None);
        let _ = std::fs::remove_file(&dir);
    }
}
