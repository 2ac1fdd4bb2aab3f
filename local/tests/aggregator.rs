//! The filters' aggregator polls under kvoy-local: `serve` sends them for real to the configured
//! cluster address (a live kvoy-aggregator following kvoy-sim simulators), and `decide
//! --snapshot` answers them with a snapshot file.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
use kvoy_local::decide::{decide, DecideOptions, Outcome};
use kvoy_local::request::Request;
use kvoy_shared::snapshot::{EndpointStatus, SnapshotHistory};
use kvoy_sim::fleet::SimFleet;
use serde_json::json;

const MODEL: &str = "kvoy-demo";

#[test]
fn serve_polls_a_live_aggregator_through_its_cluster() {
    let _serial = common::serial();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let sims = SimFleet::loopback(2, &["--model", MODEL, "--speedup", "20"]).unwrap();
    let endpoints = AggregatedEndpoint::scraped(sims.addrs(), MODEL);
    let dir = common::run_dir("serve_aggregator");
    let aggregator = LocalAggregator::start(
        &dir.join("aggregator.yaml"),
        &aggregator_yaml("scrape_interval_ms: 50\n", &endpoints),
        any,
    )
    .unwrap();
    // No static endpoints: only the aggregator's pool can route.
    let prefix = json!({"aggregator": {"cluster": "kvoy_aggregator", "poll_interval_ms": 50},
            "allowed_destinations": [{"cidr": "127.0.0.0/8"}, {"cidr": "10.0.0.0/8"}]})
    .to_string();
    let mut config = common::chain_config("{}", &json!({"endpoints": 2}).to_string(), &prefix, 2);
    config["clusters"] = json!({"kvoy_aggregator": aggregator.addr().to_string()});
    let server = common::serve("serve_aggregator", &config);
    let start = Instant::now();
    loop {
        let stats = common::local_stats(&server);
        if stats.get("kvoy_prefix_affinity_pool_live") == Some(&1)
            && stats.get("kvoy_prefix_affinity_pool_endpoints") == Some(&2)
        {
            eprintln!(
                "[serve_aggregator] live pool after {:?}: {stats:?}",
                start.elapsed()
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no live pool: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let members: Vec<String> = sims.addrs().iter().map(ToString::to_string).collect();
    let body = kvoy_testkit::requests::chat_body(
        MODEL,
        &kvoy_testkit::requests::prompt("live", 2048),
        "hi",
    );
    let r = kvoy_testkit::http::post_json(
        server.addr(),
        "/v1/chat/completions",
        &[],
        &body,
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    kvoy_testkit::served_by(&r, &members, "serve_aggregator", "through the live pool");
    let stats = common::local_stats(&server);
    assert!(stats["kvoy_prefix_affinity_snapshot_polls_total"] > 0);
}

#[test]
fn decide_routes_over_a_snapshot_file() {
    let status = |slot: u16, port: u16, waiting: u32| EndpointStatus {
        slot,
        address: ([10, 0, 0, 1], port).into(),
        models: vec![MODEL.into()],
        ready: true,
        stale: false,
        waiting,
        running: 1,
        kv_cache_usage: 0.25,
        block_size: 16,
        capacity_blocks: 1000,
        cached_blocks: [0, 0, 0],
        cache_generation: 1,
        prefix_hit_rate: None,
        prefill_tokens_per_s: None,
        role: kvoy_shared::Role::Decode,
    };
    let mut history = SnapshotHistory::new(42);
    history.update(vec![status(0, 8000, 6), status(1, 8001, 0)]);
    let mut snapshot = Vec::new();
    history.snapshot().encode(&mut snapshot);

    // A static fallback pool that must not be used once the snapshot is in.
    let prefix = json!({"endpoints": [{"address": "127.0.0.1:9", "models": [MODEL]}],
        "aggregator": {"cluster": "kvoy_aggregator"},
        "allowed_destinations": [{"cidr": "127.0.0.0/8"}, {"cidr": "10.0.0.0/8"}]})
    .to_string();
    let (config, _) = common::load(
        "decide_snapshot",
        &common::chain_config("{}", &json!({"endpoints": 1}).to_string(), &prefix, 1),
    );
    let requests = Request::parse(
        &json!({"body": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}})
            .to_string(),
        "r.json".as_ref(),
    )
    .unwrap();
    let options = DecideOptions {
        snapshot: Some(snapshot),
        no_response: false,
    };
    let reports = decide(&config, &requests, &options).unwrap();
    let report = &reports[0];
    // The shorter queue of the live pool.
    assert_eq!(
        report.outcome,
        Outcome::Routed {
            endpoint: "10.0.0.1:8001".into()
        }
    );
    let scores = report.scores.as_ref().unwrap();
    assert!(scores.pool_live);
    assert_eq!(scores.rows.len(), 2);
    assert!(scores.rows.iter().all(|r| r.kv_cache_usage == Some(0.25)));
    assert_eq!(scores.rows[1].waiting, Some(0));
    assert!(scores.rows[1].best && !scores.rows[0].best);
}
