//! End to end, issue 38's measure of the relay: two real Envoys (the combined `kvoy` filter,
//! `--concurrency 2`, the bootstrap `make run` renders) in front of four kvoy-sim at `make run`'s
//! speedup, one kvoy-aggregator. Thirty conversations run at once; each sends its next turn to
//! the other proxy the moment the previous reply (16 tokens) ends: no think time, no session
//! header echoed. A decision reaches the other proxy within a relay flush (`relay_flush_ms`,
//! 10 ms) and one long-poll round trip (`relay_wait_ms`), before the reply to it has ended, so
//! the turn finds its conversation's simulator. Its own binary: the timing is the point, and
//! the other relay tests would share the machine with it.
//!
//! Needs `envoy` on PATH and the built wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::MODEL;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::AggregatorReads;
use kvoy_aggregator::local::AggregatedEndpoint;
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{PoolEndpoint, Stack, StackConfig};

const NAME: &str = "relay-no-think";
const AGENTS: usize = 30;
const TURNS: usize = 6;

/// Runs every conversation at once, turn `t` of the `i`th through proxy `(i + t) % 2`, the next
/// turn sent as its reply ends; how many turns after the first reached the simulator that
/// served the previous one.
fn run(proxies: &[SocketAddr]) -> usize {
    let runs: Vec<_> = (0..AGENTS)
        .map(|i| {
            let proxies = proxies.to_vec();
            std::thread::spawn(move || {
                let mut previous = String::new();
                let mut kept = 0;
                for t in 0..TURNS {
                    let r = common::post_chat(
                        proxies[(i + t) % proxies.len()],
                        &common::replica::agent_turn(MODEL, i, t, false),
                    );
                    assert_eq!(r.status, 200, "{}", r.text());
                    let served = r
                        .header(kvoy_testkit::SERVED_BY_HEADER)
                        .unwrap_or("?")
                        .to_owned();
                    kept += usize::from(t > 0 && served == previous);
                    previous = served;
                }
                kept
            })
        })
        .collect();
    runs.into_iter().map(|r| r.join().unwrap()).sum()
}

#[test]
fn turns_sent_the_moment_the_last_reply_ends_reach_their_conversations_simulator() {
    let fleet = SimFleet::loopback(4, &["--model", MODEL, "--speedup", "10"]).unwrap();
    let run_dir = common::run_dir(NAME);
    let aggregated = AggregatedEndpoint::scraped(fleet.addrs(), MODEL);
    let agg = common::start_aggregator(&run_dir, "scrape_interval_ms: 50\n", &aggregated);
    agg.wait_ready(4, Duration::from_secs(10));
    let endpoints = PoolEndpoint::all(fleet.addrs(), &[MODEL]);
    let proxies: Vec<Stack> = (0..2)
        .map(|p| {
            let mut config =
                StackConfig::new(endpoints.clone(), run_dir.join(format!("proxy-{p}")));
            config.aggregator = Some(agg.addr());
            Stack::start(&config)
                .unwrap_or_else(|e| panic!("[{NAME}] could not start Envoy {p}: {e:#}"))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let listen: Vec<SocketAddr> = proxies.iter().map(|s| s.listen).collect();
    let started = Instant::now();
    let kept = run(&listen);
    let of = AGENTS * (TURNS - 1);
    eprintln!(
        "[{NAME}] 2 proxies, no think time: {kept}/{of} turns reached their conversation's simulator ({:.1}%), {} requests in {:.2} s",
        100.0 * kept as f64 / of as f64,
        AGENTS * TURNS,
        started.elapsed().as_secs_f64()
    );
    assert!(kept * 100 >= of * 95, "{kept} of {of}");
    drop(proxies);
    drop(agg);
}
