//! The router's prefill/decode split ([`crate::disagg`]).

use std::time::Duration;

use super::{Decision, PluginConfig, Router};
use crate::request::Api;
use crate::{EndpointId, Outstanding, Role};

/// Endpoints 0, 1 decode; 2, 3 prefill; 4 both (unless `roles` says otherwise).
fn router(roles: &[&str], extra: &str) -> Router {
    let endpoints: Vec<String> = roles
        .iter()
        .enumerate()
        .map(|(i, role)| {
            format!(
                r#"{{"address":"10.0.0.{}:8000","models":["m"],"role":"{role}"}}"#,
                i + 1
            )
        })
        .collect();
    let cfg = format!(r#"{{"endpoints":[{}]{extra}}}"#, endpoints.join(","));
    Router::new(PluginConfig::from_json(cfg.as_bytes()).unwrap(), 7)
}

fn pd(extra: &str) -> Router {
    router(&["decode", "decode", "prefill", "prefill", "both"], extra)
}

/// A prompt of about `chars` bytes (4 bytes per token by default).
fn body(prefix: &str, chars: usize) -> Vec<u8> {
    let text = format!("{prefix} {}", "lorem ipsum ".repeat(chars / 12 + 1));
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]})
        .to_string()
        .into_bytes()
}

fn route(r: &mut Router, body: &[u8]) -> Decision {
    r.route_body(
        Api::ChatCompletions,
        body,
        &[Outstanding::default(); 5],
        Duration::ZERO,
    )
    .unwrap()
}

fn role(r: &Router, id: EndpointId) -> Role {
    r.pool().get(id).unwrap().role
}

#[test]
fn a_long_prompt_is_split_between_a_decode_and_a_prefill_endpoint() {
    let mut r = pd("");
    let d = route(&mut r, &body("first", 8_000));
    assert!(role(&r, d.endpoint).decodes());
    let p = d.prefill.expect("split");
    assert!(role(&r, p.endpoint).prefills());
    assert_ne!(
        p.endpoint, d.endpoint,
        "an endpoint is not its own prefiller"
    );
    // The prompt is computed at the prefill endpoint: the decode one has none of it to do.
    assert_eq!(d.charge.prefill_tokens, 0);
    assert!(p.charge.prefill_tokens > 1_500, "{:?}", p.charge);
    assert_eq!(p.charge.prompt_tokens, d.charge.prompt_tokens);
    // Both now hold the prompt's blocks (the decode one received them): the repeat is served
    // whole by one of them (the prefill endpoint too when it is a `both` one).
    let again = route(&mut r, &body("first", 8_000));
    assert!(
        again.endpoint == d.endpoint || again.endpoint == p.endpoint,
        "{again:?}"
    );
    assert_eq!(again.matched_blocks, again.request_blocks);
    assert!(
        again.prefill.is_none(),
        "all cached at decode: nothing left to split"
    );
}

