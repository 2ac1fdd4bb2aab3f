//! `kvoy-local serve` in front of kvoy-sim simulators (and echo backends), with the scenarios
//! the real-Envoy end-to-end tests run (`e2e/tests/envoy_prefix_affinity.rs`,
//! `envoy_kvoy_sim.rs`, `envoy_admission.rs`): same-prefix conversations stick and hit the KV
//! cache, distinct prefixes spread, forged destination headers are ignored, bad requests get
//! OpenAI errors, streams are relayed, a burst is spread, admission holds, releases and sheds.
//!
//! Needs the built filters (`make wasm`; `KVOY_WASM_DIR` overrides where they are looked up).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{
    http::{self, Response},
    prefix_affinity_config, EchoConfig, EchoServer, PoolEndpoint, DESTINATION_HEADER,
    SERVED_BY_HEADER,
};
use serde_json::{json, Value};

use common::serial;
use kvoy_testkit::http::sse_data;
use kvoy_testkit::requests::{chat_body, prompt};
use kvoy_testkit::scenario;

const MODEL: &str = "kvoy-demo";
const TIMEOUT: Duration = Duration::from_secs(30);

fn sims(count: usize, speedup: &str) -> SimFleet {
    SimFleet::loopback(count, &["--model", MODEL, "--speedup", speedup])
        .expect("kvoy-sim simulators")
}

fn pool(addrs: &[SocketAddr]) -> Vec<PoolEndpoint> {
    PoolEndpoint::all(addrs, &[MODEL])
}

fn addrs(pool: &[PoolEndpoint]) -> Vec<String> {
    pool.iter().map(|p| p.address.to_string()).collect()
}

/// The default chain (as `Stack` configures Envoy) over `pool`.
fn default_chain(pool: &[PoolEndpoint], max_body: Option<u64>) -> Value {
    let prefix = prefix_affinity_config(pool, max_body, None);
    let admission = json!({"endpoints": pool.len()}).to_string();
    common::chain_config("{}", &admission, &prefix, 2)
}

fn post(listen: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
    http::post_json(listen, path, headers, body, TIMEOUT)
        .unwrap_or_else(|e| panic!("POST {path} through kvoy-local failed: {e}"))
}

fn ok(r: &Response, pool: &[String], what: &str) -> String {
    assert_eq!(
        r.status,
        200,
        "{what}: status {}, body {}",
        r.status,
        r.text()
    );
    kvoy_testkit::served_by(r, pool, "kvoy-local", what)
}

fn usage(v: &Value) -> (u64, u64) {
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (prompt, cached)
}

