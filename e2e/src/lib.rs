//! kvoy's end-to-end kit: a real Envoy with the built filters in front of OpenAI-shaped
//! backends (kvoy-sim simulators or echo servers) on 127.0.0.1. The `kvoy-stack` binary
//! (`make run`) and the tests in `tests/` use it.
//!
//! It is a test kit: only tests, benchmarks and `kvoy-stack` depend on it, never a component kvoy
//! ships.
//!
//! - [`SimFleet`]: kvoy-sim simulators (vLLM-like: prefix cache, `cached_tokens`) run
//!   in-process on a tokio runtime of their own.
//! - [`LocalAggregator`]: kvoy-aggregator in-process, following the simulators.
//! - [`EchoServer`]: an HTTP/1.1 backend that answers chat/completions/responses calls with a
//!   reply naming the address that served it (header `x-served-by`).
//! - [`render_bootstrap`]: fills in the `envoy/template/kvoy.yaml` template;
//!   [`runnable_bootstraps`]: the runnable `envoy/kvoy.yaml` it renders to with defaults.
//! - [`Stack`]: renders the template for a pool, runs Envoy, waits until it is ready, and kills
//!   it on drop.
//! - [`http`]: the test kit's HTTP/1.1 client, under the names the tests use.
//! - [`load`]: a streaming client that times each completion (TTFT, inter-token gaps).
//! - [`webdriver`]: a headless Chromium driven through chromedriver, for the browser tests.
//!
//! ```no_run
//! use kvoy_e2e::{EchoConfig, EchoServer, PoolEndpoint, Stack, StackConfig};
//! use std::time::Duration;
//!
//! let backend = EchoServer::start(EchoConfig::new("127.0.0.1:0".parse()?, &["m"]))?;
//! let pool = vec![PoolEndpoint::new(backend.addr(), &["m"])];
//! let stack = Stack::start(&StackConfig::new(pool, "/tmp/kvoy-run".into()))?;
//! let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
//! let reply = kvoy_e2e::http::post_json(
//!     stack.listen, "/v1/chat/completions", &[], body, Duration::from_secs(10))?;
//! assert_eq!(reply.header("x-served-by"), Some(backend.addr().to_string().as_str()));
//! # anyhow::Ok(())
//! ```

mod aggregator;
mod bootstrap;
mod echo;
mod envoy;
pub mod eviction;
pub mod http;
pub mod load;
mod sim;
mod stack;
pub mod webdriver;

pub use aggregator::{aggregator_yaml, AggregatedEndpoint, FollowedPool, LocalAggregator};
pub use bootstrap::{
    kvoy_config, prefix_affinity_config, quoted_contents, render_bootstrap, render_bootstrap_file,
    render_runnable, runnable_bootstraps, runnable_params, write_runnable_bootstraps,
    BootstrapParams, PoolEndpoint, RenderError, RunnableBootstrap, RUNNABLE_ADMIN_PORT,
    RUNNABLE_AGGREGATOR_PORT, RUNNABLE_BOOTSTRAPS, RUNNABLE_LISTEN_PORT, RUNNABLE_MODEL,
    RUNNABLE_POOL, RUNNABLE_WASM_DIR,
};
pub use echo::{
    error_body, EchoConfig, EchoServer, DELAY_HEADER, DESTINATION_HEADER, MAX_DELAY, PIN_HEADER,
    SERVED_BY_HEADER,
};
pub use envoy::{
    envoy_binary, envoy_version, free_port, validate_config, validate_config_in, wasm_failures,
    EnvoyProcess,
};
pub use sim::{small_cache_flags, PublishingSim, SimFleet};
pub use stack::{
    bootstrap_template, default_wasm_dir, require_filter_wasm, separate_bootstrap_template,
    served_by, stale_sources, workspace_root, FilterLayout, Stack, StackConfig, ADMISSION_WASM,
    AGGREGATOR_CLUSTER, KVOY_WASM, LOOPBACK_CIDR, PREFIX_AFFINITY_WASM, SERVED_HEADER,
    SESSION_WASM,
};

/// Polls `check` until it holds; panics naming `what` after `timeout` (the kit's).
pub use kvoy_testkit::wait_for;

/// Turn `t` of conversation `i` as a chat completion body for `model`: a long system brief
/// naming the conversation, the history of turns `0..t`, then a new question. The multi-turn
/// workload of the relay and reconfiguration tests: each turn's prompt extends the last one's.
pub fn conversation_turn(model: &str, i: usize, t: usize) -> Vec<u8> {
    use serde_json::json;
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
