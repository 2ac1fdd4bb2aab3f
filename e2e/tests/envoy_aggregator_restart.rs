//! End to end, a restarted kvoy-aggregator and an authenticated one: a real Envoy
//! (`envoy/kvoy.yaml`, `--concurrency 2`) with the built filters (`kvoy_prefix_affinity` and
//! `kvoy_admission` both following the aggregator), two in-process kvoy-sim simulators and
//! in-process aggregators, all on 127.0.0.1.
//!
//! - An aggregator restarted against a discovery source that accepts connections and never
//!   answers (a Kubernetes API server that hangs) answers `/v1/snapshot` with 503 not-loaded;
//!   the filters keep routing on the last good pool, then on their static endpoints once it
//!   is older than `snapshot_max_age_ms`. No request fails meanwhile.
//! - With a token, the aggregator refuses polls without it and the filters poll with the token
//!   from their configuration (`aggregator.token`): the live pool is in use.
//!
//! Needs `envoy` on PATH and the release wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{
    http::{self, Response},
    wait_for, PoolEndpoint, Stack, StackConfig,
};
use serde_json::{json, Value};

const MODEL: &str = "kvoy-demo";
const TIMEOUT: Duration = Duration::from_secs(30);
const TOKEN: &str = "e2e-token-0123456789abcdef";

fn sims() -> SimFleet {
    SimFleet::loopback(2, &["--model", MODEL, "--speedup", "10"]).unwrap()
}

fn request(envoy: SocketAddr, i: usize) -> Result<Response, String> {
    let prompt = format!("request {i}: tell me something new. ").repeat(8);
    let body = serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": prompt}]}))
    .unwrap();
    http::post_json(envoy, "/v1/chat/completions", &[], &body, TIMEOUT).map_err(|e| e.to_string())
}

fn served(r: &Response) -> String {
    r.header(kvoy_testkit::SERVED_BY_HEADER)
        .unwrap_or("?")
        .to_owned()
}

fn get(agg: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    http::send(agg, "GET", path, headers, b"", Duration::from_secs(5)).unwrap()
}

fn aggregator_metrics(agg: SocketAddr) -> String {
    get(agg, "/metrics", &[]).text()
}

/// The value of one sample line of `/metrics` (0 when absent).
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Both filters follow the aggregator; `aggregator` adds fields to their `aggregator` section.
fn stack_config(fleet: &SimFleet, agg: SocketAddr, aggregator: Value, dir: PathBuf) -> StackConfig {
    let mut settings = json!({"cluster": kvoy_testkit::AGGREGATOR_CLUSTER});
    if let (Some(s), Some(extra)) = (settings.as_object_mut(), aggregator.as_object()) {
        s.extend(extra.clone());
    }
    // The static pool, the fallback, is the first simulator only.
    let mut config = StackConfig::new(vec![PoolEndpoint::new(fleet.addrs()[0], &[MODEL])], dir);
    config.aggregator = Some(agg);
    config.extra_config = Some(json!({"aggregator": settings}));
    config.admission_config =
        Some(json!({"endpoints": 2, "aggregator": settings.clone()}).to_string());
    config
}

/// 40 requests; how many each simulator served (every one must succeed).
fn spread(envoy: SocketAddr, first: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for i in first..first + 40 {
        let r = request(envoy, i).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        *seen.entry(served(&r)).or_insert(0) += 1;
    }
    seen
}

/// A TCP listener that accepts connections and never answers (a hung API server).
fn silent_listener() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(10_000) {
            let Ok(s) = stream else { break };
            held.push(s);
        }
    });
    addr
}

