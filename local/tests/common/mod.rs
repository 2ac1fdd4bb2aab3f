//! Helpers shared by kvoy-local's end-to-end tests.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use kvoy_local::config::Config;
use kvoy_local::serve::{ServeOptions, Server};
use serde_json::{json, Value};

/// The tests of one binary run one at a time (the machine is small; some measure concurrency).
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A scratch directory for one test.
pub fn run_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("kvoy-local")
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The three filters of `envoy/kvoy.yaml`, in its order, with these plugin configurations.
pub fn chain_config(session: &str, admission: &str, prefix: &str, workers: usize) -> Value {
    let wasm_dir = kvoy_testkit::wasm_dir();
    kvoy_testkit::require_filter_wasm(&wasm_dir).unwrap_or_else(|e| panic!("{e:#}"));
    json!({
        "wasm_dir": wasm_dir,
        "workers": workers,
        "seed": 7,
        "filters": [
            {"name": "kvoy_session", "configuration": session},
            {"name": "kvoy_admission", "configuration": admission},
            {"name": "kvoy_prefix_affinity", "configuration": prefix},
        ],
    })
}

/// Writes a configuration as JSON and loads it the way the binary does. Each call writes a file
/// of its own: tests of one binary run in parallel and share `name`.
pub fn load(name: &str, config: &Value) -> (Config, PathBuf) {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = run_dir(name).join(format!("kvoy-local-{n}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
    let loaded = Config::load(&path).unwrap_or_else(|e| panic!("[{name}] {e}"));
    (loaded, path)
}

/// `kvoy-local serve` in this process, with an admin listener.
pub fn serve(name: &str, config: &Value) -> Server {
    let (config, _) = load(name, config);
    let options = ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin: Some("127.0.0.1:0".parse().unwrap()),
    };
    Server::start(&config, &options).unwrap_or_else(|e| panic!("[{name}] kvoy-local serve: {e}"))
}

/// The filters' counters and gauges by name (Envoy's `wasmcustom.` prefix removed).
pub fn local_stats(server: &Server) -> std::collections::BTreeMap<String, i64> {
    server
        .metrics()
        .unwrap()
        .into_iter()
        .filter(|(_, m)| m.kind != kvoy_harness::MetricType::Histogram)
        .map(|(_, m)| (m.name, m.value))
        .collect()
}

/// The combined `kvoy` filter with the same stage configurations as [`chain_config`] (a
/// section per stage; `None` leaves the stage out).
pub fn kvoy_config(
    session: Option<&str>,
    admission: Option<&str>,
    prefix: &str,
    workers: usize,
) -> Value {
    let wasm_dir = kvoy_testkit::wasm_dir();
    kvoy_testkit::require_filter_wasm(&wasm_dir).unwrap_or_else(|e| panic!("{e:#}"));
    let mut sections = serde_json::Map::new();
    if let Some(s) = session {
        sections.insert("session".into(), serde_json::from_str(s).unwrap());
    }
    if let Some(a) = admission {
        sections.insert("admission".into(), serde_json::from_str(a).unwrap());
    }
    sections.insert(
        "prefix_affinity".into(),
        serde_json::from_str(prefix).unwrap(),
    );
    json!({
        "wasm_dir": wasm_dir,
        "workers": workers,
        // kvoy-local gives filter i the seed `seed ^ i * K`: this is the seed the chain of
        // [`chain_config`] gives kvoy_prefix_affinity (filter 2), so that both layouts draw the
        // same tie-breaks.
        "seed": 7u64 ^ 2u64.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        "filters": [{"name": "kvoy", "configuration": Value::Object(sections)}],
    })
}
