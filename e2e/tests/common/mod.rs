//! What several end-to-end tests share and nothing else uses: their model and request bound
//! ([`MODEL`], [`TIMEOUT`]), starting a stack ([`start_stack`]), a run directory per test
//! ([`run_dir`]), the readings of an in-process aggregator ([`AggregatorReads`]), starting one
//! ([`start_aggregator`], [`followed`]) or a pool of simulators it follows ([`FollowedPool`]),
//! the multi-turn workload ([`conversation_turn`]), the manifests' YAML ([`yaml_docs`]) and the
//! eviction tests' helpers ([`eviction`]), an aggregator process to kill and the agent workload
//! ([`replica`]). What benches and kvoy-local's tests use too lives in
//! the kit (`kvoy_testkit`) or in the services' in-process starters (`kvoy_sim::fleet`,
//! `kvoy_aggregator::local`).
// Each test binary compiles this module and uses a part of it.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

pub mod eviction;
pub mod replica;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::PublishingSim;
use kvoy_testkit::{http, wait_for, PoolEndpoint, Stack, StackConfig};
use serde::Deserialize;
use serde_json::{json, Value};

/// The model the tests' backends serve and their requests ask for.
pub const MODEL: &str = "kvoy-demo";
/// Bounds each request of the tests that wait for a backend's answer (connecting, each read).
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Starts the kvoy stack `config` describes for test `name`; panics saying what could not
/// start.
pub fn start_stack(name: &str, config: &StackConfig) -> Stack {
    Stack::start(config).unwrap_or_else(|e| {
        panic!("[{name}] could not start the kvoy stack (Envoy + kvoy_prefix_affinity.wasm): {e:#}")
    })
}

/// Checks that `r`, the answer to `what` in test `name`, is a 200 (saying what came instead).
pub fn assert_ok(name: &str, what: &str, r: &http::Response) {
    assert_eq!(
        r.status,
        200,
        "[{name}] {what}: status {}, body {}",
        r.status,
        r.text()
    );
}

/// What the tests read from a running aggregator, over its HTTP API.
pub trait AggregatorReads {
    /// The JSON answer to `GET path` (`/v1/pool`, `/v1/endpoints`, ...); an error unless the
    /// answer is 200 with a JSON body.
    fn get_json(&self, path: &str) -> anyhow::Result<serde_json::Value>;

    /// The value of one sample of its `/metrics` (the name with its labels, as written there),
    /// 0 when absent.
    fn metric(&self, sample: &str) -> anyhow::Result<f64>;

    /// Waits (at most `timeout`) until its `/readyz` counts `endpoints` ready; panics past it,
    /// as [`wait_for`] does.
    fn wait_ready(&self, endpoints: usize, timeout: Duration);
}

impl AggregatorReads for LocalAggregator {
    fn get_json(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let r = http::get(self.addr(), path, Duration::from_secs(5))?;
        anyhow::ensure!(r.status == 200, "GET {path}: {} {}", r.status, r.text());
        Ok(r.json()?)
    }

    fn metric(&self, sample: &str) -> anyhow::Result<f64> {
        let text = http::get(self.addr(), "/metrics", Duration::from_secs(5))?.text();
        let prefix = format!("{sample} ");
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0))
    }

    fn wait_ready(&self, endpoints: usize, timeout: Duration) {
        let want = format!("{endpoints} ready");
        wait_for("the endpoints ready in the aggregator", timeout, || {
            http::get(self.addr(), "/readyz", Duration::from_secs(5))
                .map(|r| r.text().contains(&want))
                .unwrap_or(false)
        });
    }
}

/// Simulators publishing their KV events and an in-process aggregator following them, the
/// pool most aggregator tests start from. Fields drop in order: the aggregator, then the
/// simulators.
pub struct FollowedPool {
    pub agg: LocalAggregator,
    pub sims: Vec<PublishingSim>,
    /// A fresh directory for this run's configuration files and proxies.
    pub run_dir: PathBuf,
}

