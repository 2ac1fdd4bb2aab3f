//! The aggregator against real kvoy-sim simulators on 127.0.0.1: metrics scraping, KV events
//! over ZMQ (live, replayed for a late join, after a reset and a publisher restart), the
//! snapshot API (full and incremental), `/v1/endpoints`, `/metrics`, health, and a killed
//! simulator going not-ready.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvoy_aggregator::config::{AggregatorConfig, EndpointSpec};
use kvoy_aggregator::prom;
use kvoy_aggregator::source::StaticSource;
use kvoy_shared::snapshot::{Snapshot, SnapshotDelta, CONTENT_TYPE};
use kvoy_testkit::{free_port, wait_for};

mod common;
use common::{kv_source, runtime, start_aggregator, Scratch};

/// One simulator with its own runtime, so that dropping it kills just this one.
struct Sim {
    addr: SocketAddr,
    kv: String,
    replay: String,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Sim {
    fn start(addr: SocketAddr, kv: &str, replay: &str) -> Sim {
        Self::try_start(addr, kv, replay).unwrap()
    }

    /// Starts a simulator; the ports may still be held by one just killed, so callers retry.
    fn try_start(addr: SocketAddr, kv: &str, replay: &str) -> Result<Sim, String> {
        let args = [
            "--model",
            "m",
            "--speedup",
            "20",
            "--kv-events-endpoint",
            kv,
            "--kv-events-replay-endpoint",
            replay,
        ];
        let runtime = common::serve_sim(addr, &args)?;
        Ok(Sim {
            addr,
            kv: kv.to_owned(),
            replay: replay.to_owned(),
            runtime: Some(runtime),
        })
    }

    fn new_on_free_ports() -> Sim {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port().unwrap()));
        let kv = format!("tcp://127.0.0.1:{}", free_port().unwrap());
        let replay = format!("tcp://127.0.0.1:{}", free_port().unwrap());
        Sim::start(addr, &kv, &replay)
    }

    fn spec(&self) -> EndpointSpec {
        common::spec(self.addr, Some(kv_source(&self.kv, Some(&self.replay))))
    }

    fn kill(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One request with a JSON body: status, head, body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, Vec<u8>) {
    let json = "content-type: application/json\r\n";
    common::request(addr, method, path, json, body.as_bytes())
}

fn snapshot(agg: SocketAddr, query: &str) -> (SnapshotDelta, usize) {
    let (status, head, body) = http(agg, "GET", &format!("/v1/snapshot{query}"), "");
    assert_eq!(status, 200);
    assert!(head.contains(CONTENT_TYPE), "{head}");
    (SnapshotDelta::decode(&body).unwrap(), body.len())
}

fn current(agg: SocketAddr) -> Snapshot {
    let mut s = Snapshot::default();
    s.apply(snapshot(agg, "").0).unwrap();
    s
}

fn complete(sim: SocketAddr, prompt: &str) {
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 2}).to_string();
    let (status, _, _) = http(sim, "POST", "/v1/completions", &body);
    assert_eq!(status, 200);
}

/// Sends fresh prompts to `sim` (every half second, for up to 20 s) until `f` holds. A SUB
/// socket only receives once its subscription reached the publisher (ZMQ's slow joiner),
/// which on a loaded machine can be after the first message.
fn publish_until(sim: SocketAddr, what: &str, mut f: impl FnMut() -> bool) {
    let mut sent_at: Option<Instant> = None;
    let mut nth = 0;
    wait_for(what, Duration::from_secs(20), || {
        if sent_at.is_none_or(|t| t.elapsed() > Duration::from_millis(500)) {
            nth += 1;
            complete(
                sim,
                &format!("a fresh prompt {nth} to publish one more batch ").repeat(8),
            );
            sent_at = Some(Instant::now());
        }
        f()
    });
}

fn config() -> AggregatorConfig {
    AggregatorConfig::from_yaml("scrape_interval_ms: 50\nstale_after_ms: 500\n").unwrap()
}

