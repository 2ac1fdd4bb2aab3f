//! The differential test: the same sequence of requests through a real Envoy (`envoy/kvoy.yaml`,
//! one worker, the combined `kvoy` filter) and through `kvoy-local serve` (one worker, the three
//! separate filters), with the same stage configurations in front of the same echo backends,
//! gives the same routing decisions, the same local replies and response headers, and the
//! filters' state evolving the same way (every `kvoy_*` counter and gauge equal at the end): the
//! two layouts, and the harness and Envoy, agree.
//!
//! Envoy seeds each VM's random tie-breaks from the host's randomness, which no configuration
//! controls, so the sequence is built so that no scored decision is a tie: the endpoints have
//! different static queue lengths (waiting 0, 2, 4), sessions pin requests to chosen endpoints,
//! and prefixes then keep them there. Each request's expected endpoint is also asserted, so a
//! change that makes both sides wrong in the same way fails too.
//!
//! Needs `envoy` on PATH and the built filters (`make wasm`).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use kvoy_shared::session::encode_token;
use kvoy_testkit::{
    http::{self, Response},
    EchoServer, PoolEndpoint, Stack, StackConfig, DESTINATION_HEADER, SERVED_BY_HEADER,
    SERVED_HEADER,
};
use serde_json::{json, Value};

use kvoy_testkit::requests::{chat_body, prompt};

const MODEL: &str = "kvoy-demo";
const TIMEOUT: Duration = Duration::from_secs(30);

/// One step of the sequence.
struct Step {
    what: &'static str,
    method: &'static str,
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    /// The pool member (by index) expected to serve it, or the local reply's status.
    expect: Expect,
}

#[derive(Clone, Copy, Debug)]
enum Expect {
    Served(usize),
    Status(u16),
}

/// What one side answered, reduced to what must be equal.
#[derive(Debug, Clone, PartialEq)]
struct Observed {
    status: u16,
    served_by: Option<String>,
    served_header: Option<String>,
    session_token: Option<String>,
    dropped_reason: Option<String>,
    /// For a local reply: the JSON error.
    error: Option<Value>,
}

fn observe(r: &Response) -> Observed {
    let header = |n: &str| r.header(n).map(str::to_owned);
    let error = (r.status != 200).then(|| r.json().ok()).flatten();
    Observed {
        status: r.status,
        served_by: header(SERVED_BY_HEADER),
        served_header: header(SERVED_HEADER),
        session_token: header("x-session-token"),
        dropped_reason: header("x-kvoy-dropped-reason"),
        error,
    }
}

fn chat(system: &str, user: &str) -> Vec<u8> {
    chat_body(MODEL, system, user)
}

fn steps(pool: &[SocketAddr]) -> Vec<Step> {
    let (p1, p2, p3, p4) = (
        prompt("diff-p1", 4096),
        prompt("diff-p2", 4096),
        prompt("diff-p3", 4096),
        prompt("diff-p4", 4096),
    );
    let token = |i: usize| encode_token(pool[i]);
    let step = |what, headers: Vec<(&'static str, String)>, body, expect| Step {
        what,
        method: "POST",
        path: "/v1/chat/completions",
        headers,
        body,
        expect,
    };
    vec![
        // Empty index: the shortest queue (member 0) wins.
        step("new prefix p1", vec![], chat(&p1, "q1"), Expect::Served(0)),
        step("p1 again", vec![], chat(&p1, "q2"), Expect::Served(0)),
        // A stateless token pins p2 to member 2 (the longest queue); the prefix keeps it there.
        step(
            "p2 pinned by token",
            vec![("x-session-token", token(2))],
            chat(&p2, "q3"),
            Expect::Served(2),
        ),
        step("p2 by prefix", vec![], chat(&p2, "q4"), Expect::Served(2)),
        // A session id with no binding yet: the token pins, the id gets bound to member 1.
        step(
            "session alice bound via token",
            vec![
                ("x-session-id", "alice".into()),
                ("x-session-token", token(1)),
            ],
            chat(&p3, "q5"),
            Expect::Served(1),
        ),
        step(
            "session alice, new prefix p4",
            vec![("x-session-id", "alice".into())],
            chat(&p4, "q6"),
            Expect::Served(1),
        ),
        step("p4 by prefix", vec![], chat(&p4, "q7"), Expect::Served(1)),
        step(
            "forged destination",
            vec![(DESTINATION_HEADER, pool[2].to_string())],
            chat(&p1, "q8"),
            Expect::Served(0),
        ),
        step(
            "garbage token, p2",
            vec![("x-session-token", "!!not-a-token!!".into())],
            chat(&p2, "q9"),
            Expect::Served(2),
        ),
        step(
            "malformed body",
            vec![],
            b"{\"model\": \"kvoy-demo\", \"messages\": [".to_vec(),
            Expect::Status(400),
        ),
        step(
            "unknown model",
            vec![],
            chat_body("no-such-model", "", "hi"),
            Expect::Status(404),
        ),
        step(
            "too large",
            vec![],
            chat(&prompt("big", 300 * 1024), "hi"),
            Expect::Status(413),
        ),
        // The same prompt text through another API: its blocks live on member 1 (step 5).
        Step {
            what: "completions API, p3",
            method: "POST",
            path: "/v1/completions",
            headers: vec![],
            body: serde_json::to_vec(&json!({"model": MODEL, "prompt": p3})).unwrap(),
            expect: Expect::Served(1),
        },
        Step {
            what: "responses API, session alice",
            method: "POST",
            path: "/v1/responses",
            headers: vec![("x-session-id", "alice".into())],
            body: serde_json::to_vec(&json!({"model": MODEL, "input": "short"})).unwrap(),
            expect: Expect::Served(1),
        },
        // Not an inference request: the least-loaded member (shortest queue).
        Step {
            what: "GET /v1/models",
            method: "GET",
            path: "/v1/models",
            headers: vec![],
            body: Vec::new(),
            expect: Expect::Served(0),
        },
        step("p1 once more", vec![], chat(&p1, "q10"), Expect::Served(0)),
    ]
}

