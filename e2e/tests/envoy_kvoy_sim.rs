//! End to end with kvoy-sim: a real Envoy (`envoy/kvoy.yaml`, `--concurrency 2`) with the built
//! `kvoy_prefix_affinity` filter in front of three in-process kvoy-sim simulators (vLLM-like
//! servers with a paged prefix cache, `--speedup 20`) on 127.0.0.1.
//!
//! The point of kvoy: conversations that resend a long shared prefix keep landing on the
//! simulator that holds it, so most prompt tokens come from its KV cache
//! (`usage.prompt_tokens_details.cached_tokens`).
//!
//! Needs `envoy` on PATH and `target/wasm32-wasip1/release/kvoy_prefix_affinity.wasm`
//! (`make test` provides both); without them every test fails and says so.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{MODEL, TIMEOUT};

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::http::sse_data;
use kvoy_testkit::requests::prose;
use kvoy_testkit::{
    http::{self, Response},
    PoolEndpoint, Stack, StackConfig,
};
use serde_json::{json, Value};

const SPEEDUP: &str = "20";
const GROUPS: usize = 6;
const TURNS: usize = 5;
/// About 6k tokens: kvoy-sim's tokenizer makes one token of every 4 bytes.
const SYSTEM_PROMPT_BYTES: usize = 24 * 1024;

static SERIAL: Mutex<()> = Mutex::new(());

/// Three simulators and Envoy in front of them.
struct Fixture {
    // Fields drop in order: Envoy first, then the simulators, then the lock.
    stack: Stack,
    name: &'static str,
    sims: SimFleet,
    _serial: MutexGuard<'static, ()>,
}

impl Fixture {
    fn start(name: &'static str) -> Fixture {
        let serial = SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let sims = SimFleet::loopback(3, &["--model", MODEL, "--speedup", SPEEDUP])
            .unwrap_or_else(|e| panic!("[{name}] could not start the kvoy-sim simulators: {e:#}"));
        let endpoints = PoolEndpoint::all(sims.addrs(), &[MODEL]);
        let config = StackConfig::new(endpoints, common::run_dir(name));
        let stack = common::start_stack(name, &config);
        eprintln!(
            "[{name}] envoy on {} (admin {}), simulators {:?} (speedup {SPEEDUP}), config {}",
            stack.listen,
            stack.admin,
            sims.addrs(),
            stack.config_path.display()
        );
        Fixture {
            stack,
            name,
            sims,
            _serial: serial,
        }
    }

    fn sim_addrs(&self) -> Vec<String> {
        self.sims.addrs().iter().map(ToString::to_string).collect()
    }

    /// POSTs `body` to `addr` (Envoy or a simulator) and checks for a 200.
    fn post(&self, addr: SocketAddr, body: &Value, what: &str) -> Response {
        let body = serde_json::to_vec(body).unwrap();
        let r = http::post_json(addr, "/v1/chat/completions", &[], &body, TIMEOUT)
            .unwrap_or_else(|e| panic!("[{}] {what}: POST to {addr} failed: {e}", self.name));
        common::assert_ok(self.name, what, &r);
        r
    }