#[test]
fn follows_simulators_and_serves_snapshots() {
    let mut sims = [Sim::new_on_free_ports(), Sim::new_on_free_ports()];
    // Work done before the aggregator exists is learned through the replay socket.
    let prompt = "alpha beta gamma delta ".repeat(40);
    complete(sims[0].addr, &prompt);

    let rt = runtime(2);
    let cfg = config();
    let source = StaticSource::new(sims.iter().map(Sim::spec).collect());
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    assert_eq!(http(api, "GET", "/healthz", "").0, 200);
    wait_for("readyz", Duration::from_secs(10), || {
        http(api, "GET", "/readyz", "").0 == 200
    });
    wait_for("both endpoints ready", Duration::from_secs(10), || {
        let s = current(api);
        s.endpoints.len() == 2 && s.endpoints.iter().all(|e| e.ready && !e.stale)
    });
    // The follower replayed the server's buffered history as it connected, before the
    // aggregator answered ready: the first snapshot has it, with no new traffic.
    let caught_up = current(api);
    assert!(
        caught_up.endpoints[0].cached_blocks[0] >= 10,
        "{:?}",
        caught_up.endpoints[0]
    );

    let s = current(api);
    let e0 = &s.endpoints[0];
    assert_eq!((e0.slot, e0.address), (0, sims[0].addr));
    assert_eq!(e0.models, ["m"]);
    assert!(e0.block_size > 0 && e0.capacity_blocks > 0, "{e0:?}");
    assert_eq!(s.endpoints[1].cached_blocks, [0, 0, 0]);

    // Incremental polls: nothing changed -> an empty delta; a change -> only that endpoint.
    let (full, full_bytes) = snapshot(api, "");
    assert!(full.is_full());
    let (idle, idle_bytes) = snapshot(api, &format!("?epoch={}&since={}", s.epoch, s.version));
    if idle.version == s.version {
        assert!(idle.upserts.is_empty() && idle.removed.is_empty());
        assert!(idle_bytes < full_bytes, "{idle_bytes} vs {full_bytes}");
    }
    let before = current(api);
    publish_until(sims[1].addr, "sim 1 cache", || {
        current(api).endpoints[1].cached_blocks[0] > 0
    });
    let (delta, _) = snapshot(
        api,
        &format!("?epoch={}&since={}", before.epoch, before.version),
    );
    assert!(!delta.is_full());
    assert!(delta.upserts.iter().any(|e| e.slot == 1));
    let mut applied = before.clone();
    applied.apply(delta).unwrap();
    assert!(applied.endpoints[1].cached_blocks[0] > 0);
    let (stale_epoch, _) = snapshot(
        api,
        &format!("?epoch={}&since={}", before.epoch + 1, before.version),
    );
    assert!(stale_epoch.is_full(), "another epoch gets a full snapshot");

    // The JSON view and the metrics.
    let (status, _, body) = http(api, "GET", "/v1/endpoints", "");
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["endpoints"].as_array().unwrap().len(), 2);
    assert_eq!(v["endpoints"][0]["address"], sims[0].addr.to_string());
    assert!(v["endpoints"][0]["kv_events"]["batches"].as_u64().unwrap() > 0);
    assert!(
        v["endpoints"][0]["kv_events"]["replayed_batches"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(v["pool"]["ready"], 2);
    let (status, _, body) = http(api, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    let names: Vec<String> = prom::samples(&text)
        .map(|s| s.unwrap().name.to_owned())
        .collect();
    for name in [
        "kvoy_aggregator_pool_queue_depth",
        "kvoy_aggregator_pool_saturation",
        "kvoy_aggregator_cached_blocks",
        "kvoy_aggregator_kv_event_batches_total",
        "kvoy_aggregator_scrapes_total",
        "kvoy_aggregator_snapshot_requests_total",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} missing");
    }

    // vLLM's reset_prefix_cache: AllBlocksCleared empties the view and bumps the generation.
    let generation = current(api).endpoints[0].cache_generation;
    assert_eq!(http(sims[0].addr, "POST", "/reset_prefix_cache", "").0, 200);
    wait_for("cleared", Duration::from_secs(10), || {
        let e = &current(api).endpoints[0];
        e.cached_blocks[0] == 0 && e.cache_generation > generation
    });

    // A server restart drops what was learned from it. The aggregator must have scraped the
    // old server's counters since its request, to see them go back.
    wait_for("sim 1's counters scraped", Duration::from_secs(10), || {
        current(api).endpoints[1].prefix_hit_rate.is_some()
    });
    let generation = current(api).endpoints[1].cache_generation;
    let (addr, kv, replay) = (sims[1].addr, sims[1].kv.clone(), sims[1].replay.clone());
    sims[1].kill();
    // Killed: not ready within a second.
    let took = wait_for("killed simulator not ready", Duration::from_secs(5), || {
        !current(api).endpoints[1].ready
    });
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(current(api).endpoints[0].ready);
    let mut restarted = None;
    wait_for(
        "ports free for the restart",
        Duration::from_secs(10),
        || {
            restarted = Sim::try_start(addr, &kv, &replay).ok();
            restarted.is_some()
        },
    );
    sims[1] = restarted.unwrap();
    wait_for("restarted simulator ready", Duration::from_secs(10), || {
        current(api).endpoints[1].ready
    });
    // ZMQ reconnects on its own; publish until the follower sees the new stream.
    // ZMQ reconnects on its own, but what the new publisher sends before that is lost, and its
    // numbering may pass ours unseen; the server's counters going back tell anyway.
    let mut n = 0;
    wait_for("restart detected", Duration::from_secs(15), || {
        n += 1;
        complete(addr, &format!("post restart prompt {n} ").repeat(20));
        current(api).endpoints[1].cache_generation > generation
    });
    wait_for(
        "events from the restarted publisher",
        Duration::from_secs(15),
        || {
            n += 1;
            complete(addr, &format!("post restart prompt {n} ").repeat(20));
            current(api).endpoints[1].cached_blocks[0] > 0
        },
    );

    rt.block_on(agg.shutdown());
}

#[test]
fn the_endpoint_file_is_reloaded() {
    let scratch = Scratch::new("reload");
    let path = scratch.0.join("pool.yaml");
    let sims = [Sim::new_on_free_ports(), Sim::new_on_free_ports()];
    let write = |sims: &[&Sim]| {
        let mut yaml =
            String::from("scrape_interval_ms: 50\nreload_interval_ms: 100\nendpoints:\n");
        for s in sims {
            yaml.push_str(&format!(
                "  - address: '{}'\n    models: [m]\n    kv_events_endpoint: '{}'\n",
                s.addr, s.kv
            ));
        }
        std::fs::write(&path, yaml).unwrap();
    };
    write(&[&sims[0]]);
    let rt = runtime(2);
    let cfg = AggregatorConfig::from_file(&path).unwrap();
    let source = kvoy_aggregator::source::FileSource::new(&path);
    let agg = start_aggregator(&rt, &cfg, source);
    let api = agg.local_addr();
    // Until the file is read, the snapshot answers 503 "not loaded".
    wait_for("loaded", Duration::from_secs(10), || {
        http(api, "GET", "/readyz", "").0 == 200
    });
    wait_for("one endpoint", Duration::from_secs(10), || {
        let s = current(api);
        s.endpoints.len() == 1 && s.endpoints[0].ready
    });
    // Added: a new slot. Then removed: an incremental poll names the removed slot.
    write(&[&sims[0], &sims[1]]);
    wait_for("two endpoints", Duration::from_secs(10), || {
        let s = current(api);
        s.endpoints.len() == 2 && s.endpoints.iter().all(|e| e.ready)
    });
    let before = current(api);
    assert_eq!(before.endpoints[1].address, sims[1].addr);
    assert_eq!(before.endpoints[1].slot, 1);
    write(&[&sims[1]]);
    wait_for("endpoint 0 removed", Duration::from_secs(10), || {
        current(api).endpoints.len() == 1
    });
    let (delta, _) = snapshot(
        api,
        &format!("?epoch={}&since={}", before.epoch, before.version),
    );
    assert_eq!(delta.removed, [0]);
    let now = current(api);
    assert_eq!(
        (now.endpoints[0].slot, now.endpoints[0].address),
        (1, sims[1].addr)
    );
    // A broken file keeps the endpoints and is counted.
    std::fs::write(&path, "endpoints: [{address: nope, models: [m]}]\n").unwrap();
    wait_for("the source error counted", Duration::from_secs(10), || {
        let (_, _, body) = http(api, "GET", "/metrics", "");
        String::from_utf8_lossy(&body).contains("kvoy_aggregator_source_errors_total 1")
    });
    assert_eq!(current(api).endpoints.len(), 1);
    rt.block_on(agg.shutdown());
}
