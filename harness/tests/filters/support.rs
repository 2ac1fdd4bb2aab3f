//! What the filter tests share: starting a filter, the pool they route to, the headers and
//! bodies of a chat request, and a kvoy-aggregator that answers snapshot polls.

use std::net::SocketAddr;
use std::time::Duration;

use kvoy_harness::{
    testing, Error, HttpCall, HttpResponse, HttpStream, Plugin, PluginBuilder, StreamEvent,
    StreamType,
};
use kvoy_shared::snapshot::{EndpointStatus, SnapshotDelta};

use crate::TestResult;

/// The header the routing filter writes the chosen endpoint into.
pub const DEST: &str = "x-gateway-destination-endpoint";
/// The header that says which endpoint served (from the upstream address).
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The cluster the filters poll kvoy-aggregator through.
pub const CLUSTER: &str = "kvoy_aggregator";
/// A static pool of three endpoints serving model `m`.
pub const POOL: [&str; 3] = ["127.0.0.1:18001", "127.0.0.1:18002", "127.0.0.1:18003"];

/// `filter` (built by `make wasm`) with `config` on `vms` VMs (Envoy workers), not started.
pub fn builder(filter: &str, config: &str, vms: usize) -> Result<PluginBuilder, Error> {
    Ok(testing::filter_host(filter)?
        .plugin()
        .configuration(config)
        .vms(vms))
}

/// [`builder`], started with the guests' random source seeded with `seed`.
pub fn start(filter: &str, config: &str, vms: usize, seed: u64) -> Result<Plugin, Error> {
    builder(filter, config, vms)?.seed(seed).start()
}

/// [`start`] with the kvoy-aggregator cluster [`CLUSTER`] known to the host.
pub fn start_live(filter: &str, config: &str, vms: usize, seed: u64) -> Result<Plugin, Error> {
    builder(filter, config, vms)?
        .clusters([CLUSTER])
        .seed(seed)
        .start()
}

/// The `endpoints` of a static pool: each address serves model `m`.
pub fn endpoints(addresses: &[&str]) -> serde_json::Value {
    addresses
        .iter()
        .map(|a| serde_json::json!({"address": a, "models": ["m"]}))
        .collect()
}

/// A configuration with the static pool `addresses` and the fields of `extra` (an object).
pub fn pool_config(addresses: &[&str], extra: serde_json::Value) -> String {
    let mut config = serde_json::json!({ "endpoints": endpoints(addresses) });
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    config.to_string()
}

/// A chat completion body for model `m` with one user message.
pub fn chat_body(text: &str) -> String {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string()
}

/// The request headers of a JSON POST to `path`.
pub fn post(path: &str) -> Vec<(&str, &str)> {
    vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "gw"),
        ("content-type", "application/json"),
    ]
}

/// A request header as it went upstream (`None` while held, or if not set).
pub fn forwarded(stream: &HttpStream, name: &str) -> Option<String> {
    stream
        .forwarded_request_headers()
        .and_then(|h| h.get(name).map(str::to_owned))
}

/// Whether the filter resumed the held request (`proxy_continue_stream`).
pub fn resumed(s: &HttpStream) -> bool {
    s.events()
        .iter()
        .any(|e| matches!(e, StreamEvent::Continued(StreamType::HttpRequest)))
}

/// A ready, idle endpoint of model `m` as kvoy-aggregator reports it.
pub fn status(slot: u16, address: SocketAddr) -> EndpointStatus {
    EndpointStatus {
        kv_cache_usage: 0.1,
        block_size: 16,
        capacity_blocks: 1000,
        ..EndpointStatus::ready(slot, address, &["m"])
    }
}

/// Advances one poll interval and returns the single snapshot poll it caused.
pub fn next_poll(plugin: &Plugin) -> Result<HttpCall, Error> {
    plugin.advance(Duration::from_millis(100))?;
    let calls = testing::snapshot_polls(plugin)?;
    assert_eq!(calls.len(), 1, "one poller per proxy: {calls:?}");
    Ok(calls.into_iter().next().unwrap())
}

/// Answers a snapshot poll with `delta`, as kvoy-aggregator does.
pub fn respond_snapshot(plugin: &Plugin, call: &HttpCall, delta: SnapshotDelta) -> TestResult {
    let mut body = Vec::new();
    delta.encode(&mut body);
    plugin.respond_http_call(call, HttpResponse::new(200).body(body))
}
