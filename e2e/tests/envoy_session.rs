//! End to end with sessions: a real Envoy (`envoy/kvoy.yaml`, `--concurrency 2`) with the
//! built `kvoy_session` and `kvoy_prefix_affinity` filters, an in-process kvoy-aggregator, and
//! three in-process kvoy-sim simulators on 127.0.0.1.
//!
//! - a 20-turn conversation keyed by `x-session-id`, each turn with unrelated text (so prefix
//!   affinity alone would scatter it), stays on one simulator;
//! - a 20-turn Responses API chain (`previous_response_id`, no header) stays too: every turn
//!   finds its previous response (a simulator answers 404 for one it does not hold);
//! - killing the session's simulator moves the session to another one, where it sticks.
//!
//! Needs `envoy` on PATH and the release wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvoy_aggregator::local::AggregatedEndpoint;
use kvoy_shared::session::decode_token;
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{
    http::{self, Response},
    wait_for, PoolEndpoint, Stack, StackConfig,
};
use serde_json::{json, Value};

const NAME: &str = "session";
const MODEL: &str = "kvoy-demo";
const TIMEOUT: Duration = Duration::from_secs(30);

fn chat(envoy: SocketAddr, session: Option<&str>, turn: usize) -> Response {
    // Unrelated text per turn: no shared prefix to follow.
    let body = serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": format!("{turn}: {}", "zyx wvu tsr ".repeat(turn % 7 + 1))}]}))
    .unwrap();
    let headers: Vec<(&str, &str)> = session
        .map(|s| vec![("x-session-id", s)])
        .unwrap_or_default();
    http::post_json(envoy, "/v1/chat/completions", &headers, &body, TIMEOUT).unwrap()
}

fn served(r: &Response) -> String {
    r.header(kvoy_testkit::SERVED_BY_HEADER)
        .unwrap_or("?")
        .to_owned()
}

#[test]
fn sessions_stick_move_when_their_endpoint_dies_and_stick_again() {
    let mut fleets: Vec<Option<SimFleet>> = (0..3)
        .map(|_| {
            let f = SimFleet::loopback(1, &["--model", MODEL, "--speedup", "20"]).unwrap();
            Some(f)
        })
        .collect();
    let addrs: Vec<SocketAddr> = fleets
        .iter()
        .map(|f| f.as_ref().unwrap().addrs()[0])
        .collect();
    let run_dir = common::run_dir(NAME);
    let endpoints = AggregatedEndpoint::scraped(&addrs, MODEL);
    let agg = common::start_aggregator(
        &run_dir,
        "scrape_interval_ms: 50\nstale_after_ms: 1000\n",
        &endpoints,
    );
    let pool = PoolEndpoint::all(&addrs, &[MODEL]);
    let mut config = StackConfig::new(pool, run_dir.clone());
    config.aggregator = Some(agg.addr());
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{NAME}] {e:#}"));
    eprintln!(
        "[{NAME}] envoy {}, aggregator {}, simulators {addrs:?}",
        stack.listen,
        agg.addr()
    );
    wait_for("the aggregator's view", Duration::from_secs(10), || {
        http::get(agg.addr(), "/v1/endpoints", Duration::from_secs(5))
            .ok()
            .and_then(|r| r.json().ok())
            .is_some_and(|v: Value| v["pool"]["ready"] == 3)
    });
    std::thread::sleep(Duration::from_millis(400));

    // Control: without a session these turns scatter.
    let mut scattered = BTreeMap::new();
    for turn in 0..20 {
        *scattered
            .entry(served(&chat(stack.listen, None, turn)))
            .or_insert(0) += 1;
    }
    eprintln!("[{NAME}] without a session: {scattered:?}");
    assert!(
        scattered.len() > 1,
        "the control should spread: {scattered:?}"
    );

    // 20 turns of one x-session-id: one simulator, named by the token too.
    let mut home = None;
    for turn in 0..20 {
        let r = chat(stack.listen, Some("conversation-1"), turn);
        assert_eq!(r.status, 200, "{}", r.text());
        let s = served(&r);
        let token = r
            .header("x-session-token")
            .and_then(decode_token)
            .map(|a| a.to_string());
        assert_eq!(
            token.as_deref(),
            Some(s.as_str()),
            "the token names the server"
        );
        assert_eq!(home.get_or_insert(s.clone()), &s, "turn {turn} moved");
    }
    let home = home.unwrap();
    eprintln!("[{NAME}] x-session-id conversation: 20 turns on {home}");

    // A 20-turn Responses API chain, keyed by previous_response_id only.
    let mut previous: Option<String> = None;
    let mut chain_home = None;
    for turn in 0..20 {
        let mut body = json!({"model": MODEL, "max_output_tokens": 2,
            "input": format!("turn {turn}: {}", "qpo nml ".repeat(turn % 5 + 1))});
        if let Some(p) = &previous {
            body["previous_response_id"] = json!(p);
        }
        let r = http::post_json(
            stack.listen,
            "/v1/responses",
            &[],
            &serde_json::to_vec(&body).unwrap(),
            TIMEOUT,
        )
        .unwrap();
        assert_eq!(r.status, 200, "turn {turn}: {}", r.text());
        let v = r.json().unwrap();
        previous = Some(v["id"].as_str().unwrap().to_owned());
        let s = served(&r);
        assert_eq!(chain_home.get_or_insert(s.clone()), &s, "turn {turn} moved");
    }
    eprintln!(
        "[{NAME}] Responses API chain: 20 turns on {}",
        chain_home.unwrap()
    );

    // Kill the session's simulator: the session moves (turns may fail while the aggregator
    // notices, as a client would retry them), then sticks to its new home.
    let victim = addrs.iter().position(|a| a.to_string() == home).unwrap();
    drop(fleets[victim].take());
    let killed = Instant::now();
    let mut failed = 0;
    let mut moved_after = None;
    let mut new_home = None;
    let mut turn = 100;
    while new_home.is_none() {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "the session never moved"
        );
        let r = chat(stack.listen, Some("conversation-1"), turn);
        turn += 1;
        if r.status == 200 {
            new_home = Some(served(&r));
            moved_after = Some(killed.elapsed());
        } else {
            failed += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let new_home = new_home.unwrap();
    assert_ne!(new_home, home);
    eprintln!(
        "[{NAME}] {home} killed: the session moved to {new_home} after {moved_after:?} ({failed} failed turns)"
    );
    for t in 0..15 {
        let r = chat(stack.listen, Some("conversation-1"), 200 + t);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(served(&r), new_home, "turn {t} after the move");
    }

    stack.assert_no_wasm_failures(NAME);
    drop(stack);
    drop(agg);
    drop(fleets);
    let _ = std::fs::remove_dir_all(&run_dir);
}
