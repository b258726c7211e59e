//! One module per subcommand group. Each exposes `run(args) -> anyhow::Result<i32>` (the process exit code).

pub mod base;
pub mod demo;
pub mod doctor;
pub mod e2b;
pub mod fleet;
pub mod house;
pub mod nbd;
pub mod pool;
pub mod progress;
pub mod roam;
pub mod sandbox;
pub mod store;
pub mod supervise;
pub mod template;

/// Exit codes that mean something to scripts: 1 generic, 2 usage, 3 not found, 4 conflict, 5 resource.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    for cause in err.chain() {
        if let Some(e) = cause.downcast_ref::<clade_core::ExitCoded>() {
            return e.code;
        }
        if cause.downcast_ref::<crate::admit::Refused>().is_some() {
            return 5;
        }
        if let Some(e) = cause.downcast_ref::<clade_core::engine::EngineError>() {
            return e.exit_code();
        }
        if let Some(e) = cause.downcast_ref::<clade_ledger::LedgerError>() {
            return e.exit_code();
        }
    }
    1
}

/// The clade-agent binary installed into templates: `$CLADE_AGENT_BIN`, else `clade-agent` next to this binary.
pub fn agent_binary() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("CLADE_AGENT_BIN") {
        return Some(p.into());
    }
    let p = std::env::current_exe().ok()?.parent()?.join("clade-agent");
    p.is_file().then_some(p)
}
