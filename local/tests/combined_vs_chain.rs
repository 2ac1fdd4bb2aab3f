//! The combined `kvoy` filter against the three-filter chain of the same stage configurations:
//! the same requests, in the same order on the same workers, get the same decisions (endpoint
//! or local reply, status, headers and body bytes), the same headers upstream and on the
//! response (the served endpoint, the session token), and the same stage metrics. Sessions
//! (header, token, Responses API `previous_response_id` bound from the answer), every API shape,
//! refusals (bad path, too large, unknown model, bad JSON), and admission holds, releases, TTL
//! expiry and sheddable rejection with several requests open at once.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use kvoy_harness::{ChainState, FilterChain, HeaderMap, MetricType};
use kvoy_local::chain::{self, Callouts};
use kvoy_local::decide::{decide, DecideOptions, Outcome, RequestReport};
use kvoy_local::request::Request;
use serde_json::json;

const POOL: [&str; 3] = ["127.0.0.1:18001", "127.0.0.1:18002", "127.0.0.1:18003"];

fn prefix_config(extra: serde_json::Value) -> String {
    let mut config = json!({
        "endpoints": POOL.iter().map(|a| json!({"address": a, "models": ["m"]})).collect::<Vec<_>>(),
    });
    if let (Some(map), serde_json::Value::Object(extra)) = (config.as_object_mut(), extra) {
        map.extend(extra);
    }
    config.to_string()
}

