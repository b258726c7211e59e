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

use crate::jail::VmJail;
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
    restore_clone_mark(qemu, spec, state, &[], &[], run_dir)
}

/// [`restore`] with QEMU in `jail` (`None`: unjailed).
pub fn restore_jailed(
    qemu: &Path,
    spec: VmSpec,
    state: &Path,
    run_dir: &Path,
    jail: Option<&VmJail>,
) -> Result<(Vm, RestoreStats), VmError> {
    restore_pages(qemu, spec, state, &[], &[], run_dir, jail)
}

/// Load device state into a QEMU waiting on `-incoming defer` (its RAM already in place) and continue it.
/// Returns the load time in ms.
pub fn load_and_continue(vm: &mut Vm, state: &Path) -> Result<f64, VmError> {
    let load = Instant::now();
    let r = vm.qmp.execute(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
    );
    qmp(vm, r)?;
    let file = std::fs::File::open(state).map_err(|e| VmError::RunDir(state.display().to_string(), e))?;
    let r = vm.qmp.send_fd("statefd", file.as_fd()).map(|_| json!({}));
    qmp(vm, r)?;
    let r = vm.qmp.execute("migrate-incoming", json!({"uri": "fd:statefd"}));
    qmp(vm, r)?;
    let r = vm.qmp.wait_migration(Duration::from_secs(30));
    qmp(vm, r)?;
    let load_ms = load.elapsed().as_secs_f64() * 1e3;
    let r = vm.qmp.execute("cont", json!({}));
    qmp(vm, r)?;
    Ok(load_ms)
}

/// Write a mark's own pages (relative to the root RAM file the QEMU maps privately) into a QEMU that has not
/// run yet.
pub fn write_mark_pages(vm: &Vm, pages: &[u64], data: &[u8]) -> Result<(), VmError> {
    if pages.is_empty() {
        return Ok(());
    }
    let io = |e: std::io::Error| VmError::RunDir("guest RAM".into(), e);
    let mapping = crate::ramdiff::find_mapping(vm.pid(), &vm.spec.ram.path).map_err(io)?;
    let mem = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{}/mem", vm.pid())).map_err(io)?;
    let page = crate::ramdiff::PAGE as usize;
    let mut off = 0usize;
    for (first, n) in crate::ramdiff::runs(pages) {
        let len = n as usize * page;
        crate::ramdiff::write_pages(&mem, &mapping, first, &data[off..off + len]).map_err(io)?;
        off += len;
    }
    Ok(())
}

/// A mark of a clone: its device state (without RAM) and the pages it changed relative to the RAM file it maps.
pub struct CloneMark {
    pub stats: SaveStats,
    /// Diverged page indexes, ascending, and their contents (4 KiB each, same order).
    pub pages: Vec<u64>,
    pub data: Vec<u8>,
    pub phases: ClonePhases,
}

/// Where a clone mark's time went, in ms. `prescan` and `prefault` run before the guest stops.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ClonePhases {
    pub prescan_ms: f64,
    pub prefault_ms: f64,
    pub stop_ms: f64,
    pub devstate_ms: f64,
    pub scan_ms: f64,
    pub copy_ms: f64,
}

