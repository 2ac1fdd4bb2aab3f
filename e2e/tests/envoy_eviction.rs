//! End to end: a server that evicts a prefix under cache pressure stops attracting requests
//! with that prefix. A real Envoy (the combined `kvoy` filter, `--concurrency 2`) polls an
//! in-process kvoy-aggregator that follows four kvoy-sim simulators' KV events (ZMQ); each
//! simulator's KV cache holds 128 blocks of 16 tokens, about eight of the test's prompts (the
//! 24 conversations fill three quarters of the four caches).
//!
//! Conversations are placed, a flood of other prompts fills every cache (the simulators evict
//! the conversations' blocks, least recently used first), and 200 ms after the flood the
//! conversations' next turns are routed. The aggregator's counts of each server's blocks
//! reach the filter in its snapshot, and the filter cuts what it believes of each endpoint
//! down to them: the next turns go where the load says, a quarter to a third back to their old
//! simulator by chance. In the same run an Envoy with only its configured pool (no aggregator,
//! so no counts) sends them all back, to a cache that no longer holds them. The same after
//! every server's `/reset_prefix_cache` (its `AllBlocksCleared` bumps the endpoint's cache
//! generation, and the filter forgets the endpoint).
//!
//! Needs `envoy` on PATH and the built wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{MODEL, TIMEOUT};

use std::net::SocketAddr;
use std::time::Duration;

use common::{AggregatorReads, FollowedPool};
use kvoy_testkit::{http, Stack, StackConfig};
use serde_json::json;

const NAME: &str = "eviction";
const CONVERSATIONS: usize = 24;
const FLOOD: usize = 96;
/// What the acceptance allows between the eviction and the routing that no longer counts on it.
const AFTER_EVICTION: Duration = Duration::from_millis(200);

/// About 1 KB: 16 blocks of the simulators' caches.
fn conversation(i: usize, turn: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content":
        format!("Conversation {i}. {}", "You are a careful assistant with a long brief. ".repeat(18))})];
    for k in 0..turn {
        messages.push(json!({"role": "user", "content": format!("Question {k} of {i}?")}));
        messages.push(json!({"role": "assistant", "content": format!("Answer {k} for {i}.")}));
    }
    messages.push(json!({"role": "user", "content": format!("Question {turn} of {i}?")}));
    serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 2, "messages": messages})).unwrap()
}

/// Places conversations `base..base + CONVERSATIONS` (two turns, checking that the second
/// found the first), returning where each was served. Each conversation's second turn follows
/// its first at once: a simulator that drew more than its share of conversations evicts the
/// oldest while later ones are placed, and a proxy told of that eviction rightly sends that
/// conversation's next turn elsewhere (this check is about affinity before any eviction).
fn place(proxy: SocketAddr, base: usize) -> Vec<String> {
    let (first, second): (Vec<String>, Vec<String>) = (0..CONVERSATIONS)
        .map(|i| {
            let first = common::send_chat(proxy, &conversation(base + i, 0));
            (first, common::send_chat(proxy, &conversation(base + i, 1)))
        })
        .unzip();
    let kept = first.iter().zip(&second).filter(|(a, b)| a == b).count();
    assert!(
        kept * 100 >= CONVERSATIONS * 90,
        "[{NAME}] before any eviction only {kept} of {CONVERSATIONS} second turns found the first"
    );
    second
}

/// How many next turns go back to where the conversation was placed.
fn back(proxy: SocketAddr, base: usize, placed: &[String]) -> usize {
    placed
        .iter()
        .enumerate()
        .filter(|(i, at)| common::send_chat(proxy, &conversation(base + i, 2)) == **at)
        .count()
}

/// Four simulators, an aggregator following their KV events, an Envoy polling it
/// (`counted`) and one with only its configured pool (`alone`).
struct Fixture {
    // Fields drop in order: the proxies, then the aggregator and the simulators.
    counted: Stack,
    alone: Stack,
    pool: FollowedPool,
}

