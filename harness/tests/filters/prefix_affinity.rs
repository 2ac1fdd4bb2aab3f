//! The prefix-affinity filter's decisions, driven through the real `.wasm` (built by
//! `make wasm`) with two VMs, as two Envoy worker threads. Deterministic: the harness seeds the
//! guests' random source and nothing reads a wall clock.

use std::collections::BTreeMap;

use kvoy_harness::{Action, Error, HttpStream, Plugin};
use kvoy_shared::shared_data;

use crate::support::{self, DEST, POOL};
use crate::TestResult;

fn config(extra: serde_json::Value) -> String {
    support::pool_config(&POOL, extra)
}

fn plugin_with(config: &str, seed: u64) -> Result<Plugin, Error> {
    support::start("kvoy_prefix_affinity", config, 2, seed)
}

fn plugin() -> Result<Plugin, Error> {
    plugin_with(&config(serde_json::json!({})), 7)
}

fn chat(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
    .into_bytes()
}

fn post_headers(path: &str, extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, String)> {
    let mut h: Vec<(&'static str, String)> = vec![
        (":method", "POST".into()),
        (":path", path.into()),
        (":authority", "gateway".into()),
        (":scheme", "http".into()),
        ("content-type", "application/json".into()),
    ];
    h.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    h
}

/// Opens a stream on `vm` and sends `headers`.
fn open(
    plugin: &Plugin,
    vm: usize,
    headers: &[(&'static str, String)],
    end_of_stream: bool,
) -> Result<(HttpStream, Action), Error> {
    let stream = plugin.http_stream(vm)?;
    let refs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let action = stream.send_request_headers(&refs, end_of_stream)?;
    Ok((stream, action))
}

/// Sends a POST with `body`; returns the open stream (not finished: still in flight).
fn send(
    plugin: &Plugin,
    vm: usize,
    path: &str,
    body: &[u8],
    extra: &[(&'static str, &'static str)],
) -> Result<HttpStream, Error> {
    let (stream, action) = open(plugin, vm, &post_headers(path, extra), false)?;
    assert_eq!(action, Action::Pause, "waits for the body");
    stream.send_request_body(body, true)?;
    Ok(stream)
}

/// Sends a chat completion with `body`; returns the open stream.
fn send_chat(plugin: &Plugin, vm: usize, body: &[u8]) -> Result<HttpStream, Error> {
    send(plugin, vm, "/v1/chat/completions", body, &[])
}

/// Routes one chat request to completion and returns the chosen endpoint.
fn route(plugin: &Plugin, vm: usize, body: &[u8]) -> Result<String, Error> {
    let stream = send_chat(plugin, vm, body)?;
    let dest = destination(&stream);
    stream.finish()?;
    Ok(dest)
}

fn destination(stream: &HttpStream) -> String {
    let dest = stream
        .forwarded_request_headers()
        .and_then(|h| h.get(DEST).map(str::to_owned))
        .unwrap_or_else(|| panic!("no destination; local reply {:?}", stream.local_reply()));
    assert!(
        POOL.contains(&dest.as_str()),
        "{dest} is not a pool endpoint"
    );
    dest
}

/// The shared outstanding table: (requests, prefilling, prefill tokens) per pool endpoint, in
/// `POOL` order. The table is keyed by address (`kvoy_shared::shared_data::OutstandingTable`:
/// family, 16 address bytes, port, three counts per entry) and holds only live work.
fn outstanding(plugin: &Plugin, config: &str) -> Vec<(u32, u32, u32)> {
    let key = format!(
        "{}.outstanding.2",
        shared_data::pool_namespace(
            "kvoy.pa",
            &kvoy_shared::prefix_affinity::PluginConfig::from_json(config.as_bytes()).unwrap()
        )
    );
    let word = |c: &[u8], i: usize| u32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
    let mut out = vec![(0, 0, 0); POOL.len()];
    if let Some((b, _)) = plugin.shared_data(&key) {
        for c in b.chunks_exact(shared_data::OUTSTANDING_ENTRY_BYTES) {
            let ip = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&c[1..17]).unwrap());
            let ip: std::net::IpAddr = match c[0] {
                4 => ip.to_ipv4_mapped().unwrap().into(),
                _ => ip.into(),
            };
            let port = u16::from_le_bytes([c[17], c[18]]);
            let address = std::net::SocketAddr::new(ip, port).to_string();
            let i = POOL
                .iter()
                .position(|p| *p == address)
                .unwrap_or_else(|| panic!("{address} is not a pool endpoint"));
            out[i] = (word(c, 19), word(c, 23), word(c, 27));
        }
    }
    out
}

