//! Where a simulator's KV events go: nowhere, or a ZMQ publisher in vLLM's wire format.

use std::net::SocketAddr;

use anyhow::Result;

use crate::cli::Options;
use crate::server::runtime::EventSink;

/// The event sink of simulator number `index` (of `--count`), serving on `addr`.
pub fn sink(options: &Options, _index: u16, _addr: SocketAddr) -> Result<EventSink> {
    if options.kv_events.endpoint.is_some() {
        anyhow::bail!("--kv-events-endpoint: KV-event publishing is not wired in yet");
    }
    Ok(Box::new(|_events| {}))
}
