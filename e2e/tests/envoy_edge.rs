//! End to end, the edge of issue 16 ("nothing gets through"): a real Envoy (`envoy/kvoy.yaml`,
//! `--concurrency 2`) with the three kvoy filters in front of two echo backends on 127.0.0.1.
//!
//! - HTTP/2 (h2c, prior knowledge, a real hyper client) and chunked HTTP/1.1 requests that end
//!   with trailers are routed by kvoy like any other: one decision, one upstream request each,
//!   to a pool member.
//! - Only the OpenAI API reaches the pool: the servers' own endpoints are answered 404 by Envoy.
//! - Encoded paths are normalised (their bodies are checked) or refused, never let past the
//!   filters.
//! - A server that cannot be reached is answered 503 with kvoy's reason header.
//!
//! Needs `envoy` on PATH and the release wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, Request};
use hyper_util::rt::{TokioExecutor, TokioIo};

use kvoy_testkit::http::server;
use kvoy_testkit::{http, EchoServer, PoolEndpoint, Stack, StackConfig, SERVED_BY_HEADER};

const MODEL: &str = "kvoy-demo";
const TIMEOUT: Duration = Duration::from_secs(20);
const SERVED: &str = "x-gateway-destination-endpoint-served";

static SERIAL: Mutex<()> = Mutex::new(());

struct Fixture {
    stack: Stack,
    name: &'static str,
    pool: Vec<EchoServer>,
    _serial: MutexGuard<'static, ()>,
}

impl Fixture {
    fn start(name: &'static str) -> Fixture {
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let pool: Vec<EchoServer> = EchoServer::loopback(2, &[MODEL]).expect("echo backend");
        let endpoints = PoolEndpoint::all(
            &pool.iter().map(EchoServer::addr).collect::<Vec<_>>(),
            &[MODEL],
        );
        let run_dir = common::run_dir(name);
        let stack = Stack::start(&StackConfig::new(endpoints, run_dir))
            .unwrap_or_else(|e| panic!("[{name}] could not start the kvoy stack: {e:#}"));
        Fixture {
            stack,
            name,
            pool,
            _serial: serial,
        }
    }

    fn pool_addresses(&self) -> Vec<String> {
        self.pool.iter().map(|b| b.addr().to_string()).collect()
    }

    fn backend_requests(&self) -> u64 {
        self.pool.iter().map(EchoServer::requests).sum()
    }

    fn stat(&self, name: &str) -> u64 {
        let stats = self.stack.stats(name).expect("stats");
        stats
            .iter()
            .find(|(k, _)| k.ends_with(name))
            .map_or(0, |(_, v)| *v)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.stack.print_log_tail_if_panicking(self.name);
    }
}

fn chat(text: &str) -> Vec<u8> {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": text}]})
        .to_string()
        .into_bytes()
}

struct H2Reply {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl H2Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

async fn read_all(mut body: Incoming) -> anyhow::Result<Vec<u8>> {
    use std::future::poll_fn;
    let mut out = Vec::new();
    while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(data) = frame?.into_data() {
            out.extend_from_slice(&data);
        }
    }
    Ok(out)
}

