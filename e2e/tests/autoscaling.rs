//! The autoscaling signal of `deploy/autoscaling/`: kvoy-aggregator's pool saturation, scraped
//! the way Prometheus scrapes it, crosses the KEDA ScaledObject's threshold within a few scrape
//! intervals of a flood starting and falls back below it after the flood.
//!
//! The numbers come from the manifests, so the test and the deployment cannot drift: the
//! saturation and queue-depth thresholds from `keda-scaledobject.yaml` (and the HPA of
//! `hpa.yaml` must say the same, through metric names `prometheus-adapter.yaml` defines), the
//! scrape interval from the aggregator's job in `prometheus-scrape.yaml`. The simulators run at
//! `SPEEDUP` times real time, so the test scrapes at that interval divided by `SPEEDUP`: the
//! same number of scrapes per unit of the servers' work as in a cluster.
//!
//! No Envoy: two kvoy-sim simulators and an in-process aggregator on 127.0.0.1, the flood sent
//! to the simulators directly (what an autoscaler sees does not depend on who routed).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::yaml_docs;
use serde_json::{json, Value};

use common::AggregatorReads;
use kvoy_aggregator::local::AggregatedEndpoint;
use kvoy_aggregator::prom;
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{http, workspace_root};

const MODEL: &str = "m";
/// Simulated time runs this many times faster than real time.
const SPEEDUP: u32 = 10;
/// Sequences each simulator runs at once; the rest wait in its queue (what saturation sees).
const MAX_NUM_SEQS: u32 = 4;
/// Clients in flight at once over the two simulators: 12 each, 8 of them queued.
const CLIENTS: usize = 24;
/// The flood is bounded in count and in time (whichever ends it first).
const FLOOD_MAX_REQUESTS: usize = 400;
const FLOOD_SCRAPES: u32 = 8;
const OUTPUT_TOKENS: u32 = 400;
/// The ScaledObject's minimum: the replicas the pool has in the test (two simulators).
const REPLICAS: f64 = 2.0;
/// Scrapes allowed for the gauge to cross the threshold after the flood starts, and to fall
/// back below it after the flood's last request was sent (the queues must drain first).
const CROSS_WITHIN_SCRAPES: usize = 3;
const FALL_WITHIN_SCRAPES: usize = 6;

fn manifest(file: &str, kind: &str) -> Value {
    let path = workspace_root().join("deploy/autoscaling").join(file);
    yaml_docs(&path)
        .into_iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("{}: no {kind}", path.display()))
}

/// A Kubernetes quantity as the HPA's targets write it (`800m`, `4`, `1.5`).
fn quantity(v: &Value) -> f64 {
    let s = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
    match s.strip_suffix('m') {
        Some(milli) => milli.parse::<f64>().unwrap() / 1000.0,
        None => s.parse().unwrap(),
    }
}

/// What the autoscaling manifests say, checked against each other.
#[derive(Debug)]
struct Policy {
    saturation_threshold: f64,
    queue_depth_per_replica: f64,
    min_replicas: f64,
    /// The aggregator job's scrape interval in the cluster.
    scrape_interval: Duration,
}

/// The KEDA trigger whose query reads `metric`: (metricType, threshold).
fn keda_trigger(scaled: &Value, metric: &str) -> (String, f64) {
    let trigger = scaled["spec"]["triggers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| {
            t["type"] == "prometheus"
                && t["metadata"]["query"]
                    .as_str()
                    .is_some_and(|q| q.contains(&format!("{metric}{{")))
        })
        .unwrap_or_else(|| panic!("no prometheus trigger on {metric}"));
    (
        trigger["metricType"].as_str().unwrap().to_owned(),
        quantity(&trigger["metadata"]["threshold"]),
    )
}

