//! What the aggregator refuses and how it behaves before it knows the pool, on 127.0.0.1:
//!
//! - before its first successful discovery (a Kubernetes API server that accepts connections
//!   and never answers) `/v1/snapshot` answers 503 `not-loaded` and `/readyz` 503, never an
//!   empty pool; once the source answers, both turn 200 even with no endpoint ready;
//! - with a token configured, `/v1/snapshot` and `/v1/endpoints` answer 401 without it
//!   (counted), probes and metrics stay open;
//! - the HTTP server closes connections over its cap at once and connections that do not send
//!   their headers in time;
//! - KV events: an endpoint's blocks stop at its cap (from its `num_gpu_blocks`), malformed
//!   and unknown events and oversized frames are counted by reason, and the reason is shown.
//!
//! Every wait is bounded in time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvoy_aggregator::config::{AggregatorConfig, EndpointSpec};
use kvoy_aggregator::k8s::{Discovery, InCluster, KubernetesSource};
use kvoy_aggregator::source::{EndpointSource, SourceError};
use kvoy_kvevents::{BlockHash, EventBatch, KvEvent, Medium, Publisher, PublisherConfig, WireForm};
use kvoy_testkit::free_port;
use serde_json::Value;

mod common;
use common::{kubernetes_yaml, kv_source, runtime, start_aggregator, Scratch};

const WAIT: Duration = Duration::from_secs(10);

/// One GET with extra header lines: status, lowercased head, body.
fn get(addr: SocketAddr, path: &str, headers: &str) -> (u16, String, Vec<u8>) {
    let (status, head, body) = common::request(addr, "GET", path, headers, b"");
    (status, head.to_ascii_lowercase(), body)
}

fn json(addr: SocketAddr, path: &str, headers: &str) -> Value {
    let (status, _, body) = get(addr, path, headers);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

fn metrics(addr: SocketAddr) -> String {
    let (status, _, body) = get(addr, "/metrics", "");
    assert_eq!(status, 200);
    String::from_utf8(body).unwrap()
}

fn wait_for(what: &str, f: impl FnMut() -> bool) {
    kvoy_testkit::wait_for(what, WAIT, f);
}

/// A TCP listener that accepts connections, reads what they send and never answers.
fn silent_listener() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        // Bounded: a test makes a handful of connections.
        for stream in listener.incoming().take(1000) {
            let Ok(s) = stream else { break };
            held.push(s);
        }
    });
    addr
}

#[test]
fn a_source_that_never_answers_leaves_the_snapshot_not_loaded() {
    let rt = runtime(2);
    let api_server = silent_listener();
    let yaml = kubernetes_yaml(api_server, "''", "[m]", "  request_timeout_ms: 200\n");
    let cfg = AggregatorConfig::from_yaml(&yaml).unwrap();
    let discovery =
        Discovery::new(cfg.kubernetes.as_ref().unwrap(), &InCluster::default()).unwrap();
    let source = {
        let _guard = rt.enter();
        KubernetesSource::spawn(discovery, cfg.reload_interval)
    };
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    // Several discovery rounds time out meanwhile.
    std::thread::sleep(Duration::from_millis(800));
    for _ in 0..3 {
        let (status, head, body) = get(api, "/v1/snapshot?format=2", "");
        assert_eq!(
            status, 503,
            "an aggregator that has not discovered its pool must not serve one: {head}"
        );
        assert!(
            head.contains("x-kvoy-aggregator-status: not-loaded"),
            "{head}"
        );
        assert!(String::from_utf8_lossy(&body).contains("not loaded"));
    }
    assert_eq!(get(api, "/readyz", "").0, 503);
    assert_eq!(get(api, "/healthz", "").0, 200);
    let m = metrics(api);
    assert!(m.contains("\nkvoy_aggregator_loaded 0\n"), "{m}");
    assert!(
        m.contains("kvoy_aggregator_snapshot_requests_total{kind=\"not_loaded\"} 3"),
        "{m}"
    );
    assert!(
        m.contains("kvoy_aggregator_snapshot_requests_total{kind=\"full\"} 0"),
        "{m}"
    );
    assert!(!json(api, "/v1/endpoints", "")["loaded"].as_bool().unwrap());
    rt.block_on(agg.shutdown());
}

/// A source that fails until `open`, then lists `endpoints` once.
struct Gate {
    open: Arc<AtomicBool>,
    endpoints: Option<Vec<EndpointSpec>>,
}

impl EndpointSource for Gate {
    fn poll(&mut self) -> Result<Option<Vec<EndpointSpec>>, SourceError> {
        if !self.open.load(Ordering::Relaxed) {
            return Err(SourceError::Config(
                kvoy_aggregator::config::ConfigError::Syntax("not yet".into()),
            ));
        }
        Ok(self.endpoints.take())
    }
}

