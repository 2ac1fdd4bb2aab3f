//! End to end: a real Envoy (`envoy/kvoy.yaml`, `--concurrency 2`) with the built
//! `kvoy_prefix_affinity` filter in front of three echo backends on 127.0.0.1.
//!
//! Needs `envoy` on PATH and `target/wasm32-wasip1/release/kvoy_prefix_affinity.wasm`
//! (`make test` provides both); without them every test fails and says so.
//!
//! Each test starts its own Envoy (tests run one at a time: the machine is small and the burst
//! test measures concurrency). On failure the Envoy log tail is printed.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{MODEL, TIMEOUT};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use kvoy_testkit::requests::{chat_body, prompt};
use kvoy_testkit::scenario;
use kvoy_testkit::{
    http::{self, Response},
    EchoConfig, EchoServer, PoolEndpoint, Stack, StackConfig, DESTINATION_HEADER, PIN_HEADER,
    SERVED_BY_HEADER,
};
use serde_json::{json, Value};

static SERIAL: Mutex<()> = Mutex::new(());

/// Three pool backends, one backend outside the pool, and Envoy in front of the pool.
struct Fixture {
    // Fields drop in order: Envoy first, then the backends, then the lock.
    stack: Stack,
    name: &'static str,
    pool: Vec<EchoServer>,
    outsider: EchoServer,
    _serial: MutexGuard<'static, ()>,
}

impl Fixture {
    fn start(name: &'static str, max_body_bytes: Option<u64>) -> Fixture {
        let serial = SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let pool: Vec<EchoServer> = EchoServer::loopback(3, &[MODEL]).expect("start echo backend");
        let outsider = EchoServer::start(EchoConfig::new(any, &[MODEL])).expect("start outsider");
        let endpoints = PoolEndpoint::all(
            &pool.iter().map(EchoServer::addr).collect::<Vec<_>>(),
            &[MODEL],
        );
        let mut config = StackConfig::new(endpoints, common::run_dir(name));
        config.max_body_bytes = max_body_bytes;
        let stack = common::start_stack(name, &config);
        eprintln!(
            "[{name}] envoy on {} (admin {}), pool {:?}, outsider {}, config {}",
            stack.listen,
            stack.admin,
            pool.iter().map(|b| b.addr()).collect::<Vec<_>>(),
            outsider.addr(),
            stack.config_path.display()
        );
        Fixture {
            stack,
            name,
            pool,
            outsider,
            _serial: serial,
        }
    }

    fn pool_addrs(&self) -> Vec<String> {
        self.pool.iter().map(|b| b.addr().to_string()).collect()
    }

    fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
        http::post_json(self.stack.listen, path, headers, body, TIMEOUT)
            .unwrap_or_else(|e| panic!("[{}] POST {path} through envoy failed: {e}", self.name))
    }

    fn chat(&self, system: &str, user: &str, headers: &[(&str, &str)]) -> Response {
        self.post(
            "/v1/chat/completions",
            headers,
            &chat_body(MODEL, system, user),
        )
    }

    /// Checks a 200 reply came from a pool backend, that the filter reported the same endpoint
    /// and that the backend saw it as the destination; returns the backend address.
    fn served_ok(&self, r: &Response, what: &str) -> String {
        common::assert_ok(self.name, what, r);
        let served = kvoy_testkit::served_by(r, &self.pool_addrs(), self.name, what);
        if let Ok(v) = r.json() {
            assert_eq!(
                v["kvoy_echo"]["destination_header"],
                json!(served),
                "[{}] {what}: the backend should have received {DESTINATION_HEADER} = itself",
                self.name
            );
            assert_eq!(
                v["kvoy_echo"]["pin_header"],
                Value::Null,
                "[{}] {what}: the session pin {PIN_HEADER} reached the backend",
                self.name
            );
        }
        served
    }

    /// Fails if the Envoy log shows wasm panics, traps or VM failures; on success removes the
    /// run directory (a failed test keeps it for inspection).
    fn finish(self) {
        self.stack.finish(self.name);
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.stack.print_log_tail_if_panicking(self.name);
    }
}

fn count(dist: &mut BTreeMap<String, usize>, served: String) {
    *dist.entry(served).or_default() += 1;
}