fn run(listen: SocketAddr, steps: &[Step], side: &str) -> Vec<Observed> {
    steps
        .iter()
        .map(|s| {
            let headers: Vec<(&str, &str)> =
                s.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let r = if s.method == "GET" {
                http::send(listen, "GET", s.path, &headers, b"", TIMEOUT)
            } else {
                http::post_json(listen, s.path, &headers, &s.body, TIMEOUT)
            }
            .unwrap_or_else(|e| panic!("[{side}] {}: {e}", s.what));
            observe(&r)
        })
        .collect()
}

/// Counters and gauges named `kvoy_*`, without Envoy's `wasmcustom.` prefix.
fn kvoy_only(stats: impl IntoIterator<Item = (String, i64)>) -> BTreeMap<String, i64> {
    stats
        .into_iter()
        .filter_map(|(name, v)| {
            let name = name.strip_prefix("wasmcustom.").unwrap_or(&name).to_owned();
            name.starts_with("kvoy_").then_some((name, v))
        })
        .collect()
}

#[test]
fn envoy_and_kvoy_local_route_the_same_sequence_the_same_way() {
    let _serial = common::serial();
    let backends: Vec<EchoServer> = EchoServer::loopback(3, &[MODEL]).unwrap();
    let addrs: Vec<SocketAddr> = backends.iter().map(EchoServer::addr).collect();
    let pool: Vec<PoolEndpoint> = PoolEndpoint::all(&addrs, &[MODEL]);
    // Static queue lengths make every first choice unique.
    let endpoints: Vec<Value> = addrs
        .iter()
        .zip([0, 2, 4])
        .map(
            |(a, waiting)| json!({"address": a.to_string(), "models": [MODEL], "waiting": waiting}),
        )
        .collect();
    let run_dir = common::run_dir("local_vs_envoy");
    let mut config = StackConfig::new(pool.clone(), run_dir.join("envoy"));
    config.concurrency = 1;
    config.max_body_bytes = Some(256 * 1024);
    // The weighted scorer: this sequence's expectations are built on its queue score (the
    // test compares the two hosts; the cost scorer is the same code under both).
    config.extra_config = Some(json!({"endpoints": endpoints, "scorer": "weighted"}));
    let steps = steps(&addrs);

    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("starting Envoy: {e:#}"));
    let through_envoy = run(stack.listen, &steps, "envoy");
    let envoy_stats = kvoy_only(
        stack
            .stats("kvoy_")
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, i64::try_from(v).unwrap_or(i64::MAX))),
    );
    stack.assert_no_wasm_failures("local_vs_envoy");
    let prefix = stack.filter_config.clone();
    drop(stack);

    // The very same plugin configurations (byte for byte) under kvoy-local: as `Stack` renders
    // them into the bootstrap.
    let admission = json!({"endpoints": pool.len()}).to_string();
    let local_config = common::chain_config(&config.session_config, &admission, &prefix, 1);
    let server = common::serve("local_vs_envoy", &local_config);
    let through_local = run(server.addr(), &steps, "kvoy-local");
    let local_stats = kvoy_only(common::local_stats(&server));

    let mut mismatches = Vec::new();
    for ((step, envoy), local) in steps.iter().zip(&through_envoy).zip(&through_local) {
        eprintln!(
            "[local_vs_envoy] {:<32} envoy {} {:?}  kvoy-local {} {:?}",
            step.what, envoy.status, envoy.served_by, local.status, local.served_by
        );
        if envoy != local {
            mismatches.push(format!(
                "{}:\n  envoy      {envoy:?}\n  kvoy-local {local:?}",
                step.what
            ));
        }
        match step.expect {
            Expect::Served(i) => {
                assert_eq!(local.status, 200, "{}: {local:?}", step.what);
                assert_eq!(
                    local.served_by.as_deref(),
                    Some(addrs[i].to_string().as_str()),
                    "{}",
                    step.what
                );
            }
            Expect::Status(s) => assert_eq!(local.status, s, "{}: {local:?}", step.what),
        }
    }
    assert!(
        mismatches.is_empty(),
        "Envoy and kvoy-local differ:\n{}",
        mismatches.join("\n")
    );

    eprintln!("[local_vs_envoy] envoy stats: {envoy_stats:?}");
    let mut differ = Vec::new();
    for (name, envoy_value) in &envoy_stats {
        match local_stats.get(name) {
            Some(v) if v == envoy_value => {}
            other => differ.push(format!("{name}: envoy {envoy_value}, kvoy-local {other:?}")),
        }
    }
    for name in local_stats.keys().filter(|n| !envoy_stats.contains_key(*n)) {
        differ.push(format!("{name}: only in kvoy-local"));
    }
    assert!(
        envoy_stats.contains_key("kvoy_prefix_affinity_decisions_total"),
        "Envoy's stats have no kvoy counters: {envoy_stats:?}"
    );
    assert!(
        differ.is_empty(),
        "the filters' metrics differ:\n{}",
        differ.join("\n")
    );
}
