//! What the aggregator's black-box tests share: runtimes, a kvoy-sim on 127.0.0.1, an
//! aggregator on an ephemeral port, endpoint specs, scratch directories and one HTTP request on
//! the test kit's client.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvoy_aggregator::config::{AggregatorConfig, EndpointSpec, KvEventsSource};
use kvoy_aggregator::source::EndpointSource;
use kvoy_aggregator::Aggregator;
use kvoy_sim::engine::Profile;
use kvoy_sim::server::runtime::EngineHandle;
use kvoy_sim::server::{self, HttpOptions, Simulator};
use kvoy_testkit::http::Request;

/// A multi-thread runtime with `workers` threads.
pub fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

/// An aggregator on `rt`, its API on an ephemeral port of 127.0.0.1, its endpoints from
/// `source`.
pub fn start_aggregator(
    rt: &tokio::runtime::Runtime,
    config: &AggregatorConfig,
    source: impl EndpointSource + 'static,
) -> Aggregator {
    rt.block_on(Aggregator::start(
        config,
        Box::new(source),
        "127.0.0.1:0".parse().unwrap(),
    ))
    .unwrap()
}

/// An aggregator configuration (sources re-read every 100 ms) whose endpoints are InferencePool
/// `llm/llama-pool`'s, read from the API server at `api_server` (plain HTTP) with the token in
/// `token_file` (`''`: none), serving `models` (a YAML list); `more`: further lines of the
/// `kubernetes:` section.
pub fn kubernetes_yaml(
    api_server: SocketAddr,
    token_file: &str,
    models: &str,
    more: &str,
) -> String {
    format!(
        "reload_interval_ms: 100
kubernetes:
  inference_pool: llama-pool
  namespace: llm
  api_server: http://{api_server}
  token_file: {token_file}
  models: {models}
{more}"
    )
}

/// A kvoy-sim with command line `args` serving on `addr`, on a runtime of its own (one
/// worker): dropping the runtime stops it. An error when `addr` or its KV-event ports are
/// taken (a simulator just killed may still hold them).
pub fn serve_sim(addr: SocketAddr, args: &[&str]) -> Result<tokio::runtime::Runtime, String> {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let options = kvoy_sim::cli::parse(&args).unwrap().unwrap();
    let runtime = runtime(1);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(addr))
        .map_err(|e| e.to_string())?;
    let sink = kvoy_sim::events::sink(&options, 0, addr).map_err(|e| e.to_string())?;
    let engine = EngineHandle::start(options.profile.clone(), options.http.speedup, sink)
        .map_err(|e| e.to_string())?;
    let sim = Simulator::new(engine, options.http.clone(), addr.to_string());
    runtime.spawn(server::serve(listener, sim));
    Ok(runtime)
}

/// A kvoy-sim of `profile` without KV events, serving `options` on an ephemeral port of
/// 127.0.0.1 on the current runtime; its address.
pub async fn serve_http_sim(profile: Profile, options: HttpOptions) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let engine = EngineHandle::start(profile, options.speedup, Box::new(|_| {})).unwrap();
    tokio::spawn(server::serve(
        listener,
        Simulator::new(engine, options, addr.to_string()),
    ));
    addr
}

/// Model `m` at `address`, metrics at `/metrics`, KV events from `kv_events`.
pub fn spec(address: SocketAddr, kv_events: Option<KvEventsSource>) -> EndpointSpec {
    EndpointSpec {
        address,
        models: vec!["m".into()],
        metrics_path: "/metrics".into(),
        kv_events,
        role: kvoy_shared::Role::Decode,
    }
}

/// KV events published at `endpoint` (every topic), replayed from `replay`.
pub fn kv_source(endpoint: &str, replay: Option<&str>) -> KvEventsSource {
    KvEventsSource {
        endpoint: endpoint.to_owned(),
        replay_endpoint: replay.map(str::to_owned),
        topic: String::new(),
    }
}

/// One request (`Connection: close`) with `headers` (whole lines) and `body`: status, head as
/// sent, body.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> (u16, String, Vec<u8>) {
    let request = Request::new(method, path)
        .host("t")
        .header_lines(headers)
        .header("content-length", &body.len().to_string())
        .body(body.to_vec())
        .timeout(Duration::from_secs(10));
    let r = kvoy_testkit::http::request(addr, &request).unwrap();
    (r.status, r.head_text(), r.body)
}

/// A directory of the system's temporary one, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// `kvoy-agg-<name>-<pid>`.
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("kvoy-agg-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// Writes `token` (and a newline) to `token` in the directory; its path.
    pub fn token_file(&self, token: &str) -> PathBuf {
        let path = self.0.join("token");
        std::fs::write(&path, format!("{token}\n")).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
