//! The aggregator's online prefill-rate estimate against a live kvoy-sim on 127.0.0.1: a
//! minute of simulated traffic (six seconds at `--speedup 10`), sequential then from four
//! concurrent clients, and the estimate in `/v1/endpoints`, `/metrics` and the format-2
//! snapshot, within 15% of the simulator's configured rate.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvoy_aggregator::config::AggregatorConfig;
use kvoy_aggregator::source::StaticSource;
use kvoy_aggregator::Aggregator;
use kvoy_shared::snapshot::SnapshotDelta;
use kvoy_shared::Rng;
use kvoy_sim::engine::Profile;
use kvoy_sim::server::HttpOptions;

mod common;

const SPEEDUP: f64 = 10.0;
/// A minute of the simulated server's time.
const TRAFFIC: Duration = Duration::from_secs(6);
/// Prompt lengths, uniform (tokens).
const LENGTHS: (usize, usize) = (512, 4096);

/// One simulator (HTTP only) and one aggregator following it.
struct Stack {
    sim: SocketAddr,
    api: SocketAddr,
    _sim_rt: tokio::runtime::Runtime,
    agg_rt: tokio::runtime::Runtime,
    agg: Option<Aggregator>,
}

impl Stack {
    fn start() -> Stack {
        let sim_rt = common::runtime(2);
        let options = HttpOptions {
            models: vec!["m".into()],
            speedup: SPEEDUP,
            max_body_bytes: 1 << 24,
            ..HttpOptions::default()
        };
        let sim = sim_rt.block_on(common::serve_http_sim(Profile::llama_8b_h100(), options));
        let agg_rt = common::runtime(1);
        let cfg =
            AggregatorConfig::from_yaml("scrape_interval_ms: 50\nstale_after_ms: 500\n").unwrap();
        let source = StaticSource::new(vec![common::spec(sim, None)]);
        let agg = common::start_aggregator(&agg_rt, &cfg, source);
        let api = agg.local_addr();
        Stack {
            sim,
            api,
            _sim_rt: sim_rt,
            agg_rt,
            agg: Some(agg),
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(agg) = self.agg.take() {
            self.agg_rt.block_on(agg.shutdown());
        }
    }
}

/// One request with a JSON body: status, body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, Vec<u8>) {
    let json = "content-type: application/json\r\n";
    let (status, _, body) = common::request(addr, method, path, json, body.as_bytes());
    (status, body)
}

/// Cold prompts (4 bytes a token, a unique first block each) from `clients` closed loops for
/// `TRAFFIC`; the lengths sent.
fn traffic(sim: SocketAddr, clients: usize) -> Vec<usize> {
    let lengths = Arc::new(Mutex::new(Vec::new()));
    let next = Arc::new(AtomicUsize::new(0));
    let end = Instant::now() + TRAFFIC;
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (lengths, next) = (lengths.clone(), next.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(c as u64 + 1);
                while Instant::now() < end {
                    let id = next.fetch_add(1, Ordering::Relaxed);
                    let n = LENGTHS.0 + rng.below(LENGTHS.1 - LENGTHS.0 + 1);
                    let prompt = format!("{id:08}") + &"abcd".repeat(n - 2);
                    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1});
                    let (status, _) = http(sim, "POST", "/v1/completions", &body.to_string());
                    assert_eq!(status, 200);
                    lengths.lock().unwrap().push(n);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let v = lengths.lock().unwrap().clone();
    v
}

/// The engine's marginal prefill rate for these prompts (wall clock): linear layers plus
/// attention over the context, fixed per-step costs excluded.
fn expected_rate(lengths: &[usize]) -> f64 {
    let p = Profile::llama_8b_h100();
    let (tokens, seconds) = lengths.iter().fold((0.0, 0.0), |(k, s), &n| {
        let n = n as f64;
        let cost = n / p.prefill_tokens_per_s + p.prefill_attention_s_per_token_pair * n * n / 2.0;
        (k + n, s + cost)
    });
    SPEEDUP * tokens / seconds
}

