//! A sandbox's run dir under `$CLADE_HOME/run` (its sockets, QEMU's dir; removed on drop), and the check that a
//! home is shallow enough for QEMU's unix socket paths (shared with `clade doctor`). Kept apart because cold
//! start and restore both make one and the running sandbox holds it.

use std::path::PathBuf;

use clade_core::backend::BackendError;
use clade_core::CladeHome;

use super::failed;

/// QEMU is handed its sockets (QMP, agent, disk) by path, and a unix socket path holds 107 bytes: a home too
/// deep for a sandbox `id`'s sockets is refused up front with what to do, not by QEMU half-way through a start.
/// (`clade doctor` asks the same with a sandbox id's usual length.)
pub fn check_socket_room(home: &CladeHome, id: &str) -> Result<(), String> {
    let longest = home.run_dir().join(id).join("agent.sock").as_os_str().len();
    if longest <= 107 {
        return Ok(());
    }
    Err(format!(
        "CLADE_HOME {} is too long for a vm sandbox: its sockets would be {longest} bytes, and a unix socket \
         path holds 107; use a CLADE_HOME of at most {} bytes",
        home.root().display(),
        home.root().as_os_str().len().saturating_sub(longest - 107)
    ))
}

/// A sandbox's run dir under `$CLADE_HOME/run`; removed on drop.
pub(super) struct RunDir {
    pub(super) path: PathBuf,
}

impl RunDir {
    pub(super) fn create(home: &CladeHome, id: &str) -> Result<Self, BackendError> {
        let path = home.run_dir().join(id);
        check_socket_room(home, id).map_err(failed)?;
        if path.exists() {
            return Err(failed(format!("sandbox {id} already has a run dir {}", path.display())));
        }
        std::fs::create_dir_all(&path).map_err(|e| failed(format!("create {}: {e}", path.display())))?;
        Ok(RunDir { path })
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_home_too_deep_for_qemus_sockets_is_refused_with_the_length_to_use() {
        let t = tempfile::tempdir().unwrap();
        let deep = t.path().join("x".repeat(60));
        let id = format!("sb-{}", "0".repeat(32));
        let err = RunDir::create(&CladeHome::at(&deep), &id).err().expect("refused");
        let msg = err.to_string();
        assert!(msg.contains("too long") && msg.contains("at most"), "{msg}");
        assert!(!deep.join("run").join(&id).exists(), "no run dir is left");
        let ok = RunDir::create(&CladeHome::at(t.path()), &id).expect("a short home works");
        assert!(ok.path.exists());
    }
}
