//! End to end: a server's eviction reaches the proxy's prefix index. A real Envoy (the combined
//! `kvoy` filter, `--concurrency 2`) relays its decisions to kvoy-aggregator, which links them
//! to the blocks two kvoy-sim simulators store (their real KV events over ZMQ; the linker at
//! its defaults). A conversation's first turn is routed and linked; then prompts sent straight
//! to its simulator (not through the proxy) fill that simulator's small cache until it evicts
//! the conversation's blocks (`BlockRemoved`). The aggregator records the removal, the proxy's
//! next decision exchange brings it, and both workers forget those keys: measured from the
//! eviction's event (its batch's timestamp) to the proxy's `removed_keys` counter moving (the
//! design's budget is 200 ms; asserted within 2 s on a loaded machine, printed). The
//! conversation's next turn then matches less of its prompt than the first turn's keys.
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
use serde_json::Value;

const NAME: &str = "removals";
const MODEL: &str = "kvoy-demo";
/// Prompts of about 16 blocks sent to the conversation's simulator at most, to evict it.
const MAX_FLOOD: usize = 80;
const REMOVED: &str = "kvoy_prefix_affinity_removed_keys_total";
const MATCHED: &str = "kvoy_prefix_affinity_prefix_blocks_matched_total";

/// Keys the aggregator's removal records name for `endpoint`, and the earliest record's event
/// time (the server's clock, seconds since the Unix epoch).
fn removed_at_aggregator(agg: &LocalAggregator, endpoint: &str) -> (usize, Option<f64>) {
    let v = agg.get_json("/v1/removals?after=0").unwrap();
    let records: Vec<&Value> = v["removals"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["endpoint"] == endpoint)
        .collect();
    let keys = records
        .iter()
        .map(|r| r["keys"].as_array().map_or(0, Vec::len))
        .sum();
    let first = records
        .iter()
        .filter_map(|r| r["event_ts"].as_f64())
        .reduce(f64::min);
    (keys, first)
}

#[test]
fn an_eviction_the_servers_report_ends_that_prefixs_affinity_at_the_proxy() {
    // The linker at its defaults: on, with its tolerance.
    let run = linked_conversation(
        "evicted",
        &kvoy_sim::fleet::small_cache_flags(MODEL, "128"),
        MODEL,
    )
    .unwrap();
    let (agg, sims, proxy) = (&run.pool.agg, &run.pool.sims, &run.proxy);
    let (served, linked) = (run.served.clone(), run.linked);
    let sim = sims.iter().find(|s| s.addr.to_string() == served).unwrap();

    // Other prompts straight to that simulator evict the conversation's blocks.
    let mut sent = 0;
    while removed_at_aggregator(agg, &served).0 == 0 {
        assert!(
            sent < MAX_FLOOD,
            "[{NAME}] {sent} prompts to {served} evicted none of the conversation's blocks"
        );
        post_chat(sim.addr, &flood_prompt(MODEL, sent)).unwrap();
        sent += 1;
    }
    let removal_seen = Instant::now();
    let (removed, event_ts) = removed_at_aggregator(agg, &served);
    let event_ts = event_ts.expect("a removal record carries its event's time");
    // Both workers forget them on their tick after the proxy's next exchange (each worker's
    // index holds the conversation: one routed it, the other replayed its decision).
    // Times are from the eviction's event (its batch's timestamp; the simulator runs on this
    // machine's clock), and include the filters' metrics flush on their tick.
    let (mut first_worker, mut applied) = (None, None);
    while removal_seen.elapsed() < Duration::from_secs(5) {
        let forgot = proxy_counter(proxy, REMOVED, true).unwrap() as usize;
        let since_event = Duration::from_secs_f64((unix_now() - event_ts).max(0.0));
        if forgot > 0 && first_worker.is_none() {
            first_worker = Some(since_event);
        }
        if forgot >= 2 * removed {
            applied = Some(since_event);
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let forgotten = proxy_counter(proxy, REMOVED, false).unwrap();
    eprintln!(
        "[{NAME}] {sent} prompts to {served} evicted {removed} of its {linked} linked keys; the proxy's workers forgot {forgotten} keys, the first {first_worker:?} and both {applied:?} after the eviction's event (budget 200 ms)"
    );
    let applied = applied.unwrap_or_else(|| {
        panic!("[{NAME}] the proxy never applied the removal (5 s after the aggregator had it)")
    });
    assert!(
        applied < Duration::from_secs(2),
        "[{NAME}] the eviction took {applied:?} to reach both workers' indexes"
    );

    // The next turn: its prefix is no longer believed cached whole on that simulator.
    let before = proxy_counter(proxy, MATCHED, false).unwrap();
    post_chat(proxy.listen, &long_turn("evicted", MODEL, 1)).unwrap();
    let matched_now = proxy_counter(proxy, MATCHED, false).unwrap() - before;
    eprintln!(
        "[{NAME}] the next turn matched {matched_now} blocks (the first turn made {linked} keys linked there)"
    );
    assert!(
        matched_now < linked,
        "[{NAME}] the next turn still matched {matched_now} blocks of the evicted prefix"
    );
    proxy.assert_no_wasm_failures(NAME);
}