/// Model `m` at `address`, KV events (if any) from `kv` without a replay socket.
fn spec(address: SocketAddr, kv: Option<String>) -> EndpointSpec {
    common::spec(address, kv.map(|endpoint| kv_source(&endpoint, None)))
}

#[test]
fn the_first_successful_discovery_makes_it_ready_even_with_no_endpoint_up() {
    let rt = runtime(2);
    let open = Arc::new(AtomicBool::new(false));
    let dead = SocketAddr::from(([127, 0, 0, 1], free_port().unwrap()));
    let source = Gate {
        open: open.clone(),
        endpoints: Some(vec![spec(dead, None)]),
    };
    let cfg =
        AggregatorConfig::from_yaml("scrape_interval_ms: 50\nreload_interval_ms: 100\n").unwrap();
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(get(api, "/v1/snapshot", "").0, 503);
    assert_eq!(get(api, "/readyz", "").0, 503);
    open.store(true, Ordering::Relaxed);
    wait_for("the snapshot once loaded", || {
        get(api, "/v1/snapshot", "").0 == 200
    });
    let (status, _, body) = get(api, "/readyz", "");
    assert_eq!(
        status,
        200,
        "ready once loaded, although its one endpoint is down: {}",
        String::from_utf8_lossy(&body)
    );
    let view = json(api, "/v1/endpoints", "");
    assert_eq!(view["pool"]["ready"], 0);
    assert!(view["loaded"].as_bool().unwrap());
    rt.block_on(agg.shutdown());
}

#[test]
fn the_snapshot_requires_the_token_when_one_is_configured() {
    let rt = runtime(2);
    let scratch = Scratch::new("token");
    let token_file = scratch.token_file("s3cret-token-0123456789");
    let yaml = format!(
        "api_token_file: {}\nendpoints: [{{address: '127.0.0.1:{}', models: [m]}}]\n",
        token_file.display(),
        free_port().unwrap()
    );
    let cfg = AggregatorConfig::from_yaml(&yaml).unwrap();
    let source = kvoy_aggregator::source::StaticSource::new(cfg.endpoints.clone());
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    wait_for("loaded", || get(api, "/readyz", "").0 == 200);
    for path in ["/v1/snapshot", "/v1/endpoints"] {
        let (status, head, _) = get(api, path, "");
        assert_eq!(status, 401, "{path} without a token");
        assert!(head.contains("www-authenticate: bearer"), "{head}");
        let (status, _, _) = get(
            api,
            path,
            "authorization: Bearer s3cret-token-012345678X\r\n",
        );
        assert_eq!(status, 401, "{path} with a wrong token");
        let (status, _, _) = get(
            api,
            path,
            "authorization: Bearer s3cret-token-0123456789\r\n",
        );
        assert_eq!(status, 200, "{path} with the token");
    }
    assert_eq!(
        get(
            api,
            "/v1/snapshot",
            "authorization: Basic s3cret-token-0123456789\r\n"
        )
        .0,
        401
    );
    // Probes and scrapers need no token.
    assert_eq!(get(api, "/healthz", "").0, 200);
    let m = metrics(api);
    assert!(
        m.contains("kvoy_aggregator_http_rejected_total{reason=\"unauthorized\"} 5"),
        "{m}"
    );
    rt.block_on(agg.shutdown());
}

/// Whether the server closes `s` within `within` (reads until EOF or a reset).
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 512];
    let start = Instant::now();
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
        if start.elapsed() > within {
            return false;
        }
    }
}

#[test]
fn connections_are_capped_and_must_send_their_headers_in_time() {
    let rt = runtime(2);
    let cfg = AggregatorConfig::from_yaml(
        "limits: {http_max_connections: 2, http_header_read_timeout_ms: 1500}\nendpoints: []\n",
    )
    .unwrap();
    let source = kvoy_aggregator::source::StaticSource::new(Vec::new());
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    // Two slow clients: half a request head each.
    let mut slow: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(api).unwrap();
            s.write_all(b"GET /healthz HTTP/1.1\r\nhost:").unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = TcpStream::connect(api).unwrap();
    let _ = third.write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n");
    assert!(
        closed_within(&mut third, Duration::from_millis(1000)),
        "a connection over the cap must be closed at once"
    );
    // The slow ones are closed at their header deadline, which frees the slots.
    for s in &mut slow {
        assert!(
            closed_within(s, Duration::from_secs(5)),
            "a connection that never finishes its headers must be closed"
        );
    }
    assert_eq!(get(api, "/healthz", "").0, 200);
    let m = metrics(api);
    assert!(
        m.contains("kvoy_aggregator_http_rejected_total{reason=\"connection_cap\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("kvoy_aggregator_http_rejected_total{reason=\"bad_request\"} 2"),
        "{m}"
    );
    rt.block_on(agg.shutdown());
}

/// A kvoy-sim serving metrics only (no KV events of its own), with `num_gpu_blocks` blocks.
struct MetricsSim {
    addr: SocketAddr,
    _runtime: tokio::runtime::Runtime,
}

fn metrics_sim(num_gpu_blocks: u32) -> MetricsSim {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port().unwrap()));
    let blocks = num_gpu_blocks.to_string();
    MetricsSim {
        addr,
        _runtime: common::serve_sim(addr, &["--model", "m", "--num-gpu-blocks", &blocks]).unwrap(),
    }
}

