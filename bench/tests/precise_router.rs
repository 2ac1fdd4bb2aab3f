//! vLLM's router in its precise mode (`vllm-router==0.1.17 --policy kv_aware`, static
//! `--kv-event-source` per worker) in front of two kvoy-sim simulators that tokenize with the
//! repository's tokenizer and publish their KV events. A prompt is first sent straight to one
//! simulator, bypassing the router: the router can only learn where it is cached from that
//! simulator's KV events. The same prompt through the router must then go to that simulator
//! (for each of the two, so a tie broken towards the first worker cannot pass the test), and
//! the router's own metrics must count the prefix lookups as hits and the render calls it made
//! on its request path. With kvoy-sim's former `kv@<addr>@<model>` topic every lookup missed.
//!
//! Skips, saying so, only when pip cannot reach PyPI to install the router; any other install
//! failure fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

mod common;

use kvoy_bench::live::routers::{KvEventSource, RouterKind, RouterProcess};
use kvoy_sim::fleet::PublishingSim;
use kvoy_testkit::http;

const MODEL: &str = "m";

fn chat(system: &str) -> Vec<u8> {
    serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "and what does that mean for today?"},
        ],
        "max_tokens": 2,
    })
    .to_string()
    .into_bytes()
}

fn complete(addr: SocketAddr, body: &[u8]) -> String {
    let r = http::send(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body,
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.header("x-served-by")
        .expect("kvoy-sim names who served")
        .to_owned()
}

#[test]
fn kv_aware_routes_a_prefix_to_the_simulator_whose_kv_events_hold_it() {
    let Some(binary) = common::installed_or_skip(RouterKind::VllmRouter, "the precise-router test")
    else {
        return;
    };
    let tokenizer = kvoy_bench::live::default_tokenizer().display().to_string();
    let flags = [
        "--model",
        MODEL,
        "--speedup",
        "20",
        "--tokenizer",
        &tokenizer,
    ];
    let sims: Vec<PublishingSim> = (0..2)
        .map(|_| PublishingSim::start(&flags, true).unwrap())
        .collect();
    let workers: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let sources: Vec<KvEventSource> = sims
        .iter()
        .map(|s| KvEventSource {
            worker: s.addr,
            endpoint: s.kv.clone(),
            replay: s.replay.clone(),
        })
        .collect();
    let dir = common::run_dir("kvoy-bench-precise-router");
    let router = RouterProcess::start(
        RouterKind::VllmRouter,
        &binary,
        "kv_aware",
        &workers,
        &RouterKind::kv_event_args(&sources, MODEL, 16),
        &dir,
    )
    .unwrap();
    let before = router.counters().unwrap();

    // Sent to the second simulator first, then the first: a tie goes to neither twice.
    let prompts: Vec<(usize, Vec<u8>)> = [1usize, 0]
        .into_iter()
        .map(|i| {
            let system = format!(
                "prompt {i}: you answer questions about the weather in many cities of the \
                 world, briefly and kindly, with numbers and units. "
            )
            .repeat(6);
            (i, chat(&system))
        })
        .collect();
    for (i, body) in &prompts {
        assert_eq!(complete(workers[*i], body), workers[*i].to_string());
    }
    // The events reach the router within milliseconds; give them a second on this busy machine.
    std::thread::sleep(Duration::from_secs(1));
    let routed: Vec<String> = prompts
        .iter()
        .map(|(_, body)| complete(router.listen, body))
        .collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|(i, _)| workers[*i].to_string())
        .collect();
    let counters = router.counters().unwrap().since(&before);
    eprintln!("[precise] routed {routed:?} (want {want:?}), counters {counters:?}");
    assert_eq!(routed, want, "{}", router.log_tail(20));
    assert!(
        counters.lookups("hit") >= 2,
        "the router's lookups counted no hits: {counters:?}"
    );
    assert!(
        counters.render_calls >= 2,
        "the router renders every request on a worker: {counters:?}"
    );
    drop(router);
    let _ = std::fs::remove_dir_all(&dir);
}
