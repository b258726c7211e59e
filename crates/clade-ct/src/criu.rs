//! Locating and checking the private CRIU. Debian 12's CRIU 3.17 fails on recent kernels (vDSO), so `./x
//! setup` extracts CRIU 4.2 from Debian sid under `$CLADE_HOME/criu` and writes a wrapper that runs it through
//! sid's own loader. `$CLADE_CRIU` overrides the path (e.g. a CRIU installed by the distro on a newer host).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The CRIU binary or wrapper clade runs.
pub fn criu_binary(home: &clade_core::CladeHome) -> PathBuf {
    std::env::var_os("CLADE_CRIU").map(PathBuf::from).unwrap_or_else(|| home.criu_bin())
}

/// `Version: 4.2.1` -> `4.2.1`.
pub fn criu_version(bin: &Path) -> Option<String> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

/// [`criu_version`], remembered in `cache_file` under a key of the binary's identity (path, inode, size, mtime;
/// the same for the real CRIU behind clade's wrapper): running CRIU only to print its version costs 7-15 ms
/// here (a shell, sid's loader and a dozen libraries), and every sandbox's supervisor asks once. A CRIU
/// replaced or reinstalled changes the key, so the cache never answers for a binary it did not run.
pub fn criu_version_cached(bin: &Path, cache_file: &Path) -> Option<String> {
    let key = identity_key(bin);
    if let Some(key) = &key {
        if let Some(v) = std::fs::read_to_string(cache_file).ok().and_then(|t| cached_version(&t, key)) {
            return Some(v);
        }
    }
    let version = criu_version(bin)?;
    if let (Some(key), Some(dir)) = (key, cache_file.parent()) {
        // Best effort: a cache that cannot be written only costs the next caller the run.
        let tmp = clade_core::home::temp_beside(cache_file);
        let written =
            std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, format!("{key}\n{version}\n")).is_ok();
        if !written || std::fs::rename(&tmp, cache_file).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Some(version)
}

/// The version a cache file's text holds for `key` (its first line), if any.
fn cached_version(text: &str, key: &str) -> Option<String> {
    let mut lines = text.lines();
    (lines.next()? == key).then(|| lines.next().map(str::trim).filter(|v| !v.is_empty()).map(String::from))?
}

/// `path:inode:size:mtime_ns` of `bin` and, where it is clade's wrapper, of the CRIU it runs.
fn identity_key(bin: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let one = |p: &Path| {
        let m = std::fs::metadata(p).ok()?;
        Some(format!("{}:{}:{}:{}", p.display(), m.ino(), m.size(), m.mtime() * 1_000_000_000 + m.mtime_nsec()))
    };
    let mut key = one(bin)?;
    if let Some(real) = bin.parent().and_then(Path::parent).map(|d| d.join("root/usr/sbin/criu")) {
        if let Some(k) = one(&real) {
            key.push('|');
            key.push_str(&k);
        }
    }
    Some(key)
}

fn parse_version(text: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix("Version:")).map(|v| v.trim().to_string())
}

/// The outcome of `criu check`: ok, and what it printed.
pub fn criu_check(bin: &Path) -> (bool, String) {
    match Command::new(bin).arg("check").output() {
        Ok(out) => {
            let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&out.stderr));
            let ok = out.status.success() && text.contains("Looks good");
            (ok, text.trim().to_string())
        }
        Err(e) => (false, format!("cannot run {}: {e}", bin.display())),
    }
}

/// Whether CRIU finds a process's pages with the `PAGEMAP_SCAN` ioctl (Linux 6.7 and later), from `criu check
/// --feature pagemap_scan`; `None` when CRIU could not be run. Without it CRIU reads `/proc/PID/pagemap` entry by
/// entry over every mapping, empty address-space reservations included: Chromium's V8 reserves three of
/// 1.3 TiB, and on Linux 6.1 those reads were ~65 s of each ~80 s browser mark in a TCG guest, against ~3 s on
/// 6.12 (docs/scale.md, "The browser's mark pause").
pub fn scans_page_maps(bin: &Path) -> Option<bool> {
    let out = Command::new(bin).args(["check", "--feature", "pagemap_scan"]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && text.contains("is supported") {
        Some(true)
    } else if out.status.code().is_some() {
        Some(false)
    } else {
        None
    }
}

/// CRIU keeps its kernel-feature probe (70-170 ms measured here, on every run) in `/run/criu.kdat`, but only
/// when /run is a tmpfs, which it is not on this host. Each CRIU we run gets a private mount namespace with a
/// tmpfs directory bound over /run, so the probe is paid once per boot.
pub(crate) fn kdat_dir() -> Result<PathBuf, String> {
    let dir = PathBuf::from("/dev/shm/clade-criu-run");
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    Ok(dir)
}

pub(crate) fn private_run(kdat: &Path) -> std::io::Result<()> {
    use nix::mount::{mount, MsFlags};
    use nix::sched::{unshare, CloneFlags};
    let io = |e: nix::errno::Errno| std::io::Error::from_raw_os_error(e as i32);
    unshare(CloneFlags::CLONE_NEWNS).map_err(io)?;
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>).map_err(io)?;
    mount(Some(kdat), "/run", None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(io)
}

#[cfg(test)]
mod tests {
    /// CRIU's answer agrees with the kernel's version (the ioctl came in Linux 6.7).
    #[test]
    fn page_map_scan_agrees_with_the_kernel_version() {
        let bin = super::criu_binary(&clade_core::CladeHome::from_env());
        if !bin.exists() {
            eprintln!("skip: no CRIU at {} (./x setup installs it)", bin.display());
            return;
        }
        let release = clade_core::host::kernel_release();
        let mut v = release.split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        assert_eq!(super::scans_page_maps(&bin), Some((major, minor) >= (6, 7)), "on {release}");
    }

    #[test]
    fn version_cache_answers_only_for_the_same_binary() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (bin, cache, runs) =
            (dir.path().join("criu"), dir.path().join("cache/criu-version"), dir.path().join("runs"));
        let write = |v: &str| {
            let script = format!("#!/bin/sh\necho run >> {}\necho 'Version: {v}'\n", runs.display());
            std::fs::write(&bin, script).unwrap();
            std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        let count = || std::fs::read_to_string(&runs).map(|t| t.lines().count()).unwrap_or(0);
        write("4.2.1");
        assert_eq!(super::criu_version_cached(&bin, &cache).as_deref(), Some("4.2.1"));
        assert_eq!(super::criu_version_cached(&bin, &cache).as_deref(), Some("4.2.1"));
        assert_eq!(count(), 1, "the second answer came from the cache");
        // A reinstalled CRIU (another size, inode or mtime) is run again.
        std::fs::remove_file(&bin).unwrap();
        write("4.3");
        assert_eq!(super::criu_version_cached(&bin, &cache).as_deref(), Some("4.3"));
        assert_eq!(count(), 2);
        assert_eq!(super::cached_version("k\n4.2.1\n", "other"), None);
        assert_eq!(super::cached_version("k\n\n", "k"), None);
    }

    #[test]
    fn parses_version() {
        assert_eq!(super::parse_version("Version: 4.2.1\nGitID: x\n").as_deref(), Some("4.2.1"));
        assert_eq!(super::parse_version("nothing"), None);
    }
}
