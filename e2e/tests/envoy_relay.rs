//! End to end: several real Envoys (the combined `kvoy` filter, `--concurrency 2`) in front of
//! the same four kvoy-sim simulators, sharing their routing decisions through one in-process
//! kvoy-aggregator (`POST /v1/decisions`). A multi-turn workload whose turns go to the proxies
//! in turn: with the relay, a turn reaches the simulator that served the conversation's last
//! turn (and holds its prefix) whichever proxy routes it; with each proxy's own index
//! (aggregator off) in the same run, about a quarter do. And a restarted proxy (its shared data
//! gone) gets the pool's decisions back from the aggregator on its first exchange.
//!
//! Needs `envoy` on PATH and the built wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{MODEL, TIMEOUT};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::AggregatorReads;
use kvoy_aggregator::local::{AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{http, PoolEndpoint, Stack, StackConfig};

const NAME: &str = "relay";
const CONVERSATIONS: usize = 30;
const TURNS: usize = 6;
/// Between two turns of one conversation (an agent's tool call, a person typing): the relay's
/// round trip is two poll intervals (100 ms each) and a catch-up tick.
const THINK: Duration = Duration::from_millis(500);

/// Turn `t` of conversation `i` ([`common::conversation_turn`]).
fn turn(i: usize, t: usize) -> Vec<u8> {
    common::conversation_turn(MODEL, i, t)
}

/// Runs the workload on conversations `base..base + CONVERSATIONS`, turn `t` of the `i`th
/// through proxy `(i + t) % proxies.len()`; returns how many turns after the first reached the
/// simulator that served the previous one, and of how many.
fn follow(proxies: &[SocketAddr], base: usize) -> (usize, usize) {
    let mut last = vec![String::new(); CONVERSATIONS];
    let (mut kept, mut turns) = (0, 0);
    for t in 0..TURNS {
        for (i, previous) in last.iter_mut().enumerate() {
            let proxy = proxies[(i + t) % proxies.len()];
            let r = common::post_chat(proxy, &turn(base + i, t));
            assert_eq!(r.status, 200, "{}", r.text());
            let served = r
                .header(kvoy_testkit::SERVED_BY_HEADER)
                .unwrap_or("?")
                .to_owned();
            if t > 0 {
                turns += 1;
                kept += usize::from(served == *previous);
            }
            *previous = served;
        }
        std::thread::sleep(THINK);
    }
    (kept, turns)
}

/// The sum of Envoy's `name` stats (one per filter instance).
fn metric(stack: &Stack, name: &str) -> u64 {
    stack.stats(name).unwrap().values().sum()
}

/// Four simulators and one aggregator following them, every wait bounded; the proxies come
/// from [`Pool::proxy`].
struct Pool {
    // Fields drop in order: the proxies' callers drop theirs first, then the aggregator, then
    // the simulators.
    agg: LocalAggregator,
    endpoints: Vec<PoolEndpoint>,
    run_dir: PathBuf,
    _fleet: SimFleet,
}

impl Pool {
    fn start(run: &str) -> Pool {
        let fleet = SimFleet::loopback(4, &["--model", MODEL, "--speedup", "10"]).unwrap();
        let run_dir = common::run_dir(&format!("{NAME}-{run}"));
        let aggregated = AggregatedEndpoint::scraped(fleet.addrs(), MODEL);
        let agg = common::start_aggregator(&run_dir, "scrape_interval_ms: 50\n", &aggregated);
        agg.wait_ready(4, Duration::from_secs(10));
        let endpoints = PoolEndpoint::all(fleet.addrs(), &[MODEL]);
        Pool {
            agg,
            endpoints,
            run_dir,
            _fleet: fleet,
        }
    }

    /// An Envoy with the combined filter in front of the four simulators, relaying through the
    /// aggregator or (`relayed` false) with only its own index.
    fn proxy(&self, name: &str, relayed: bool) -> Stack {
        let mut config = StackConfig::new(self.endpoints.clone(), self.run_dir.join(name));
        config.aggregator = relayed.then(|| self.agg.addr());
        Stack::start(&config)
            .unwrap_or_else(|e| panic!("[{NAME}] could not start Envoy {name}: {e:#}"))
    }

    /// An Envoy following the aggregator's pool with the relay off (`relay_decisions`): the
    /// per-proxy index of the aggregator mode.
    fn unrelayed_proxy(&self, name: &str) -> Stack {
        let mut config = StackConfig::new(self.endpoints.clone(), self.run_dir.join(name));
        config.aggregator = Some(self.agg.addr());
        config.extra_config = Some(serde_json::json!({"aggregator": {
            "cluster": kvoy_testkit::AGGREGATOR_CLUSTER, "relay_decisions": false}}));
        Stack::start(&config)
            .unwrap_or_else(|e| panic!("[{NAME}] could not start Envoy {name}: {e:#}"))
    }
}

#[test]
fn turns_alternating_between_proxies_reach_their_conversations_simulator() {
    let pool = Pool::start("alternate");
    let relayed: Vec<Stack> = (0..4)
        .map(|p| pool.proxy(&format!("relayed-{p}"), true))
        .collect();
    let alone: Vec<Stack> = (0..2)
        .map(|p| pool.proxy(&format!("alone-{p}"), false))
        .collect();
    std::thread::sleep(Duration::from_millis(500));

    let listen = |stacks: &[Stack]| stacks.iter().map(|s| s.listen).collect::<Vec<_>>();
    // Each run has conversations of its own.
    let (two, of_two) = follow(&listen(&relayed[..2]), 0);
    let (alone_kept, of_alone) = follow(&listen(&alone), 1000);
    let (four, of_four) = follow(&listen(&relayed), 2000);
    let sent: u64 = relayed
        .iter()
        .map(|s| metric(s, "kvoy_prefix_affinity_relay_decisions_sent_total"))
        .sum();
    let received: u64 = relayed
        .iter()
        .map(|s| metric(s, "kvoy_prefix_affinity_relay_decisions_received_total"))
        .sum();
    let bytes = |direction: &str| -> f64 {
        pool.agg
            .metric(&format!(
                "kvoy_aggregator_decision_bytes_total{{direction=\"{direction}\"}}"
            ))
            .unwrap()
    };
    // The relayed runs' requests (both relayed workloads).
    let requests = (2 * CONVERSATIONS * TURNS) as f64;
    eprintln!(
        "[{NAME}] turns kept on their simulator: 2 proxies relayed {two}/{of_two}, 2 proxies alone {alone_kept}/{of_alone}, 4 proxies relayed {four}/{of_four}; decisions sent {sent}, received {received}; to the aggregator {:.0} bytes per request, from it {:.0}",
        bytes("in") / requests,
        bytes("out") / requests
    );
    assert!(
        two * 100 >= of_two * 95,
        "2 relayed proxies kept {two} of {of_two}"
    );
    assert!(
        four * 100 >= of_four * 95,
        "4 relayed proxies kept {four} of {of_four}"
    );
    // The comparison is real: alone, the proxies split the conversations.
    assert!(
        alone_kept * 100 < of_alone * 80,
        "2 proxies alone kept {alone_kept} of {of_alone}"
    );
    assert!(sent > 0 && received > 0);
    drop(relayed);
    drop(alone);
}

#[test]
fn a_restarted_proxy_gets_the_pools_decisions_back_from_the_aggregator() {
    let pool = Pool::start("restart");
    // One proxy places 30 conversations (three turns each), then restarts: a new Envoy
    // process, its shared data and indexes gone.
    let before = pool.proxy("before", true);
    std::thread::sleep(Duration::from_millis(500));
    let mut last = vec![String::new(); CONVERSATIONS];
    for t in 0..3 {
        for (i, previous) in last.iter_mut().enumerate() {
            let r = http::post_json(
                before.listen,
                "/v1/chat/completions",
                &[],
                &turn(3000 + i, t),
                TIMEOUT,
            )
            .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            *previous = r
                .header(kvoy_testkit::SERVED_BY_HEADER)
                .unwrap_or("?")
                .to_owned();
        }
    }
    // Its decisions reach the aggregator on its next poll ticks.
    std::thread::sleep(THINK);
    drop(before);
    let after = pool.proxy("after", true);
    std::thread::sleep(THINK);
    let mut kept = 0;
    for (i, previous) in last.iter().enumerate() {
        let r = http::post_json(
            after.listen,
            "/v1/chat/completions",
            &[],
            &turn(3000 + i, 3),
            TIMEOUT,
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        kept += usize::from(r.header(kvoy_testkit::SERVED_BY_HEADER) == Some(previous.as_str()));
    }
    eprintln!("[{NAME}] after a restart {kept} of {CONVERSATIONS} conversations went back to their simulator");
    assert!(kept * 10 >= CONVERSATIONS * 9, "{kept} of {CONVERSATIONS}");
    drop(after);
}

/// CPU seconds (user and system) process `pid` has used: `/proc/PID/stat` fields 14 and 15, in
/// clock ticks of 1/100 s (Linux's `USER_HZ`).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The command name may hold spaces: count fields after its closing parenthesis.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    let ticks = |i: usize| fields[i - 3].parse::<f64>().unwrap();
    (ticks(14) + ticks(15)) / 100.0
}

/// A measurement, not a check (`cargo test -p kvoy-e2e --test envoy_relay -- --ignored
/// --nocapture`): Envoy's CPU per request, two proxies each, the same alternating workload:
/// relaying decisions through the aggregator, following the aggregator without the relay (the
/// per-proxy index), and with a static pool. The runs are interleaved turn by turn so that all
/// see the same machine; the proxies' poll-tick work (snapshot polls, exchanges) is included.
#[test]
#[ignore = "a measurement; run it by name"]
fn relay_cpu_per_request() {
    const ROUNDS: usize = 6;
    const PER_ROUND: usize = 400;
    let pool = Pool::start("cost");
    let modes: Vec<(&str, Vec<Stack>)> = vec![
        (
            "relayed",
            (0..2)
                .map(|p| pool.proxy(&format!("cost-relayed-{p}"), true))
                .collect(),
        ),
        (
            "aggregator, no relay",
            (0..2)
                .map(|p| pool.unrelayed_proxy(&format!("cost-unrelayed-{p}")))
                .collect(),
        ),
        (
            "static pool",
            (0..2)
                .map(|p| pool.proxy(&format!("cost-static-{p}"), false))
                .collect(),
        ),
    ];
    std::thread::sleep(Duration::from_millis(500));
    let cpu = |stacks: &[Stack]| -> f64 { stacks.iter().map(|s| cpu_seconds(s.envoy.pid())).sum() };
    let before: Vec<f64> = modes.iter().map(|(_, s)| cpu(s)).collect();
    for t in 0..ROUNDS {
        for (m, (_, stacks)) in modes.iter().enumerate() {
            for i in 0..PER_ROUND {
                let proxy = stacks[(i + t) % stacks.len()].listen;
                let body = turn(10_000 * (m + 1) + i, t);
                let r =
                    http::post_json(proxy, "/v1/chat/completions", &[], &body, TIMEOUT).unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
            }
        }
    }
    let requests = (ROUNDS * PER_ROUND) as f64;
    let per_request: Vec<f64> = modes
        .iter()
        .zip(&before)
        .map(|((_, s), b)| (cpu(s) - b) / requests * 1e6)
        .collect();
    for ((name, _), us) in modes.iter().zip(&per_request) {
        eprintln!(
            "[{NAME}] Envoy CPU per request, {name}: {us:.0} us ({:.3} of the per-proxy index's)",
            us / per_request[1]
        );
    }
}
