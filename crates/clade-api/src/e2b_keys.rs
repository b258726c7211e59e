//! E2B API keys (`clade e2b key create`): the daemon only ever verifies them, so `$CLADE_HOME/e2b/keys` (0600,
//! in the 0700 `e2b/`) holds one BLAKE3 hash a line (`blake3:<hex>`), never a key: `create` prints the key
//! once. A keys file of an older clade (plaintext `e2b_...` lines) is rewritten as hashes when `clade serve`
//! starts its E2B face; until then such lines still verify. Comparisons are constant time.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};

use anyhow::Context;
use clade_core::CladeHome;
use clade_e2b::state::same_secret;

const HASHED: &str = "blake3:";

pub fn keys_file(home: &CladeHome) -> std::path::PathBuf {
    home.e2b_dir().join("keys")
}

fn hash_line(key: &str) -> String {
    format!("{HASHED}{}", blake3::hash(key.as_bytes()).to_hex())
}

/// Whether `key` is one `clade e2b key create` made.
pub fn check_key(home: &CladeHome, key: &str) -> bool {
    let Ok(lines) = std::fs::read_to_string(keys_file(home)) else { return false };
    if key.is_empty() {
        return false;
    }
    let hashed = hash_line(key);
    // Every line is compared (no early exit): the time taken does not say which line, if any, matched.
    lines.lines().map(str::trim).filter(|l| !l.is_empty()).fold(false, |hit, l| {
        let m = if l.starts_with(HASHED) {
            same_secret(l.as_bytes(), hashed.as_bytes())
        } else {
            same_secret(l.as_bytes(), key.as_bytes())
        };
        hit | m
    })
}

/// Make a new key (`e2b_` + 40 hex digits), add its hash to the keys file (0600), and return it.
pub fn create_key(home: &CladeHome) -> anyhow::Result<String> {
    let key = format!("e2b_{}", clade_e2b::state::random_hex(20));
    let dir = home.e2b_dir();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("create {}", dir.display()))?;
    let path = keys_file(home);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    writeln!(f, "{}", hash_line(&key))?;
    clade_core::home::private_file(&path).with_context(|| format!("chmod 0600 {}", path.display()))?;
    Ok(key)
}

/// Rewrite plaintext keys of an older clade as hashes (temp file 0600, then rename); nothing to do otherwise.
pub fn hash_plaintext_keys(home: &CladeHome) -> anyhow::Result<()> {
    let path = keys_file(home);
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(()) };
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if lines.iter().all(|l| l.starts_with(HASHED)) {
        return clade_core::home::private_file(&path).with_context(|| format!("chmod 0600 {}", path.display()));
    }
    let out: String = lines
        .iter()
        .map(|l| if l.starts_with(HASHED) { format!("{l}\n") } else { format!("{}\n", hash_line(l)) })
        .collect();
    let tmp = clade_core::home::temp_beside(&path);
    clade_core::home::write_new_private(&tmp, out.as_bytes()).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("replace {}", path.display()))?;
    eprintln!("clade serve: {} now holds hashes of its E2B keys (the keys themselves still work)", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_keys_file_holds_hashes_only() {
        let dir = tempfile::tempdir().unwrap();
        let home = CladeHome::at(dir.path());
        let k = create_key(&home).unwrap();
        let k2 = create_key(&home).unwrap();
        let text = std::fs::read_to_string(keys_file(&home)).unwrap();
        assert!(!text.contains(&k) && !text.contains(&k[4..]), "{text}");
        assert_eq!(std::fs::metadata(keys_file(&home)).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(home.e2b_dir()).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(check_key(&home, &k) && check_key(&home, &k2));
        assert!(!check_key(&home, &k[..k.len() - 1]));
        assert!(!check_key(&home, ""));
        // Someone who read the file cannot use what it holds as a key.
        assert!(!check_key(&home, text.lines().next().unwrap()));
    }

    #[test]
    fn plaintext_keys_are_rewritten_as_hashes_and_still_work() {
        let dir = tempfile::tempdir().unwrap();
        let home = CladeHome::at(dir.path());
        std::fs::create_dir_all(home.e2b_dir()).unwrap();
        std::fs::write(keys_file(&home), "e2b_old\n").unwrap();
        assert!(check_key(&home, "e2b_old"));
        hash_plaintext_keys(&home).unwrap();
        let text = std::fs::read_to_string(keys_file(&home)).unwrap();
        assert!(!text.contains("e2b_old"), "{text}");
        assert!(check_key(&home, "e2b_old"));
        assert!(!check_key(&home, "e2b_ol"));
    }
}
