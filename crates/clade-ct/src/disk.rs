//! Disk-only marks (E2B's filesystem-only pause and snapshot; docs/ct.md, "Disk-only marks"): the sandbox's
//! overlay upper and the names of its lower layers, no CRIU images. A suspend ends the processes first and
//! stores the upper as they left it; a mark of a running sandbox freezes it only for a copy of the upper. The
//! restore of such a mark is a cold boot ([`boot_disk`]): a fresh init on the same layers, with empty /dev and
//! /run and a new boot id, as a machine that was shut down and started again.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use clade_core::backend::{BackendError, BackendKind, Identity, MarkOptions, MarkState, BOOT_COLD, ROLE_BOOT};

use crate::sandbox::{no_new_privs_of, BootSpec, CtSandbox, ROLE_ROOTFS, ROLE_UPPER};
use crate::CtBackend;

fn failed(e: String) -> BackendError {
    BackendError::Failed(e)
}

impl CtSandbox {
    /// A disk-only mark of the running sandbox: frozen while its upper is copied, then thawed.
    pub(crate) fn disk_mark(&mut self, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        for warning in clade_core::hygiene::pre_mark(&self.agent, !opts.not_clean) {
            eprintln!("clade-ct: {}: mark goes on: {warning}", self.id);
        }
        // Frozen, no process writes while the copy runs (the page cache is the host's: what they wrote is there).
        let t0 = Instant::now();
        let cg = self.res.cgroup.as_ref().ok_or_else(|| failed("this sandbox has no cgroup to freeze".into()))?;
        cg.freeze(true).map_err(failed)?;
        self.dumps += 1;
        let copy = self.res.rw().join(format!("disk-{}", self.dumps));
        let copied = copy_tree(&self.upper_dir(), &copy);
        if let Err(e) = cg.freeze(false) {
            let _ = std::fs::remove_dir_all(&copy);
            return Err(failed(format!("thaw after copying the upper: {e}")));
        }
        let pause = t0.elapsed();
        copied?;
        let stored = self.store_disk(&copy, pause, opts);
        let _ = std::fs::remove_dir_all(&copy);
        stored
    }

    /// A disk-only suspend: the processes end (as at a power-off), then the upper they left is stored and
    /// everything else released.
    pub(crate) fn disk_suspend(mut self: Box<Self>, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        let t0 = Instant::now();
        self.end_processes();
        let upper = self.upper_dir();
        let state = self.store_disk(&upper, t0.elapsed(), opts)?;
        self.res.release().map_err(failed)?;
        Ok(state)
    }

