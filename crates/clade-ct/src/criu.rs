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

#[cfg(test)]
mod tests {
    #[test]
    fn parses_version() {
        assert_eq!(super::parse_version("Version: 4.2.1\nGitID: x\n").as_deref(), Some("4.2.1"));
        assert_eq!(super::parse_version("nothing"), None);
    }
}