fn inflight(plugin: &Plugin, config: &str) -> Vec<u32> {
    outstanding(plugin, config).iter().map(|o| o.0).collect()
}

#[test]
fn a_shared_prefix_sticks_across_both_workers() -> TestResult {
    let plugin = plugin()?;
    let system = "You are a careful assistant for the ACME support desk. ".repeat(80);
    let first = route(&plugin, 0, &chat(&system, "question 0"))?;
    for i in 1..20 {
        // alternate workers: VM 1 learns VM 0's decisions through the shared decision log
        let got = route(&plugin, i % 2, &chat(&system, &format!("question {i}")))?;
        assert_eq!(got, first, "request {i} on vm {}", i % 2);
    }
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_decisions_total"),
        Some(20)
    );
    let requested = plugin
        .counter("kvoy_prefix_affinity_prefix_blocks_requested_total")
        .unwrap_or(0);
    let matched = plugin
        .counter("kvoy_prefix_affinity_prefix_blocks_matched_total")
        .unwrap_or(0);
    // every request after the first matches the whole shared system prompt
    assert!(
        matched * 100 >= requested * 85,
        "matched {matched} of {requested}"
    );
    assert!(
        plugin
            .counter("kvoy_prefix_affinity_remote_decisions_applied_total")
            .unwrap_or(0)
            >= 9
    );
    Ok(())
}

#[test]
fn distinct_prefixes_spread_over_the_pool() -> TestResult {
    let plugin = plugin()?;
    let mut per: BTreeMap<String, u32> = BTreeMap::new();
    for i in 0..30 {
        let body = chat(
            &format!("Conversation {i}: {}", "context ".repeat(40)),
            "hi",
        );
        *per.entry(route(&plugin, i % 2, &body)?).or_default() += 1;
    }
    assert_eq!(per.len(), 3, "{per:?}");
    assert!(per.values().all(|&n| n >= 4), "{per:?}");
    Ok(())
}

#[test]
fn the_cost_scorer_spills_a_burst_once_queued_work_outweighs_the_prefix() -> TestResult {
    let cfg = config(serde_json::json!({}));
    let plugin = plugin_with(&cfg, 11)?;
    // 2,800 shared bytes (700 tokens at 4 bytes a token), then a 1,200-byte task (300 tokens).
    let system = "Shared agent instructions. ".repeat(100);
    let task = |i: usize| format!("task {i:04} {}", "x".repeat(1190));
    // A first request computes the prefix; its answer begins (its prefill is done).
    let first = send_chat(&plugin, 0, &chat(&system, &task(99)))?;
    let holder = destination(&first);
    first.send_response(&[(":status", "200")], b"{}")?;
    first.finish()?;
    let mut open = Vec::new();
    let mut order = Vec::new();
    for i in 0..30 {
        let stream = send_chat(&plugin, i % 2, &chat(&system, &task(i)))?;
        order.push(destination(&stream));
        open.push(stream);
    }
    // The holder takes requests while its queued tokens plus 300 cost less than 1,000 tokens
    // elsewhere: three of them (0, 300, 600 queued), then the prefix is computed again on
    // another endpoint, which becomes a holder too.
    assert!(
        order[..3].iter().all(|d| *d == holder),
        "{holder} {order:?}"
    );
    assert_ne!(order[3], holder, "{order:?}");
    let mut per: BTreeMap<&str, u32> = BTreeMap::new();
    for d in &order {
        *per.entry(d.as_str()).or_default() += 1;
    }
    assert_eq!(per.len(), 3, "{per:?}");
    let (min, max) = (
        per.values().min().copied().unwrap_or(0),
        per.values().max().copied().unwrap_or(0),
    );
    assert!(max - min <= 4, "holders share the burst: {per:?}");
    // Every worker sees every open request and its pending prefill tokens.
    let table = outstanding(&plugin, &cfg);
    assert_eq!(table.iter().map(|o| o.0).sum::<u32>(), 30);
    assert_eq!(table.iter().map(|o| o.1).sum::<u32>(), 30);
    assert!(
        table.iter().all(|o| o.2 >= 300 * (o.1.saturating_sub(1))),
        "{table:?}"
    );
    // The answer's first byte releases a request's prefill tokens; the end releases the rest.
    open[0].send_response(&[(":status", "200")], b"{}")?;
    let after = outstanding(&plugin, &cfg);
    assert_eq!(after.iter().map(|o| o.1).sum::<u32>(), 29);
    for s in &open {
        s.finish()?;
    }
    assert_eq!(outstanding(&plugin, &cfg), vec![(0, 0, 0); 3]);
    Ok(())
}