#[test]
fn shared_prefix_lands_on_one_backend() {
    let f = Fixture::start("shared_prefix", None);
    let system = prompt("shared-system-prompt", 4096);
    let mut dist = BTreeMap::new();
    for i in 0..10 {
        let r = f.chat(
            &system,
            &format!("Question {i}: what does setting {i} do?"),
            &[],
        );
        count(
            &mut dist,
            f.served_ok(&r, &format!("shared-prefix request {i}")),
        );
    }
    eprintln!("[shared_prefix] distribution: {dist:?}");
    assert_eq!(
        dist.len(),
        1,
        "10 requests sharing a 4 KB prefix should all land on one backend: {dist:?}"
    );
    f.finish();
}

#[test]
fn distinct_prefixes_spread_over_the_pool() {
    let f = Fixture::start("distinct_prefixes", None);
    let mut dist = BTreeMap::new();
    for i in 0..30 {
        let system = prompt(&format!("tenant-{i:03}-{}", i * 7919 % 1000), 2048);
        let r = f.chat(&system, "Hello", &[]);
        count(
            &mut dist,
            f.served_ok(&r, &format!("distinct-prefix request {i}")),
        );
    }
    eprintln!("[distinct_prefixes] distribution: {dist:?}");
    for addr in f.pool_addrs() {
        assert!(
            dist.get(&addr).copied().unwrap_or(0) > 0,
            "30 distinct prefixes should reach every backend; {addr} got none: {dist:?}"
        );
    }
    f.finish();
}

#[test]
fn concurrent_burst_is_not_piled_on_one_backend() {
    let f = Fixture::start("burst", None);
    let system = prompt("burst-system-prompt", 4096);
    // Bind the prefix first, so the burst meets an established affinity.
    let first = f.chat(&system, "warm-up", &[]);
    let home = f.served_ok(&first, "warm-up");
    let start = Instant::now();
    let burst = scenario::same_prefix_burst(f.stack.listen, MODEL, &system, 50, TIMEOUT);
    let mut dist = BTreeMap::new();
    for (i, r) in burst.into_iter().enumerate() {
        let r = r.unwrap_or_else(|e| panic!("burst request {i} failed: {e}"));
        count(&mut dist, f.served_ok(&r, &format!("burst request {i}")));
    }
    eprintln!(
        "[burst] 50 concurrent same-prefix requests in {:?}; prefix home {home}; distribution: {dist:?}",
        start.elapsed()
    );
    assert!(
        dist.len() >= 2,
        "a burst of 50 in-flight same-prefix requests all went to one backend: {dist:?}"
    );
    f.finish();
}

#[test]
fn forged_destination_headers_are_ignored() {
    let f = Fixture::start("forged_destination", None);
    let system = prompt("forgery-system-prompt", 4096);
    let first = f.chat(&system, "bind this prefix", &[]);
    let home = f.served_ok(&first, "binding request");
    let other_member = f
        .pool_addrs()
        .into_iter()
        .find(|a| *a != home)
        .expect("a second pool member");
    let outsider = f.outsider.addr().to_string();
    let forgeries = [outsider.as_str(), "127.0.0.1:1", other_member.as_str()];
    // The destination, and the internal session pin (which only the session stage sets; a
    // client's is neither followed nor passed on: `served_ok` checks the backend saw none).
    for header in [DESTINATION_HEADER, PIN_HEADER] {
        for (i, forged) in forgeries.iter().enumerate() {
            let r = f.chat(
                &system,
                &format!("forged question {i} in {header}"),
                &[(header, forged)],
            );
            let served = f.served_ok(&r, &format!("request forging {header}: {forged}"));
            assert_eq!(
                served, home,
                "forging {header}: {forged} moved a request whose prefix lives on {home} to {served}"
            );
        }
    }
    assert_eq!(
        f.outsider.requests(),
        0,
        "the backend outside the pool ({outsider}) received a request"
    );
    f.finish();
}

