//! Finding QEMU and reading its version: marks record the version and machine type they were taken under,
//! and a restore under another one is refused before any process starts.

use std::path::PathBuf;
use std::process::Command;

/// The QEMU system emulator clade runs: `$CLADE_QEMU`, else `qemu-system-x86_64` on PATH.
pub fn qemu_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_QEMU") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join("qemu-system-x86_64")).find(|p| p.is_file()))
}

/// `QEMU emulator version 7.2.22 (...)` -> `7.2.22`.
pub fn qemu_version(bin: &std::path::Path) -> Option<String> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version(&text)
}

fn parse_version(text: &str) -> Option<String> {
    let rest = text.lines().next()?.split("version ").nth(1)?;
    Some(rest.split_whitespace().next()?.to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_debian_version_line() {
        let v = super::parse_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright");
        assert_eq!(v.as_deref(), Some("7.2.22"));
        assert_eq!(super::parse_version("garbage"), None);
    }
}
