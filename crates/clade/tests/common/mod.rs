//! Helpers the guest tests of the `clade` binary share.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The installed home whose kernel, CRIU and caches the tests borrow (`CLADE_TEST_HOME`, else /var/lib/clade).
pub fn real_home() -> PathBuf {
    PathBuf::from(std::env::var("CLADE_TEST_HOME").unwrap_or_else(|_| "/var/lib/clade".into()))
}

/// Runs the built `clade` with `CLADE_HOME=home`: exit code, stdout, stderr.
pub fn clade(home: &Path, args: &[&str]) -> (i32, String, String) {
    clade_with(home, &[], args)
}

/// [`clade`] with more environment variables.
pub fn clade_with(home: &Path, env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_clade"))
        .args(args)
        .env("CLADE_HOME", home)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
