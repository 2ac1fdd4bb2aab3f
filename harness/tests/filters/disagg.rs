//! Prefill/decode disaggregation through the real `.wasm` of both routing filters: a long
//! prompt goes to a decode endpoint with a prefill endpoint named in `x-prefiller-host-port`
//! (llm-d's header), a short one goes whole, and a client never names the prefiller.

use kvoy_harness::{Error, HttpStream, Plugin};

use crate::support::{self, DEST};
use crate::TestResult;

const PREFILLER: &str = "x-prefiller-host-port";
const DECODE: [&str; 2] = ["127.0.0.1:18101", "127.0.0.1:18102"];
const PREFILL: [&str; 2] = ["127.0.0.1:18201", "127.0.0.1:18202"];

/// The routing section: two decode and two prefill endpoints, split from `threshold`
/// uncached tokens.
fn routing(threshold: u32) -> serde_json::Value {
    let mut endpoints: Vec<serde_json::Value> = DECODE
        .iter()
        .map(|a| serde_json::json!({"address": a, "models": ["m"], "role": "decode"}))
        .collect();
    endpoints.extend(
        PREFILL
            .iter()
            .map(|a| serde_json::json!({"address": a, "models": ["m"], "role": "prefill"})),
    );
    serde_json::json!({
        "endpoints": endpoints,
        "disaggregation": {"non_cached_tokens": threshold},
    })
}

/// Both filters that route, configured alike.
fn plugins(threshold: u32) -> Result<Vec<Plugin>, Error> {
    let section = routing(threshold);
    Ok(vec![
        support::start("kvoy_prefix_affinity", &section.to_string(), 2, 5)?,
        support::start(
            "kvoy",
            &serde_json::json!({"prefix_affinity": section}).to_string(),
            2,
            5,
        )?,
    ])
}

/// A chat request of `text`, the client's `extra` headers, answered and finished.
fn send(plugin: &Plugin, text: &str, extra: &[(&str, &str)]) -> Result<HttpStream, Error> {
    let stream = plugin.http_stream(0)?;
    let mut headers = support::post("/v1/chat/completions");
    headers.extend_from_slice(extra);
    stream.send_request_headers(&headers, false)?;
    stream.send_request_body(support::chat_body(text).as_bytes(), true)?;
    Ok(stream)
}

fn answer(stream: &HttpStream) -> TestResult {
    stream.send_response(&[(":status", "200")], br#"{"choices":[]}"#)?;
    stream.finish()
}

#[test]
fn a_long_prompt_names_a_prefill_endpoint_and_a_short_one_does_not() -> TestResult {
    for plugin in plugins(1_000)? {
        let long = "A long document to summarise. ".repeat(600);
        let s = send(&plugin, &long, &[])?;
        let dest = support::forwarded(&s, DEST).expect("routed");
        let prefiller = support::forwarded(&s, PREFILLER).expect("split");
        assert!(DECODE.contains(&dest.as_str()), "{dest}");
        assert!(PREFILL.contains(&prefiller.as_str()), "{prefiller}");
        answer(&s)?;
        for i in 0..20 {
            let s = send(&plugin, &format!("a short question {i}"), &[])?;
            let dest = support::forwarded(&s, DEST).expect("routed");
            assert!(
                DECODE.contains(&dest.as_str()),
                "a prefill server answers nothing"
            );
            assert_eq!(support::forwarded(&s, PREFILLER), None, "question {i}");
            answer(&s)?;
        }
    }
    Ok(())
}

#[test]
fn a_client_never_names_the_prefiller() -> TestResult {
    for plugin in plugins(1_000)? {
        // Short: not split, and the client's header is gone.
        for forged in ["10.9.9.9:80", PREFILL[0], "not an address"] {
            let s = send(&plugin, "hi", &[(PREFILLER, forged)])?;
            assert_eq!(
                s.request_header(PREFILLER),
                None,
                "removed at once: {forged}"
            );
            assert_eq!(support::forwarded(&s, PREFILLER), None, "{forged}");
            answer(&s)?;
        }
        // Long: split, and the one header is the router's own.
        let long = "Another long document. ".repeat(800);
        let s = send(&plugin, &long, &[(PREFILLER, "10.9.9.9:80")])?;
        let forwarded = s.forwarded_request_headers().unwrap_or_default();
        let all: Vec<&str> = forwarded.get_all(PREFILLER).collect();
        assert_eq!(all.len(), 1, "{all:?}");
        assert!(PREFILL.contains(&all[0]), "{all:?}");
        answer(&s)?;
        // A request routed without its body: no prefiller either.
        let s = plugin.http_stream(1)?;
        s.send_request_headers(
            &[
                (":method", "GET"),
                (":path", "/v1/models"),
                (":authority", "g"),
                (PREFILLER, "10.9.9.9:80"),
            ],
            true,
        )?;
        let dest = support::forwarded(&s, DEST).expect("routed");
        assert!(DECODE.contains(&dest.as_str()), "{dest}");
        assert_eq!(support::forwarded(&s, PREFILLER), None);
        answer(&s)?;
    }
    Ok(())
}