#[test]
fn the_servers_usage_teaches_the_bytes_per_token_and_output_length() -> TestResult {
    let cfg = config(serde_json::json!({"cost": {"learn_output_tokens": true}}));
    let plugin = plugin_with(&cfg, 5)?;
    // Prompts of 4,000 bytes that the server counts as 2,000 tokens (2 bytes a token, not the
    // configured 4); each request's own prefix, so all of it is uncached.
    let prompt = |i: usize| format!("{i:04} {}", "y".repeat(3995));
    let body = |i: usize| {
        serde_json::json!({"model": "m", "prompt": prompt(i)})
            .to_string()
            .into_bytes()
    };
    let pending = |s: &HttpStream| -> Result<u32, Error> {
        let table = outstanding(&plugin, &cfg);
        let d = destination(s);
        let i = POOL.iter().position(|a| *a == d).unwrap_or(0);
        Ok(table[i].2)
    };
    let first = send(&plugin, 0, "/v1/completions", &body(0), &[])?;
    assert_eq!(
        pending(&first)?,
        1000,
        "4,000 bytes at the configured 4 a token"
    );
    // The answer's usage, split inside the key across two chunks (the first answer of a VM
    // is sampled).
    first.send_response_headers(&[(":status", "200")], false)?;
    first.send_response_body(
        br#"{"choices":[{"text":"\"prompt_tokens\":9"}],"usage":{"prompt_to"#,
        false,
    )?;
    first.send_response_body(br#"kens":2000,"completion_tokens":1}}"#, true)?;
    first.finish()?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_usage_observed_total"),
        Some(1)
    );
    // ... and its output count, the last one of the body (the model's output length).
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_output_observed_total"),
        Some(1)
    );
    // The same VM now counts that model's prompts at 2 bytes a token.
    let second = send(&plugin, 0, "/v1/completions", &body(1), &[])?;
    assert_eq!(pending(&second)?, 2000, "learned from the server's count");
    second.send_response(
        &[(":status", "200")],
        br#"{"usage":{"prompt_tokens":2000}}"#,
    )?;
    second.finish()?;
    // Unsampled answers are not read: only every 8th request of a VM is.
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_usage_observed_total"),
        Some(1)
    );
    // The other VM has learned nothing yet.
    let other = send(&plugin, 1, "/v1/completions", &body(2), &[])?;
    assert_eq!(pending(&other)?, 1000);
    other.finish()?;
    Ok(())
}