    /// The simulator that served `r` through Envoy; checks that the filter reported it too.
    fn served_by(&self, r: &Response, what: &str) -> String {
        kvoy_testkit::served_by(r, &self.sim_addrs(), self.name, what)
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

/// About `bytes` of prose that starts with `tag`, so prompts with different tags differ from
/// their first block on.
fn prompt(tag: &str, bytes: usize) -> String {
    prose(
        tag,
        "You are the support assistant of tenant kvoy; answer precisely, cite the relevant \
         configuration keys, and keep answers short. ",
        bytes,
    )
}

/// `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` of a reply.
fn usage(v: &Value) -> (u64, u64) {
    let prompt = v["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage.prompt_tokens in {v}"));
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage.prompt_tokens_details.cached_tokens in {v}"));
    (prompt, cached)
}

/// What a workload run saw.
#[derive(Default)]
struct Tally {
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Group -> simulator -> requests.
    placement: BTreeMap<usize, BTreeMap<String, usize>>,
}

impl Tally {
    fn ratio(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// `GROUPS` conversations of `TURNS` turns each, one request at a time, the groups interleaved
/// (turn 0 of every group, then turn 1, ...). Each group has its own ~6k-token system prompt;
/// each turn resends the whole conversation so far plus a new question. `route` sends one
/// request and returns the reply and the simulator that served it.
fn run_workload(
    tag: &str,
    mut route: impl FnMut(usize, &Value, &str) -> (Response, String),
) -> Tally {
    let mut conversations: Vec<Vec<Value>> = (0..GROUPS)
        .map(|g| {
            vec![json!({"role": "system", "content": prompt(&format!("{tag}-group-{g}"), SYSTEM_PROMPT_BYTES)})]
        })
        .collect();
    let mut tally = Tally::default();
    for turn in 0..TURNS {
        for (g, messages) in conversations.iter_mut().enumerate() {
            messages.push(json!({
                "role": "user",
                "content": format!("Turn {turn}: which setting controls behaviour {g}.{turn}?"),
            }));
            let body = json!({"model": MODEL, "max_tokens": 16, "messages": messages});
            let what = format!("{tag} group {g} turn {turn}");
            let (r, served) = route(g, &body, &what);
            let v = r
                .json()
                .unwrap_or_else(|e| panic!("{what}: reply is not JSON ({e}): {}", r.text()));
            let (prompt, cached) = usage(&v);
            tally.prompt_tokens += prompt;
            tally.cached_tokens += cached;
            *tally
                .placement
                .entry(g)
                .or_default()
                .entry(served)
                .or_default() += 1;
            let answer = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("{what}: no message content in {v}"))
                .to_string();
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    tally
}

#[test]
fn shared_prefix_conversations_hit_the_kv_cache() {
    let f = Fixture::start("kvoy_sim_cache");
    let start = Instant::now();
    let kvoy = run_workload("kvoy", |_, body, what| {
        let r = f.post(f.stack.listen, body, what);
        let served = f.served_by(&r, what);
        (r, served)
    });
    let kvoy_time = start.elapsed();

    // The same workload (other prefixes, so nothing is cached yet) sent straight to a
    // pseudo-random simulator, as a prefix-blind balancer would: the figure kvoy improves on.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let start = Instant::now();
    let blind = run_workload("blind", |_, body, what| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let addr = f.sims.addrs()[(state % 3) as usize];
        let r = f.post(addr, body, what);
        (r, addr.to_string())
    });
    let blind_time = start.elapsed();

    eprintln!(
        "[kvoy_sim_cache] {GROUPS} groups x {TURNS} turns, ~{}k-token system prompts, sequential",
        SYSTEM_PROMPT_BYTES / 4 / 1000
    );
    eprintln!(
        "[kvoy_sim_cache] through kvoy:  cached {} / prompt {} tokens = {:.3} in {kvoy_time:?}; \
         placement {:?}",
        kvoy.cached_tokens,
        kvoy.prompt_tokens,
        kvoy.ratio(),
        kvoy.placement
    );
    eprintln!(
        "[kvoy_sim_cache] random pick:   cached {} / prompt {} tokens = {:.3} in {blind_time:?}",
        blind.cached_tokens,
        blind.prompt_tokens,
        blind.ratio()
    );
    for (g, dist) in &kvoy.placement {
        assert_eq!(
            dist.len(),
            1,
            "group {g}'s {TURNS} requests should all land on one simulator: {dist:?}"
        );
    }
    let used: BTreeSet<&String> = kvoy.placement.values().flat_map(BTreeMap::keys).collect();
    eprintln!(
        "[kvoy_sim_cache] groups spread over {} simulator(s)",
        used.len()
    );
    assert!(
        kvoy.ratio() > 0.7,
        "through kvoy, cached/prompt tokens should exceed 0.7, was {:.3}",
        kvoy.ratio()
    );
    assert!(
        kvoy.ratio() > blind.ratio(),
        "kvoy's cache hit ratio {:.3} should beat a random pick's {:.3}",
        kvoy.ratio(),
        blind.ratio()
    );
    f.finish();
}

#[test]
fn streaming_through_envoy_ends_with_done() {
    let f = Fixture::start("kvoy_sim_stream");
    let body = json!({
        "model": MODEL,
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": prompt("stream", 4096)},
            {"role": "user", "content": "Stream me a short answer."},
        ],
    });
    let mut homes = Vec::new();
    for attempt in 0..2 {
        let what = format!("streaming request {attempt}");
        let r = f.post(f.stack.listen, &body, &what);
        homes.push(f.served_by(&r, &what));
        assert!(
            r.header("content-type")
                .is_some_and(|v| v.starts_with("text/event-stream")),
            "{what}: content-type {:?}",
            r.header("content-type")
        );
        let text = r.text();
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "{what}: the stream should end with `data: [DONE]`: {text}"
        );
        let data = sse_data(&text);
        let chunks: Vec<Value> = data
            .iter()
            .filter(|d| **d != "[DONE]")
            .map(|d| {
                serde_json::from_str(d).unwrap_or_else(|e| panic!("{what}: bad chunk {d}: {e}"))
            })
            .collect();
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        let last_usage = chunks
            .iter()
            .rev()
            .find(|c| c["usage"].is_object())
            .unwrap_or_else(|| panic!("{what}: no usage chunk (include_usage): {text}"));
        let (prompt, cached) = usage(last_usage);
        eprintln!(
            "[kvoy_sim_stream] {what}: {} SSE events, served by {}, content {content:?}, \
             prompt {prompt} tokens, cached {cached}",
            data.len(),
            homes[attempt]
        );
        assert!(!content.is_empty(), "{what}: no streamed content: {text}");
        if attempt == 1 {
            assert_eq!(homes[0], homes[1], "the repeated stream should stick");
            assert!(cached > 0, "the repeated stream should hit the cache");
        }
    }

    let r = http::get(f.stack.listen, "/v1/models", TIMEOUT).expect("GET /v1/models");
    assert_eq!(r.status, 200, "GET /v1/models: {}", r.text());
    assert_eq!(r.json().expect("models JSON")["data"][0]["id"], MODEL);
    f.finish();
}
