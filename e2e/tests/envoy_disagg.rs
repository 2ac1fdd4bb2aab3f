//! Prefill/decode disaggregation end to end: a real Envoy with the `kvoy` filter in front of two
//! prefill and two decode kvoy-sim (`--role prefill`, `--role decode`, the decode side running
//! llm-d's sidecar protocol). A long prompt is sent to a decode simulator with a prefill one
//! named in `x-prefiller-host-port`, which prefills it; a short one (below
//! `disaggregation.non_cached_tokens`) is served whole by a decode simulator; with every
//! prefill server down, long prompts are prefilled by the decode side (no request fails).
//!
//! Needs `envoy` on PATH and the built `kvoy.wasm` (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{MODEL, TIMEOUT};

use std::net::SocketAddr;

use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::http::{self, sse_data};
use kvoy_testkit::requests::prose;
use kvoy_testkit::{PoolEndpoint, StackConfig};
use serde_json::{json, Value};

const NAME: &str = "envoy_disagg";
const SPEEDUP: &str = "20";
/// Split from this many tokens not cached at the decode endpoint.
const THRESHOLD: u32 = 2_000;

/// Counter `name` of a simulator's `/metrics`.
fn sim_counter(addr: SocketAddr, name: &str) -> f64 {
    let text = http::get(addr, "/metrics", TIMEOUT).unwrap().text();
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("[{NAME}] no {name} at {addr}"))
}

fn total(addrs: &[SocketAddr], name: &str) -> f64 {
    addrs.iter().map(|a| sim_counter(*a, name)).sum()
}

fn chat(text: &str, stream: bool) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 8, "stream": stream,
        "messages": [{"role": "user", "content": text}]}))
    .unwrap()
}

#[test]
fn long_prompts_are_prefilled_elsewhere_short_ones_whole_and_a_dead_prefiller_costs_nothing() {
    let sim = |role: &str| {
        SimFleet::loopback(2, &["--model", MODEL, "--speedup", SPEEDUP, "--role", role])
            .unwrap_or_else(|e| panic!("[{NAME}] kvoy-sim --role {role}: {e:#}"))
    };
    let decode = sim("decode");
    let prefill = sim("prefill");
    let (d, p) = (decode.addrs().to_vec(), prefill.addrs().to_vec());
    let mut endpoints: Vec<Value> = d
        .iter()
        .map(|a| json!({"address": a.to_string(), "models": [MODEL], "role": "decode"}))
        .collect();
    endpoints.extend(
        p.iter()
            .map(|a| json!({"address": a.to_string(), "models": [MODEL], "role": "prefill"})),
    );
    let mut all = d.clone();
    all.extend(&p);
    let mut config = StackConfig::new(PoolEndpoint::all(&all, &[MODEL]), common::run_dir(NAME));
    config.extra_config = Some(json!({
        "endpoints": endpoints,
        "disaggregation": {"non_cached_tokens": THRESHOLD},
    }));
    let stack = common::start_stack(NAME, &config);
    let decoders: Vec<String> = d.iter().map(ToString::to_string).collect();
    let send = |body: &[u8], what: &str| {
        let r = http::post_json(stack.listen, "/v1/chat/completions", &[], body, TIMEOUT)
            .unwrap_or_else(|e| panic!("[{NAME}] {what}: {e}"));
        common::assert_ok(NAME, what, &r);
        let served = kvoy_testkit::served_by(&r, &decoders, NAME, what);
        (served, r.text())
    };

    // Long prompts (about 8,000 tokens, each its own): split, streaming and not.
    let long = 4;
    for i in 0..long {
        let stream = i % 2 == 1;
        let text = prose(
            &format!("long {i}"),
            "Summarise the incident report. ",
            32 * 1024,
        );
        let (_, body) = send(&chat(&text, stream), &format!("long {i}"));
        if stream {
            assert!(
                sse_data(&body).contains(&"[DONE]"),
                "[{NAME}] long {i}: {body}"
            );
        }
    }
    assert_eq!(total(&d, "kvoy_sim_remote_prefills_total"), long as f64);
    assert_eq!(
        total(&p, "kvoy_sim_prefills_for_remote_decode_total"),
        long as f64
    );
    assert_eq!(total(&d, "kvoy_sim_remote_prefill_fallbacks_total"), 0.0);
    // Each prefill server generated one token per prefill; nothing else reached them.
    assert_eq!(total(&p, "vllm:generation_tokens_total"), long as f64);

    // Short prompts (about 250 tokens): whole, on a decode server.
    for i in 0..6 {
        let text = prose(&format!("short {i}"), "A quick question. ", 1_000);
        send(&chat(&text, i % 2 == 0), &format!("short {i}"));
    }
    assert_eq!(total(&d, "kvoy_sim_remote_prefills_total"), long as f64);
    assert_eq!(
        total(&p, "kvoy_sim_prefills_for_remote_decode_total"),
        long as f64
    );
    let split =
        common::eviction::proxy_counter(&stack, "kvoy_prefix_affinity_disaggregated", false)
            .unwrap();
    assert_eq!(
        split, long as u64,
        "[{NAME}] the filter's count of split requests"
    );

    // Every prefill server down: a long prompt is still split (the static pool has no health),
    // and the decode side prefills it itself.
    drop(prefill);
    for i in 0..3 {
        let text = prose(
            &format!("orphan {i}"),
            "Summarise the incident report. ",
            32 * 1024,
        );
        send(&chat(&text, i == 1), &format!("orphan {i}"));
    }
    assert_eq!(total(&d, "kvoy_sim_remote_prefill_fallbacks_total"), 3.0);
    stack.finish(NAME);
}
