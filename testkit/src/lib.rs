//! kvoy's test kit: what every test, bench and the `kvoy-stack` launcher (`make run`) use to
//! talk HTTP, pick ports, find the built filters and start a kvoy stack (a real Envoy with the
//! filters in front of backends on 127.0.0.1), each in one place.
//!
//! - [`http`]: a blocking HTTP/1.1 client on hyper (one-shot requests, streamed responses,
//!   kept-alive connections), its async core ([`http::aio`]) and a small server
//!   ([`http::server`]) for fake upstreams.
//! - [`net`]: [`free_port`]; [`wait`]: [`wait_for`], polling a condition with a deadline.
//! - [`wasm`]: the built wasm filters: [`wasm_dir`] (the one way to find them), their file
//!   names, [`require_filter_wasm`] and [`stale_sources`].
//! - [`envoy`]: running a real Envoy ([`EnvoyProcess`], [`envoy_version`],
//!   [`validate_config`]) and reading its log ([`wasm_failures`]).
//! - [`bootstrap`]: filling in the templates `envoy/template/kvoy.yaml` and `kvoy-separate.yaml`
//!   ([`render_bootstrap`]); [`runnable_bootstraps`]: the runnable `envoy/kvoy.yaml` they render
//!   to with defaults.
//! - [`stack`]: [`Stack`] renders the template for a pool, runs Envoy, waits until it is ready,
//!   and kills it on drop; [`served_by`] checks where the proxy sent a request.
//! - [`echo`]: [`EchoServer`], an OpenAI-shaped backend whose replies name the address that
//!   served them (header `x-served-by`).
//! - [`requests`]: OpenAI request bodies the tests send ([`requests::prompt`], ...); [`load`]: a
//!   streaming client that times each completion (TTFT, inter-token gaps); [`scenario`]: the
//!   request patterns the Envoy tests and kvoy-local's both run (a same-prefix burst,
//!   admission's priority and TTL runs).
//! - [`redis`]: a real `redis-server` on a free port ([`redis::RedisServer`]), for kvoy-async.
//! - [`webdriver`]: a headless Chromium driven through chromedriver, for the browser tests.
//!
//! kvoy's own services run in-process through their crates' starters, not through the kit:
//! `kvoy_sim::fleet::SimFleet` and `kvoy_aggregator::local::LocalAggregator`.
//!
//! It depends on kvoy-shared only (the protocol's header names and paths; pure, and it does not
//! depend on the kit), never on a crate that uses the kit (the harness, kvoy-sim,
//! kvoy-aggregator, kvoy-local, kvoy-bench, kvoy-e2e, kvoy-stack), so that each of them can.
//! Only tests, benches and kvoy's local tools (the harness, the launchers) depend on it; a
//! component kvoy ships (the filters, kvoy-sim, kvoy-aggregator) only in its tests.
//!
//! ```no_run
//! use kvoy_testkit::{http, EchoConfig, EchoServer, PoolEndpoint, Stack, StackConfig};
//! use std::time::Duration;
//!
//! let backend = EchoServer::start(EchoConfig::new("127.0.0.1:0".parse()?, &["m"]))?;
//! let pool = vec![PoolEndpoint::new(backend.addr(), &["m"])];
//! let stack = Stack::start(&StackConfig::new(pool, "/tmp/kvoy-run".into()))?;
//! let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
//! let reply = http::post_json(
//!     stack.listen, "/v1/chat/completions", &[], body, Duration::from_secs(10))?;
//! assert_eq!(reply.header("x-served-by"), Some(backend.addr().to_string().as_str()));
//! # anyhow::Ok(())
//! ```

pub mod bootstrap;
pub mod echo;
pub mod envoy;
pub mod http;
pub mod load;
pub mod net;
pub mod redis;
pub mod requests;
pub mod scenario;
pub mod stack;
pub mod wait;
pub mod wasm;
pub mod webdriver;

pub use bootstrap::{
    bootstrap_template, kvoy_config, prefix_affinity_config, quoted_contents, render_bootstrap,
    render_bootstrap_file, render_runnable, runnable_bootstraps, runnable_params,
    separate_bootstrap_template, write_runnable_bootstraps, BootstrapParams, PoolEndpoint,
    RenderError, RunnableBootstrap, RUNNABLE_ADMIN_PORT, RUNNABLE_AGGREGATOR_PORT,
    RUNNABLE_BOOTSTRAPS, RUNNABLE_LISTEN_PORT, RUNNABLE_MODEL, RUNNABLE_POOL, RUNNABLE_WASM_DIR,
};
pub use echo::{
    error_body, EchoConfig, EchoServer, DELAY_HEADER, DESTINATION_HEADER, MAX_DELAY, PIN_HEADER,
    SERVED_BY_HEADER,
};
pub use envoy::{
    envoy_binary, envoy_version, terminate, validate_config, validate_config_in, wasm_failures,
    EnvoyProcess,
};
pub use net::free_port;
pub use stack::{
    served_by, FilterLayout, Stack, StackConfig, AGGREGATOR_B_CLUSTER, AGGREGATOR_CLUSTER,
    LOOPBACK_CIDR, SERVED_HEADER,
};
pub use wait::{try_wait_for, wait_for, TimedOut};
pub use wasm::{
    require_filter_wasm, stale_sources, target_dir, wasm_dir, workspace_root, MissingModule,
    ADMISSION_WASM, KVOY_WASM, PREFIX_AFFINITY_WASM, SESSION_WASM, WASM_DIR_ENV,
};