#[test]
fn a_same_prefix_burst_spills_past_the_hot_endpoint() -> TestResult {
    let cfg = config(serde_json::json!({"scorer": "weighted"}));
    let plugin = plugin_with(&cfg, 11)?;
    let system = "Shared agent instructions. ".repeat(100);
    let mut open = Vec::new();
    let mut per: BTreeMap<String, u32> = BTreeMap::new();
    for i in 0..50 {
        let stream = send_chat(&plugin, i % 2, &chat(&system, &format!("task {i}")))?;
        *per.entry(destination(&stream)).or_default() += 1;
        open.push(stream);
    }
    assert!(per.len() >= 2, "burst went to one endpoint: {per:?}");
    // the guard keeps the spread within `hotspot.abs` (8) of even, plus one
    let (min, max) = (
        per.values().min().copied().unwrap_or(0),
        per.values().max().copied().unwrap_or(0),
    );
    assert!(max - min <= 9, "{per:?}");
    // the in-flight table, shared by both workers, counts every open request
    assert_eq!(inflight(&plugin, &cfg).iter().sum::<u32>(), 50);
    for s in &open {
        s.finish()?;
    }
    assert_eq!(
        inflight(&plugin, &cfg),
        vec![0, 0, 0],
        "finished requests release their count"
    );
    Ok(())
}

#[test]
fn forged_destinations_are_overwritten() -> TestResult {
    let plugin = plugin()?;
    let system = "Pinned prefix for the forgery test. ".repeat(50);
    let home = route(&plugin, 0, &chat(&system, "first"))?;
    let other = POOL
        .iter()
        .find(|a| **a != home)
        .copied()
        .unwrap_or(POOL[0]);
    for (vm, forged) in [
        (0, "10.9.9.9:80"),
        (1, "127.0.0.1:1"),
        (0, other),
        (1, "not an address"),
    ] {
        let mut headers = post_headers("/v1/chat/completions", &[]);
        headers.push((DEST, forged.to_owned()));
        let (stream, _) = open(&plugin, vm, &headers, false)?;
        // removed at once, before the body is even seen
        assert_eq!(stream.request_header(DEST), None, "forged {forged}");
        stream.send_request_body(&chat(&system, "again"), true)?;
        assert_eq!(destination(&stream), home, "forged {forged}");
        let forwarded = stream.forwarded_request_headers().unwrap_or_default();
        assert_eq!(
            forwarded.get_all(DEST).count(),
            1,
            "exactly one destination header"
        );
        stream.finish()?;
    }
    // a GET with a forged header is routed by the filter too
    let stream = plugin.http_stream(1)?;
    stream.send_request_headers(
        &[
            (":method", "GET"),
            (":path", "/v1/models"),
            (":authority", "g"),
            (DEST, "10.9.9.9:80"),
        ],
        true,
    )?;
    let dest = destination(&stream);
    assert_ne!(dest, "10.9.9.9:80");
    stream.finish()?;
    Ok(())
}

fn error_reply(stream: &HttpStream) -> (u32, serde_json::Value) {
    let reply = stream.local_reply().expect("a local reply");
    assert!(
        stream.forwarded_request_headers().is_none(),
        "nothing went upstream"
    );
    assert_eq!(reply.headers.get("content-type"), Some("application/json"));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).expect("JSON error body");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(body["error"]["type"].is_string(), "{body}");
    (reply.status, body)
}

