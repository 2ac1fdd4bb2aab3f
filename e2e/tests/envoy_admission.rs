//! End to end with admission control: a real Envoy (`--concurrency 1`: the queue order holds
//! within one worker; see `kvoy_shared::admission` for what holds across workers) with the three kvoy
//! filters in front of one kvoy-sim simulator at real speed, the admission filter limiting
//! this proxy to 2 requests in flight. Held requests are resumed by Envoy when capacity frees
//! (a request completes), interactive ones before batch ones; a request held past the queue
//! TTL gets 429 with `x-kvoy-dropped-reason: ttl-expired`; a sheddable one is refused at once.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{http, PoolEndpoint, Stack, StackConfig};
use serde_json::json;

const NAME: &str = "admission";
const MODEL: &str = "kvoy-demo";

fn body(tokens: u32) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hello there"}]}))
    .unwrap()
}

/// Sends a request in the background; reports (label, status, reason header, finished at).
fn spawn(
    envoy: SocketAddr,
    label: &'static str,
    objective: &'static str,
    tokens: u32,
    start: Instant,
    tx: &mpsc::Sender<(&'static str, u16, Option<String>, Duration)>,
) {
    let tx = tx.clone();
    std::thread::spawn(move || {
        let headers = [
            ("x-gateway-inference-objective", objective),
            ("x-gateway-inference-fairness-id", label),
        ];
        let r = http::post_json(
            envoy,
            "/v1/chat/completions",
            &headers,
            &body(tokens),
            Duration::from_secs(60),
        )
        .unwrap();
        let reason = r.header("x-kvoy-dropped-reason").map(str::to_owned);
        let _ = tx.send((label, r.status, reason, start.elapsed()));
    });
}

#[test]
fn held_requests_resume_in_priority_order_and_expire() {
    let sims = SimFleet::loopback(1, &["--model", MODEL, "--speedup", "1"]).unwrap();
    let run_dir = common::run_dir(NAME);
    let mut config = StackConfig::new(
        vec![PoolEndpoint::new(sims.addrs()[0], &[MODEL])],
        run_dir.clone(),
    );
    config.admission_config = Some(
        json!({"endpoints": 1, "tick_ms": 10, "flow": {
            "saturation": {"max_inflight_per_endpoint": 2},
            "objectives": {"interactive": 10, "batch": 0, "scavenger": -1},
            "queue_ttl_ms": 1500}})
        .to_string(),
    );
    config.concurrency = 1;
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{NAME}] {e:#}"));
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    // Two batch requests take both slots and end one after the other (~0.7 s, ~1.4 s).
    spawn(stack.listen, "batch-running-1", "batch", 100, start, &tx);
    spawn(stack.listen, "batch-running-2", "batch", 200, start, &tx);
    std::thread::sleep(Duration::from_millis(150));
    // Then a batch request and an interactive one wait; the interactive one must go first.
    spawn(stack.listen, "batch-held", "batch", 2, start, &tx);
    std::thread::sleep(Duration::from_millis(50));
    spawn(
        stack.listen,
        "interactive-held",
        "interactive",
        2,
        start,
        &tx,
    );
    std::thread::sleep(Duration::from_millis(50));
    // A sheddable request is refused at once.
    let shed = http::post_json(
        stack.listen,
        "/v1/chat/completions",
        &[("x-gateway-inference-objective", "scavenger")],
        &body(2),
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert_eq!(shed.header("x-kvoy-dropped-reason"), Some("saturated"));
    let mut done = Vec::new();
    for _ in 0..4 {
        done.push(rx.recv_timeout(Duration::from_secs(30)).unwrap());
    }
    eprintln!("[{NAME}] completions: {done:?}");
    for (label, status, _, _) in &done {
        assert_eq!(*status, 200, "{label}");
    }
    let at = |l: &str| done.iter().find(|d| d.0 == l).unwrap().3;
    // Nothing held ran before a slot freed; the first free slot went to the interactive
    // request (it came later), the batch one ran when the interactive one was done.
    assert!(at("interactive-held") > at("batch-running-1"), "{done:?}");
    assert!(
        at("batch-held") > at("interactive-held"),
        "interactive first: {done:?}"
    );

    // Hold one behind two long ones for longer than the TTL (1.5 s): 429 ttl-expired.
    let start = Instant::now();
    spawn(stack.listen, "long-1", "batch", 300, start, &tx);
    spawn(stack.listen, "long-2", "batch", 300, start, &tx);
    std::thread::sleep(Duration::from_millis(150));
    spawn(stack.listen, "expires", "batch", 2, start, &tx);
    let mut expired = None;
    for _ in 0..3 {
        let d = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        if d.0 == "expires" {
            expired = Some(d);
        }
    }
    let (_, status, reason, at) = expired.unwrap();
    eprintln!("[{NAME}] held past the TTL: {status} {reason:?} after {at:?}");
    assert_eq!((status, reason.as_deref()), (429, Some("ttl-expired")));
    stack.assert_no_wasm_failures(NAME);
    drop(stack);
    let _ = std::fs::remove_dir_all(&run_dir);
}
