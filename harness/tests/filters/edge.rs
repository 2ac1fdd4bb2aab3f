//! What reaches the pool, through the real `.wasm` filters (issue 16): requests that end with
//! trailers are routed (or kept held) like any other, encoded paths cannot skip the body,
//! `allowed_destinations` refuses the aggregator's endpoints outside it, a large snapshot is
//! not copied in, a body of too many prompt parts is refused, and outstanding work follows an
//! endpoint's address when an aggregator restart renumbers the pool.

use std::time::Duration;

use kvoy_harness::{Action, Error, HttpResponse, HttpStream, Plugin};
use kvoy_shared::session::PIN_HEADER;
use kvoy_shared::snapshot::{EndpointStatus, SnapshotHistory};

use crate::support::{
    self, chat_body, forwarded, next_poll, post, respond_snapshot, CLUSTER, DEST, POOL,
};
use crate::TestResult;

fn prefix_affinity(config: &str, vms: usize) -> Result<Plugin, Error> {
    support::start_live("kvoy_prefix_affinity", config, vms, 5)
}

fn static_config() -> String {
    support::pool_config(&POOL[..2], serde_json::json!({}))
}

#[test]
fn prefix_affinity_routes_a_request_that_ends_with_trailers() -> TestResult {
    let plugin = prefix_affinity(&static_config(), 1)?;
    let body = chat_body("a question that arrives in two frames and ends with trailers");
    let (a, b) = body.as_bytes().split_at(20);
    let s = plugin.http_stream(0)?;
    assert_eq!(
        s.send_request_headers(&post("/v1/chat/completions"), false)?,
        Action::Pause
    );
    assert_eq!(s.send_request_body(a, false)?, Action::Pause);
    assert_eq!(s.send_request_body(b, false)?, Action::Pause);
    // The end of the stream is the trailers: the decision is made there.
    assert_eq!(
        s.send_request_trailers(&[("x-checksum", "1")])?,
        Action::Continue
    );
    let dest = forwarded(&s, DEST);
    assert!(
        matches!(dest.as_deref(), Some("127.0.0.1:18001" | "127.0.0.1:18002")),
        "routed with a destination: {dest:?}"
    );
    assert_eq!(s.forwarded_request_body(), body.as_bytes());
    s.finish()?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_decisions_total"),
        Some(1)
    );

    // A malformed body that ends with trailers is answered like any other.
    let s = plugin.http_stream(0)?;
    s.send_request_headers(&post("/v1/chat/completions"), false)?;
    s.send_request_body(b"{\"model\":", false)?;
    assert_eq!(s.send_request_trailers(&[("x", "y")])?, Action::Pause);
    assert_eq!(s.local_reply().map(|r| r.status), Some(400));
    assert!(forwarded(&s, DEST).is_none());
    s.finish()?;
    // Headers then trailers, no body at all: an empty body, refused.
    let s = plugin.http_stream(0)?;
    s.send_request_headers(&post("/v1/completions"), false)?;
    assert_eq!(s.send_request_trailers(&[("x", "y")])?, Action::Pause);
    assert_eq!(s.local_reply().map(|r| r.status), Some(400));
    s.finish()?;
    Ok(())
}

#[test]
fn session_pins_a_responses_request_that_ends_with_trailers() -> TestResult {
    let plugin = support::builder("kvoy_session", "{}", 1)?.start()?;
    let body = r#"{"model":"m","input":"hello"}"#;
    // Bind s1 to an endpoint.
    let s = plugin.http_stream(0)?;
    let mut headers = post("/v1/responses");
    headers.push(("x-session-id", "s1"));
    s.send_request_headers(&headers, false)?;
    s.send_request_body(body.as_bytes(), true)?;
    s.send_response_headers(
        &[
            (":status", "200"),
            ("x-gateway-destination-endpoint-served", "10.0.0.7:8000"),
        ],
        true,
    )?;
    s.finish()?;
    // The next turn ends with trailers: still pinned.
    let s = plugin.http_stream(0)?;
    assert_eq!(s.send_request_headers(&headers, false)?, Action::Pause);
    assert_eq!(s.send_request_body(body.as_bytes(), false)?, Action::Pause);
    assert_eq!(s.send_request_trailers(&[("x", "y")])?, Action::Continue);
    assert_eq!(forwarded(&s, PIN_HEADER).as_deref(), Some("10.0.0.7:8000"));
    s.finish()?;
    Ok(())
}