/// The HPA's external metric that prometheus-adapter's rules serve from `series`:
/// (target type, target value).
fn hpa_target(hpa: &Value, adapter_rules: &Value, series: &str) -> (String, f64) {
    let rule = adapter_rules["externalRules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| {
            r["seriesQuery"]
                .as_str()
                .is_some_and(|q| q.starts_with(&format!("{series}{{")))
        })
        .unwrap_or_else(|| panic!("prometheus-adapter has no rule for {series}"));
    let name = rule["name"]["as"].as_str().unwrap();
    let metric = hpa["spec"]["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["type"] == "External" && m["external"]["metric"]["name"] == name)
        .unwrap_or_else(|| panic!("the HPA reads no external metric {name} (for {series})"));
    let target = &metric["external"]["target"];
    let kind = target["type"].as_str().unwrap().to_owned();
    let value = match kind.as_str() {
        "Value" => quantity(&target["value"]),
        "AverageValue" => quantity(&target["averageValue"]),
        other => panic!("unexpected target type {other}"),
    };
    (kind, value)
}

fn policy() -> Policy {
    let scaled = manifest("keda-scaledobject.yaml", "ScaledObject");
    let hpa = manifest("hpa.yaml", "HorizontalPodAutoscaler");
    let adapter = manifest("prometheus-adapter.yaml", "ConfigMap");
    let adapter: Value =
        serde_yaml_ng::from_str(adapter["data"]["config.yaml"].as_str().unwrap()).unwrap();
    let scrape = manifest("prometheus-scrape.yaml", "ConfigMap");
    let scrape: Value =
        serde_yaml_ng::from_str(scrape["data"]["kvoy-scrape.yml"].as_str().unwrap()).unwrap();

    let (sat_kind, saturation_threshold) = keda_trigger(&scaled, "kvoy_aggregator_pool_saturation");
    let (queue_kind, queue_depth_per_replica) =
        keda_trigger(&scaled, "kvoy_aggregator_pool_queue_depth");
    // Saturation is a mean over endpoints already (Value); queue depth is a pool total that
    // the HPA divides by the replicas (AverageValue).
    assert_eq!(
        (sat_kind.as_str(), queue_kind.as_str()),
        ("Value", "AverageValue")
    );
    assert_eq!(
        hpa_target(&hpa, &adapter, "kvoy_aggregator_pool_saturation"),
        (sat_kind, saturation_threshold),
        "hpa.yaml and keda-scaledobject.yaml disagree on saturation"
    );
    assert_eq!(
        hpa_target(&hpa, &adapter, "kvoy_aggregator_pool_queue_depth"),
        (queue_kind, queue_depth_per_replica),
        "hpa.yaml and keda-scaledobject.yaml disagree on queue depth"
    );
    let min_replicas = scaled["spec"]["minReplicaCount"].as_f64().unwrap();
    assert_eq!(hpa["spec"]["minReplicas"].as_f64(), Some(min_replicas));
    assert_eq!(
        hpa["spec"]["maxReplicas"],
        scaled["spec"]["maxReplicaCount"]
    );
    assert_eq!(
        hpa["spec"]["scaleTargetRef"],
        scaled["spec"]["scaleTargetRef"]
    );
    // Below the admission stage's saturation point (1.0), above idle.
    assert!(
        saturation_threshold > 0.0 && saturation_threshold < 1.0,
        "{saturation_threshold}"
    );

    let job = scrape["scrape_configs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job_name"] == "kvoy-aggregator")
        .expect("prometheus-scrape.yaml has no kvoy-aggregator job");
    // The triggers select the job by its name.
    let query = scaled["spec"]["triggers"][0]["metadata"]["query"]
        .as_str()
        .unwrap();
    assert!(query.contains("job=\"kvoy-aggregator\""), "{query}");
    assert_eq!(job["metrics_path"], "/metrics");
    // The proxies' job keeps Envoy's kvoy_* series: Envoy writes the filters' stats
    // (`wasmcustom.kvoy_...` inside) to /stats/prometheus as `kvoy_...`, no `envoy_` prefix.
    let envoy = scrape["scrape_configs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job_name"] == "kvoy-envoy")
        .expect("prometheus-scrape.yaml has no kvoy-envoy job");
    assert_eq!(envoy["metrics_path"], "/stats/prometheus");
    assert_eq!(envoy["metric_relabel_configs"][0]["regex"], "kvoy_.*");
    assert_eq!(envoy["metric_relabel_configs"][0]["action"], "keep");
    let interval = job["scrape_interval"].as_str().unwrap();
    let seconds: u64 = interval.strip_suffix('s').unwrap().parse().unwrap();
    Policy {
        saturation_threshold,
        queue_depth_per_replica,
        min_replicas,
        scrape_interval: Duration::from_secs(seconds),
    }
}