#[test]
fn bad_requests_get_openai_errors() -> TestResult {
    let cfg = config(serde_json::json!({"max_body_bytes": 1000}));
    let plugin = plugin_with(&cfg, 3)?;

    let s = send_chat(&plugin, 0, b"{\"model\":\"m\",\"messages\":[")?;
    let (status, body) = error_reply(&s);
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    s.finish()?;

    let s = send_chat(&plugin, 1, br#"{"model":"zzz","messages":[]}"#)?;
    let (status, body) = error_reply(&s);
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    s.finish()?;

    // Too large by content-length: refused at headers, before buffering anything.
    let headers = post_headers("/v1/chat/completions", &[("content-length", "5000")]);
    let (s, _) = open(&plugin, 0, &headers, false)?;
    let (status, body) = error_reply(&s);
    assert_eq!(status, 413);
    assert_eq!(body["error"]["code"], "request_too_large");
    s.finish()?;

    // Too large without content-length: refused as soon as the buffer passes the limit.
    let headers = post_headers("/v1/chat/completions", &[]);
    let (s, _) = open(&plugin, 1, &headers, false)?;
    assert_eq!(s.send_request_body(&[b' '; 600], false)?, Action::Pause);
    s.send_request_body(&[b' '; 600], false)?;
    let (status, _) = error_reply(&s);
    assert_eq!(status, 413);
    s.finish()?;

    // A POST with no body at all.
    let (s, _) = open(&plugin, 0, &headers, true)?;
    assert_eq!(error_reply(&s).0, 400);
    s.finish()?;

    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_errors_bad_request_total"),
        Some(2)
    );
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_errors_unknown_model_total"),
        Some(1)
    );
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_errors_body_too_large_total"),
        Some(2)
    );
    assert_eq!(
        inflight(&plugin, &cfg),
        vec![0, 0, 0],
        "rejections hold no count"
    );
    Ok(())
}

#[test]
fn fallback_policy_routes_bad_bodies_to_the_least_loaded() -> TestResult {
    let cfg = config(serde_json::json!({"on_invalid_body": "fallback"}));
    let plugin = plugin_with(&cfg, 5)?;
    // load two endpoints with open requests so that one is clearly the least loaded
    let mut open = Vec::new();
    for i in 0..7 {
        let s = send_chat(&plugin, 0, &chat(&format!("p{i}"), "u"))?;
        destination(&s);
        open.push(s);
    }
    let counts = inflight(&plugin, &cfg);
    let min = counts.iter().copied().min().unwrap_or(0);
    let least: Vec<&str> = (0..3)
        .filter(|&i| counts[i] == min)
        .map(|i| POOL[i])
        .collect();
    let s = send_chat(&plugin, 1, b"not json at all")?;
    assert!(
        least.contains(&destination(&s).as_str()),
        "counts {counts:?}"
    );
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_fallbacks_total"),
        Some(1)
    );
    s.finish()?;
    // an unknown model is still a 404 under fallback: the body parsed, the model is not served
    let s = send_chat(&plugin, 1, br#"{"model":"other","messages":[]}"#)?;
    assert_eq!(error_reply(&s).0, 404);
    s.finish()?;
    for s in &open {
        s.finish()?;
    }
    Ok(())
}

#[test]
fn other_requests_pass_through_to_a_pool_endpoint() -> TestResult {
    let plugin = plugin()?;
    for (vm, (method, path)) in [
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("POST", "/tokenize"),
        ("GET", "/v1/chat/completions"),
    ]
    .into_iter()
    .enumerate()
    {
        let s = plugin.http_stream(vm % 2)?;
        assert_eq!(
            s.send_request_headers(
                &[(":method", method), (":path", path), (":authority", "g")],
                true
            )?,
            Action::Continue
        );
        destination(&s);
        s.finish()?;
    }
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_passthrough_total"),
        Some(4)
    );
    Ok(())
}

#[test]
fn the_served_endpoint_is_reported_from_the_upstream_address() -> TestResult {
    let plugin = plugin()?;
    let s = send(
        &plugin,
        0,
        "/v1/completions",
        br#"{"model":"m","prompt":"Once upon a time"}"#,
        &[],
    )?;
    let chosen = destination(&s);
    let other = POOL
        .iter()
        .find(|a| **a != chosen)
        .copied()
        .unwrap_or(POOL[0]);
    s.set_property(&["upstream", "address"], other)?;
    s.send_response_headers(&[(":status", "200")], false)?;
    assert_eq!(
        s.response_header("x-gateway-destination-endpoint-served")
            .as_deref(),
        Some(other)
    );
    s.finish()?;
    // an upstream outside the pool is never echoed: the filter reports its own choice
    let s = send(
        &plugin,
        1,
        "/v1/responses",
        br#"{"model":"m","input":"hello"}"#,
        &[],
    )?;
    let chosen = destination(&s);
    s.set_property(&["upstream", "address"], "10.1.1.1:9")?;
    s.send_response_headers(&[(":status", "200")], false)?;
    assert_eq!(
        s.response_header("x-gateway-destination-endpoint-served"),
        Some(chosen)
    );
    s.finish()?;
    Ok(())
}

