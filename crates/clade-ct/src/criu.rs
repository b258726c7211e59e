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
    #[test]
    fn parses_version() {
        assert_eq!(super::parse_version("Version: 4.2.1\nGitID: x\n").as_deref(), Some("4.2.1"));
        assert_eq!(super::parse_version("nothing"), None);
    }
}