/// Pause a clone (RAM mapped `share=off`), save its device state alone with `xen-save-devices-state` (RAM is not
/// streamed: the base file plus the diverged pages are the RAM), and read its diverged pages. The guest stays
/// paused; the caller continues it.
///
/// Before the stop, the diverged pages are counted while the guest runs and a buffer that size (plus slack for
/// what the guest writes meanwhile) is faulted in, so the paused copy takes no page faults; the copy itself is
/// `process_vm_readv` (ramdiff).
pub fn save_clone_state(vm: &mut Vm, dest: &Path) -> Result<CloneMark, VmError> {
    let pid = vm.pid();
    let io = move |e: std::io::Error| VmError::RunDir(format!("guest RAM of QEMU {pid}"), e);
    let mut ph = ClonePhases::default();
    let t = Instant::now();
    let mapping = crate::ramdiff::find_mapping(pid, &vm.spec.ram.path).map_err(io)?;
    let expected = crate::ramdiff::diverged_pages(pid, &mapping).map_err(io)?.len();
    ph.prescan_ms = ms(t);
    let t = Instant::now();
    let page = crate::ramdiff::PAGE as usize;
    // Slack: 1/8 more and at least 8 MiB; a guest that writes more than that before the stop grows the buffer
    // inside the pause (correct, only slower).
    let mut data = crate::ramdiff::prefaulted((expected + expected / 8 + 2048) * page);
    ph.prefault_ms = ms(t);

    let start = Instant::now();
    let r = vm.qmp.execute("stop", json!({}));
    qmp(vm, r)?;
    ph.stop_ms = ms(start);
    // Device state (QEMU's main thread does the work) and the pages (our threads) at once.
    let tmp = dest.with_extension("tmp");
    // QEMU opens the file by name after it started: a jailed QEMU inside its chroot (which it owns), from where
    // the host takes the file out without following links (crate::jail::take_out).
    let in_qemu = match vm.jailed() {
        Some(j) => {
            crate::jail::clear(j, JAIL_DEVSTATE).map_err(|e| VmError::RunDir(j.dir.display().to_string(), e))?;
            format!("/{JAIL_DEVSTATE}")
        }
        None => tmp.display().to_string(),
    };
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(4);
    let (saved, copied) = std::thread::scope(|s| {
        let data = &mut data;
        let pages = s.spawn(move || -> std::io::Result<(Vec<u64>, f64, f64)> {
            let t = Instant::now();
            let pages = crate::ramdiff::diverged_pages(pid, &mapping)?;
            let scan = ms(t);
            let t = Instant::now();
            data.resize(pages.len() * page, 0);
            crate::ramdiff::read_pages_parallel(pid, &mapping, &pages, data, threads)?;
            Ok((pages, scan, ms(t)))
        });
        let t = Instant::now();
        let r = vm.qmp.execute("xen-save-devices-state", json!({"filename": in_qemu, "live": false}));
        let r = qmp(vm, r);
        ph.devstate_ms = ms(t);
        let copied = pages.join().unwrap_or_else(|_| Err(std::io::Error::other("page copy thread panicked")));
        (r, copied)
    });
    saved?;
    let (pages, scan_ms, copy_ms) = copied.map_err(io)?;
    ph.scan_ms = scan_ms;
    ph.copy_ms = copy_ms;
    let pause_ms = ms(start);
    match vm.jailed() {
        Some(j) => {
            crate::jail::take_out(j, JAIL_DEVSTATE, dest)
                .map_err(|e| VmError::RunDir(dest.display().to_string(), e))?;
        }
        None => std::fs::rename(&tmp, dest).map_err(|e| VmError::RunDir(dest.display().to_string(), e))?,
    }
    let state_bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
    Ok(CloneMark { stats: SaveStats { pause_ms, state_bytes }, pages, data, phases: ph })
}

/// The name a jailed QEMU writes a clone's device state to, at the top of its chroot.
const JAIL_DEVSTATE: &str = "devstate.tmp";

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Start a child of a clone's mark: QEMU maps the base RAM file `share=off` and waits on `-incoming defer`; the
/// mark's pages are written into its private mapping, then its device state is loaded through the ordinary
/// incoming path and it continues. `spec` must have `share: false`, `incoming: true`, and `devstate_only` when
/// the state came from [`save_clone_state`]. (`xen-load-devices-state` would load the same file without
/// `-incoming`, but QEMU 7.2 aborts in it: `yank_unregister_instance: Assertion 'entry' failed`.)
pub fn restore_clone_mark(
    qemu: &Path,
    spec: VmSpec,
    state: &Path,
    pages: &[u64],
    data: &[u8],
    run_dir: &Path,
) -> Result<(Vm, RestoreStats), VmError> {
    restore_pages(qemu, spec, state, pages, data, run_dir, None)
}

fn restore_pages(
    qemu: &Path,
    spec: VmSpec,
    state: &Path,
    pages: &[u64],
    data: &[u8],
    run_dir: &Path,
    jail: Option<&VmJail>,
) -> Result<(Vm, RestoreStats), VmError> {
    let start = Instant::now();
    let mut vm = match jail {
        Some(j) => Vm::spawn_jailed(qemu, spec, run_dir, j)?,
        None => Vm::spawn(qemu, spec, run_dir)?,
    };
    let spawn_ms = start.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    write_mark_pages(&vm, pages, data)?;
    let pages_ms = t.elapsed().as_secs_f64() * 1e3;
    let load_ms = load_and_continue(&mut vm, state)? + pages_ms;
    Ok((vm, RestoreStats { spawn_ms, load_ms, total_ms: start.elapsed().as_secs_f64() * 1e3 }))
}