    /// Kill the sandbox's processes (crate::resources) and wait until its cgroup holds none, so nothing writes
    /// any more; the mounts on the host stay.
    fn end_processes(&mut self) {
        self.res.kill_processes();
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while !clade_core::backend::Sandbox::pids(self).is_empty() && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    fn store_disk(
        &mut self,
        upper: &Path,
        pause: std::time::Duration,
        opts: &MarkOptions,
    ) -> Result<MarkState, BackendError> {
        let tree = self.store.put_dir(upper).map_err(|e| failed(format!("store the upper: {e}")))?;
        let manifests: BTreeMap<String, String> = [
            (ROLE_UPPER.to_string(), tree.id.to_hex()),
            (ROLE_ROOTFS.to_string(), self.lower.clone()),
            (ROLE_BOOT.to_string(), BOOT_COLD.to_string()),
        ]
        .into();
        Ok(self.mark_state(manifests, tree.data.size, tree.data.bytes_stored + tree.tree_bytes, pause, opts))
    }
}

/// `cp -a` of a directory (an upper: whiteouts, xattrs and owners kept) to `to`, removed again on failure.
pub(crate) fn copy_tree(from: &Path, to: &Path) -> Result<(), BackendError> {
    copy_tree_charged(from, to, &[])
}

/// [`copy_tree`] by a `cp` that first joins the cgroups whose `cgroup.procs` files are `procs`: the copy's pages
/// (an upper laid out on the sandbox's tmpfs) are charged to the sandbox, as the files it writes itself are,
/// not to the process that restores it.
pub(crate) fn copy_tree_charged(from: &Path, to: &Path, procs: &[std::path::PathBuf]) -> Result<(), BackendError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let join: Vec<std::fs::File> = procs
        .iter()
        .map(|p| {
            std::fs::OpenOptions::new().write(true).open(p).map_err(|e| failed(format!("open {}: {e}", p.display())))
        })
        .collect::<Result<_, _>>()?;
    let fds: Vec<i32> = join.iter().map(|f| f.as_raw_fd()).collect();
    let mut cmd = Command::new("cp");
    cmd.arg("-a").arg("-T").arg(from).arg(to);
    if !fds.is_empty() {
        // SAFETY: runs in the forked child before exec, where only async-signal-safe calls are allowed: it only
        // calls write(2) on descriptors opened above (kept open by `join` until the child has exec'd) with a
        // static buffer, and builds its error from errno without allocating. "0" names the writing process.
        unsafe {
            cmd.pre_exec(move || {
                for &fd in &fds {
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    let out = cmd.output().map_err(|e| failed(format!("run cp (in the sandbox's cgroup): {e}")))?;
    drop(join);
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(to);
        return Err(failed(format!(
            "copy the upper {} to {}: {}",
            from.display(),
            to.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Boot a disk-only mark cold: its lower layers (the agent's layer replaced by this host's current one) and a
/// copy of its upper, a fresh init, the network its mark records.
pub(crate) fn boot_disk(b: &CtBackend, mark: &MarkState, id: &Identity) -> Result<CtSandbox, BackendError> {
    if mark.backend != BackendKind::Ct {
        return Err(failed(format!("not a ct mark (a {} one)", mark.backend.as_str())));
    }
    let upper = mark
        .manifests
        .get(ROLE_UPPER)
        .ok_or_else(|| BackendError::Corrupt("the disk-only mark has no 'upper' entry".into()))?;
    let upper =
        upper.parse().map_err(|_| BackendError::Corrupt(format!("the mark's upper {upper:?} is not a tree id")))?;
    b.store.tree(&upper).map_err(|e| BackendError::Corrupt(format!("tree {upper}: {e}")))?;
    let named =
        mark.manifests.get(ROLE_ROOTFS).ok_or_else(|| BackendError::Corrupt("the mark names no rootfs".into()))?;
    let lower = current_agent_layer(b, named)?;
    let egress = matches!(crate::net::mark_net(mark)?, crate::net::MarkNet::Egress);
    let spec = BootSpec { lower, upper: Some(upper), shape: &mark.shape, egress, no_new_privs: no_new_privs_of(mark) };
    crate::sandbox::boot(b, &spec, id)
}

/// `lowers` with its first entry, when that is an agent layer of this host (`$CLADE_HOME/cache/ct-agent/...`),
/// replaced by the current agent's: a boot runs the agent this host has now. Other entries must exist.
fn current_agent_layer(b: &CtBackend, lowers: &str) -> Result<String, BackendError> {
    let agents = b.home.cache_dir().join("ct-agent");
    let current = crate::sandbox::agent_layer(&b.home, &b.cfg.agent_bin)?.display().to_string();
    let mut out = Vec::new();
    for entry in lowers.split(':').filter(|e| !e.is_empty()) {
        if Path::new(entry).starts_with(&agents) {
            out.push(current.clone());
        } else if crate::lower::tree_of(entry).is_none() && !Path::new(entry).is_dir() {
            return Err(failed(format!(
                "the mark's lower layer {entry} is gone: rebuild the template it was taken from"
            )));
        } else {
            out.push(entry.to_string());
        }
    }
    Ok(out.join(":"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{mount_tmpfs, Cgroup, Limits};

    /// An upper copied onto a tmpfs by `copy_tree_charged` is billed to the sandbox's memory cgroup; the control,
    /// `copy_tree`, leaves the cgroup's usage where it was (the pages go to the copying process's cgroup).
    #[test]
    fn privileged_upper_copy_is_charged_to_the_sandbox_cgroup() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root (cgroups, tmpfs)");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("root")).unwrap();
        let data: Vec<u8> = (0..8u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        std::fs::write(src.join("root/data"), &data).unwrap();
        let rw = d.path().join("rw");
        mount_tmpfs(&rw, 64 << 20).unwrap();
        let limits = Limits { memory_bytes: 256 << 20, pids: 64, cpu_ms_per_100ms: 0, devices: None };
        let cg = Cgroup::create(&format!("clade-test-charge-{}", std::process::id()), &limits).unwrap();
        let usage = || cg.memory_usage().unwrap_or(0);
        let before = usage();
        copy_tree(&src, &rw.join("control")).unwrap();
        let after_control = usage();
        copy_tree_charged(&src, &rw.join("upper"), &cg.procs_files()).unwrap();
        let after = usage();
        let _ = nix::mount::umount2(&rw, nix::mount::MntFlags::MNT_DETACH);
        let _ = cg.remove();
        assert!(
            after_control < before + (4 << 20),
            "control: the plain copy is not billed here ({before} -> {after_control})"
        );
        assert!(after >= after_control + (8 << 20), "the charged copy is billed: {after_control} -> {after}");
    }
}
