//! The prefix-affinity filter's side of sessions, through the real `.wasm` with two VMs: a pin
//! from `kvoy_session` (the internal header) is honoured for a pool member, never followed
//! outside the pool, stripped before the request leaves, and broken when its endpoint is
//! clearly overloaded (unless the pin is hard).

use kvoy_harness::{Error, HttpStream, Plugin};
use kvoy_shared::session::PIN_HEADER;

use crate::support::{self, DEST, POOL};
use crate::TestResult;

/// The prefix-affinity filter over [`POOL`], with the fields of `extra` besides.
fn plugin(extra: serde_json::Value) -> Result<Plugin, Error> {
    let config = support::pool_config(&POOL, extra);
    support::start("kvoy_prefix_affinity", &config, 2, 5)
}

/// Sends a chat request pinned to `pin` on `vm`; returns the open stream and its destination.
fn send(
    plugin: &Plugin,
    vm: usize,
    i: usize,
    pin: Option<&str>,
) -> Result<(HttpStream, String), Error> {
    let body =
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"turn {i} of a chat"}}]}}"#);
    let stream = plugin.http_stream(vm)?;
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "gw"),
    ];
    if let Some(p) = pin {
        headers.push((PIN_HEADER, p));
    }
    stream.send_request_headers(&headers, false)?;
    stream.send_request_body(body.as_bytes(), true)?;
    let forwarded = stream.forwarded_request_headers().expect("forwarded");
    assert_eq!(
        forwarded.get(PIN_HEADER),
        None,
        "the pin never leaves the proxy"
    );
    let dest = forwarded.get(DEST).expect("a destination").to_owned();
    assert!(POOL.contains(&dest.as_str()), "{dest}");
    Ok((stream, dest))
}

#[test]
fn pins_are_honoured_inside_the_pool_only() -> TestResult {
    let plugin = plugin(serde_json::json!({}))?;
    for i in 0..20 {
        let (s, dest) = send(&plugin, i % 2, i, Some(POOL[2]))?;
        assert_eq!(dest, POOL[2]);
        s.finish()?;
    }
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_session_pins_honoured_total"),
        Some(20)
    );
    for (i, forged) in ["10.9.9.9:80", "127.0.0.1:18004", "not an address", ""]
        .iter()
        .enumerate()
    {
        let (s, _) = send(&plugin, 0, 100 + i, Some(forged))?;
        s.finish()?;
    }
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_session_pins_broken_not_in_pool_total"),
        Some(4)
    );
    Ok(())
}

#[test]
fn an_overloaded_pin_breaks_unless_hard() -> TestResult {
    let plugin = plugin(serde_json::json!({}))?;
    // Requests pinned to endpoint 0 stay open: its in-flight count grows.
    let mut open = Vec::new();
    let mut broke_at = None;
    for i in 0..40 {
        let (s, dest) = send(&plugin, i % 2, i, Some(POOL[0]))?;
        if dest != POOL[0] && broke_at.is_none() {
            broke_at = Some(i);
        }
        open.push(s);
    }
    // break_abs 16: the 17th open request (16 ahead of the idle endpoints) goes elsewhere.
    assert_eq!(broke_at, Some(16), "pin broken once 16 ahead");
    assert!(
        plugin
            .counter("kvoy_prefix_affinity_session_pins_broken_overloaded_total")
            .unwrap_or(0)
            > 0
    );
    for s in open {
        s.finish()?;
    }

    let plugin = plugin_hard()?;
    let mut open = Vec::new();
    for i in 0..40 {
        let (s, dest) = send(&plugin, i % 2, i, Some(POOL[0]))?;
        assert_eq!(dest, POOL[0], "a hard pin holds at {i} open requests");
        open.push(s);
    }
    Ok(())
}

fn plugin_hard() -> Result<Plugin, Error> {
    plugin(serde_json::json!({"session": {"hard": true}}))
}
