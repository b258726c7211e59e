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
pub mod serve;
pub mod store;
pub mod supervise;
pub mod template;

/// Exit codes that mean something to scripts, from the failure's kind (the one place they are decided):
/// 1 generic, 2 usage or invalid request, 3 not found, 4 conflict, 5 resource (capacity or space), 6 permission.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    use clade_core::ErrorKind as K;
    match clade_host::error::kind(err) {
        K::Invalid => 2,
        K::NotFound => 3,
        K::Conflict => 4,
        K::NoCapacity | K::NoSpace => 5,
        K::Permission => 6,
        K::Timeout | K::Unavailable | K::Internal => 1,
    }
}