fn req(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Request {
    Request {
        method: method.to_owned(),
        path: path.to_owned(),
        headers: headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect(),
        body: body.as_bytes().to_vec(),
    }
}

fn chat(user: &str, system: &str) -> String {
    json!({"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]})
    .to_string()
}

/// What must agree between the two layouts (timings and per-filter names left out).
fn decision(r: &RequestReport) -> String {
    let outcome = match &r.outcome {
        Outcome::LocalReply {
            status,
            headers,
            body,
            ..
        } => format!("reply {status} {headers:?} {body}"),
        Outcome::Routed { endpoint } => format!("routed {endpoint}"),
        other => format!("{other:?}"),
    };
    format!(
        "#{} {} {} w{}: {outcome}; up {:?}; resp {:?}; held {:?}",
        r.index, r.method, r.path, r.worker, r.upstream_headers, r.response_headers, r.held_ms
    )
}

/// The stage metrics (counters and gauges) of every filter of a chain, by name.
fn metrics(chain: &FilterChain) -> std::collections::BTreeMap<String, i64> {
    let mut all = std::collections::BTreeMap::new();
    for i in 0..chain.len() {
        for m in chain.plugin(i).unwrap().metrics() {
            if m.kind != MetricType::Histogram {
                all.insert(m.name, m.value);
            }
        }
    }
    all
}

#[test]
fn the_combined_filter_decides_as_the_three_filters_do() {
    let session = r#"{}"#;
    let admission = r#"{"endpoints": 3}"#;
    let prefix = prefix_config(json!({"on_invalid_body": "reject", "max_body_bytes": 4096}));
    let system = "You are a careful assistant. ".repeat(20);
    let big = "x".repeat(5000);
    let requests = vec![
        req("POST", "/v1/chat/completions", &[], &chat("one", &system)),
        req("POST", "/v1/chat/completions", &[], &chat("two", &system)),
        req(
            "POST",
            "/v1/chat/completions",
            &[("x-session-id", "alice")],
            &chat("a1", "other"),
        ),
        req(
            "POST",
            "/v1/chat/completions",
            &[("x-session-id", "alice")],
            &chat("a2", "different"),
        ),
        req(
            "POST",
            "/v1/completions",
            &[],
            &json!({"model": "m", "prompt": system}).to_string(),
        ),
        req(
            "POST",
            "/v1/responses",
            &[],
            &json!({"model": "m", "instructions": system, "input": "hi"}).to_string(),
        ),
        req(
            "POST",
            "/v1/responses",
            &[],
            &json!({"model": "m", "input": "next", "previous_response_id": "resp_1"}).to_string(),
        ),
        req(
            "POST",
            "/v1/embeddings",
            &[],
            &json!({"model": "m", "input": "embed me"}).to_string(),
        ),
        req("GET", "/v1/models", &[], ""),
        req(
            "POST",
            "/v1/chat/completions",
            &[("x-gateway-destination-endpoint", "10.9.9.9:80")],
            &chat("forged", &system),
        ),
        req(
            "POST",
            "/v1/chat/completions",
            &[("x-session-token", "bm90IGEgdG9rZW4")],
            &chat("bad token", &system),
        ),
        req(
            "POST",
            "/v1/chat%2Fcompletions",
            &[],
            &chat("bad path", &system),
        ),
        req("POST", "/v1/chat/completions", &[], &chat(&big, "")),
        req(
            "POST",
            "/v1/chat/completions",
            &[],
            &json!({"model": "nope", "messages": []}).to_string(),
        ),
        req("POST", "/v1/chat/completions", &[], "{not json"),
        req(
            "POST",
            "/v1/chat/completions",
            &[
                ("x-gateway-inference-objective", "batch"),
                ("x-gateway-inference-fairness-id", "f"),
            ],
            &chat("three", &system),
        ),
    ];
    let (three, _) = common::load(
        "combined-vs-chain",
        &common::chain_config(session, admission, &prefix, 2),
    );
    let (one, _) = common::load(
        "combined-vs-chain",
        &common::kvoy_config(Some(session), Some(admission), &prefix, 2),
    );
    let a = decide(&three, &requests, &DecideOptions::default()).unwrap();
    let b = decide(&one, &requests, &DecideOptions::default()).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(decision(x), decision(y));
    }
    assert_eq!(a.len(), b.len());
    // `decide` scores the combined filter's requests too (unpinned ones alike).
    assert!(b[0].scores.is_some());
    assert_eq!(a[0].scores, b[0].scores);
    // Sessions pinned, the forged destination overwritten, refusals answered.
    assert!(
        matches!(&b[3].outcome, Outcome::Routed { endpoint } if matches!(&b[2].outcome, Outcome::Routed { endpoint: e } if e == endpoint))
    );
    assert!(matches!(
        &b[11].outcome,
        Outcome::LocalReply { status: 400, .. }
    ));
    assert!(matches!(
        &b[12].outcome,
        Outcome::LocalReply { status: 413, .. }
    ));
}

/// Sends `body` on worker `w` with an objective and flow; returns the open stream.
fn open(chain: &FilterChain, w: usize, objective: &str, user: &str) -> kvoy_harness::ChainStream {
    let mut s = chain.stream(w).unwrap();
    let body = chat(user, "shared system prompt for the admission test");
    let mut headers = HeaderMap::from_pairs([
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gw"),
        ("x-gateway-inference-objective", objective),
        ("x-gateway-inference-fairness-id", "flow"),
    ]);
    headers.replace("content-length", &body.len().to_string());
    s.send_request(headers, body.as_bytes()).unwrap();
    s
}

fn state(s: &kvoy_harness::ChainStream) -> String {
    match s.state() {
        ChainState::Upstream => {
            let dest = s.upstream_request().and_then(|u| {
                u.headers
                    .get("x-gateway-destination-endpoint")
                    .map(str::to_owned)
            });
            format!("upstream {dest:?}")
        }
        ChainState::LocalReply { .. } => {
            let (_, r) = s.local_reply().unwrap();
            format!(
                "reply {} {:?}",
                r.status,
                r.headers.get("x-kvoy-dropped-reason")
            )
        }
        ChainState::Held { .. } => "held".to_owned(),
        other => format!("{other:?}"),
    }
}

/// Runs the admission scenario on `chain`; returns every step's states and the metrics.
fn admission_scenario(
    chain: &FilterChain,
) -> (Vec<String>, std::collections::BTreeMap<String, i64>) {
    let mut log = Vec::new();
    // Room for 3 x 1 in flight: three run, the next are held (two bands), a sheddable one shed.
    let mut running: Vec<_> = (0..3)
        .map(|i| open(chain, 0, "batch", &format!("r{i}")))
        .collect();
    let mut held_low = open(chain, 0, "batch", "low");
    let mut held_high = open(chain, 0, "interactive", "high");
    let shed = open(chain, 0, "scavenger", "shed");
    for s in running.iter().chain([&held_low, &held_high, &shed]) {
        log.push(state(s));
    }
    // One ends: the higher band goes first, routed before it is resumed.
    running.remove(0).finish().unwrap();
    held_high.pump().unwrap();
    held_low.pump().unwrap();
    log.push(format!(
        "after one ends: high {} low {}",
        state(&held_high),
        state(&held_low)
    ));
    // Nothing else ends: the low one's TTL runs out on the tick.
    chain.advance(Duration::from_millis(2500)).unwrap();
    held_low.pump().unwrap();
    log.push(format!("after the TTL: low {}", state(&held_low)));
    // A client that leaves while held is removed.
    let mut gone = open(chain, 0, "batch", "gone");
    log.push(format!("gone {}", state(&gone)));
    gone.finish().unwrap();
    for mut s in running.into_iter().chain([held_high, held_low, shed]) {
        s.finish().unwrap();
    }
    chain.advance(Duration::from_millis(100)).unwrap();
    (log, metrics(chain))
}

#[test]
fn admission_holds_releases_and_sheds_alike() {
    let admission = r#"{"endpoints": 3, "tick_ms": 10, "flow": {
        "saturation": {"max_inflight_per_endpoint": 1},
        "objectives": {"interactive": 10, "batch": 0, "scavenger": -1},
        "queue_ttl_ms": 2000}}"#;
    let prefix = prefix_config(json!({}));
    let (three, _) = common::load(
        "combined-admission",
        &common::chain_config("{}", admission, &prefix, 1),
    );
    let (one, _) = common::load(
        "combined-admission",
        &common::kvoy_config(Some("{}"), Some(admission), &prefix, 1),
    );
    let a = admission_scenario(&chain::start(&three, Callouts::Recorded, None).unwrap());
    let b = admission_scenario(&chain::start(&one, Callouts::Recorded, None).unwrap());
    assert_eq!(a.0, b.0);
    println!("{:#?}", b.0);
    assert!(b.0[3] == "held" && b.0[4] == "held", "{:?}", b.0);
    assert!(b.0[5].starts_with("reply 429"), "{:?}", b.0);
    assert!(
        b.0[6].contains("high upstream Some") && b.0[6].contains("low held"),
        "{:?}",
        b.0
    );
    assert!(
        b.0[7].contains("reply 429 Some(\"ttl-expired\")"),
        "{:?}",
        b.0
    );
    assert_eq!(a.1, b.1, "the same metrics by the same names");
    assert_eq!(b.1.get("kvoy_admission_inflight"), Some(&0));
    assert_eq!(b.1.get("kvoy_admission_queue_depth"), Some(&0));
    assert_eq!(b.1.get("kvoy_prefix_affinity_inflight"), Some(&0));
}
