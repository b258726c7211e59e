//! `containerd-shim-clade-v2`: a containerd runtime v2 shim (runtime type `io.containerd.clade.v2`) that runs
//! each container of an OCI bundle as a clade sandbox, forked from a mark instead of cold-started where one
//! exists (docs/kubernetes.md).
//!
//! containerd starts the binary with `start` (it spawns the long-lived shim server, one per container, and
//! prints its socket address), talks to that server over TTRPC (the Task service, [`tasks`]), and runs the
//! binary with `delete` to clean up after a shim that died ([`Shim::delete_shim`]). The shim links clade's
//! product library and does the operations in-process, against `$CLADE_HOME` (default `/var/lib/clade`), as
//! the `clade` CLI does; sandboxes outlive the shim process exactly as they outlive a CLI call.
//!
//! Environment: `CLADE_HOME`; `CLADE_SHIM_BACKEND` (`ct`, the default, or `vm`), overridden per container by
//! the annotation `clade.dev/backend`; `CLADE_BIN` when the `clade` binary is not beside this one.

mod bundle;
mod state;
mod stats;
mod stdio;
mod tasks;

use std::sync::Arc;

use clade_core::backend::BackendKind;
use clade_core::CladeHome;
use containerd_shim::api::DeleteResponse;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, ExitSignal, Flags, StartOpts};

pub const RUNTIME: &str = "io.containerd.clade.v2";

struct Shim {
    exit: Arc<ExitSignal>,
    namespace: String,
    bundle: String,
}

fn default_backend() -> BackendKind {
    match std::env::var("CLADE_SHIM_BACKEND").as_deref() {
        Ok("vm") => BackendKind::Vm,
        _ => BackendKind::Ct,
    }
}

impl containerd_shim::Shim for Shim {
    type T = tasks::Service;

    fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Shim { exit: Arc::new(ExitSignal::default()), namespace: args.namespace.clone(), bundle: args.bundle.clone() }
    }

    /// One shim server per pod: a CRI container's bundle names its pod, and every container of the pod is
    /// served by the shim started for the pod's first (its sandbox container), as containerd expects.
    fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        let here = std::env::current_dir().unwrap_or_default();
        let grouping = bundle::Bundle::load(&here)
            .ok()
            .and_then(|b| b.annotation(bundle::CRI_SANDBOX_ID).map(str::to_string))
            .unwrap_or_else(|| opts.id.clone());
        let (_pid, address) = containerd_shim::spawn(opts, &grouping, Vec::new())?;
        Ok(address)
    }

    /// containerd's cleanup after a shim that ended without deleting its container (killed, crashed): the
    /// sandbox the bundle names is killed and the rootfs unmounted, so nothing of the container is left.
    fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        let dir = if self.bundle.is_empty() {
            std::env::current_dir().unwrap_or_default()
        } else {
            std::path::PathBuf::from(&self.bundle)
        };
        if let Ok(sandbox) = std::fs::read_to_string(dir.join(bundle::SANDBOX_FILE)) {
            let home = CladeHome::from_env();
            match clade_host::Ops::open(&home) {
                Ok(ops) => {
                    if let Err(e) = clade_host::api::SandboxApi::kill(&ops, sandbox.trim()) {
                        log::warn!("delete: kill sandbox {}: {e:#}", sandbox.trim());
                    }
                }
                Err(e) => log::warn!("delete: open {}: {e:#}", home.root().display()),
            }
            let _ = std::fs::remove_file(dir.join(bundle::SANDBOX_FILE));
        }
        bundle::unmount_rootfs(&dir.join("rootfs"));
        Ok(DeleteResponse { exit_status: 128 + 9, exited_at: Some(Timestamp::now()).into(), ..Default::default() })
    }

    fn wait(&mut self) {
        self.exit.wait();
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        let home = CladeHome::from_env();
        let ops = match clade_host::Ops::open(&home) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("{RUNTIME}: cannot open clade's home {}: {e:#}", home.root().display());
                std::process::exit(1);
            }
        };
        let t = state::Tasks::new(
            home,
            Arc::new(ops),
            default_backend(),
            self.namespace.clone(),
            publisher,
            self.exit.clone(),
        );
        tasks::Service(Arc::new(t))
    }
}

fn main() {
    // No reaper and no subreaper: the shim's own children are `Command`s that wait for themselves (a reaper
    // thread calling waitpid(-1) would take their exit statuses from them); sandboxes' supervisors are not
    // children of the shim.
    let config = Config { no_reaper: true, no_sub_reaper: true, ..Default::default() };
    containerd_shim::run::<Shim>(RUNTIME, Some(config));
}