#[test]
fn shared_prefix_conversations_stick_and_hit_the_kv_cache() {
    let _serial = serial();
    let fleet = sims(3, "20");
    let pool = pool(fleet.addrs());
    let members = addrs(&pool);
    let server = common::serve("sim_cache", &default_chain(&pool, None));
    let (groups, turns) = (4, 4);
    let mut conversations: Vec<Vec<Value>> = (0..groups)
        .map(|g| {
            vec![json!({"role": "system", "content": prompt(&format!("group-{g}"), 24 * 1024)})]
        })
        .collect();
    let (mut prompt_tokens, mut cached_tokens) = (0, 0);
    let mut placement: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for turn in 0..turns {
        for (g, messages) in conversations.iter_mut().enumerate() {
            messages.push(
                json!({"role": "user", "content": format!("Turn {turn}: setting {g}.{turn}?")}),
            );
            let body = serde_json::to_vec(
                &json!({"model": MODEL, "max_tokens": 16, "messages": messages}),
            )
            .unwrap();
            let what = format!("group {g} turn {turn}");
            let r = post(server.addr(), "/v1/chat/completions", &[], &body);
            placement
                .entry(g)
                .or_default()
                .insert(ok(&r, &members, &what));
            let v = r.json().unwrap();
            let (p, c) = usage(&v);
            prompt_tokens += p;
            cached_tokens += c;
            let answer = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    let ratio = cached_tokens as f64 / prompt_tokens.max(1) as f64;
    eprintln!("[sim_cache] cached {cached_tokens} / prompt {prompt_tokens} = {ratio:.3}; placement {placement:?}");
    for (g, homes) in &placement {
        assert_eq!(
            homes.len(),
            1,
            "group {g} should stay on one simulator: {homes:?}"
        );
    }
    assert!(
        ratio > 0.7,
        "cached/prompt tokens should exceed 0.7, was {ratio:.3}"
    );
    let stats = common::local_stats(&server);
    assert_eq!(
        stats["kvoy_prefix_affinity_decisions_total"],
        (groups * turns) as i64
    );
}

#[test]
fn streams_are_relayed_and_stick() {
    let _serial = serial();
    let fleet = sims(3, "20");
    let pool = pool(fleet.addrs());
    let members = addrs(&pool);
    let server = common::serve("sim_stream", &default_chain(&pool, None));
    let body = serde_json::to_vec(&json!({
        "model": MODEL, "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 8,
        "messages": [
            {"role": "system", "content": prompt("stream", 4096)},
            {"role": "user", "content": "Stream me a short answer."},
        ],
    }))
    .unwrap();
    let mut homes = Vec::new();
    for attempt in 0..2 {
        let what = format!("streaming request {attempt}");
        let r = post(server.addr(), "/v1/chat/completions", &[], &body);
        homes.push(ok(&r, &members, &what));
        assert!(r
            .header("content-type")
            .is_some_and(|v| v.starts_with("text/event-stream")));
        let text = r.text();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{what}: {text}");
        let last_usage: Value = sse_data(&text)
            .iter()
            .rev()
            .filter(|d| **d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find(|c| c["usage"].is_object())
            .unwrap_or_else(|| panic!("{what}: no usage chunk: {text}"));
        if attempt == 1 {
            assert_eq!(homes[0], homes[1], "the repeated stream should stick");
            assert!(
                usage(&last_usage).1 > 0,
                "the repeated stream should hit the cache"
            );
        }
    }
    let r = http::get(server.addr(), "/v1/models", TIMEOUT).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json().unwrap()["data"][0]["id"], MODEL);
    assert!(r
        .header(SERVED_BY_HEADER)
        .is_some_and(|s| members.iter().any(|m| m == s)));
}

#[test]
fn distinct_prefixes_spread_and_forged_destinations_are_ignored() {
    let _serial = serial();
    let fleet = sims(3, "20");
    let pool = pool(fleet.addrs());
    let members = addrs(&pool);
    let outsider =
        EchoServer::start(EchoConfig::new("127.0.0.1:0".parse().unwrap(), &[MODEL])).unwrap();
    let server = common::serve("sim_spread", &default_chain(&pool, None));
    let mut dist: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..30 {
        let system = prompt(&format!("tenant-{i:03}-{}", i * 7919 % 1000), 2048);
        let body = serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]})).unwrap();
        let r = post(server.addr(), "/v1/chat/completions", &[], &body);
        *dist
            .entry(ok(&r, &members, &format!("distinct prefix {i}")))
            .or_default() += 1;
    }
    eprintln!("[sim_spread] distribution {dist:?}");
    for m in &members {
        assert!(
            dist.get(m).copied().unwrap_or(0) > 0,
            "{m} got none of 30 distinct prefixes: {dist:?}"
        );
    }

    let system = prompt("forgery-system-prompt", 4096);
    let bind = chat_body(MODEL, &system, "bind this prefix");
    let home = ok(
        &post(server.addr(), "/v1/chat/completions", &[], &bind),
        &members,
        "binding request",
    );
    let other = members.iter().find(|m| **m != home).unwrap().clone();
    let outsider_addr = outsider.addr().to_string();
    for forged in [outsider_addr.as_str(), "127.0.0.1:1", other.as_str()] {
        let body = chat_body(MODEL, &system, &format!("forged {forged}"));
        let r = post(
            server.addr(),
            "/v1/chat/completions",
            &[(DESTINATION_HEADER, forged)],
            &body,
        );
        let served = ok(&r, &members, &format!("forging {forged}"));
        assert_eq!(
            served, home,
            "forging {DESTINATION_HEADER}: {forged} moved the request"
        );
    }
    assert_eq!(
        outsider.requests(),
        0,
        "the backend outside the pool received a request"
    );
}

fn assert_openai_error(r: &Response, status: u16, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    assert!(
        r.header(SERVED_BY_HEADER).is_none(),
        "{what}: answered by a backend"
    );
    let v: Value = r
        .json()
        .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", r.text()));
    for field in ["message", "type"] {
        assert!(
            v["error"][field].is_string(),
            "{what}: error.{field} missing: {v}"
        );
    }
    assert!(
        v["error"].get("code").is_some(),
        "{what}: error.code missing: {v}"
    );
}