#[test]
fn admission_keeps_a_held_request_held_through_its_trailers() -> TestResult {
    let config = r#"{"endpoints":1,"tick_ms":10,"flow":{"saturation":{"max_inflight_per_endpoint":1},"queue_ttl_ms":60000}}"#;
    let plugin = support::builder("kvoy_admission", config, 1)?.start()?;
    let first = plugin.http_stream(0)?;
    assert_eq!(
        first.send_request_headers(&post("/v1/chat/completions"), true)?,
        Action::Continue
    );
    let held = plugin.http_stream(0)?;
    assert_eq!(
        held.send_request_headers(&post("/v1/chat/completions"), false)?,
        Action::Pause
    );
    assert_eq!(held.send_request_body(b"{}", false)?, Action::Pause);
    assert_eq!(
        held.send_request_trailers(&[("x", "y")])?,
        Action::Pause,
        "still in the queue: it must not go on"
    );
    assert!(held.forwarded_request_headers().is_none());
    plugin.advance(Duration::from_millis(50))?;
    assert!(held.forwarded_request_headers().is_none(), "no room yet");
    assert_eq!(plugin.gauge("kvoy_admission_queue_depth"), Some(1));
    // The first one ends: the held one is released, and counted.
    first.finish()?;
    assert_eq!(plugin.counter("kvoy_admission_released_total"), Some(1));
    assert_eq!(plugin.gauge("kvoy_admission_queue_depth"), Some(0));
    held.finish()?;
    Ok(())
}

#[test]
fn encoded_paths_cannot_skip_the_body() -> TestResult {
    let plugin = prefix_affinity(&static_config(), 1)?;
    // Decoded like Envoy's normalize_path: the body is read and checked.
    for path in ["/v1/%63hat/completions", "//v1/chat/./completions"] {
        let s = plugin.http_stream(0)?;
        assert_eq!(
            s.send_request_headers(&post(path), false)?,
            Action::Pause,
            "{path}"
        );
        s.send_request_body(b"not json", true)?;
        assert_eq!(s.local_reply().map(|r| r.status), Some(400), "{path}");
        s.finish()?;
    }
    // An encoded slash is refused outright.
    let s = plugin.http_stream(0)?;
    s.send_request_headers(&post("/v1/chat%2Fcompletions"), false)?;
    let reply = s.local_reply().expect("answered");
    assert_eq!(reply.status, 400);
    assert!(forwarded(&s, DEST).is_none());
    s.finish()?;
    Ok(())
}

fn status(slot: u16, address: &str) -> EndpointStatus {
    support::status(slot, address.parse().unwrap())
}

/// Answers the next poll with the full snapshot: a restarted aggregator has a new epoch anyway.
fn answer(plugin: &Plugin, history: &SnapshotHistory) -> TestResult {
    let call = next_poll(plugin)?;
    respond_snapshot(plugin, &call, history.delta_since(None, None))
}

/// A chat request on `vm` routed and left open (not answered); its stream and destination.
fn open_chat(plugin: &Plugin, vm: usize, text: &str) -> Result<(HttpStream, String), Error> {
    let s = plugin.http_stream(vm)?;
    s.send_request_headers(&post("/v1/chat/completions"), false)?;
    s.send_request_body(chat_body(text).as_bytes(), true)?;
    let dest =
        forwarded(&s, DEST).unwrap_or_else(|| panic!("not forwarded: {:?}", s.local_reply()));
    Ok((s, dest))
}

