//! Opening the backends this binary carries. Each is opened only when an operation needs it: opening `vm`
//! may run the accelerator probe once per boot; opening `ct` checks the private CRIU and the agent layer.

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
        BackendKind::Ct => {
            let cfg = clade_ct::CtConfig::from_home(&engine.home).context("configure the ct backend")?;
            Ok(Arc::new(
                clade_ct::CtBackend::new(engine.home.clone(), engine.store.clone(), cfg)
                    .context("open the ct backend")?,
            ))
        }
    }
}