/// What the HPA would ask for from one reading: the larger recommendation of the two
/// triggers, within [min, 16] (HPA: Value -> ceil(replicas x value / target), AverageValue ->
/// ceil(total / target)).
fn desired_replicas(p: &Policy, s: &Scrape) -> f64 {
    let by_saturation = (REPLICAS * s.saturation / p.saturation_threshold).ceil();
    let by_queue = (s.queue_depth / p.queue_depth_per_replica).ceil();
    by_saturation.max(by_queue).clamp(p.min_replicas, 16.0)
}

/// One scrape of the aggregator's /metrics.
#[derive(Clone, Debug)]
struct Scrape {
    at: Duration,
    saturation: f64,
    queue_depth: f64,
    running: f64,
    ready: f64,
}

fn scrape(aggregator: SocketAddr, at: Duration) -> Scrape {
    let r = http::get(aggregator, "/metrics", Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200);
    let text = r.text();
    let value = |name: &str| -> f64 {
        prom::samples(&text)
            .filter_map(Result::ok)
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
            .value
    };
    Scrape {
        at,
        saturation: value("kvoy_aggregator_pool_saturation"),
        queue_depth: value("kvoy_aggregator_pool_queue_depth"),
        running: value("kvoy_aggregator_pool_running_requests"),
        ready: value("kvoy_aggregator_pool_ready_endpoints"),
    }
}

#[test]
fn the_manifests_agree_on_the_thresholds() {
    let p = policy();
    eprintln!("[autoscaling] {p:?}");
    assert_eq!(p.scrape_interval, Duration::from_secs(5));
}