fn live_config(extra: &str) -> String {
    format!(
        r#"{{"aggregator":{{"cluster":"{CLUSTER}"}},
            "allowed_destinations":[{{"cidr":"127.0.0.0/8","ports":["19000-19010"]}}]{extra}}}"#
    )
}

#[test]
fn the_aggregator_cannot_route_outside_allowed_destinations() -> TestResult {
    let plugin = prefix_affinity(&live_config(""), 2)?;
    let mut history = SnapshotHistory::new(3);
    // A poisoned snapshot: the proxy's admin port, a metadata address, and one real server.
    history.update(vec![
        status(0, "127.0.0.1:19901"),
        status(1, "169.254.169.254:80"),
        status(2, "127.0.0.1:19001"),
    ]);
    answer(&plugin, &history)?;
    for i in 0..20 {
        let (s, dest) = open_chat(&plugin, i % 2, &format!("question {i} "))?;
        assert_eq!(dest, "127.0.0.1:19001");
        s.finish()?;
    }
    for forged in ["127.0.0.1:19901", "169.254.169.254:80"] {
        let s = plugin.http_stream(0)?;
        s.send_request_headers(
            &[(":method", "GET"), (":path", "/v1/models"), (DEST, forged)],
            true,
        )?;
        assert_eq!(forwarded(&s, DEST).as_deref(), Some("127.0.0.1:19001"));
        s.finish()?;
    }
    assert_eq!(plugin.gauge("kvoy_prefix_affinity_pool_endpoints"), Some(1));
    assert_eq!(
        plugin.gauge("kvoy_prefix_affinity_pool_endpoints_refused"),
        Some(2)
    );
    assert!(plugin.counter("kvoy_prefix_affinity_endpoints_refused_total") >= Some(2));
    let refusals = plugin
        .logs()
        .iter()
        .filter(|l| l.message.contains("169.254.169.254:80 refused"))
        .count();
    // Once per VM, however often the pool is rebuilt.
    assert!((1..=2).contains(&refusals), "{refusals}");
    assert!(plugin.logged("its port is not allowed"));

    // Nothing allowed at all: answered by the filter (no endpoint serves the model), never
    // sent to the refused one.
    let mut history = SnapshotHistory::new(4);
    history.update(vec![status(0, "10.1.1.1:8000")]);
    answer(&plugin, &history)?;
    let s = plugin.http_stream(0)?;
    s.send_request_headers(&post("/v1/chat/completions"), false)?;
    s.send_request_body(chat_body("x").as_bytes(), true)?;
    assert_eq!(s.local_reply().map(|r| r.status), Some(404));
    assert!(forwarded(&s, DEST).is_none());
    s.finish()?;
    let s = plugin.http_stream(0)?;
    s.send_request_headers(&[(":method", "GET"), (":path", "/v1/models")], true)?;
    assert_eq!(s.local_reply().map(|r| r.status), Some(503));
    s.finish()?;
    Ok(())
}

#[test]
fn static_endpoints_outside_allowed_destinations_are_dropped() -> TestResult {
    let plugin = prefix_affinity(
        r#"{"endpoints":[{"address":"127.0.0.1:18001","models":["m"]},
                         {"address":"127.0.0.1:9901","models":["m"]}],
            "allowed_destinations":[{"cidr":"127.0.0.1/32","ports":["18000-18100"]}]}"#,
        1,
    )?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_endpoints_refused_total"),
        Some(1)
    );
    assert!(plugin.logged("127.0.0.1:9901 left out of the pool"));
    for i in 0..10 {
        let (s, dest) = open_chat(&plugin, 0, &format!("q{i}"))?;
        assert_eq!(dest, "127.0.0.1:18001");
        s.finish()?;
    }
    // No endpoint left: the configuration is refused.
    let refused = prefix_affinity(
        r#"{"endpoints":[{"address":"127.0.0.1:9901","models":["m"]}],
            "allowed_destinations":[{"cidr":"10.0.0.0/8"}]}"#,
        1,
    );
    assert!(refused.is_err());
    Ok(())
}