fn endpoint_json(api: SocketAddr) -> serde_json::Value {
    let (status, body) = http(api, "GET", "/v1/endpoints", "");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["endpoints"][0].clone()
}

/// Runs `clients` loops against a fresh stack; the estimate and what it is compared with.
fn measure(clients: usize) -> (f64, f64, serde_json::Value) {
    let stack = Stack::start();
    let started = Instant::now();
    while endpoint_json(stack.api)["ready"] != true {
        assert!(started.elapsed() < Duration::from_secs(10), "never ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(endpoint_json(stack.api)["prefill_tokens_per_s"].is_null());
    let lengths = traffic(stack.sim, clients);
    // the last requests' figures reach the aggregator with the next scrape
    std::thread::sleep(Duration::from_millis(200));
    let e = endpoint_json(stack.api);
    let estimate = e["prefill_tokens_per_s"]
        .as_f64()
        .unwrap_or_else(|| panic!("no estimate after {} requests: {e:#}", lengths.len()));
    let expected = expected_rate(&lengths);
    eprintln!(
        "{clients} client(s), {} requests: estimate {estimate:.0} tokens/s, expected {expected:.0} \
         ({:+.1}%), configured {:.0} ({:+.1}%); {}",
        lengths.len(),
        100.0 * (estimate / expected - 1.0),
        SPEEDUP * 25_000.0,
        100.0 * (estimate / (SPEEDUP * 25_000.0) - 1.0),
        e["prefill_estimate"]
    );

    // the same figure in /metrics and in format-2 snapshots, not in format-1 ones
    let (_, metrics) = http(stack.api, "GET", "/metrics", "");
    let metrics = String::from_utf8(metrics).unwrap();
    let gauge = format!(
        "kvoy_aggregator_endpoint_prefill_tokens_per_second{{endpoint=\"{}\"}} ",
        stack.sim
    );
    let line = metrics
        .lines()
        .find(|l| l.starts_with(&gauge))
        .unwrap_or_else(|| panic!("no {gauge}"));
    let gauge_value: f64 = line[gauge.len()..].parse().unwrap();
    let snapshot = |query: &str| {
        let (status, body) = http(stack.api, "GET", &format!("/v1/snapshot{query}"), "");
        assert_eq!(status, 200);
        SnapshotDelta::decode(&body).unwrap().upserts[0].prefill_tokens_per_s
    };
    let in_snapshot = snapshot("?format=2").expect("format 2 carries the rate");
    assert_eq!(snapshot(""), None, "format 1 does not");
    // estimates only move by more than 1%: the three readings are the same value
    assert!(
        (gauge_value / estimate - 1.0).abs() < 1e-6,
        "{line} vs {estimate}"
    );
    assert!((f64::from(in_snapshot) / estimate - 1.0).abs() < 1e-6);
    (estimate, expected, e)
}

/// The acceptance: within 15% of the configured rate (25,000 tokens/s x the speedup) after a
/// minute of (simulated) traffic, sequential and concurrent. The comparison with the engine's
/// marginal rate for the prompts sent (attention included) is tighter.
#[test]
fn estimate_is_within_15_percent_of_the_configured_rate() {
    let configured = SPEEDUP * 25_000.0;
    for clients in [1, 4] {
        let (estimate, expected, e) = measure(clients);
        assert!(
            (estimate / configured - 1.0).abs() < 0.15,
            "{clients} client(s): {estimate} vs configured {configured}: {e:#}"
        );
        // Real time at a speedup: a busy machine (other tests, builds) slows the simulator's
        // steps and the estimate with them; 15% here too (seen: -11% with two other jobs on
        // two cores, -3% to -6% on an idle machine).
        assert!(
            (estimate / expected - 1.0).abs() < 0.15,
            "{clients} client(s): {estimate} vs expected {expected}: {e:#}"
        );
        let concurrency = e["prefill_estimate"]["concurrency"].as_f64().unwrap();
        if clients == 1 {
            assert!(concurrency < 1.05, "{e:#}");
        } else {
            assert!(concurrency > 1.5, "prefills overlapped: {e:#}");
        }
    }
}