impl Fixture {
    fn start(run: &str) -> Fixture {
        let pool = FollowedPool::start(
            &format!("{NAME}-{run}"),
            4,
            &kvoy_sim::fleet::small_cache_flags(MODEL, "128"),
            MODEL,
            "scrape_interval_ms: 50\n",
        )
        .unwrap();
        let endpoints = pool.endpoints(MODEL);
        let mut config = StackConfig::new(endpoints.clone(), pool.run_dir.join("counted"));
        config.aggregator = Some(pool.agg.addr());
        let counted = Stack::start(&config).unwrap();
        let alone = Stack::start(&StackConfig::new(endpoints, pool.run_dir.join("alone"))).unwrap();
        std::thread::sleep(Duration::from_millis(500));

        Fixture {
            counted,
            alone,
            pool,
        }
    }
}

impl Fixture {
    fn snapshot_bytes(&self) -> f64 {
        self.pool
            .agg
            .metric("kvoy_aggregator_snapshot_bytes_total")
            .unwrap()
    }

    fn incremental_polls(&self) -> f64 {
        self.pool
            .agg
            .metric(r#"kvoy_aggregator_snapshot_requests_total{kind="incremental"}"#)
            .unwrap()
    }
}

#[test]
fn an_evicted_prefix_stops_attracting_its_requests() {
    let f = Fixture::start("pressure");
    let placed_counted = place(f.counted.listen, 0);
    let placed_alone = place(f.alone.listen, 1000);
    // A flood: every simulator's cache turns over several times.
    let (bytes_before, polls_before) = (f.snapshot_bytes(), f.incremental_polls());
    let flood_started = std::time::Instant::now();
    // Through the counted proxy only: its index sees what the servers see (two proxies that
    // do not relay each see only their own share of what filled the caches).
    for i in 0..FLOOD {
        common::send_chat(f.counted.listen, &common::flood_prompt(i));
    }
    let flood_s = flood_started.elapsed().as_secs_f64();
    let (bytes, polls) = (
        f.snapshot_bytes() - bytes_before,
        f.incremental_polls() - polls_before,
    );
    eprintln!(
        "[{NAME}] snapshot deltas to the one polling proxy during the flood ({FLOOD} requests, {flood_s:.1} s, every cache count changing): {:.0} bytes/s, {polls} incremental polls of {:.0} bytes each",
        bytes / flood_s,
        bytes / polls.max(1.0)
    );
    std::thread::sleep(AFTER_EVICTION);
    let back_counted = back(f.counted.listen, 0, &placed_counted);
    let back_alone = back(f.alone.listen, 1000, &placed_alone);
    eprintln!(
        "[{NAME}] next turns back on their evicted simulator, {} ms after the flood: with the aggregator's counts {back_counted}/{CONVERSATIONS}, alone {back_alone}/{CONVERSATIONS}",
        AFTER_EVICTION.as_millis()
    );
    // By chance a quarter to a third go back (the load decides); 15 or more of 24 would be
    // about 1 in 500 at a third.
    assert!(
        back_counted < 15,
        "{back_counted} of {CONVERSATIONS} went back to a cache that evicted them"
    );
    // The comparison is real: without the counts the stale belief sends them back.
    assert!(
        back_alone >= CONVERSATIONS * 3 / 4,
        "alone, only {back_alone} of {CONVERSATIONS} went back"
    );
}

#[test]
fn a_reset_cache_stops_attracting_its_requests() {
    let f = Fixture::start("reset");
    let placed_counted = place(f.counted.listen, 0);
    let placed_alone = place(f.alone.listen, 1000);
    // vLLM's /reset_prefix_cache on every server: its AllBlocksCleared event bumps the
    // endpoint's cache generation in the aggregator's snapshot.
    for sim in &f.pool.sims {
        let r = http::send(sim.addr, "POST", "/reset_prefix_cache", &[], b"", TIMEOUT).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    std::thread::sleep(AFTER_EVICTION);
    let back_counted = back(f.counted.listen, 0, &placed_counted);
    let back_alone = back(f.alone.listen, 1000, &placed_alone);
    eprintln!(
        "[{NAME}] next turns back on their simulator {} ms after it reset its cache: with the aggregator {back_counted}/{CONVERSATIONS}, alone {back_alone}/{CONVERSATIONS}",
        AFTER_EVICTION.as_millis()
    );
    assert!(
        back_counted < 15,
        "{back_counted} of {CONVERSATIONS} went back to a cache that was reset"
    );
    assert!(
        back_alone >= CONVERSATIONS * 3 / 4,
        "alone, only {back_alone} of {CONVERSATIONS} went back"
    );
}
