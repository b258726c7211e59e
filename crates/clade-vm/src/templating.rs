//! VM templating: the mechanism under marks and forks. A guest whose RAM is a shared tmpfs file is paused and
//! its device state alone is migrated to a file (`x-ignore-shared` skips the RAM block, which already is the
//! file). A clone is a fresh QEMU mapping that RAM file `share=off` (MAP_PRIVATE: clean pages stay shared with
//! the file and every other clone), started with `-incoming defer`, that loads the device state through an `fd:`
//! URI (1-2 ms; `exec:cat` costs 5-9 ms) and continues (`cont`). This is what Kata Containers calls VM templating.

use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use crate::machine::{Vm, VmError, VmSpec};
use crate::qmp::QmpError;

/// What saving a mark's device state cost.
#[derive(Debug, Clone, Serialize)]
pub struct SaveStats {
    /// From `stop` to the migration's completion: the time the guest did not run.
    pub pause_ms: f64,
    pub state_bytes: u64,
}

/// Timings of one restore.
#[derive(Debug, Clone, Serialize)]
pub struct RestoreStats {
    /// Process start to QMP connected.
    pub spawn_ms: f64,
    /// `migrate-incoming` to the state being loaded.
    pub load_ms: f64,
    /// Process start to `running`.
    pub total_ms: f64,
}

fn qmp(vm: &mut Vm, r: Result<serde_json::Value, QmpError>) -> Result<serde_json::Value, VmError> {
    r.map_err(|e| vm.qmp_error(e))
}

/// Pause `vm` (whose RAM must be a shared file) and write its device state to `dest`. The guest stays paused:
/// the caller resumes it (`cont`) or ends it (a base is ended: its RAM file is now the mark's).
pub fn save_device_state(vm: &mut Vm, dest: &Path) -> Result<SaveStats, VmError> {
    let start = Instant::now();
    let r = vm.qmp.execute("stop", json!({}));
    qmp(vm, r)?;
    let r = vm.qmp.execute(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
    );
    qmp(vm, r)?;
    let tmp = dest.with_extension("tmp");
    let file = std::fs::File::create(&tmp).map_err(|e| VmError::RunDir(tmp.display().to_string(), e))?;
    let r = vm.qmp.send_fd("markfd", file.as_fd()).map(|_| json!({}));
    qmp(vm, r)?;
    let r = vm.qmp.execute("migrate", json!({"uri": "fd:markfd"}));
    qmp(vm, r)?;
    let r = vm.qmp.wait_migration(Duration::from_secs(60));
    qmp(vm, r)?;
    let pause_ms = start.elapsed().as_secs_f64() * 1e3;
    file.sync_all().map_err(|e| VmError::RunDir(tmp.display().to_string(), e))?;
    std::fs::rename(&tmp, dest).map_err(|e| VmError::RunDir(dest.display().to_string(), e))?;
    let state_bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
    Ok(SaveStats { pause_ms, state_bytes })
}

/// Start a clone of a mark: `spec` must name the mark's RAM file with `share: false` and `incoming: true`.
pub fn restore(qemu: &Path, spec: VmSpec, state: &Path, run_dir: &Path) -> Result<(Vm, RestoreStats), VmError> {
    let start = Instant::now();
    let mut vm = Vm::spawn(qemu, spec, run_dir)?;
    let spawn_ms = start.elapsed().as_secs_f64() * 1e3;
    let load = Instant::now();
    let r = vm.qmp.execute(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
    );
    qmp(&mut vm, r)?;
    let file = std::fs::File::open(state).map_err(|e| VmError::RunDir(state.display().to_string(), e))?;
    let r = vm.qmp.send_fd("statefd", file.as_fd()).map(|_| json!({}));
    qmp(&mut vm, r)?;
    let r = vm.qmp.execute("migrate-incoming", json!({"uri": "fd:statefd"}));
    qmp(&mut vm, r)?;
    let r = vm.qmp.wait_migration(Duration::from_secs(30));
    qmp(&mut vm, r)?;
    let load_ms = load.elapsed().as_secs_f64() * 1e3;
    let r = vm.qmp.execute("cont", json!({}));
    qmp(&mut vm, r)?;
    let total_ms = start.elapsed().as_secs_f64() * 1e3;
    Ok((vm, RestoreStats { spawn_ms, load_ms, total_ms }))
}