#[test]
fn bad_configurations_are_refused_with_the_field_named() -> TestResult {
    for (cfg, field) in [
        (
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}],"blok_size":4}"#,
            "blok_size",
        ),
        (
            r#"{"endpoints":[{"address":"nowhere","models":["m"]}]}"#,
            "endpoints[0].address",
        ),
        (r#"{"endpoints":[]}"#, "endpoints"),
        ("not json", "configuration JSON"),
    ] {
        match support::builder("kvoy_prefix_affinity", cfg, 1)?.start() {
            Ok(_) => panic!("accepted {cfg}"),
            Err(e) => {
                let text = format!("{e:?}");
                assert!(text.contains(field), "{cfg}: {text}");
            }
        }
    }
    Ok(())
}

/// Random bodies, valid JSON of the wrong shapes and truncations never trap the VM: every
/// request ends in a destination or an OpenAI error.
#[test]
fn no_body_traps_the_filter() -> TestResult {
    let plugin = plugin()?;
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let valid = chat("sys", "user question with \"quotes\" and \\ backslashes\n");
    // the whole body first (index 0 goes to the chat path), then every truncation of it
    let mut bodies: Vec<Vec<u8>> = (0..=valid.len())
        .rev()
        .map(|cut| valid[..cut].to_vec())
        .collect();
    for _ in 0..150 {
        let len = (next() % 300) as usize;
        let alphabet = b"{}[]\":,\\ amodelsgcontent0123";
        bodies.push(
            (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect(),
        );
        bodies.push((0..len).map(|_| next() as u8).collect());
    }
    for shape in [
        r#"{"model":"m","messages":[1,2]}"#,
        r#"{"model":"m","messages":[{"role":1,"content":{"a":[]}}]}"#,
        r#"{"model":["m"],"messages":[]}"#,
        r#"{"model":"m","messages":null}"#,
        r#"{"model":"m","messages":[{"content":[null,1,{"text":5}]}]}"#,
        r#"[{"model":"m"}]"#,
    ] {
        bodies.push(shape.as_bytes().to_vec());
    }
    let (mut routed, mut rejected) = (0, 0);
    for (i, body) in bodies.iter().enumerate() {
        let path = ["/v1/chat/completions", "/v1/completions", "/v1/responses"][i % 3];
        let s = send(&plugin, i % 2, path, body, &[])?;
        match s.local_reply() {
            Some(r) => {
                assert!([400, 404].contains(&r.status), "{r:?}");
                rejected += 1;
            }
            None => {
                destination(&s);
                routed += 1;
            }
        }
        s.finish()?;
    }
    assert!(
        routed > 0 && rejected > 0,
        "routed {routed}, rejected {rejected}"
    );
    assert!(!plugin.logged("panicked"));
    Ok(())
}

#[test]
fn an_idle_worker_catches_up_on_its_tick_not_on_the_request_that_wakes_it() -> TestResult {
    let plugin = plugin()?;
    assert_eq!(
        plugin.vm(1).tick_period(),
        Some(std::time::Duration::from_millis(200)),
        "a static pool ticks too, to replay the other workers' decisions"
    );
    // VM 0 routes 100 conversations while VM 1 sits idle (no time passes: no tick).
    let conversation = |i: usize| {
        chat(
            &format!("Conversation {i}: {}", "context ".repeat(40)),
            "hi",
        )
    };
    let mut first = Vec::new();
    for i in 0..100 {
        first.push(route(&plugin, 0, &conversation(i))?);
    }
    // VM 1's next request replays at most 32 of those 100 records: a shared-data read each,
    // plus the log head, the outstanding table and its own decision's writes.
    let before = plugin.call_counts();
    let got = route(&plugin, 1, &chat("Another conversation entirely.", "hi"))?;
    let spent = plugin.call_counts();
    let shared = spent.shared_data - before.shared_data;
    assert!(POOL.contains(&got.as_str()));
    assert!(
        (32..=32 + 10).contains(&shared),
        "{shared} shared-data operations for one request"
    );
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_remote_decisions_applied_total"),
        Some(32)
    );
    // Its tick replays the rest, in order: every conversation then follows VM 0's choice on
    // VM 1, the oldest included.
    plugin.advance(std::time::Duration::from_millis(200))?;
    assert_eq!(
        plugin.counter("kvoy_prefix_affinity_remote_decisions_applied_total"),
        Some(100)
    );
    for i in [0, 1, 50, 99] {
        assert_eq!(
            route(&plugin, 1, &conversation(i))?,
            first[i],
            "conversation {i}"
        );
    }
    Ok(())
}

