//! The running `vm` sandbox: its QEMU, disk export, agent connection and leases, what `Sandbox` asks of it,
//! and what its drop releases. Its marks are in `mark.rs`; it is made by a cold start (`cold_start.rs`) or a
//! restore (`restore.rs`). Kept apart as clade-ct keeps its running sandbox in `sandbox.rs`.

use std::path::{Path, PathBuf};

use clade_agent::client::AgentClient;
use clade_core::backend::{BackendError, BackendKind, MarkOptions, MarkState, Sandbox, Shape};
use clade_store::Lease;

use super::run_dir::RunDir;
use super::{failed, MarkStats, VmBackend};
use crate::disks::DiskExport;
use crate::machine::Vm;

/// A running `vm` sandbox: its QEMU, its disk export, its agent connection and the store leases that keep what
/// it runs from alive.
pub struct VmSandbox {
    pub(super) backend: VmBackend,
    pub(super) id: String,
    pub(super) shape: Shape,
    pub(super) vm: Option<Vm>,
    pub(super) disk: DiskExport,
    pub(super) agent: AgentClient,
    pub(super) agent_sock: PathBuf,
    /// The RAM file QEMU maps: private to a cold sandbox (shared mapping), else the root file (private mapping).
    pub(super) ram_file: PathBuf,
    /// The root RAM manifest this sandbox's RAM is relative to; `None` for a cold sandbox.
    pub(super) root: Option<String>,
    pub(super) leases: Vec<Lease>,
    pub(super) run: RunDir,
    pub(super) generation: u64,
    pub(super) last_mark: Option<MarkStats>,
    /// `network = "egress"`: a user-mode NIC (crate::net), recorded in every mark.
    pub(super) egress: bool,
    /// The lazily fetched root RAM QEMU maps, when this host had no root file (last: unmounted after QEMU ends).
    pub(super) lazy: Option<clade_lazyfs::LazyFile>,
    /// Egress: the sandbox's own network namespace, which its QEMU runs in (clade_core::sandbox_net; released
    /// after QEMU is gone).
    pub(super) net: Option<clade_core::sandbox_net::SandboxNet>,
}

impl VmSandbox {
    /// Bytes served so far by the lazily fetched root RAM, when this sandbox maps one.
    pub fn lazy_ram_bytes(&self) -> Option<u64> {
        self.lazy.as_ref().map(|l| l.counters().bytes.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The stats of this sandbox's last mark of a clone.
    pub fn last_mark_stats(&self) -> Option<MarkStats> {
        self.last_mark
    }

    pub(super) fn vm(&mut self) -> &mut Vm {
        self.vm.as_mut().expect("a live sandbox has its QEMU")
    }

    pub fn qemu_pid(&self) -> Option<u32> {
        self.vm.as_ref().map(|v| v.pid())
    }

    /// The uid its QEMU runs as (`None`: unjailed).
    pub fn qemu_uid(&self) -> Option<u32> {
        self.vm.as_ref().and_then(|v| v.jailed()).map(|j| j.uid())
    }

    /// The RAM file its QEMU maps.
    pub fn ram_file(&self) -> &Path {
        &self.ram_file
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl Sandbox for VmSandbox {
    fn kind(&self) -> BackendKind {
        BackendKind::Vm
    }
    /// A guest without a NIC reaches nothing: denials hold already. A guest with the user-mode NIC gets the
    /// rules in its QEMU's network namespace, where slirp opens its sockets (as a ct sandbox's own).
    fn set_egress_rules(&mut self, rules: &clade_core::backend::EgressRules) -> Result<(), BackendError> {
        rules.check().map_err(BackendError::Unsupported)?;
        match &self.net {
            Some(net) => net.set_rules(rules).map_err(BackendError::Failed),
            None => rules.without_network(&self.id),
        }
    }
    fn id(&self) -> &str {
        &self.id
    }
    fn agent(&self) -> &AgentClient {
        &self.agent
    }
    fn pids(&self) -> Vec<u32> {
        self.qemu_pid().into_iter().collect()
    }
    /// Inside the guest, by the agent: the group is stopped and continued by signals (SIGSTOP, SIGCONT), as the
    /// host cannot reach a guest's cgroups; its processes see a stop as a job-control stop.
    fn proc_group(&mut self, leader: u32, op: clade_core::backend::GroupOp) -> Result<usize, BackendError> {
        use clade_core::backend::GroupOp;
        let signal = match op {
            GroupOp::Freeze => nix::sys::signal::Signal::SIGSTOP as i32,
            GroupOp::Thaw => nix::sys::signal::Signal::SIGCONT as i32,
            GroupOp::Kill => nix::sys::signal::Signal::SIGKILL as i32,
        };
        let n = self
            .agent
            .signal_group(leader, signal)
            .map_err(|e| BackendError::Failed(format!("{op:?} the group of {leader}: {e}")))?;
        Ok(n as usize)
    }
    /// A copy of the host's file or directory, mounted in the guest (`volumes.rs`): a guest cannot see the host.
    fn bind(&mut self, host: &Path, inside: &str, readonly: bool) -> Result<(), BackendError> {
        super::volumes::copy_in(&self.agent, host, inside, readonly)
    }
    /// A copy of the image's root in the guest (`volumes.rs`); the agent starts the member's processes in it.
    fn attach_root(&mut self, name: &str, host: &Path) -> Result<String, BackendError> {
        super::volumes::attach_root(&self.agent, name, host)
    }
    fn detach_root(&mut self, name: &str) -> Result<(), BackendError> {
        super::volumes::detach_root(&self.agent, name)
    }
    fn mark(&mut self, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        if opts.disk_only {
            return self.disk_mark(opts, false);
        }
        // The guest's own preparations first (pre-mark.d hooks): they run before the pause.
        for warning in clade_core::hygiene::pre_mark(&self.agent, !opts.not_clean) {
            eprintln!("clade-vm: {}: mark goes on: {warning}", self.id);
        }
        match self.root.clone() {
            None => self.mark_cold(opts),
            Some(root) => self.mark_clone(root, opts),
        }
    }
    fn suspend(mut self: Box<Self>, opts: &MarkOptions) -> Result<MarkState, BackendError> {
        let m = if opts.disk_only { self.disk_mark(opts, true)? } else { self.mark(opts)? };
        self.kill()?;
        Ok(m)
    }
    fn kill(self: Box<Self>) -> Result<(), BackendError> {
        drop(self);
        Ok(())
    }
    fn pause(&mut self) -> Result<(), BackendError> {
        self.vm().qmp.execute("stop", serde_json::json!({})).map(|_| ()).map_err(failed)
    }
    fn resume(&mut self) -> Result<(), BackendError> {
        self.vm().qmp.execute("cont", serde_json::json!({})).map(|_| ()).map_err(failed)
    }
    /// The vCPUs stopped (QEMU's `stop`): the guest's processes stand where they are.
    fn freeze(&mut self) -> Result<(), BackendError> {
        self.pause()
    }
    fn thaw(&mut self) -> Result<(), BackendError> {
        self.resume()
    }
    fn exited(&mut self) -> Option<String> {
        let vm = self.vm.as_mut()?;
        let why = vm.exited()?;
        Some(format!("{why}; last console lines: {}", vm.console_tail(8)))
    }
}

impl Drop for VmSandbox {
    fn drop(&mut self) {
        self.vm = None;
        if self.root.is_none() {
            let _ = std::fs::remove_file(&self.ram_file);
        }
        self.leases.clear();
    }
}
