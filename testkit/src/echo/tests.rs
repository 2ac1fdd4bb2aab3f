//! The echo backend over real sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use crate::http::{post_json, send};
use std::io::Write;
use std::net::TcpStream;

const T: Duration = Duration::from_secs(5);

fn server() -> EchoServer {
    let listen = "127.0.0.1:0".parse().unwrap();
    EchoServer::start(EchoConfig::new(listen, &["m1", "m2"])).expect("start echo")
}

#[test]
fn chat_reply_names_the_server() {
    let s = server();
    let body = br#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#;
    let r = post_json(
        s.addr(),
        "/v1/chat/completions",
        &[(DESTINATION_HEADER, "1.2.3.4:5")],
        body,
        T,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let addr = s.addr().to_string();
    assert_eq!(r.header(SERVED_BY_HEADER), Some(addr.as_str()));
    let v = r.json().unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["kvoy_echo"]["served_by"], addr.as_str());
    assert_eq!(v["kvoy_echo"]["path"], "/v1/chat/completions");
    assert_eq!(v["kvoy_echo"]["destination_header"], "1.2.3.4:5");
    assert!(v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains(&addr));
    assert_eq!(s.inference_requests(), 1);
}

#[test]
fn completions_and_responses_shapes() {
    let s = server();
    let reply = |path: &str, body: &[u8]| post_json(s.addr(), path, &[], body, T).unwrap();
    let v = reply("/v1/completions", br#"{"model":"m2","prompt":"x"}"#)
        .json()
        .unwrap();
    assert_eq!(v["object"], "text_completion");
    assert!(v["kvoy_echo"]["destination_header"].is_null());
    let v = reply("/v1/responses", br#"{"model":"m2","input":"x"}"#)
        .json()
        .unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
}

#[test]
fn streaming_is_sse_ending_in_done() {
    let s = server();
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/responses"] {
        let body = br#"{"model":"m1","prompt":"x","stream":true}"#;
        let r = post_json(s.addr(), path, &[], body, T).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        let text = r.text();
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        for line in text.lines().filter(|l| l.starts_with("data: {")) {
            let _: Value = serde_json::from_str(&line["data: ".len()..]).expect("event is JSON");
        }
        assert!(text.contains(&s.addr().to_string()));
    }
}

#[test]
fn models_health_and_errors() {
    let s = server();
    let r = send(s.addr(), "GET", "/v1/models", &[], b"", T).unwrap();
    let v = r.json().unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][1]["id"], "m2");
    assert_eq!(
        send(s.addr(), "GET", "/health", &[], b"", T)
            .unwrap()
            .status,
        200
    );
    let r = post_json(s.addr(), "/v1/chat/completions", &[], b"{not json", T).unwrap();
    assert_eq!(r.status, 400);
    assert!(r.json().unwrap()["error"]["message"].is_string());
    let r = post_json(
        s.addr(),
        "/v1/chat/completions",
        &[],
        br#"{"model":"zz"}"#,
        T,
    )
    .unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(
        send(s.addr(), "GET", "/nope", &[], b"", T).unwrap().status,
        404
    );
    assert_eq!(s.inference_requests(), 0);
}

#[test]
fn keep_alive_and_chunked_request() {
    use std::io::Read;
    let s = server();
    let mut stream = TcpStream::connect(s.addr()).unwrap();
    stream.set_read_timeout(Some(T)).unwrap();
    let chunked = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
                   a\r\n{\"model\":\"\r\n7\r\nm1\"}   \r\n0\r\n\r\n";
    let plain = "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
    stream.write_all(chunked.as_bytes()).unwrap();
    stream.write_all(plain.as_bytes()).unwrap();
    let mut all = String::new();
    stream.read_to_string(&mut all).unwrap();
    assert_eq!(all.matches("HTTP/1.1 200 OK").count(), 2, "{all}");
    assert_eq!(s.requests(), 2);
}

#[test]
fn delay_header_delays() {
    let s = server();
    let start = std::time::Instant::now();
    let r = post_json(
        s.addr(),
        "/v1/completions",
        &[(DELAY_HEADER, "200")],
        br#"{"model":"m1"}"#,
        T,
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert!(start.elapsed() >= Duration::from_millis(200));
}
