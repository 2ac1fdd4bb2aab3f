//! The `kvoy_session` filter through its real `.wasm` with two VMs (two Envoy workers): each
//! key source, bindings shared across workers, TTL expiry, the bound on memory, forged and
//! malformed tokens, Responses API ids in JSON and SSE bodies, and rebinding to whatever
//! endpoint served. The prefix-affinity filter's part (validating and honouring the pin) is in
//! `prefix_affinity_session.rs`.

use std::time::Duration;

use kvoy_harness::{Action, Error, HttpStream, Plugin};
use kvoy_shared::session::{encode_token, PIN_HEADER};

use crate::support::{self, SERVED};
use crate::TestResult;

fn plugin(config: &str) -> Result<Plugin, Error> {
    support::start("kvoy_session", config, 2, 3)
}

/// Sends a request with `headers` (and `body`, if any) on `vm`; returns the stream and the
/// pin handed to the next filter.
fn request(
    plugin: &Plugin,
    vm: usize,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Result<(HttpStream, Option<String>), Error> {
    let stream = plugin.http_stream(vm)?;
    let mut h = vec![(":method", "POST"), (":path", path), (":authority", "gw")];
    h.extend_from_slice(headers);
    match body {
        None => {
            assert_eq!(stream.send_request_headers(&h, true)?, Action::Continue);
        }
        Some(b) => {
            let first = stream.send_request_headers(&h, false)?;
            let last = stream.send_request_body(b.as_bytes(), true)?;
            assert_eq!(last, Action::Continue, "{first:?}");
        }
    }
    let pin = stream
        .forwarded_request_headers()
        .and_then(|h| h.get(PIN_HEADER).map(str::to_owned));
    Ok((stream, pin))
}

/// [`request`] without a body, with one header besides the pseudo-headers.
fn headers_only(
    plugin: &Plugin,
    vm: usize,
    path: &str,
    header: (&str, &str),
) -> Result<(HttpStream, Option<String>), Error> {
    request(plugin, vm, path, &[header], None)
}

/// Answers the stream as if `served` served it (the prefix-affinity filter's header), with
/// `body`; returns the session token written on the response.
fn respond(stream: &HttpStream, served: &str, body: &[&str]) -> Result<Option<String>, Error> {
    stream.send_response_headers(&[(":status", "200"), (SERVED, served)], body.is_empty())?;
    for (i, chunk) in body.iter().enumerate() {
        stream.send_response_body(chunk.as_bytes(), i + 1 == body.len())?;
    }
    let token = stream
        .forwarded_response_headers()
        .and_then(|h| h.get("x-session-token").map(str::to_owned));
    stream.finish()?;
    Ok(token)
}

#[test]
fn a_session_header_binds_on_one_worker_and_pins_on_the_other() -> TestResult {
    let plugin = plugin("{}")?;
    let (s, pin) = headers_only(&plugin, 0, "/v1/chat/completions", ("x-session-id", "s1"))?;
    assert_eq!(pin, None, "nothing bound yet");
    let token = respond(&s, "10.0.0.2:8000", &[])?;
    assert_eq!(token, Some(encode_token("10.0.0.2:8000".parse().unwrap())));
    for vm in [1, 0, 1] {
        let (s, pin) = headers_only(&plugin, vm, "/v1/chat/completions", ("x-session-id", "s1"))?;
        assert_eq!(pin.as_deref(), Some("10.0.0.2:8000"), "vm {vm}");
        respond(&s, "10.0.0.2:8000", &[])?;
    }
    // Whoever served last is what the session is bound to (a broken pin rebinds).
    let (s, _) = headers_only(&plugin, 0, "/v1/chat/completions", ("x-session-id", "s1"))?;
    respond(&s, "10.0.0.3:8000", &[])?;
    let (_, pin) = headers_only(&plugin, 1, "/v1/chat/completions", ("x-session-id", "s1"))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.3:8000"));
    assert_eq!(plugin.counter("kvoy_session_hits_total"), Some(5));
    assert_eq!(plugin.counter("kvoy_session_misses_total"), Some(1));
    Ok(())
}

#[test]
fn bindings_expire_after_the_ttl() -> TestResult {
    let plugin = plugin(r#"{"ttl_ms": 5000}"#)?;
    let (s, _) = headers_only(&plugin, 0, "/v1/completions", ("x-session-id", "t"))?;
    respond(&s, "10.0.0.1:8000", &[])?;
    plugin.advance(Duration::from_millis(4000))?;
    let (s, pin) = headers_only(&plugin, 1, "/v1/completions", ("x-session-id", "t"))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.1:8000"));
    respond(&s, "10.0.0.1:8000", &[])?; // used: the TTL starts again
    plugin.advance(Duration::from_millis(4000))?;
    let (_, pin) = headers_only(&plugin, 0, "/v1/completions", ("x-session-id", "t"))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.1:8000"), "sliding TTL");
    plugin.advance(Duration::from_millis(6000))?;
    let (_, pin) = headers_only(&plugin, 0, "/v1/completions", ("x-session-id", "t"))?;
    assert_eq!(pin, None, "expired");
    Ok(())
}

#[test]
fn memory_stays_bounded() -> TestResult {
    let plugin = plugin(r#"{"max_bindings": 64}"#)?;
    for i in 0..2000 {
        let id = format!("session-{i}");
        let (s, _) = headers_only(&plugin, i % 2, "/v1/completions", ("x-session-id", &id))?;
        respond(&s, "10.0.0.1:8000", &[])?;
    }
    let (keys, bytes) = plugin.shared_data_size();
    assert!(keys <= 8, "{keys} shared-data keys for 64 bindings");
    assert!(bytes <= 64 * 64, "{bytes} bytes");
    let (_, pin) = headers_only(
        &plugin,
        0,
        "/v1/completions",
        ("x-session-id", "session-1999"),
    )?;
    assert_eq!(pin.as_deref(), Some("10.0.0.1:8000"), "the newest survive");
    Ok(())
}

#[test]
fn cookies_tokens_and_forgeries() -> TestResult {
    let plugin = plugin(r#"{"cookie": "kvoy_sid"}"#)?;
    let (s, _) = headers_only(
        &plugin,
        0,
        "/v1/completions",
        ("cookie", "a=b; kvoy_sid=c1"),
    )?;
    respond(&s, "10.0.0.4:8000", &[])?;
    let (_, pin) = headers_only(&plugin, 1, "/v1/completions", ("cookie", "kvoy_sid=c1"))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.4:8000"));

    // A token is handed over as a candidate (the prefix-affinity filter checks the pool).
    let token = encode_token("10.0.0.9:8000".parse().unwrap());
    let (_, pin) = headers_only(&plugin, 0, "/v1/completions", ("x-session-token", &token))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.9:8000"));
    // Malformed tokens are ignored and counted.
    for bad in ["%%%", "aGVsbG8=", "QUFB"] {
        let (_, pin) = headers_only(&plugin, 0, "/v1/completions", ("x-session-token", bad))?;
        assert_eq!(pin, None, "{bad}");
    }
    assert_eq!(plugin.counter("kvoy_session_invalid_tokens_total"), Some(3));
    // A client cannot set the internal pin header itself.
    let (_, pin) = headers_only(&plugin, 1, "/v1/completions", (PIN_HEADER, "10.6.6.6:1"))?;
    assert_eq!(pin, None);
    // A response without the served header binds nothing and writes no token.
    let (s, _) = headers_only(&plugin, 0, "/v1/completions", ("x-session-id", "u"))?;
    s.send_response_headers(&[(":status", "200")], true)?;
    assert_eq!(
        s.forwarded_response_headers()
            .and_then(|h| h.get("x-session-token").map(str::to_owned)),
        None
    );
    Ok(())
}

#[test]
fn responses_api_chains_follow_their_response_ids() -> TestResult {
    let plugin = plugin("{}")?;
    let first = r#"{"model":"m","input":"hello"}"#;
    let (s, pin) = request(&plugin, 0, "/v1/responses", &[], Some(first))?;
    assert_eq!(pin, None);
    // Non-streaming JSON, the id split across chunks.
    respond(
        &s,
        "10.0.0.5:8000",
        &[
            r#"{"id":"resp_ab"#,
            r#"c123","object":"response","output":[]}"#,
        ],
    )?;
    let second = r#"{"model":"m","input":"more","previous_response_id":"resp_abc123"}"#;
    let (s, pin) = request(&plugin, 1, "/v1/responses", &[], Some(second))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.5:8000"));
    // Streaming events.
    respond(
        &s,
        "10.0.0.5:8000",
        &[
            "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,",
            "\"response\":{\"id\":\"resp_def456\",\"object\":\"response\"}}\n\n",
            "event: response.completed\ndata: {}\n\n",
        ],
    )?;
    let third = r#"{"model":"m","input":"again","previous_response_id":"resp_def456"}"#;
    let (_, pin) = request(&plugin, 0, "/v1/responses", &[], Some(third))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.5:8000"));
    assert_eq!(
        plugin.counter("kvoy_session_response_ids_bound_total"),
        Some(2)
    );
    // Unknown ids and unparsable bodies just go on unpinned.
    let (_, pin) = request(
        &plugin,
        0,
        "/v1/responses",
        &[],
        Some(r#"{"model":"m","input":"x","previous_response_id":"resp_nope"}"#),
    )?;
    assert_eq!(pin, None);
    let (_, pin) = request(&plugin, 0, "/v1/responses", &[], Some("{not json"))?;
    assert_eq!(pin, None);
    // A conversation id binds like a session id.
    let conv = r#"{"model":"m","input":"x","conversation":"conv_7"}"#;
    let (s, _) = request(&plugin, 1, "/v1/responses", &[], Some(conv))?;
    respond(&s, "10.0.0.6:8000", &[r#"{"id":"resp_1"}"#])?;
    let (_, pin) = request(&plugin, 0, "/v1/responses", &[], Some(conv))?;
    assert_eq!(pin.as_deref(), Some("10.0.0.6:8000"));
    Ok(())
}

#[test]
fn bad_configurations_are_refused() -> TestResult {
    for (config, field) in [
        (r#"{"ttl_ms": 1}"#, "ttl_ms"),
        (r#"{"key_sources": ["ip"]}"#, "unknown variant"),
        (r#"{"cookie": "a;b"}"#, "cookie"),
        ("not json", "configuration JSON"),
    ] {
        match plugin(config) {
            Ok(_) => panic!("accepted {config}"),
            Err(e) => {
                let text = format!("{e:?}");
                assert!(text.contains(field), "{config}: {text}");
            }
        }
    }
    Ok(())
}
