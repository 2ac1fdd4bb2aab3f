//! Prefill/decode disaggregation between two simulators, in llm-d's sidecar protocol: the
//! decode server asks the prefiller named in `x-prefiller-host-port` to prefill, pulls the KV
//! and decodes with it cached; a dead prefiller costs time, never the request.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use kvoy_shared::Role;
use kvoy_sim::engine::Profile;
use kvoy_sim::server::HttpOptions;

use common::{options, request, request_with, start_with};

const PREFILLER: &str = "x-prefiller-host-port";

fn with_role(role: Role) -> HttpOptions {
    HttpOptions {
        role,
        ..options(20.0)
    }
}

/// The value of counter `name` in `addr`'s `/metrics`.
async fn counter(addr: std::net::SocketAddr, name: &str) -> f64 {
    let text = request(addr, "GET", "/metrics", "").await.body;
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

fn chat(text: &str, stream: bool) -> String {
    serde_json::json!({"model": "m", "max_tokens": 4, "stream": stream,
        "messages": [{"role": "user", "content": text}]})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_prefiller_prefills_and_the_decoder_decodes_with_its_kv() {
    let profile = Profile::llama_8b_h100();
    let (prefill, _) = start_with(profile.clone(), with_role(Role::Prefill)).await;
    let (decode, _) = start_with(profile, with_role(Role::Decode)).await;
    let target = prefill.to_string();
    let long = "Disaggregate this long prompt please. ".repeat(800);
    for (i, stream) in [false, true].into_iter().enumerate() {
        let prompt = format!("{i} {long}");
        let r = request_with(
            decode,
            "POST",
            "/v1/chat/completions",
            &chat(&prompt, stream),
            &[(PREFILLER, &target)],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        if stream {
            assert!(r.body.contains("data: [DONE]"), "{}", r.body);
        } else {
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["usage"]["completion_tokens"], 4, "the client's own limit");
            assert!(v.get("kv_transfer_params").is_none(), "{v}");
            // The KV arrived: nearly the whole prompt counts as cached at the decoder.
            let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            assert!(cached + 16 >= prompt_tokens, "{cached} of {prompt_tokens}");
        }
    }
    assert_eq!(counter(decode, "kvoy_sim_remote_prefills_total").await, 2.0);
    assert_eq!(
        counter(decode, "kvoy_sim_remote_prefill_fallbacks_total").await,
        0.0
    );
    assert_eq!(
        counter(prefill, "kvoy_sim_prefills_for_remote_decode_total").await,
        2.0
    );
    // The prefiller generated one token per request, the decoder four.
    assert_eq!(counter(prefill, "vllm:generation_tokens_total").await, 2.0);
    assert_eq!(counter(decode, "vllm:generation_tokens_total").await, 8.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_server_answers_with_the_transfer_parameters() {
    let (prefill, _) = start_with(Profile::llama_8b_h100(), with_role(Role::Prefill)).await;
    let body = serde_json::json!({"model": "m", "max_tokens": 1, "stream": false,
        "messages": [{"role": "user", "content": "x ".repeat(400)}],
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}})
    .to_string();
    let r = request(prefill, "POST", "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200);
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let p = &v["kv_transfer_params"];
    assert_eq!(p["do_remote_prefill"], true);
    assert_eq!(p["remote_port"], prefill.port());
    assert!(!p["remote_block_ids"].as_array().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefiller_or_a_bad_header_falls_back_to_decoding_alone() {
    let (decode, _) = start_with(Profile::llama_8b_h100(), with_role(Role::Decode)).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let started = std::time::Instant::now();
    for (target, counted) in [(dead.as_str(), 1.0), ("not an address", 1.0)] {
        let r = request_with(
            decode,
            "POST",
            "/v1/chat/completions",
            &chat("a prompt", false),
            &[(PREFILLER, target)],
        )
        .await;
        assert_eq!(r.status, 200, "{target}: {}", r.body);
        assert_eq!(
            counter(decode, "kvoy_sim_remote_prefill_fallbacks_total").await,
            counted,
            "{target}: an address that does not parse is not tried"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    // A prefill-only server follows no header: it serves what it gets.
    let (prefill, _) = start_with(Profile::llama_8b_h100(), with_role(Role::Prefill)).await;
    let r = request_with(
        prefill,
        "POST",
        "/v1/chat/completions",
        &chat("a prompt", false),
        &[(PREFILLER, &dead)],
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        counter(prefill, "kvoy_sim_remote_prefill_fallbacks_total").await,
        0.0
    );
}
