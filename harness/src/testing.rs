//! Helpers for tests and benchmarks that load the workspace's own filters.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::vm::host::Host;

/// Overrides the directory the built filters are looked up in; the workspace's target
/// directory (the kit's one finder for both).
pub use kvoy_testkit::{target_dir, WASM_DIR_ENV};

/// The path of a filter built with `cargo build --release --target wasm32-wasip1`, e.g.
/// `filter_wasm_path("kvoy_prefix_affinity")` (dashes are accepted too). Fails with a message
/// telling to run `make wasm` when the file is missing; it never builds anything itself.
pub fn filter_wasm_path(name: &str) -> Result<PathBuf> {
    let file = format!("{}.wasm", name.replace('-', "_"));
    let path = kvoy_testkit::wasm_dir().join(file);
    if !path.is_file() {
        return Err(Error::WasmNotBuilt {
            name: name.to_owned(),
            path,
        });
    }
    Ok(path)
}

/// Loads and compiles a workspace filter once per process: tests in one binary share the
/// compiled module (compiling takes a second or more).
pub fn filter_host(name: &str) -> Result<Host> {
    static CACHE: OnceLock<Mutex<HashMap<PathBuf, Host>>> = OnceLock::new();
    let path = filter_wasm_path(name)?;
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(host) = cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&path)
    {
        return Ok(host.clone());
    }
    let host = Host::load(&path)?;
    cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(path, host.clone());
    Ok(host)
}

/// Whether `call` is a filter's decision exchange with kvoy-aggregator (`POST /v1/decisions`).
pub fn is_decision_exchange(call: &crate::HttpCall) -> bool {
    call.headers
        .get(":path")
        .is_some_and(|p| p.starts_with(kvoy_shared::relay::PATH))
}

/// Whether `call` is the relay's send of the proxy's own decisions (`POST /v1/decisions` with
/// `limit=0`: it asks for nothing back).
pub fn is_decision_send(call: &crate::HttpCall) -> bool {
    is_decision_exchange(call)
        && call
            .headers
            .get(":path")
            .is_some_and(|p| p.contains("&limit=0"))
}

/// Whether `call` is the relay's long poll for the other proxies' decisions (`POST
/// /v1/decisions` with `wait_ms`).
pub fn is_decision_receive(call: &crate::HttpCall) -> bool {
    is_decision_exchange(call)
        && call
            .headers
            .get(":path")
            .is_some_and(|p| p.contains(&format!("&{}=", kvoy_shared::relay::WAIT_PARAM)))
}

/// The snapshot polls `plugin`'s filter has in flight to kvoy-aggregator; its decision exchanges
/// (`POST /v1/decisions`, which the lease holder starts on its ticks) are answered on the way
/// as an aggregator with nothing to relay answers them.
pub fn snapshot_polls(plugin: &crate::Plugin) -> Result<Vec<crate::HttpCall>> {
    use kvoy_shared::relay::DecisionBatch;
    let mut polls = Vec::new();
    for call in plugin.http_calls() {
        if is_decision_exchange(&call) {
            let mut none = Vec::new();
            DecisionBatch::default().encode(&mut none);
            plugin.respond_http_call(&call, crate::HttpResponse::new(200).body(none))?;
        } else {
            polls.push(call);
        }
    }
    Ok(polls)
}

/// A raw HTTP/1.1 server on a loopback port for one request, for tests of real callouts
/// ([`crate::PluginBuilder::upstream`]): it reads the request head, writes `reply` as it is
/// and hands back the head it read.
pub fn serve_once(
    reply: &'static [u8],
) -> std::io::Result<(SocketAddr, JoinHandle<std::io::Result<String>>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let handle = std::thread::spawn(move || {
        let (mut s, _) = listener.accept()?;
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
        }
        s.write_all(reply)?;
        Ok(String::from_utf8_lossy(&seen).into_owned())
    });
    Ok((addr, handle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_filter_names_the_fix() {
        let err = filter_wasm_path("kvoy-no-such-filter").expect_err("not built");
        let text = err.to_string();
        assert!(text.contains("kvoy_no_such_filter.wasm"), "{text}");
        assert!(text.contains("make wasm"), "{text}");
    }
}
