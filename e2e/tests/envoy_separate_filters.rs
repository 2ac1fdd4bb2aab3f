//! End to end with the three separate filters (`envoy/kvoy-separate.yaml`: `kvoy_session`,
//! `kvoy_admission`, `kvoy_prefix_affinity`) in a real Envoy (`--concurrency 2`) in front of
//! three echo backends, for those who compose them: requests are routed to pool members, a
//! client's destination and internal pin headers never choose the upstream, a session sticks
//! to its endpoint across workers, and the filters fail nowhere. The other end-to-end tests run
//! the combined `kvoy` filter (`envoy/kvoy.yaml`).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use kvoy_testkit::{
    http::post_json, served_by, EchoConfig, EchoServer, FilterLayout, PoolEndpoint, Stack,
    StackConfig,
};

const MODEL: &str = "kvoy-demo";
const TIMEOUT: Duration = Duration::from_secs(30);

fn chat(user: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": MODEL, "messages": [
        {"role": "system", "content": "You are a helpful assistant for the separate-filter test."},
        {"role": "user", "content": user},
    ]}))
    .unwrap()
}

#[test]
fn the_separate_filters_route_pin_and_guard_the_upstream() {
    let name = "separate-filters";
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let pool: Vec<EchoServer> = EchoServer::loopback(3, &[MODEL]).unwrap();
    let outsider = EchoServer::start(EchoConfig::new(any, &[MODEL])).unwrap();
    let addrs: Vec<String> = pool.iter().map(|b| b.addr().to_string()).collect();
    let run_dir = common::run_dir(name);
    let mut config = StackConfig::new(
        PoolEndpoint::all(
            &pool.iter().map(EchoServer::addr).collect::<Vec<_>>(),
            &[MODEL],
        ),
        run_dir,
    );
    config.layout = FilterLayout::Separate;
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{name}] {e:#}"));
    let rendered = std::fs::read_to_string(&stack.config_path).unwrap();
    for filter in [
        "kvoy_session.wasm",
        "kvoy_admission.wasm",
        "kvoy_prefix_affinity.wasm",
    ] {
        assert!(
            rendered.contains(filter),
            "[{name}] {filter} in the bootstrap"
        );
    }
    assert!(
        !rendered.contains("/kvoy.wasm"),
        "[{name}] not the combined filter"
    );

    let outsider_addr = outsider.addr().to_string();
    for i in 0..12 {
        let headers = [
            ("x-gateway-destination-endpoint", outsider_addr.as_str()),
            ("x-kvoy-session-endpoint", outsider_addr.as_str()),
        ];
        let r = post_json(
            stack.listen,
            "/v1/chat/completions",
            &headers,
            &chat(&format!("question {i}")),
            TIMEOUT,
        )
        .unwrap();
        assert_eq!(r.status, 200, "[{name}] {i}: {}", r.text());
        served_by(&r, &addrs, name, "a forged destination");
    }
    // A session: its first answer binds it, every later turn (on either worker) follows.
    let first = post_json(
        stack.listen,
        "/v1/chat/completions",
        &[("x-session-id", "sep-1")],
        &chat("turn 0"),
        TIMEOUT,
    )
    .unwrap();
    let home = served_by(&first, &addrs, name, "turn 0");
    for turn in 1..8 {
        let r = post_json(
            stack.listen,
            "/v1/chat/completions",
            &[("x-session-id", "sep-1")],
            &chat(&format!("a different turn {turn}")),
            TIMEOUT,
        )
        .unwrap();
        assert_eq!(
            served_by(&r, &addrs, name, "a later turn"),
            home,
            "[{name}] turn {turn}"
        );
    }
    let stats = stack.stats("kvoy_session_hits").unwrap();
    assert!(
        stats.values().any(|v| *v >= 7),
        "[{name}] the session filter pinned the later turns: {stats:?}"
    );
    stack.assert_no_wasm_failures(name);
}