impl FollowedPool {
    /// `sims` simulators started with `sim_args` (serving `model`), an aggregator with
    /// `settings` (YAML lines before its `endpoints`) following them, ready; files in
    /// [`run_dir`]`(run)`.
    pub fn start(
        run: &str,
        sims: usize,
        sim_args: &[&str],
        model: &str,
        settings: &str,
    ) -> anyhow::Result<FollowedPool> {
        let sims: Vec<PublishingSim> = (0..sims)
            .map(|_| PublishingSim::start(sim_args, false))
            .collect::<anyhow::Result<_>>()
            .with_context(|| format!("[{run}] could not start a simulator"))?;
        let run_dir = run_dir(run);
        let agg = LocalAggregator::start(
            &run_dir.join("aggregator.yaml"),
            &aggregator_yaml(settings, &followed(&sims, model, false)),
            "127.0.0.1:0".parse()?,
        )?;
        agg.wait_ready(sims.len(), Duration::from_secs(10));
        Ok(FollowedPool { agg, sims, run_dir })
    }

    /// The simulators as a proxy's configured pool.
    pub fn endpoints(&self, model: &str) -> Vec<PoolEndpoint> {
        self.sims
            .iter()
            .map(|s| PoolEndpoint::new(s.addr, &[model]))
            .collect()
    }
}

/// Turn `t` of conversation `i` as a chat completion body for `model`: a long system brief
/// naming the conversation, the history of turns `0..t`, then a new question. The multi-turn
/// workload of the relay and reconfiguration tests: each turn's prompt extends the last one's.
pub fn conversation_turn(model: &str, i: usize, t: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content":
        format!("Conversation {i}. {}", "You are a careful assistant with a long brief. ".repeat(12))})];
    for k in 0..t {
        messages
            .push(json!({"role": "user", "content": format!("Question {k} of conversation {i}?")}));
        messages.push(json!({"role": "assistant", "content": format!("Answer {k}, at some length, for conversation {i}.")}));
    }
    messages.push(json!({"role": "user", "content": format!("Question {t} of conversation {i}?")}));
    json!({"model": model, "max_tokens": 2, "messages": messages})
        .to_string()
        .into_bytes()
}

/// A prompt of about 1 KB (16 blocks of the simulators' caches) unrelated to any
/// conversation, number `i` of a flood that fills the caches and makes the simulators evict.
pub fn flood_prompt(i: usize) -> Vec<u8> {
    let text = format!(
        "Unrelated prompt {i}. {}",
        "Other work fills the cache. ".repeat(36)
    );
    serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": text}]}))
    .unwrap()
}

/// POSTs a chat completion `body` to `proxy` within [`TIMEOUT`]; panics when no answer comes.
pub fn post_chat(proxy: std::net::SocketAddr, body: &[u8]) -> http::Response {
    http::post_json(proxy, "/v1/chat/completions", &[], body, TIMEOUT).unwrap()
}

/// [`post_chat`], answered 200; the address of the backend that served it (`?` when it did not
/// say).
pub fn send_chat(proxy: std::net::SocketAddr, body: &[u8]) -> String {
    let r = post_chat(proxy, body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.header(kvoy_testkit::SERVED_BY_HEADER)
        .unwrap_or("?")
        .to_owned()
}

/// A fresh directory for run `name` of this test binary's tests:
/// `$CARGO_TARGET_TMPDIR/kvoy-e2e/{name}-{pid}`, created.
pub fn run_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("kvoy-e2e")
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An aggregator on a free port of 127.0.0.1 with `settings` (YAML lines before its
/// `endpoints`) following `endpoints`, its configuration in `run_dir/aggregator.yaml`.
pub fn start_aggregator(
    run_dir: &std::path::Path,
    settings: &str,
    endpoints: &[AggregatedEndpoint],
) -> LocalAggregator {
    LocalAggregator::start(
        &run_dir.join("aggregator.yaml"),
        &aggregator_yaml(settings, endpoints),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap()
}

/// Simulators serving `model` followed by their metrics and KV events (and their replay
/// sockets, when `replay`).
pub fn followed(sims: &[PublishingSim], model: &str, replay: bool) -> Vec<AggregatedEndpoint> {
    sims.iter()
        .map(|s| AggregatedEndpoint {
            address: s.addr,
            models: vec![model.into()],
            kv_events: Some((s.kv.clone(), if replay { s.replay.clone() } else { None })),
        })
        .collect()
}

/// [`run_dir`], emptied first.
pub fn fresh_run_dir(name: &str) -> PathBuf {
    let dir = run_dir(name);
    std::fs::remove_dir_all(&dir).unwrap();
    run_dir(name)
}

/// Every document of the YAML file at `path` (empty ones skipped), as JSON values; panics
/// naming the file when it cannot be read or parsed.
pub fn yaml_docs(path: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}