#[test]
fn a_restarted_aggregator_that_is_not_loaded_yet_fails_no_request() {
    const NAME: &str = "aggregator-restart";
    let fleet = sims();
    let addrs: Vec<String> = fleet.addrs().iter().map(ToString::to_string).collect();
    let dir = common::run_dir(NAME);
    let yaml = aggregator_yaml(
        "scrape_interval_ms: 50\n",
        &AggregatedEndpoint::scraped(fleet.addrs(), MODEL),
    );
    let mut agg = LocalAggregator::start(
        &dir.join("aggregator.yaml"),
        &yaml,
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let agg_addr = agg.addr();
    let max_age_ms = 2500u64;
    let config = stack_config(
        &fleet,
        agg_addr,
        json!({"snapshot_max_age_ms": max_age_ms}),
        dir.clone(),
    );
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{NAME}] {e:#}"));
    wait_for("both simulators ready", Duration::from_secs(10), || {
        get(agg_addr, "/v1/endpoints", &[]).json().unwrap()["pool"]["ready"] == 2
    });
    std::thread::sleep(Duration::from_millis(500));
    let seen = spread(stack.listen, 0);
    eprintln!("[{NAME}] on the live pool: {seen:?}");
    assert_eq!(seen.len(), 2, "the live pool has both simulators: {seen:?}");
    // A prompt sim 1 (not in the static pool) holds: sent again, its prefix keeps it there
    // for as long as sim 1 is in the pool the filter uses, whatever the loads it last saw
    // (unrelated prompts would follow those loads, and a stale figure can make them all pick
    // sim 0).
    let on_sim1 = (500..540)
        .find(|&k| served(&request(stack.listen, k).unwrap()) == addrs[1])
        .unwrap_or_else(|| panic!("[{NAME}] no request reached sim 1 in 40"));

    // The restart: the new aggregator's discovery hangs, so it never loads.
    agg.kill();
    let killed = Instant::now();
    let hung = silent_listener();
    let k8s_yaml = format!(
        "reload_interval_ms: 100
kubernetes:
  inference_pool: llama-pool
  namespace: llm
  api_server: http://{hung}
  token_file: ''
  models: [{MODEL}]
  request_timeout_ms: 300
"
    );
    let mut restarted = None;
    wait_for(
        "the aggregator port free again",
        Duration::from_secs(10),
        || {
            restarted =
                LocalAggregator::start(&dir.join("aggregator-k8s.yaml"), &k8s_yaml, agg_addr).ok();
            restarted.is_some()
        },
    );
    let agg = restarted.unwrap();
    let (status, body) = {
        let r = get(agg_addr, "/v1/snapshot", &[]);
        (r.status, r.text())
    };
    eprintln!("[{NAME}] restarted aggregator: /v1/snapshot {status} {body:?}");

    // Traffic through the restart: first on the last good pool, then on the static one.
    let mut outcomes = Vec::new();
    let run = Duration::from_millis(max_age_ms + 2500);
    while killed.elapsed() < run && outcomes.len() < 2000 {
        let t = killed.elapsed();
        outcomes.push((t, request(stack.listen, on_sim1)));
    }
    let failed: Vec<_> = outcomes
        .iter()
        .filter(|(_, o)| !matches!(o, Ok(r) if r.status == 200))
        .map(|(t, o)| match o {
            Ok(r) => format!("at {t:?}: {} {}", r.status, r.text()),
            Err(e) => format!("at {t:?}: {e}"),
        })
        .collect();
    assert!(
        failed.is_empty(),
        "[{NAME}] {} of {} requests failed while the aggregator was not loaded, first: {}",
        failed.len(),
        outcomes.len(),
        failed[0]
    );
    let early: BTreeMap<String, usize> = outcomes
        .iter()
        .filter(|(t, _)| *t < Duration::from_millis(max_age_ms / 2))
        .fold(BTreeMap::new(), |mut m, (_, o)| {
            *m.entry(served(o.as_ref().unwrap())).or_insert(0) += 1;
            m
        });
    let late: BTreeMap<String, usize> = outcomes
        .iter()
        .filter(|(t, _)| *t > Duration::from_millis(max_age_ms + 1000))
        .fold(BTreeMap::new(), |mut m, (_, o)| {
            *m.entry(served(o.as_ref().unwrap())).or_insert(0) += 1;
            m
        });
    eprintln!(
        "[{NAME}] {} requests after the restart; early (last good pool) {early:?}, late (static pool) {late:?}",
        outcomes.len()
    );
    assert!(
        early.contains_key(&addrs[1]),
        "the last good pool (both simulators) stays in use at first: {early:?}"
    );
    assert_eq!(
        late.keys().cloned().collect::<Vec<_>>(),
        [addrs[0].clone()],
        "after snapshot_max_age_ms the static pool (simulator 0) is used"
    );
    let m = aggregator_metrics(agg_addr);
    let not_loaded = sample(
        &m,
        "kvoy_aggregator_snapshot_requests_total{kind=\"not_loaded\"}",
    );
    assert!(
        not_loaded > 0.0,
        "the filters polled the restarted aggregator and were told it is not loaded"
    );
    assert_eq!(sample(&m, "kvoy_aggregator_loaded"), 0.0);
    stack.assert_no_wasm_failures(NAME);
    drop(stack);
    drop(agg);
    drop(fleet);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_filters_poll_with_the_aggregators_token() {
    const NAME: &str = "aggregator-token";
    let fleet = sims();
    let dir = common::run_dir(NAME);
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let yaml = aggregator_yaml(
        &format!(
            "scrape_interval_ms: 50\napi_token_file: {}\n",
            token_file.display()
        ),
        &AggregatedEndpoint::scraped(fleet.addrs(), MODEL),
    );
    let agg = LocalAggregator::start(
        &dir.join("aggregator.yaml"),
        &yaml,
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let agg_addr = agg.addr();
    assert_eq!(get(agg_addr, "/v1/snapshot", &[]).status, 401);
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("authorization", bearer.as_str())];
    wait_for("both simulators ready", Duration::from_secs(10), || {
        get(agg_addr, "/v1/endpoints", &auth).json().unwrap()["pool"]["ready"] == 2
    });
    let config = stack_config(&fleet, agg_addr, json!({"token": TOKEN}), dir.clone());
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{NAME}] {e:#}"));
    let before = sample(
        &aggregator_metrics(agg_addr),
        "kvoy_aggregator_http_rejected_total{reason=\"unauthorized\"}",
    );
    wait_for(
        "the filters' first snapshot",
        Duration::from_secs(10),
        || {
            sample(
                &aggregator_metrics(agg_addr),
                "kvoy_aggregator_snapshot_requests_total{kind=\"full\"}",
            ) >= 1.0
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    let seen = spread(stack.listen, 0);
    eprintln!("[{NAME}] with the token: {seen:?}");
    assert_eq!(
        seen.len(),
        2,
        "the live pool (both simulators, the static pool has one) is in use: {seen:?}"
    );
    let after = sample(
        &aggregator_metrics(agg_addr),
        "kvoy_aggregator_http_rejected_total{reason=\"unauthorized\"}",
    );
    assert_eq!(after, before, "no poll of the filters was refused");
    stack.assert_no_wasm_failures(NAME);
    drop(stack);
    drop(agg);
    drop(fleet);
    let _ = std::fs::remove_dir_all(&dir);
}
