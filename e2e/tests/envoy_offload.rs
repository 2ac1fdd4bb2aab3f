//! End to end: a prefix the server offloaded keeps its affinity. A real Envoy (the combined
//! `kvoy` filter, `--concurrency 2`) relays its decisions to kvoy-aggregator, which links them
//! to the blocks two kvoy-sim simulators store; the simulators have a CPU tier for their KV
//! cache (`--cpu-offload-blocks`, written through as vLLM's CPU offloading does) and publish
//! its events over ZMQ. A conversation's first turn is routed and linked; prompts sent straight
//! to its simulator then evict the conversation's blocks from the GPU, while their CPU copies
//! stay. The aggregator records an offload (not a removal), the proxy's next decision exchange
//! brings it (format 3), and both workers move those keys down to the CPU tier. The
//! conversation's next turn still goes to that simulator, its whole prefix matched at the CPU
//! tier's credit, and the simulator serves the prefix from its CPU tier (`cached_tokens`)
//! instead of computing it again.
//!
//! Needs `envoy` on PATH and the built wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    eviction::{flood_prompt, linked_conversation, long_turn, post_chat, proxy_counter, unix_now},
    AggregatorReads,
};
use kvoy_aggregator::local::LocalAggregator;
use kvoy_testkit::http;
use serde_json::Value;

const NAME: &str = "offload";
const MODEL: &str = "kvoy-demo";
const TIMEOUT: Duration = Duration::from_secs(30);
/// Prompts of about 16 blocks sent to the conversation's simulator at most, to evict it from
/// the GPU (128 blocks) but not from the CPU tier (1,024 blocks).
const MAX_FLOOD: usize = 40;
const OFFLOADED: &str = "kvoy_prefix_affinity_offloaded_keys_total";
const REMOVED: &str = "kvoy_prefix_affinity_removed_keys_total";
const MATCHED: &str = "kvoy_prefix_affinity_prefix_blocks_matched_total";

/// The aggregator's records for `endpoint`: keys offloaded to CPU, keys removed, and the last
/// offload's event time.
fn records(agg: &LocalAggregator, endpoint: &str) -> (usize, usize, Option<f64>) {
    let v = agg.get_json("/v1/removals?after=0").unwrap();
    let (mut offloaded, mut removed, mut last) = (0, 0, None::<f64>);
    for r in v["removals"].as_array().unwrap() {
        if r["endpoint"] != endpoint {
            continue;
        }
        let keys = r["keys"].as_array().map_or(0, Vec::len);
        if r["offloaded_to"] == "CPU" {
            offloaded += keys;
            if let Some(ts) = r["event_ts"].as_f64() {
                last = Some(last.map_or(ts, |l| l.max(ts)));
            }
        } else {
            removed += keys;
        }
    }
    (offloaded, removed, last)
}

fn cached_tokens(r: &http::Response) -> u64 {
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn a_prefix_offloaded_to_the_servers_cpu_tier_keeps_its_affinity_and_is_loaded_not_recomputed() {
    let mut flags = kvoy_sim::fleet::small_cache_flags(MODEL, "128").to_vec();
    flags.extend(["--cpu-offload-blocks", "1024"]);
    let run = linked_conversation("offloaded", &flags, MODEL).unwrap();
    let (agg, sims, proxy) = (&run.pool.agg, &run.pool.sims, &run.proxy);
    let (served, linked) = (run.served.clone(), run.linked);
    let sim = sims.iter().find(|s| s.addr.to_string() == served).unwrap();

    // Other prompts straight to that simulator evict the whole conversation from its GPU
    // (tail first); its CPU copies stay. Then the simulator holds nothing of it on the GPU,
    // and only the CPU tier's credit keeps the next turn there rather than on the other, cold,
    // idle simulator.
    let mut sent = 0;
    while records(agg, &served).0 < linked as usize {
        assert!(
            sent < MAX_FLOOD,
            "[{NAME}] {sent} prompts to {served} offloaded none of the conversation's blocks: {}",
            agg.get_json("/v1/removals?after=0").unwrap()
        );
        post_chat(sim.addr, &flood_prompt(MODEL, sent)).unwrap();
        sent += 1;
    }
    let seen = Instant::now();
    // Both workers move the keys down a tier on their tick after the proxy's next exchange
    // (measured from the last offload's event, its batch's timestamp, to both workers having
    // applied every offload).
    let (mut offloaded, mut removed, mut applied) = (0, 0, None);
    while seen.elapsed() < Duration::from_secs(5) {
        let (o, r, event_ts) = records(agg, &served);
        (offloaded, removed) = (o, r);
        if proxy_counter(proxy, OFFLOADED, true).unwrap() as usize >= 2 * offloaded {
            let event_ts = event_ts.expect("an offload record carries its event's time");
            applied = Some(Duration::from_secs_f64((unix_now() - event_ts).max(0.0)));
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        removed, 0,
        "[{NAME}] blocks with a CPU copy were removed, not offloaded"
    );
    eprintln!(
        "[{NAME}] {sent} prompts to {served} offloaded {offloaded} of its {linked} linked keys to CPU; both workers applied them {applied:?} after the last offload's event (budget 200 ms)"
    );
    let applied = applied.unwrap_or_else(|| {
        panic!(
            "[{NAME}] the proxy never applied the offload: {} keys moved",
            proxy_counter(proxy, OFFLOADED, true).unwrap()
        )
    });
    assert!(
        applied < Duration::from_secs(2),
        "[{NAME}] the offload took {applied:?} to reach both workers' indexes"
    );
    assert_eq!(
        proxy_counter(proxy, REMOVED, true).unwrap(),
        0,
        "nothing was removed"
    );

    // The next turn: still that simulator, the whole prefix matched, and served from the
    // simulator's CPU tier rather than computed again.
    let before = proxy_counter(proxy, MATCHED, false).unwrap();
    let next = post_chat(proxy.listen, &long_turn("offloaded", MODEL, 1)).unwrap();
    let matched = proxy_counter(proxy, MATCHED, false).unwrap() - before;
    let cached = cached_tokens(&next);
    eprintln!(
        "[{NAME}] the next turn went to {:?}, matched {matched} blocks, {cached} prompt tokens cached (loaded from CPU)",
        next.header(kvoy_testkit::SERVED_BY_HEADER)
    );
    assert_eq!(
        next.header(kvoy_testkit::SERVED_BY_HEADER),
        Some(served.as_str()),
        "[{NAME}] the next turn left the simulator holding its prefix on CPU"
    );
    assert!(
        matched >= linked,
        "[{NAME}] the next turn matched {matched} blocks, the first turn linked {linked}"
    );
    // 64-byte keys at about 4 bytes per token: the linked keys cover about 16 tokens each.
    assert!(
        cached >= 8 * linked,
        "[{NAME}] only {cached} prompt tokens were cached ({linked} keys linked)"
    );
    let metrics = http::get(sim.addr, "/metrics", TIMEOUT).unwrap();
    let loaded: f64 = metrics
        .text()
        .lines()
        .find_map(|l| l.strip_prefix("vllm:external_prefix_cache_hits_total"))
        .and_then(|rest| rest.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        loaded > 0.0,
        "[{NAME}] the simulator loaded nothing from CPU"
    );
    proxy.assert_no_wasm_failures(NAME);
}
