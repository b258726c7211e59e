//! One module per subcommand group. Each exposes `run(args) -> anyhow::Result<i32>` (the process exit code).

pub mod demo;
pub mod doctor;
pub mod nbd;
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
        if let Some(e) = cause.downcast_ref::<clade_core::engine::EngineError>() {
            return e.exit_code();
        }
        if let Some(e) = cause.downcast_ref::<clade_ledger::LedgerError>() {
            return e.exit_code();
        }
    }
    1
}