#[test]
fn a_prompt_below_the_threshold_is_never_split() {
    let mut r = pd(r#","disaggregation":{"non_cached_tokens":1000}"#);
    for i in 0..50 {
        // About 750 tokens: below 1,000 whatever is cached.
        let d = route(&mut r, &body(&format!("short {i}"), 3_000));
        assert!(d.prefill.is_none(), "request {i}");
        assert!(
            d.charge.prefill_tokens > 0,
            "the decode endpoint prefills it"
        );
    }
    let d = route(&mut r, &body("long", 8_000));
    assert!(d.prefill.is_some());
    // promptTokens: a prompt shorter than it stays whole even with nothing cached.
    let mut r = pd(r#","disaggregation":{"non_cached_tokens":16,"prompt_tokens":4000}"#);
    assert!(route(&mut r, &body("long", 8_000)).prefill.is_none());
    assert!(route(&mut r, &body("longer", 20_000)).prefill.is_some());
    // 0 disables it.
    let mut r = pd(r#","disaggregation":{"non_cached_tokens":0}"#);
    assert!(route(&mut r, &body("long", 20_000)).prefill.is_none());
}

#[test]
fn a_prefill_only_endpoint_never_answers_a_request() {
    let mut r = pd(r#","disaggregation":{"non_cached_tokens":0}"#);
    for i in 0..200 {
        let d = route(&mut r, &body(&format!("p{i}"), 100 + 37 * i));
        assert!(role(&r, d.endpoint).decodes(), "request {i}");
    }
    let d = r.route_passthrough(&[Outstanding::default(); 5]).unwrap();
    assert!(role(&r, d.endpoint).decodes());
}

#[test]
fn a_pool_without_prefill_endpoints_never_splits() {
    let mut r = router(&["decode", "decode", "decode"], "");
    for i in 0..20 {
        assert!(route(&mut r, &body(&format!("x{i}"), 20_000))
            .prefill
            .is_none());
    }
}

#[test]
fn with_no_prefill_endpoint_left_the_request_is_served_whole() {
    // The only prefill-capable endpoint is the decode choice itself.
    let mut r = router(&["both"], "");
    let d = route(&mut r, &body("x", 20_000));
    assert!(d.prefill.is_none());
    assert!(d.charge.prefill_tokens > 0);
}

#[test]
fn prefill_goes_where_the_prefix_is_cached_and_the_queue_is_short() {
    let mut r = pd("");
    let system = "shared system prompt ".repeat(400);
    let first = route(&mut r, &body(&system, 200));
    let p0 = first.prefill.unwrap().endpoint;
    // The next request of the group prefills where its prefix already is, wherever it decodes.
    for i in 0..5 {
        let d = route(&mut r, &body(&format!("{system} q{i}"), 4_000));
        let p = d.prefill.expect("its question is uncached everywhere");
        // p0 may be the `both` endpoint, then also the decode one's best choice (the blocks
        // it holds need no transfer): the prefix is used either way.
        if d.endpoint == p0 {
            continue;
        }
        assert_eq!(p.endpoint, p0, "request {i}");
        assert!(p.matched_blocks > 0);
    }
    // A heavily queued prefill endpoint is avoided by a request that matches nowhere.
    let mut loads = [Outstanding::default(); 5];
    loads[2].prefilling = 10;
    loads[2].requests = 10;
    loads[2].prefill_tokens = 500_000;
    for i in 0..20 {
        let d = r
            .route_body(
                Api::ChatCompletions,
                &body(&format!("cold {i}"), 8_000),
                &loads,
                Duration::ZERO,
            )
            .unwrap();
        assert_ne!(d.prefill.unwrap().endpoint, EndpointId(2), "request {i}");
    }
}

/// A split request's decode endpoint is where the transfer and the decode load cost least, not
/// where the aggregated model would have computed the prompt: a decode endpoint holding half of
/// it but with a prefill queued (a whole request's) loses to an idle one, since the transfer
/// of the other half is quicker than waiting for that queue.
#[test]
fn a_split_request_decodes_where_the_transfer_and_the_decode_load_are_least() {
    let mut r = router(
        &["decode", "decode", "prefill"],
        r#","cost":{"prefill_tokens_per_s":20000}"#,
    );
    let half = "half of the prompt ".repeat(850);
    let (holder, d) = half_then_whole(&mut r, &half);
    let other = EndpointId(1 - holder.0);
    // The aggregated model: (3,000 queued + 4,000 uncached) / 20,000 at the holder against
    // 8,000 / 20,000 at the other. Split, the holder waits 0.15 s for its queue, the other
    // 8,000 / 200,000 for the transfer.
    assert!(d.prefill.is_some());
    assert_eq!(d.endpoint, other, "{d:?}");
    // Not split (a threshold above the prompt), the same request is the holder's.
    let mut whole = router(
        &["decode", "decode", "prefill"],
        r#","cost":{"prefill_tokens_per_s":20000},"disaggregation":{"non_cached_tokens":100000}"#,
    );
    let (holder, d) = half_then_whole(&mut whole, &half);
    assert!(d.prefill.is_none());
    assert_eq!(d.endpoint, holder, "{d:?}");
}

/// Routes `half` (about 4,000 tokens), then, with one whole request's 3,000 tokens of
/// prefill queued at its decode endpoint (the holder), `half` and as much again: the holder
/// and that second decision.
fn half_then_whole(r: &mut Router, half: &str) -> (EndpointId, Decision) {
    let holder = route(r, &body(half, 0)).endpoint;
    let mut loads = [Outstanding::default(); 3];
    loads[holder.index()] = Outstanding {
        requests: 1,
        prefilling: 1,
        prefill_tokens: 3_000,
        ..Outstanding::default()
    };
    let d = r
        .route_body(
            Api::ChatCompletions,
            &body(&format!("{half} and the other half"), 16_000),
            &loads,
            Duration::ZERO,
        )
        .unwrap();
    (holder, d)
}
