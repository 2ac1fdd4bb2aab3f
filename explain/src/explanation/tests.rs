#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;

use super::*;
use kvoy_shared::request::Api;
use kvoy_shared::session::encode_token;
use kvoy_shared::snapshot::{EndpointStatus, SnapshotHistory};

const CHAT: &str = "/v1/chat/completions";

fn address(i: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], 8000 + i))
}

fn status(slot: u16) -> EndpointStatus {
    EndpointStatus {
        kv_cache_usage: 0.1,
        block_size: 16,
        capacity_blocks: 10_000,
        ..EndpointStatus::ready(slot, address(slot), &["m"])
    }
}

/// `GET /v1/snapshot`'s answer for these endpoints.
fn snapshot(endpoints: Vec<EndpointStatus>) -> Vec<u8> {
    let mut history = SnapshotHistory::new(3);
    history.update(endpoints);
    let mut out = Vec::new();
    history.delta_since(None, None).encode(&mut out);
    out
}

/// A page of `GET /v1/decisions`.
fn page(decisions: Vec<RelayedDecision>, cursor: u64) -> Vec<u8> {
    let mut out = Vec::new();
    DecisionBatch {
        proxy: 0,
        cursor,
        decisions,
        removals: None,
    }
    .encode(&mut out);
    out
}