fn assert_openai_error(name: &str, r: &Response, status: u16, what: &str) {
    assert_eq!(
        r.status,
        status,
        "[{name}] {what}: expected {status}, got {} with body {}",
        r.status,
        r.text()
    );
    assert!(
        r.header(SERVED_BY_HEADER).is_none(),
        "[{name}] {what}: the reply came from backend {:?}, not from the filter",
        r.header(SERVED_BY_HEADER)
    );
    let v: Value = r.json().unwrap_or_else(|e| {
        panic!(
            "[{name}] {what}: error body is not JSON ({e}): {}",
            r.text()
        )
    });
    let err = &v["error"];
    assert!(
        err["message"].is_string(),
        "[{name}] {what}: error.message missing: {v}"
    );
    assert!(
        err["type"].is_string(),
        "[{name}] {what}: error.type missing: {v}"
    );
    assert!(
        err.get("code").is_some(),
        "[{name}] {what}: error.code missing: {v}"
    );
    eprintln!("[{name}] {what} -> {status} {v}");
}

#[test]
fn invalid_requests_get_openai_errors() {
    let name = "invalid_requests";
    let f = Fixture::start(name, Some(1024 * 1024));

    let r = f.post(
        "/v1/chat/completions",
        &[],
        b"{\"model\": \"kvoy-demo\", \"messages\": [",
    );
    assert_openai_error(name, &r, 400, "malformed JSON body");

    let big = prompt("too-big", 2 * 1024 * 1024);
    let r = f.chat(&big, "hi", &[]);
    assert_openai_error(name, &r, 413, "2 MiB body over max_body_bytes = 1 MiB");

    let body = serde_json::to_vec(&json!({
        "model": "no-such-model",
        "messages": [{"role": "user", "content": "hi"}],
    }))
    .unwrap();
    let r = f.post("/v1/chat/completions", &[], &body);
    assert_openai_error(name, &r, 404, "unknown model");

    let r = http::get(f.stack.listen, "/v1/models", TIMEOUT).expect("GET /v1/models");
    assert_eq!(r.status, 200, "GET /v1/models: {}", r.text());
    let from = r.header(SERVED_BY_HEADER).map(str::to_string);
    assert!(
        from.as_ref().is_some_and(|a| f.pool_addrs().contains(a)),
        "GET /v1/models should be answered by a pool backend, was {from:?}"
    );
    assert_eq!(r.json().expect("models JSON")["data"][0]["id"], MODEL);
    f.finish();
}

#[test]
fn large_and_streaming_requests_route() {
    let f = Fixture::start("large_and_streaming", Some(8 * 1024 * 1024));
    // ~100k tokens at ~4 bytes per token.
    let huge = prompt("hundred-k-tokens", 400 * 1024);
    let start = Instant::now();
    let r = f.chat(&huge, "Summarise the above.", &[]);
    let first = f.served_ok(&r, "400 KB prompt");
    eprintln!(
        "[large_and_streaming] 400 KB prompt served by {first} in {:?}",
        start.elapsed()
    );
    let r = f.chat(&huge, "Now list the keys.", &[]);
    assert_eq!(
        f.served_ok(&r, "second 400 KB prompt"),
        first,
        "the 400 KB prefix should stick"
    );

    let body = serde_json::to_vec(&json!({
        "model": MODEL,
        "stream": true,
        "messages": [{"role": "user", "content": prompt("stream", 1024)}],
    }))
    .unwrap();
    let r = f.post("/v1/chat/completions", &[], &body);
    f.served_ok(&r, "streaming request");
    let text = r.text();
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "streamed reply should end with [DONE]: {text}"
    );
    f.finish();
}

#[test]
fn every_openai_api_routes() {
    let f = Fixture::start("every_api", None);
    let text = prompt("every-api", 2048);
    let calls = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": text}]}),
        ),
        ("/v1/completions", json!({"model": MODEL, "prompt": text})),
        ("/v1/responses", json!({"model": MODEL, "input": text})),
    ];
    for (path, body) in calls {
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let r = f.post(path, &[], &serde_json::to_vec(&body).unwrap());
            let served = f.served_ok(&r, &format!("POST {path} stream={stream}"));
            if stream {
                assert!(
                    r.text().trim_end().ends_with("data: [DONE]"),
                    "{path}: {}",
                    r.text()
                );
            } else {
                assert_eq!(r.json().expect("reply JSON")["kvoy_echo"]["path"], path);
            }
            eprintln!("[every_api] POST {path} stream={stream} -> {served}");
        }
    }
    f.finish();
}
