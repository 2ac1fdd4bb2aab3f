//! Smoke test against the real `kvoy_prefix_affinity` filter (built by `make wasm`): the host
//! starts it in two VMs, routes a chat completion and rejects a malformed body.

use kvoy_harness::{Action, Error, Plugin};

use crate::support;
use crate::TestResult;

const ENDPOINTS: [&str; 2] = ["127.0.0.1:18001", "127.0.0.1:18002"];

fn plugin() -> Result<Plugin, Error> {
    let config = support::pool_config(&ENDPOINTS, serde_json::json!({}));
    support::builder("kvoy_prefix_affinity", &config, 2)?.start()
}

const HEADERS: &[(&str, &str)] = &[
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "gateway"),
    (":scheme", "http"),
    ("content-type", "application/json"),
];

#[test]
fn routes_a_chat_completion_to_a_configured_endpoint() -> TestResult {
    let plugin = plugin()?;
    for vm in 0..plugin.vm_count() {
        let stream = plugin.vm(vm).http_stream()?;
        assert_eq!(
            stream.send_request_headers(HEADERS, false)?,
            Action::Pause,
            "waits for the body"
        );
        let body =
            br#"{"model":"m","messages":[{"role":"user","content":"Hello there, how are you?"}]}"#;
        assert_eq!(stream.send_request_body(body, true)?, Action::Continue);
        let destination = stream
            .request_header("x-gateway-destination-endpoint")
            .unwrap_or_default();
        assert!(
            ENDPOINTS.contains(&destination.as_str()),
            "destination {destination:?}; logs {:?}",
            plugin.logs()
        );
        let forwarded = stream.forwarded_request_headers().unwrap_or_default();
        assert_eq!(
            forwarded.get("x-gateway-destination-endpoint"),
            Some(destination.as_str())
        );
        assert_eq!(stream.local_reply(), None);

        stream.set_property(&["upstream", "address"], destination.as_str())?;
        stream.send_response(&[(":status", "200")], b"{}")?;
        stream.finish()?;
    }
    Ok(())
}

#[test]
fn a_malformed_body_gets_a_local_400() -> TestResult {
    let plugin = plugin()?;
    let stream = plugin.vm(1).http_stream()?;
    assert_eq!(stream.send_request_headers(HEADERS, false)?, Action::Pause);
    stream.send_request_body(b"{not json", true)?;
    let reply = stream.local_reply().expect("a local reply");
    assert_eq!(reply.status, 400, "{reply:?}");
    assert_eq!(
        stream.request_header("x-gateway-destination-endpoint"),
        None
    );
    assert!(
        stream.forwarded_request_headers().is_none(),
        "nothing went upstream"
    );
    stream.finish()?;
    Ok(())
}
