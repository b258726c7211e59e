//! The E2B-compatible control plane and envd endpoint (`clade serve --e2b-api --e2b-sandbox`).
//! Placeholder until the E2B surface lands: it refuses to start rather than pretend.

use std::net::SocketAddr;
use std::sync::Arc;

use clade_core::CladeHome;

use crate::ops::Ops;

pub async fn spawn(_ops: Arc<Ops>, _api: SocketAddr, _sandbox: SocketAddr, _home: CladeHome) -> anyhow::Result<()> {
    Err(anyhow::anyhow!("the E2B surface is not built into this clade yet"))
}