/// A multi-turn workload: conversation `i`'s turn `t` repeats turns `0..t` and adds one.
fn turn(i: usize, t: usize) -> Vec<u8> {
    let mut history = format!("Conversation {i}: {}", "context ".repeat(40));
    for k in 0..t {
        history.push_str(&format!(
            " Question {k} of {i}? Answer {k}, at some length."
        ));
    }
    chat(&history, &format!("question {t}"))
}

/// Routes turns `turns` of conversations `0..n` through `plugin`, alternating its two VMs;
/// counts the turns that went where the conversation's previous turn went (`last`).
fn follow(plugin: &Plugin, n: usize, turns: std::ops::Range<usize>, last: &mut [String]) -> usize {
    let mut hits = 0;
    for t in turns {
        for (i, previous) in last.iter_mut().enumerate().take(n) {
            let got = route(plugin, (i + t) % 2, &turn(i, t)).unwrap();
            hits += usize::from(got == *previous);
            *previous = got;
        }
    }
    hits
}

#[test]
fn a_new_configuration_of_the_same_pool_keeps_the_routing_state() -> TestResult {
    // 40 conversations, 3 turns each, on the first configuration.
    let before = config(serde_json::json!({}));
    let old = plugin_with(&before, 7)?;
    let mut last = vec![String::new(); 40];
    follow(&old, 40, 0..3, &mut last);
    // The next 200 requests (5 more turns each) on the steady proxy, and on a new
    // configuration that changes a field other than the pool: Envoy keeps shared data and
    // starts the new configuration's VMs (new root contexts, other seeds) beside it.
    let after = config(serde_json::json!({"max_body_bytes": 4 << 20}));
    let new = support::builder("kvoy_prefix_affinity", &after, 2)?
        .seed(8)
        .shared_data_of(&old)
        .start()?;
    let mut steady_last = last.clone();
    let steady = follow(&old, 40, 3..8, &mut steady_last);
    let changed = follow(&new, 40, 3..8, &mut last);
    eprintln!("next 200 turns on their endpoint: steady {steady}, after the change {changed}");
    assert!(steady >= 190, "the steady proxy kept {steady} of 200 turns");
    assert!(
        changed * 10 >= steady * 9,
        "after the change {changed} of 200 turns went where their conversation was, \
         against {steady} on the steady proxy"
    );
    // The new VMs learned it from the old configuration's decisions.
    assert!(new
        .counter("kvoy_prefix_affinity_remote_decisions_applied_total")
        .is_some_and(|n| n >= 120));
    // A new pool (another endpoint order) is a new namespace: nothing carries over.
    let reversed: Vec<&str> = POOL.iter().rev().copied().collect();
    let reordered = support::pool_config(&reversed, serde_json::json!({}));
    let other = support::builder("kvoy_prefix_affinity", &reordered, 2)?
        .seed(9)
        .shared_data_of(&old)
        .start()?;
    route(&other, 0, &turn(0, 8))?;
    assert_eq!(
        other
            .counter("kvoy_prefix_affinity_remote_decisions_applied_total")
            .unwrap_or(0),
        0
    );
    Ok(())
}