fn chat(system: &str, user: &str) -> Vec<u8> {
    json!({"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
    .into_bytes()
}

fn explainer(endpoints: u16) -> Explainer {
    let mut e = Explainer::new("").unwrap();
    e.set_snapshot(&snapshot((0..endpoints).map(status).collect()))
        .unwrap();
    e
}

/// A proxy's router over the same pool: what the filter does with the same inputs.
fn proxy(endpoints: u16) -> Router {
    let mut r = Router::new(
        PluginConfig::from_json(DEFAULT_CONFIG.as_bytes()).unwrap(),
        9,
    );
    let mut history = SnapshotHistory::new(3);
    history.update((0..endpoints).map(status).collect());
    r.set_pool(snapshot_board::live_pool(&history.snapshot(), true));
    r
}

/// The keys a proxy records for `body` (what it relays).
fn keys_of(body: &[u8]) -> Vec<kvoy_shared::prefix::BlockKey> {
    let mut r = proxy(3);
    r.route_body(
        Api::ChatCompletions,
        body,
        &[Outstanding::default(); 3],
        Duration::ZERO,
    )
    .unwrap();
    r.last_keys().to_vec()
}

#[test]
fn a_prefix_relayed_to_one_endpoint_decides_as_in_the_proxy() {
    let system = "You are the explain panel's test assistant. ".repeat(30);
    let first = chat(&system, "question 1");
    let next = chat(&system, "question 2");
    let relayed = RelayedDecision {
        endpoint: address(1),
        keys: keys_of(&first),
        routed_at_ms: None,
    };
    let mut e = explainer(3);
    assert_eq!(
        e.add_decisions(&page(vec![relayed.clone()], 7)).unwrap(),
        (1, 7)
    );
    let answer = e.explain(CHAT, &next, None).unwrap();
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["chosen"], address(1).to_string());
    assert_eq!(answer["tied"], json!([]), "one holder: no tie");
    // The proxy that learned the same decision from the relay.
    let mut p = proxy(3);
    p.apply_remote(kvoy_shared::EndpointId(1), &relayed.keys);
    let d = p
        .route_body(
            Api::ChatCompletions,
            &next,
            &[Outstanding::default(); 3],
            Duration::ZERO,
        )
        .unwrap();
    assert_eq!(answer["matched_blocks"], d.matched_blocks);
    assert_eq!(answer["request_blocks"], d.request_blocks);
    assert!(d.matched_blocks > 10, "{}", d.matched_blocks);
    let rows = answer["candidates"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for row in rows {
        let holder = row["address"] == address(1).to_string();
        assert_eq!(row["chosen"], holder);
        assert_eq!(row["matched_blocks"].as_u64().unwrap() > 0, holder, "{row}");
        assert!(row["cost"]["total_s"].as_f64().unwrap() > 0.0);
        assert_eq!(row["health"], "ready");
    }
    assert_eq!(
        answer["index"],
        json!({"relayed_decisions": 1, "applied": 1, "dropped": 0})
    );
    // Explaining does not teach the index: the same answer again.
    assert_eq!(e.explain(CHAT, &next, None).unwrap(), answer);
}

#[test]
fn a_cold_prompt_on_idle_endpoints_is_a_tie_and_says_so() {
    let e = explainer(3);
    let answer = e
        .explain(CHAT, &chat("never seen", "before"), None)
        .unwrap();
    let tied: Vec<&str> = answer["tied"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(tied.len(), 3, "{answer}");
    assert!(tied.contains(&answer["chosen"].as_str().unwrap()));
    assert_eq!(answer["matched_blocks"], 0);
    assert!(answer["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["tied"] == true));
    // A busier endpoint is out of the tie: the server's queue is in the snapshot.
    let mut e = Explainer::new("").unwrap();
    let mut busy = status(0);
    busy.waiting = 4;
    busy.running = 2;
    e.set_snapshot(&snapshot(vec![busy, status(1), status(2)]))
        .unwrap();
    let answer = e
        .explain(CHAT, &chat("never seen", "before"), None)
        .unwrap();
    assert_eq!(
        answer["tied"],
        json!([address(1).to_string(), address(2).to_string()])
    );
    let busy_row = &answer["candidates"][0];
    assert_eq!(
        (busy_row["waiting"].as_u64(), busy_row["running"].as_u64()),
        (Some(4), Some(2))
    );
    assert!(busy_row["cost"]["decode_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_malformed_body_gets_the_proxys_own_error() {
    let e = explainer(2);
    for body in [
        &b"{nope"[..],
        b"",
        br#"{"messages":[]}"#,
        br#"{"model":"m","messages":7}"#,
    ] {
        let answer = e.explain(CHAT, body, None).unwrap();
        let want = proxy(2)
            .route_body(
                Api::ChatCompletions,
                body,
                &[Outstanding::default(); 2],
                Duration::ZERO,
            )
            .unwrap_err();
        assert_eq!(answer["ok"], false);
        assert_eq!(answer["status"], want.status());
        assert_eq!(answer["code"], want.code());
        assert_eq!(answer["body"], want.body(), "the bytes the proxy answers");
        assert_eq!(answer["error"]["error"]["type"], "invalid_request_error");
    }
    let answer = e
        .explain(
            CHAT,
            br#"{"model":"other","messages":[{"role":"user","content":"x"}]}"#,
            None,
        )
        .unwrap();
    assert_eq!(
        (answer["status"].as_u64(), answer["code"].as_str()),
        (Some(404), Some("model_not_found"))
    );
    // An encoded `/` in the path: 400 before the body is read, as in the filter.
    let answer = e.explain("/v1%2Fchat/completions", b"{}", None).unwrap();
    assert_eq!(answer["status"], 400);
    assert_eq!(
        e.explain("/v1/models", b"", None).unwrap_err(),
        ExplainError::NotRoutedByBody("/v1/models".into())
    );
}

#[test]
fn the_other_apis_are_read_as_the_filter_reads_them() {
    let e = explainer(2);
    let completions = e
        .explain(
            "/v1/completions",
            br#"{"model":"m","prompt":"once upon a time, far away"}"#,
            None,
        )
        .unwrap();
    assert_eq!(
        (
            completions["ok"].as_bool(),
            completions["request_blocks"].as_u64()
        ),
        (Some(true), Some(0))
    );
    let long = "a long instruction ".repeat(20);
    let responses = e
        .explain(
            "/v1/responses",
            json!({"model": "m", "instructions": long, "input": "hi"})
                .to_string()
                .as_bytes(),
            None,
        )
        .unwrap();
    assert_eq!(responses["model"], "m");
    assert!(
        responses["request_blocks"].as_u64().unwrap() >= 5,
        "{responses}"
    );
}

#[test]
fn a_session_token_pins_or_is_ignored_as_in_the_proxy() {
    let e = explainer(3);
    let body = chat("pinned prompt", "q");
    let token = encode_token(address(2));
    let answer = e.explain(CHAT, &body, Some(&token)).unwrap();
    assert_eq!(answer["chosen"], address(2).to_string());
    assert_eq!(answer["tied"], json!([]), "a followed pin decides alone");
    assert_eq!(answer["session"]["state"], "honoured");
    assert_eq!(answer["session"]["pin"], address(2).to_string());
    assert_eq!(answer["candidates"][2]["pinned"], true);
    let answer = e.explain(CHAT, &body, Some("not a token!")).unwrap();
    assert_eq!(answer["session"]["state"], "invalid_token");
    assert_eq!(answer["tied"].as_array().unwrap().len(), 3);
    let outside = encode_token("10.9.9.9:1".parse().unwrap());
    let answer = e.explain(CHAT, &body, Some(&outside)).unwrap();
    assert_eq!(answer["session"]["state"], "broken");
    assert_eq!(
        answer["session"]["reason"],
        "the pinned address is not in the pool"
    );
}

#[test]
fn stale_endpoints_and_foreign_decisions_are_shown_for_what_they_are() {
    let mut e = Explainer::new("").unwrap();
    let mut stale = status(1);
    stale.stale = true;
    let mut other_model = status(2);
    other_model.models = vec!["n".into()];
    e.set_snapshot(&snapshot(vec![status(0), stale, other_model]))
        .unwrap();
    let foreign = RelayedDecision {
        endpoint: "10.9.9.9:1".parse().unwrap(),
        keys: vec![kvoy_shared::prefix::BlockKey(1)],
        routed_at_ms: None,
    };
    e.add_decisions(&page(vec![foreign], 1)).unwrap();
    let answer = e.explain(CHAT, &chat("s", "u"), None).unwrap();
    assert_eq!(answer["chosen"], address(0).to_string());
    assert_eq!(answer["candidates"].as_array().unwrap().len(), 1);
    let left: Vec<(&str, &str)> = answer["left_out"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["address"].as_str().unwrap(), l["why"].as_str().unwrap()))
        .collect();
    assert_eq!(
        left,
        [
            ("10.0.0.1:8001", "stale: healthier endpoints serve it"),
            ("10.0.0.1:8002", "does not serve m"),
        ]
    );
    assert_eq!(answer["index"]["dropped"], 1);
}

#[test]
fn a_configuration_narrows_the_pool_as_it_does_in_the_proxy() {
    let config = r#"{"aggregator":{"cluster":"agg"},"allowed_destinations":[{"cidr":"10.0.0.1/32","ports":[8000,8001]}],"scorer":"weighted"}"#;
    let mut e = Explainer::new(config).unwrap();
    e.set_snapshot(&snapshot((0..3).map(status).collect()))
        .unwrap();
    let answer = e.explain(CHAT, &chat("s", "u"), None).unwrap();
    assert_eq!(answer["scorer"], "weighted");
    assert_eq!(answer["refused"][0]["address"], "10.0.0.1:8002");
    assert_eq!(answer["candidates"].as_array().unwrap().len(), 2);
    assert!(answer["candidates"][0]["score"]["total"].as_f64().is_some());
}

#[test]
fn bad_inputs_are_typed_errors() {
    let e = Explainer::new("{nope").unwrap_err();
    assert!(
        matches!(e, ExplainError::Config(ConfigError::Json(_))),
        "{e}"
    );
    let e = Explainer::new(r#"{"aggregator":{"cluster":"a"}}"#).unwrap_err();
    assert_eq!(e, ExplainError::Config(ConfigError::AllowlistRequired));
    let mut x = Explainer::new("").unwrap();
    assert_eq!(
        x.explain(CHAT, b"{}", None).unwrap_err(),
        ExplainError::NoSnapshot
    );
    assert!(matches!(
        x.set_snapshot(b"garbage").unwrap_err(),
        ExplainError::Snapshot(PollError::Decode(_))
    ));
    assert!(matches!(
        x.add_decisions(b"KVDR").unwrap_err(),
        ExplainError::Decisions(_)
    ));
    assert_eq!(x.decisions(), 0);
    // Every truncation of a real snapshot is refused, never a panic.
    let full = snapshot((0..3).map(status).collect());
    for cut in 0..full.len() {
        assert!(x.set_snapshot(&full[..cut]).is_err(), "cut at {cut}");
    }
}
