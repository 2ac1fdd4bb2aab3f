//! End to end, routing state that survives change.
//!
//! A configuration change: a real Envoy (the combined `kvoy` filter,
//! `--concurrency 2`) takes its listener over LDS from a watched file, as it does from Istio or
//! Envoy Gateway, in front of four kvoy-sim simulators. Midway through a multi-turn workload
//! the listener is replaced by one whose filter configuration changes a field other than the
//! pool (`max_body_bytes`): Envoy starts the new configuration's root contexts, whose index
//! starts empty. The pool's routing state is namespaced by the pool, not by the whole
//! configuration, so the new contexts replay the decisions the old ones left in shared data.
//! The next 200 requests must keep at least 90% of the prefix-cache hit rate (the simulators'
//! `cached_tokens`) that a steady proxy, beside it in the same run, has on its own copy of the
//! workload.
//!
//! A restart: a proxy following kvoy-aggregator with the decision relay on is stopped and a new
//! Envoy process (its shared data gone) takes its place; it gets the pool's decisions back from
//! the aggregator on its first exchange, and the next 200 requests must again keep 90% of a
//! steady proxy's hit rate.
//!
//! Needs `envoy` on PATH and the built wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::MODEL;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::AggregatorReads;
use kvoy_aggregator::local::AggregatedEndpoint;
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{PoolEndpoint, Stack, StackConfig};
use serde_json::Value;

const NAME: &str = "reconfigure";
const CONVERSATIONS: usize = 40;
/// Turns before the change, and after it (5 x 40 = the next 200 requests).
const TURNS_BEFORE: usize = 3;
const TURNS_AFTER: usize = 5;

/// Turn `t` of conversation `i` ([`common::conversation_turn`]).
fn turn(i: usize, t: usize) -> Vec<u8> {
    common::conversation_turn(MODEL, i, t)
}

/// What a stretch of the workload saw.
#[derive(Debug, Default)]
struct Tally {
    requests: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Turns that reached the simulator that served their conversation's previous turn.
    kept: usize,
}

