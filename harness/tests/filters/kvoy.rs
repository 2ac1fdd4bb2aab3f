//! The combined `kvoy` filter through its real `.wasm`: its configuration (a section per stage,
//! `prefix_affinity` required, unknown sections refused by name), the session pin handed to the
//! router as a value (a Responses API chain follows its response id; a client's internal pin
//! header is ignored), and a held request's release: routed before it is resumed when its body
//! is complete, routed and continued at its body's end when it is not. The decisions against the
//! three separate filters are compared in `local/tests/combined_vs_chain.rs`.

use std::time::Duration;

use kvoy_harness::{Action, Error, HttpStream, Plugin};

use crate::support::{self, resumed, DEST, POOL, SERVED};
use crate::TestResult;

/// The routing stage's section: the static pool.
fn prefix() -> String {
    support::pool_config(&POOL, serde_json::json!({}))
}

fn plugin(config: &str) -> Result<Plugin, Error> {
    support::start("kvoy", config, 2, 11)
}

#[test]
fn the_configuration_needs_the_routing_stage_and_known_sections() -> TestResult {
    for (config, why) in [
        (r#"{"session": {}}"#.to_owned(), "no prefix_affinity"),
        (String::new(), "empty"),
        (
            format!(r#"{{"prefix_affinity": {}, "sessions": {{}}}}"#, prefix()),
            "unknown section",
        ),
        (
            format!(
                r#"{{"prefix_affinity": {}, "session": {{"ttl": 1}}}}"#,
                prefix()
            ),
            "a bad section",
        ),
        (
            format!(r#"{{"prefix_affinity": {}, "admission": {{}}}}"#, prefix()),
            "admission needs endpoints",
        ),
    ] {
        assert!(plugin(&config).is_err(), "{why}: accepted {config}");
    }
    // The routing stage alone is a valid configuration (no sessions, no admission).
    let p = plugin(&format!(r#"{{"prefix_affinity": {}}}"#, prefix()))?;
    let s = p.http_stream(0)?;
    s.send_request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "gw"),
        ],
        false,
    )?;
    assert_eq!(
        s.send_request_body(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            true
        )?,
        Action::Continue
    );
    let dest = s
        .forwarded_request_headers()
        .unwrap()
        .get(DEST)
        .unwrap()
        .to_owned();
    assert!(POOL.contains(&dest.as_str()), "{dest}");
    Ok(())
}

#[test]
fn a_responses_chain_follows_its_response_id_without_an_internal_header() -> TestResult {
    let p = plugin(&format!(
        r#"{{"session": {{}}, "prefix_affinity": {}}}"#,
        prefix()
    ))?;
    let post =
        |vm: usize, body: &str, extra: &[(&str, &str)]| -> Result<(HttpStream, String), Error> {
            let s = p.http_stream(vm)?;
            let mut h = vec![
                (":method", "POST"),
                (":path", "/v1/responses"),
                (":authority", "gw"),
            ];
            h.extend_from_slice(extra);
            assert_eq!(s.send_request_headers(&h, false)?, Action::Pause);
            assert_eq!(
                s.send_request_body(body.as_bytes(), true)?,
                Action::Continue
            );
            let fwd = s.forwarded_request_headers().unwrap();
            // kvoy's internal pin header never leaves the proxy, a client's included.
            assert_eq!(fwd.get("x-kvoy-session-endpoint"), None);
            Ok((s, fwd.get(DEST).unwrap().to_owned()))
        };
    let (first, dest) = post(0, r#"{"model":"m","input":"first turn"}"#, &[])?;
    first.set_property(&["upstream", "address"], dest.clone())?;
    first.send_response_headers(&[(":status", "200")], false)?;
    assert_eq!(
        first.forwarded_response_headers().unwrap().get(SERVED),
        Some(dest.as_str())
    );
    first.send_response_body(br#"{"id":"resp_77","object":"response","output":[]}"#, true)?;
    first.finish()?;
    // The next turn, on the other worker, with a different prompt and a forged internal pin
    // (the combined filter passes the pin as a value: the header is neither followed nor
    // forwarded).
    let forged = POOL.iter().find(|a| **a != dest).unwrap();
    for vm in [1, 0] {
        let (next, again) = post(
            vm,
            r#"{"model":"m","input":"a quite different question","previous_response_id":"resp_77"}"#,
            &[("x-kvoy-session-endpoint", forged)],
        )?;
        assert_eq!(again, dest, "pinned by its previous response");
        next.finish()?;
    }
    // The combined filter gives the host its metrics on its tick.
    p.advance(Duration::from_millis(250))?;
    assert_eq!(p.counter("kvoy_session_response_ids_bound_total"), Some(1));
    assert_eq!(
        p.counter("kvoy_prefix_affinity_session_pins_honoured_total"),
        Some(2)
    );
    Ok(())
}

/// The request went upstream with a destination inside the pool.
fn assert_routed_to_the_pool(s: &HttpStream) {
    let dest = s
        .forwarded_request_headers()
        .unwrap()
        .get(DEST)
        .map(str::to_owned);
    assert!(
        dest.as_deref().is_some_and(|d| POOL.contains(&d)),
        "{dest:?}"
    );
}

#[test]
fn a_held_request_is_routed_before_it_goes_on() -> TestResult {
    let config = format!(
        r#"{{"admission": {{"endpoints": 1, "tick_ms": 10, "flow": {{"saturation": {{"max_inflight_per_endpoint": 1}}}}}},
            "prefix_affinity": {}}}"#,
        prefix()
    );
    let p = plugin(&config)?;
    let headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gw"),
    ];
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
    let running = p.http_stream(0)?;
    assert_eq!(
        running.send_request_headers(&headers, false)?,
        Action::Pause
    );
    assert_eq!(running.send_request_body(body, true)?, Action::Continue);

    // Held with its whole body: the release routes it, then resumes it.
    let whole = p.http_stream(0)?;
    assert_eq!(whole.send_request_headers(&headers, false)?, Action::Pause);
    assert_eq!(whole.send_request_body(body, true)?, Action::Pause, "held");
    assert!(whole.forwarded_request_headers().is_none());
    running.finish()?;
    assert!(resumed(&whole), "released and resumed");
    assert_routed_to_the_pool(&whole);

    // Held before its body arrived: released (the one ahead ends), not resumed; its body's end
    // routes and continues it.
    let partial = p.http_stream(0)?;
    assert_eq!(
        partial.send_request_headers(&headers, false)?,
        Action::Pause
    );
    assert_eq!(
        partial.send_request_body(&body[..10], false)?,
        Action::Pause
    );
    whole.finish()?;
    assert!(!resumed(&partial), "its body is still arriving");
    assert_eq!(
        partial.send_request_body(&body[10..], true)?,
        Action::Continue
    );
    assert_routed_to_the_pool(&partial);
    partial.finish()?;
    // The combined filter gives the host its metrics on its tick.
    p.advance(Duration::from_millis(250))?;
    assert_eq!(p.counter("kvoy_admission_released_total"), Some(2));
    assert_eq!(p.counter("kvoy_prefix_affinity_decisions_total"), Some(3));
    Ok(())
}