/// POSTs `body` over one h2c connection (prior knowledge), with `trailers` ending the stream
/// when given.
async fn h2_post(
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    trailers: Option<&[(&str, &str)]>,
) -> anyhow::Result<H2Reply> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let half = body.len() / 2;
    let trailers = trailers.map(|t| {
        let mut map = HeaderMap::new();
        for (k, v) in t {
            map.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    });
    let frames = server::Body::chunks([
        Bytes::copy_from_slice(&body[..half]),
        Bytes::copy_from_slice(&body[half..]),
    ]);
    let request = Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(match trailers {
            Some(trailers) => frames.with_trailers(trailers),
            None => frames,
        })?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = read_all(response.into_body()).await?;
    Ok(H2Reply {
        status,
        headers,
        body,
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A chunked HTTP/1.1 POST whose last chunk is followed by a trailer; the raw response.
fn h1_chunked_with_trailers(addr: SocketAddr, path: &str, body: &[u8]) -> String {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let half = body.len() / 2;
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\ntrailer: x-checksum\r\nconnection: close\r\n\r\n"
    )
    .into_bytes();
    for part in [&body[..half], &body[half..]] {
        req.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        req.extend_from_slice(part);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\nx-checksum: 1\r\n\r\n");
    s.write_all(&req).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn requests_that_end_with_trailers_are_routed_like_any_other() {
    let f = Fixture::start("trailers");
    let pool = f.pool_addresses();
    let before_rq = f.stat("cluster.kvoy_pool.upstream_rq_total");
    let before_decisions = f.stat("kvoy_prefix_affinity_decisions_total");
    let rt = runtime();
    const N: u64 = 8;
    for i in 0..N {
        let body = chat(&format!("question {i} sent over HTTP/2 with trailers"));
        let trailers: Option<&[(&str, &str)]> = if i % 2 == 0 {
            Some(&[("x-checksum", "1")])
        } else {
            None
        };
        let reply = rt
            .block_on(async {
                tokio::time::timeout(
                    TIMEOUT,
                    h2_post(f.stack.listen, "/v1/chat/completions", &body, trailers),
                )
                .await
            })
            .expect("in time")
            .expect("h2 request");
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        assert_eq!(reply.status, 200, "request {i}: {text}");
        let by = reply
            .header(SERVED_BY_HEADER)
            .unwrap_or_default()
            .to_owned();
        assert!(
            pool.contains(&by),
            "request {i} served by {by:?}, not the pool {pool:?}"
        );
        assert_eq!(
            reply.header(SERVED),
            Some(by.as_str()),
            "request {i}: routed by kvoy"
        );
    }
    // Chunked HTTP/1.1 with a trailer, too.
    let raw = h1_chunked_with_trailers(
        f.stack.listen,
        "/v1/chat/completions",
        &chat("a chunked question with a trailer"),
    );
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    assert!(raw.to_ascii_lowercase().contains(SERVED), "{raw}");
    // Exactly one kvoy decision and one upstream request per request: none went anywhere
    // kvoy did not choose (ORIGINAL_DST's fallback would be the proxy's own listener).
    assert_eq!(
        f.stat("kvoy_prefix_affinity_decisions_total") - before_decisions,
        N + 1
    );
    assert_eq!(
        f.stat("cluster.kvoy_pool.upstream_rq_total") - before_rq,
        N + 1
    );
    assert_eq!(f.backend_requests(), N + 1);
    f.stack.assert_no_wasm_failures(f.name);
}

#[test]
fn only_the_api_reaches_the_pool() {
    let f = Fixture::start("routes");
    for (method, path) in [
        ("GET", "/metrics"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/flush_cache"),
        ("GET", "/health"),
        ("GET", "/"),
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions/extra"),
        ("POST", "/v1/models"),
    ] {
        let before = f.backend_requests();
        let r = http::send(f.stack.listen, method, path, &[], b"{}", TIMEOUT).unwrap();
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text());
        assert!(
            r.header(SERVED_BY_HEADER).is_none(),
            "{method} {path} reached a backend"
        );
        assert_eq!(
            f.backend_requests(),
            before,
            "{method} {path} reached a backend"
        );
        assert!(r.text().contains("not_found"), "{}", r.text());
    }
    let r = http::get(f.stack.listen, "/v1/models", TIMEOUT).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let r = http::post_json(
        f.stack.listen,
        "/v1/chat/completions",
        &[],
        &chat("hello"),
        TIMEOUT,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    f.stack.assert_no_wasm_failures(f.name);
}

#[test]
fn encoded_paths_cannot_bypass_the_filters() {
    let f = Fixture::start("encoded");
    let pool = f.pool_addresses();
    // A body the filter refuses: any path that reaches the pool without it is a bypass.
    let bad = br#"{"messages": "not a list"}"#;
    for path in [
        "/v1/chat%2Fcompletions",
        "/v1/chat%2fcompletions",
        "/v1%2Fchat%2Fcompletions",
        "/v1/%63hat/completions",
        "/v1/chat/%63ompletions",
        "//v1//chat/completions",
        "/v1/./chat/completions",
        "/v1/x/../chat/completions",
        "/v1/chat/completions?stream=true",
    ] {
        let before = f.backend_requests();
        let r = http::send(f.stack.listen, "POST", path, &[], bad, TIMEOUT).unwrap();
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(
            r.header(SERVED_BY_HEADER).is_none(),
            "{path} reached a backend"
        );
        assert_eq!(f.backend_requests(), before, "{path} reached a backend");
    }
    // The normalised spelling of an API path is that API: routed by kvoy.
    let r = http::send(
        f.stack.listen,
        "POST",
        "/v1/%63hat/completions",
        &[("content-type", "application/json")],
        &chat("hello"),
        TIMEOUT,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let by = r.header(SERVED_BY_HEADER).unwrap_or_default().to_owned();
    assert!(pool.contains(&by), "{by}");
    assert_eq!(r.header(SERVED), Some(by.as_str()));
    f.stack.assert_no_wasm_failures(f.name);
}

#[test]
fn an_unreachable_server_is_answered_503_with_a_reason() {
    // The pool's one server is gone (its port closed): Envoy's own answer carries kvoy's
    // reason header and an OpenAI-shaped error (envoy/kvoy.yaml's `local_reply_config`).
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let run_dir = common::run_dir("unreachable");
    let stack = Stack::start(&StackConfig::new(
        vec![PoolEndpoint::new(gone, &[MODEL])],
        run_dir,
    ))
    .unwrap_or_else(|e| panic!("[unreachable] could not start the kvoy stack: {e:#}"));
    let r = http::post_json(
        stack.listen,
        "/v1/chat/completions",
        &[],
        &chat("is anyone there"),
        TIMEOUT,
    )
    .unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.header("x-kvoy-dropped-reason"),
        Some("upstream-unavailable"),
        "{:?}",
        r.headers
    );
    assert_eq!(r.header("content-type"), Some("application/json"));
    let body = r.json().unwrap();
    assert_eq!(body["error"]["code"], "upstream_unavailable", "{body}");
    stack.assert_no_wasm_failures("unreachable");
}

/// A POST to `path` (any bytes) with `extra` raw header lines (any bytes); the raw response.
fn h1_post_raw(addr: SocketAddr, path: &[u8], extra: &[u8], body: &[u8]) -> String {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut req = b"POST ".to_vec();
    req.extend_from_slice(path);
    req.extend_from_slice(
        format!(
            " HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n",
            body.len()
        )
        .as_bytes(),
    );
    req.extend_from_slice(extra);
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(body);
    s.write_all(&req).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn header_values_that_are_not_utf8_fail_no_filter() {
    // The SDK's string header getters trap on such a value: one request used to fail the VM,
    // and every later request on its worker was answered 503.
    let f = Fixture::start("non-utf8");
    let pool = f.pool_addresses();
    let served = |raw: &str| -> Option<String> {
        raw.lines()
            .find_map(|l| l.strip_prefix(&format!("{SERVED_BY_HEADER}: ")))
            .map(|s| s.trim().to_owned())
    };
    for (i, name) in [
        "x-session-id",
        "cookie",
        "x-session-token",
        "x-gateway-inference-objective",
        "x-llm-d-inference-objective",
        "x-gateway-inference-fairness-id",
        "x-llm-d-inference-fairness-id",
        "x-kvoy-session-endpoint",
        "x-gateway-destination-endpoint",
    ]
    .iter()
    .enumerate()
    {
        let mut line = format!("{name}: a").into_bytes();
        line.extend_from_slice(b"\xff\xfe\xc3\x28\r\n");
        let raw = h1_post_raw(
            f.stack.listen,
            b"/v1/chat/completions",
            &line,
            &chat(&format!("question {i} with a {name} that is not UTF-8")),
        );
        // Routed by kvoy to a pool member (which may answer as it likes: the echo backend
        // refuses the header with a 400 of its own).
        let by = served(&raw).unwrap_or_default();
        assert!(pool.contains(&by), "{name}: served by {by:?}: {raw}");
        assert!(
            raw.contains(&format!("{SERVED}: {by}")),
            "{name}: routed by kvoy: {raw}"
        );
    }
    // A path that is not UTF-8 reaches no backend (Envoy's routes are exact; the filter
    // would refuse it as a path it cannot read).
    let before = f.backend_requests();
    let raw = h1_post_raw(
        f.stack.listen,
        b"/v1/chat/completions\xff",
        b"",
        &chat("a question on a path that is not UTF-8"),
    );
    assert!(raw.starts_with("HTTP/1.1 4"), "{raw}");
    assert_eq!(f.backend_requests(), before, "{raw}");
    // Both workers still route.
    for i in 0..8 {
        let raw = h1_post_raw(
            f.stack.listen,
            b"/v1/chat/completions",
            b"",
            &chat(&format!("a plain question {i}")),
        );
        assert!(raw.starts_with("HTTP/1.1 200"), "after: {raw}");
    }
    f.stack.assert_no_wasm_failures(f.name);
}