#[test]
fn saturation_crosses_the_scaled_object_threshold_under_a_flood_and_falls_back() {
    let p = policy();
    let interval = p.scrape_interval / SPEEDUP;
    let speedup = SPEEDUP.to_string();
    let seqs = MAX_NUM_SEQS.to_string();
    let fleet = SimFleet::loopback(
        2,
        &[
            "--model",
            MODEL,
            "--speedup",
            &speedup,
            "--max-num-seqs",
            &seqs,
        ],
    )
    .unwrap();
    let sims = fleet.addrs().to_vec();
    let dir = common::run_dir("autoscaling");
    let aggregator = common::start_aggregator(
        &dir,
        "scrape_interval_ms: 50\nstale_after_ms: 1000\n",
        &AggregatedEndpoint::scraped(&sims, MODEL),
    );
    aggregator.wait_ready(2, Duration::from_secs(10));
    eprintln!(
        "[autoscaling] saturation threshold {} (Value), queue depth {} per replica \
         (AverageValue), Prometheus every {:?} = every {interval:?} at {SPEEDUP}x",
        p.saturation_threshold, p.queue_depth_per_replica, p.scrape_interval
    );

    let start = Instant::now();
    let mut series: Vec<Scrape> = Vec::new();
    let tick = |series: &mut Vec<Scrape>| {
        // Fixed-rate scrapes, as Prometheus does: the next one is due a whole interval after
        // the previous was due, however long the scrape took.
        let due = interval * series.len() as u32;
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        series.push(scrape(aggregator.addr(), start.elapsed()));
    };

    // Idle.
    for _ in 0..3 {
        tick(&mut series);
    }
    let idle = series.len();

    // The flood: CLIENTS at once, each sending its next request as soon as the last one ended,
    // until FLOOD_MAX_REQUESTS were sent or FLOOD_SCRAPES intervals passed.
    let flood_start = start.elapsed();
    let flood_end = flood_start + interval * FLOOD_SCRAPES;
    let sent = Arc::new(AtomicUsize::new(0));
    let statuses = Arc::new(Mutex::new(Vec::<u16>::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (sent, statuses) = (sent.clone(), statuses.clone());
            let sim = sims[c % sims.len()];
            std::thread::spawn(move || loop {
                if start.elapsed() >= flood_end {
                    return;
                }
                let n = sent.fetch_add(1, Ordering::Relaxed);
                if n >= FLOOD_MAX_REQUESTS {
                    return;
                }
                let body = json!({"model": MODEL, "max_tokens": OUTPUT_TOKENS,
                    "prompt": format!("flood request {n}: write a long story. ")});
                let status = http::post_json(
                    sim,
                    "/v1/completions",
                    &[],
                    body.to_string().as_bytes(),
                    Duration::from_secs(60),
                )
                .map_or(0, |r| r.status);
                statuses.lock().unwrap().push(status);
            })
        })
        .collect();
    // A scrape counts as the flood's only if it is due well before the flood ends: `tick`
    // sleeps until the scrape is due, so testing the clock before it would let one scrape land
    // after the clients stopped.
    while interval * series.len() as u32 + interval / 2 <= flood_end {
        tick(&mut series);
    }
    let flood_scrapes = series.len();
    // After the flood: scrape while the queues drain, a bounded number of intervals.
    for _ in 0..FALL_WITHIN_SCRAPES + 3 {
        tick(&mut series);
    }
    for c in clients {
        c.join().unwrap();
    }
    let statuses = statuses.lock().unwrap().clone();
    let requests = statuses.len();
    let failed = statuses.iter().filter(|s| **s != 200).count();

    eprintln!(
        "[autoscaling] scrape  t (ms)  phase  saturation  queue  running  ready  desired replicas"
    );
    for (i, s) in series.iter().enumerate() {
        let phase = if i < idle {
            "idle"
        } else if i < flood_scrapes {
            "flood"
        } else {
            "after"
        };
        eprintln!(
            "[autoscaling] {i:>6}  {:>6}  {phase:<5}  {:>10.3}  {:>5}  {:>7}  {:>5}  {:>16}",
            s.at.as_millis(),
            s.saturation,
            s.queue_depth,
            s.running,
            s.ready,
            desired_replicas(&p, s)
        );
    }
    eprintln!(
        "[autoscaling] flood: {requests} requests ({failed} failed) from {} to {} ms",
        flood_start.as_millis(),
        flood_end.as_millis()
    );
    assert_eq!(failed, 0, "flood requests failed: {statuses:?}");
    assert!(
        requests < FLOOD_MAX_REQUESTS,
        "the flood ran out of requests before its time"
    );

    let threshold = p.saturation_threshold;
    for s in &series[..idle] {
        assert!(
            s.saturation < threshold,
            "idle pool above the threshold: {s:?}"
        );
        assert_eq!(
            (s.ready, desired_replicas(&p, s)),
            (REPLICAS, p.min_replicas)
        );
    }
    let flood = &series[idle..flood_scrapes];
    let crossed = flood
        .iter()
        .position(|s| s.saturation > threshold)
        .unwrap_or_else(|| panic!("saturation never crossed {threshold} during the flood"));
    assert!(
        crossed < CROSS_WITHIN_SCRAPES,
        "saturation crossed {threshold} only at the flood's scrape {}",
        crossed + 1
    );
    // Once crossed it stays above while the flood lasts: the autoscaler sees a steady signal.
    for s in &flood[crossed..] {
        assert!(s.saturation > threshold, "dipped during the flood: {s:?}");
        assert!(
            desired_replicas(&p, s) > REPLICAS,
            "no scale-up asked: {s:?}"
        );
        assert!(
            s.queue_depth / REPLICAS > p.queue_depth_per_replica,
            "{s:?}"
        );
    }
    let after = &series[flood_scrapes..];
    let fell = after
        .iter()
        .position(|s| s.saturation < threshold)
        .unwrap_or_else(|| panic!("saturation stayed above {threshold} after the flood"));
    assert!(
        fell < FALL_WITHIN_SCRAPES,
        "saturation fell below {threshold} only at scrape {} after the flood",
        fell + 1
    );
    for s in &after[fell..] {
        assert!(
            s.saturation < threshold,
            "rose again after the flood: {s:?}"
        );
    }
    let last = series.last().unwrap();
    assert_eq!(
        (last.queue_depth, last.running, desired_replicas(&p, last)),
        (0.0, 0.0, p.min_replicas)
    );
    let peak = flood.iter().map(|s| s.saturation).fold(0.0, f64::max);
    eprintln!(
        "[autoscaling] crossed {threshold} at flood scrape {}, peak {peak:.3}, back below at \
         scrape {} after the flood",
        crossed + 1,
        fell + 1
    );
    let _ = std::fs::remove_dir_all(&dir);
}