#[test]
fn a_large_snapshot_is_not_copied_in() -> TestResult {
    let plugin = prefix_affinity(
        r#"{"endpoints":[{"address":"127.0.0.1:19002","models":["m"]}],
            "aggregator":{"cluster":"kvoy_aggregator","max_snapshot_bytes":1024},
            "allowed_destinations":[{"cidr":"127.0.0.0/8"}]}"#,
        1,
    )?;
    let call = next_poll(&plugin)?;
    plugin.respond_http_call(&call, HttpResponse::new(200).body(vec![7u8; 5000]))?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_snapshot_rejected_total"),
        Some(1)
    );
    assert!(plugin.logged("over aggregator.max_snapshot_bytes"));
    let call = next_poll(&plugin)?;
    plugin.respond_http_call(&call, HttpResponse::new(200).body(vec![7u8; 5000]))?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_snapshot_rejected_total"),
        Some(2)
    );
    let logged = plugin
        .logs()
        .iter()
        .filter(|l| l.message.contains("max_snapshot_bytes"))
        .count();
    assert_eq!(logged, 1, "logged once");
    // The static pool still routes.
    let (s, dest) = open_chat(&plugin, 0, "still routed")?;
    assert_eq!(dest, "127.0.0.1:19002");
    s.finish()?;
    Ok(())
}

#[test]
fn a_body_of_too_many_prompt_parts_is_refused() -> TestResult {
    let plugin = prefix_affinity(
        r#"{"endpoints":[{"address":"127.0.0.1:18001","models":["m"]}],"max_prompt_segments":64,"on_invalid_body":"fallback"}"#,
        1,
    )?;
    let messages: Vec<_> = (0..100)
        .map(|i| serde_json::json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
    for _ in 0..2 {
        let s = plugin.http_stream(0)?;
        s.send_request_headers(&post("/v1/chat/completions"), false)?;
        s.send_request_body(body.as_bytes(), true)?;
        let reply = s
            .local_reply()
            .expect("refused, even with on_invalid_body: fallback");
        assert_eq!(reply.status, 400);
        assert!(reply.body_text().contains("more than 64 parts"));
        s.finish()?;
    }
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_errors_too_many_segments_total"),
        Some(2)
    );
    assert_eq!(
        plugin
            .logs()
            .iter()
            .filter(|l| l.message.contains("more than 64 parts"))
            .count(),
        1
    );
    Ok(())
}

#[test]
fn outstanding_work_follows_the_endpoint_when_the_pool_is_renumbered() -> TestResult {
    let plugin = prefix_affinity(&live_config(""), 2)?;
    let (a, b) = ("127.0.0.1:19001", "127.0.0.1:19002");
    let mut history = SnapshotHistory::new(1);
    history.update(vec![status(0, a), status(1, b)]);
    answer(&plugin, &history)?;
    // A long prompt, still prefilling where it went.
    let (long, busy) = open_chat(&plugin, 0, &"a long prompt still prefilling ".repeat(2000))?;
    let idle = if busy == a { b } else { a };
    // The aggregator restarts and numbers the endpoints the other way round.
    // `busy` now has the id the idle endpoint had, and the other way round.
    let mut restarted = SnapshotHistory::new(2);
    restarted.update(vec![status(1, a), status(0, b)]);
    answer(&plugin, &restarted)?;
    // New work goes to the idle endpoint: the busy one's queue is still charged to it.
    for i in 0..10 {
        let (s, dest) = open_chat(&plugin, i % 2, &format!("short question {i}"))?;
        assert_eq!(
            dest, idle,
            "request {i} went to the endpoint still prefilling"
        );
        s.finish()?;
    }
    long.finish()?;
    // Released where it was charged: both endpoints idle again, so both get work.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..20 {
        let (s, dest) = open_chat(&plugin, i % 2, &format!("another question {i}"))?;
        seen.insert(dest);
        s.finish()?;
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    Ok(())
}
