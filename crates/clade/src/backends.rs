//! Opening the backends this binary carries. Each is opened only when an operation needs it: opening `vm`
//! may run the accelerator probe once per boot.

use std::sync::Arc;

use anyhow::Context;
use clade_core::backend::{Backend, BackendKind};
use clade_core::engine::Engine;

pub fn open(engine: &Engine, kind: BackendKind) -> anyhow::Result<Arc<dyn Backend>> {
    match kind {
        BackendKind::Vm => Ok(Arc::new(
            clade_vm::backend::VmBackend::open(&engine.home, engine.store.clone(), None)
                .context("open the vm backend")?,
        )),
        BackendKind::Ct => ct(engine),
    }
}

fn ct(_engine: &Engine) -> anyhow::Result<Arc<dyn Backend>> {
    Err(anyhow::anyhow!(clade_core::ExitCoded::new(5, "the ct backend is not wired into this build yet")))
}
