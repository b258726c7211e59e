//! `clade serve`: the daemon (see `clade_api::server`).

use std::net::SocketAddr;

#[derive(clap::Args)]
pub struct Args {
    /// Where to listen: `unix:PATH` or `HOST:PORT` (repeatable). Default: unix:$CLADE_HOME/api.sock.
    #[arg(long)]
    pub listen: Vec<String>,
    /// Also answer E2B's control plane here (HOST:PORT), for the official E2B SDKs.
    #[arg(long, requires = "e2b_sandbox")]
    pub e2b_api: Option<SocketAddr>,
    /// ... and E2B's in-sandbox API (envd) here (HOST:PORT).
    #[arg(long, requires = "e2b_api")]
    pub e2b_sandbox: Option<SocketAddr>,
    /// Largest file upload accepted, MiB (larger: 413).
    #[arg(long, default_value_t = 1024)]
    pub max_upload_mib: u64,
    /// A non-streamed exec is killed after this many seconds (504); a request's timeout_ms may only lower it.
    #[arg(long, default_value_t = 3600)]
    pub exec_timeout: u64,
    /// Suspend sandboxes idle for this many seconds unless a create says otherwise (0: only those that ask).
    #[arg(long, default_value_t = 0)]
    pub idle_timeout: u64,
    /// How often the idle loop looks, in seconds.
    #[arg(long, default_value_t = 5, hide = true)]
    pub idle_tick: u64,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    clade_api::server::run(clade_api::server::Config {
        listen: a.listen,
        e2b: a.e2b_api.zip(a.e2b_sandbox),
        max_upload_mib: a.max_upload_mib,
        exec_timeout: a.exec_timeout,
        idle_timeout: a.idle_timeout,
        idle_tick: a.idle_tick,
    })
}