#[test]
fn bad_requests_get_openai_errors() {
    let _serial = serial();
    let fleet = sims(2, "20");
    let pool = pool(fleet.addrs());
    let server = common::serve("sim_errors", &default_chain(&pool, Some(1024 * 1024)));
    let listen = server.addr();
    let r = post(
        listen,
        "/v1/chat/completions",
        &[],
        b"{\"model\": \"kvoy-demo\", \"messages\": [",
    );
    assert_openai_error(&r, 400, "malformed JSON");
    let big = chat_body(MODEL, &prompt("too-big", 2 * 1024 * 1024), "hi");
    assert_openai_error(
        &post(listen, "/v1/chat/completions", &[], &big),
        413,
        "2 MiB body",
    );
    let unknown = chat_body("no-such-model", "", "hi");
    assert_openai_error(
        &post(listen, "/v1/chat/completions", &[], &unknown),
        404,
        "unknown model",
    );
    let stats = common::local_stats(&server);
    assert_eq!(stats["kvoy_prefix_affinity_errors_bad_request_total"], 1);
    assert_eq!(stats["kvoy_prefix_affinity_errors_body_too_large_total"], 1);
    assert_eq!(stats["kvoy_prefix_affinity_errors_unknown_model_total"], 1);
}

#[test]
fn a_concurrent_burst_is_not_piled_on_one_backend() {
    let _serial = serial();
    let backends: Vec<EchoServer> = EchoServer::loopback(3, &[MODEL]).unwrap();
    let pool = pool(&backends.iter().map(EchoServer::addr).collect::<Vec<_>>());
    let members = addrs(&pool);
    let server = common::serve("burst", &default_chain(&pool, None));
    let system = prompt("burst-system-prompt", 4096);
    let home = ok(
        &post(
            server.addr(),
            "/v1/chat/completions",
            &[],
            &chat_body(MODEL, &system, "warm-up"),
        ),
        &members,
        "warm-up",
    );
    let start = Instant::now();
    let burst = scenario::same_prefix_burst(server.addr(), MODEL, &system, 50, TIMEOUT);
    let mut dist: BTreeMap<String, usize> = BTreeMap::new();
    for (i, r) in burst.into_iter().enumerate() {
        let r = r.unwrap_or_else(|e| panic!("burst request {i}: {e}"));
        *dist
            .entry(ok(&r, &members, &format!("burst request {i}")))
            .or_default() += 1;
    }
    eprintln!(
        "[burst] 50 same-prefix requests in {:?}; home {home}; distribution {dist:?}",
        start.elapsed()
    );
    assert!(
        dist.len() >= 2,
        "a burst of 50 in-flight requests all went to one backend: {dist:?}"
    );
    assert!(
        dist.get(&home).copied().unwrap_or(0) >= 8,
        "the prefix home should take the first ones"
    );
}

#[test]
fn admission_holds_releases_in_priority_order_and_sheds() {
    let _serial = serial();
    let fleet = sims(1, "1");
    let pool = pool(fleet.addrs());
    let admission = scenario::admission_config();
    let prefix = prefix_affinity_config(&pool, None, None);
    let server = common::serve(
        "admission",
        &common::chain_config("{}", &admission, &prefix, 1),
    );
    let scenario::PriorityRun { shed, done } =
        scenario::priority_order(server.addr(), MODEL).unwrap();
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert_eq!(shed.header("x-kvoy-dropped-reason"), Some("saturated"));
    eprintln!("[admission] completions: {done:?}");
    for (label, status, _, _) in &done {
        assert_eq!(*status, 200, "{label}");
    }
    let at = |l: &str| done.iter().find(|d| d.0 == l).unwrap().3;
    assert!(at("interactive-held") > at("batch-running-1"), "{done:?}");
    assert!(
        at("batch-held") > at("interactive-held"),
        "interactive first: {done:?}"
    );

    // Both slots busy for longer than the TTL: the next batch request expires with 429.
    let (_, status, reason, at) = scenario::held_past_ttl(server.addr(), MODEL).unwrap();
    assert_eq!(
        (status, reason.as_deref()),
        (429, Some("ttl-expired")),
        "after {at:?}"
    );
    assert!(
        at >= Duration::from_millis(1400),
        "expired too early: {at:?}"
    );
    let stats = common::local_stats(&server);
    assert_eq!(stats["kvoy_admission_rejected_ttl_expired_total"], 1);
    assert_eq!(stats["kvoy_admission_rejected_saturated_total"], 1);
}