fn stored(hashes: std::ops::Range<u64>, tokens: usize, block_size: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.map(BlockHash::from_u64).collect(),
        parent_block_hash: None,
        token_ids: (0..tokens as u32).collect(),
        block_size,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        group_idx: None,
    }
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: 1.0,
        events,
        data_parallel_rank: None,
    }
}

#[test]
fn kv_events_are_bounded_and_every_rejection_is_counted_with_its_reason() {
    let sim = metrics_sim(8);
    let publisher = Publisher::start(PublisherConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        ..PublisherConfig::default()
    })
    .unwrap();
    let rt = runtime(2);
    let cfg = AggregatorConfig::from_yaml(
        "scrape_interval_ms: 50
limits: {blocks_per_capacity_block: 2, kv_events_max_message_bytes: 65536}
",
    )
    .unwrap();
    let source = kvoy_aggregator::source::StaticSource::new(vec![spec(
        sim.addr,
        Some(publisher.endpoint().to_owned()),
    )]);
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    let entry = || json(api, "/v1/endpoints", "")["endpoints"][0].clone();
    wait_for("the capacity scraped", || entry()["capacity_blocks"] == 8);
    assert!(publisher.wait_for_subscriptions(1, WAIT));
    // The follower hears of the capacity within a pool tick and a receive poll.
    std::thread::sleep(Duration::from_millis(400));

    // Malformed (3 blocks of 16 from 5 tokens: kept, keyed without tokens), an unknown event,
    // then 40 blocks against a cap of 2 x 8 = 16.
    let first = batch(vec![
        stored(100..103, 5, 16),
        KvEvent::Unknown {
            type_name: "BlockTeleported".into(),
        },
    ]);
    publisher.publish_batch(&first, WireForm::Array).unwrap();
    publisher
        .publish_batch(&batch(vec![stored(0..40, 40 * 4, 4)]), WireForm::Array)
        .unwrap();
    wait_for("both batches applied", || {
        let e = entry();
        e["kv_events"]["batches"] == 2 && e["cached_blocks"]["gpu"].as_u64().unwrap_or(0) >= 16
    });
    let e = entry();
    assert_eq!(e["cached_blocks"]["gpu"], 16, "the block cap: {e:#}");
    let rejected = &e["kv_events"]["rejected"];
    assert_eq!(rejected["block_cap"]["count"], 27, "{rejected:#}");
    assert!(
        rejected["block_cap"]["last"]
            .as_str()
            .unwrap()
            .contains("cap of 16 blocks"),
        "{rejected:#}"
    );
    assert_eq!(rejected["malformed_event"]["count"], 1, "{rejected:#}");
    let why = rejected["malformed_event"]["last"].as_str().unwrap();
    assert!(
        why.contains("3 block hashes")
            && why.contains("block_size 16")
            && why.contains("5 token ids"),
        "the reason names what was wrong: {why}"
    );
    assert!(
        rejected["unknown_event"]["last"]
            .as_str()
            .unwrap()
            .contains("BlockTeleported"),
        "{rejected:#}"
    );

    // A frame over the 64 KiB limit never reaches the index; the drop is counted.
    let huge = batch(vec![KvEvent::Unknown {
        type_name: "x".repeat(256 * 1024),
    }]);
    publisher.publish_batch(&huge, WireForm::Map).unwrap();
    wait_for("the oversized frame refused", || {
        entry()["kv_events"]["rejected"]["publisher_disconnect"]["count"]
            .as_u64()
            .unwrap_or(0)
            >= 1
    });
    let e = entry();
    assert_eq!(e["kv_events"]["batches"], 2, "not applied: {e:#}");
    assert_eq!(e["kv_events"]["rejected"]["unknown_event"]["count"], 1);
    let m = metrics(api);
    let label = format!("endpoint=\"{}\"", sim.addr);
    for (reason, n) in [
        ("block_cap", 27),
        ("malformed_event", 1),
        ("unknown_event", 1),
    ] {
        let line =
            format!("kvoy_aggregator_kv_rejected_total{{{label},reason=\"{reason}\"}} {n}\n");
        assert!(m.contains(&line), "{line}\n{m}");
    }
    rt.block_on(agg.shutdown());
}