impl Tally {
    fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// Turns `turns` of conversations `base..base + CONVERSATIONS`, through `proxy`.
fn run(
    proxy: SocketAddr,
    base: usize,
    turns: std::ops::Range<usize>,
    last: &mut [String],
) -> Tally {
    let mut tally = Tally::default();
    for t in turns {
        for (i, previous) in last.iter_mut().enumerate() {
            let r = common::post_chat(proxy, &turn(base + i, t));
            assert_eq!(r.status, 200, "[{NAME}] {}", r.text());
            let body: Value = serde_json::from_slice(&r.body).unwrap();
            let usage = &body["usage"];
            tally.requests += 1;
            tally.prompt_tokens += usage["prompt_tokens"].as_u64().unwrap();
            tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            let served = r
                .header(kvoy_testkit::SERVED_BY_HEADER)
                .unwrap_or("?")
                .to_owned();
            tally.kept += usize::from(served == *previous);
            *previous = served;
        }
    }
    tally
}

/// Lines of the Envoy log where a root context of the filter took a configuration.
fn configured(stack: &Stack) -> Vec<String> {
    stack
        .envoy
        .log_text()
        .lines()
        .filter(|l| l.contains("kvoy_prefix_affinity: configured"))
        .map(str::to_owned)
        .collect()
}

/// Four simulators, a run directory and the pool they make.
fn fleet(run: &str) -> (SimFleet, PathBuf, Vec<PoolEndpoint>) {
    let fleet = SimFleet::loopback(4, &["--model", MODEL, "--speedup", "10"]).unwrap();
    let run_dir = common::run_dir(&format!("{NAME}-{run}"));
    let pool: Vec<PoolEndpoint> = PoolEndpoint::all(fleet.addrs(), &[MODEL]);
    (fleet, run_dir, pool)
}

/// Prints the comparison and asserts what both tests ask of the proxy that went through the
/// change (`changed`) against the steady one, on the same next 200 requests.
fn assert_keeps_up(what: &str, steady: &Tally, changed: &Tally) {
    eprintln!(
        "[{NAME}] the next {} requests: steady hit rate {:.3} ({} turns on their simulator), \
         after {what} {:.3} ({}); ratio {:.3}",
        changed.requests,
        steady.hit_rate(),
        steady.kept,
        changed.hit_rate(),
        changed.kept,
        changed.hit_rate() / steady.hit_rate()
    );
    assert_eq!(changed.requests, 200);
    assert!(
        steady.hit_rate() > 0.5,
        "[{NAME}] the steady proxy's hit rate {:.3} is too low to compare with",
        steady.hit_rate()
    );
    assert!(
        changed.hit_rate() >= 0.9 * steady.hit_rate(),
        "[{NAME}] after {what} the hit rate is {:.3}, against {:.3} on the steady proxy",
        changed.hit_rate(),
        steady.hit_rate()
    );
    // The turns say the same: a new namespace (the pool reordered, say) lost about one in
    // seven of them to a cold simulator in trials, and its hit rate fell to 0.88x the steady's.
    assert!(
        changed.kept * 10 >= steady.kept * 9,
        "[{NAME}] after {what} {} turns reached their conversation's simulator, against {} \
         on the steady proxy",
        changed.kept,
        steady.kept
    );
}

#[test]
fn a_configuration_change_over_lds_keeps_the_hit_rate() {
    let (_fleet, run_dir, pool) = fleet("lds");

    let steady = Stack::start(&StackConfig::new(pool.clone(), run_dir.join("steady"))).unwrap();
    let mut config = StackConfig::new(pool, run_dir.join("changed"));
    config.listeners_over_lds = true;
    let mut changed = Stack::start(&config).unwrap();

    // The same workload on both, each on conversations of its own (the simulators' caches
    // are shared, the prompts are not).
    let mut steady_last = vec![String::new(); CONVERSATIONS];
    let mut changed_last = vec![String::new(); CONVERSATIONS];
    let steady_before = run(steady.listen, 0, 0..TURNS_BEFORE, &mut steady_last);
    let changed_before = run(changed.listen, 1000, 0..TURNS_BEFORE, &mut changed_last);
    let configured_before = configured(&changed);

    // A field other than the pool: a new filter configuration, the same pool.
    let mut new_config = config.clone();
    new_config.max_body_bytes = Some(4 << 20);
    changed.reconfigure(&new_config).unwrap();
    assert_ne!(
        changed.filter_config, steady.filter_config,
        "[{NAME}] the listener should carry a new filter configuration"
    );
    // Envoy writes its log every 100 ms (`--file-flush-interval-msec`).
    let mut configured_after = configured(&changed);
    for _ in 0..30 {
        if configured_after.len() > configured_before.len() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        configured_after = configured(&changed);
    }
    let new_contexts = &configured_after[configured_before.len()..];
    eprintln!(
        "[{NAME}] root contexts configured: {} at start, {} more after the LDS update",
        configured_before.len(),
        new_contexts.len()
    );
    assert!(
        !new_contexts.is_empty(),
        "[{NAME}] Envoy took the listener but no new root context was configured"
    );
    // ... in the namespace the old ones used: the pool's.
    let namespace = |line: &str| line.rsplit("namespace ").next().unwrap_or("").to_owned();
    for line in new_contexts {
        assert_eq!(
            namespace(line),
            namespace(&configured_before[0]),
            "[{NAME}] {line}"
        );
    }

    let steady_after = run(
        steady.listen,
        0,
        TURNS_BEFORE..TURNS_BEFORE + TURNS_AFTER,
        &mut steady_last,
    );
    let changed_after = run(
        changed.listen,
        1000,
        TURNS_BEFORE..TURNS_BEFORE + TURNS_AFTER,
        &mut changed_last,
    );
    eprintln!(
        "[{NAME}] before: steady hit rate {:.3}, changed {:.3} ({} requests each)",
        steady_before.hit_rate(),
        changed_before.hit_rate(),
        steady_before.requests
    );
    assert_keeps_up("the change", &steady_after, &changed_after);
    steady.assert_no_wasm_failures(NAME);
    changed.assert_no_wasm_failures(NAME);
}

#[test]
fn a_restarted_proxy_keeps_the_hit_rate_through_the_aggregator() {
    let (fleet, run_dir, pool) = fleet("restart");
    let aggregated = AggregatedEndpoint::scraped(fleet.addrs(), MODEL);
    let agg = common::start_aggregator(&run_dir, "scrape_interval_ms: 50\n", &aggregated);
    agg.wait_ready(4, Duration::from_secs(10));
    let proxy = |name: &str| {
        let mut config = StackConfig::new(pool.clone(), run_dir.join(name));
        config.aggregator = Some(agg.addr());
        Stack::start(&config).unwrap()
    };
    // The relay's round trip: two poll intervals (100 ms each) and a catch-up tick.
    let relay_round_trip = Duration::from_millis(500);

    let steady = proxy("steady");
    let before = proxy("before");
    std::thread::sleep(relay_round_trip);
    let mut steady_last = vec![String::new(); CONVERSATIONS];
    let mut restarted_last = vec![String::new(); CONVERSATIONS];
    run(steady.listen, 0, 0..TURNS_BEFORE, &mut steady_last);
    run(before.listen, 1000, 0..TURNS_BEFORE, &mut restarted_last);
    // Its last decisions reach the aggregator on its next ticks; then a new process.
    std::thread::sleep(relay_round_trip);
    before.assert_no_wasm_failures(NAME);
    drop(before);
    let after = proxy("after");
    std::thread::sleep(relay_round_trip);

    let turns = TURNS_BEFORE..TURNS_BEFORE + TURNS_AFTER;
    let steady_after = run(steady.listen, 0, turns.clone(), &mut steady_last);
    let restarted_after = run(after.listen, 1000, turns, &mut restarted_last);
    assert_keeps_up("a restart", &steady_after, &restarted_after);
    steady.assert_no_wasm_failures(NAME);
    after.assert_no_wasm_failures(NAME);
}
