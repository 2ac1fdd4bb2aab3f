//! `kvoy-local`: run, inspect and debug kvoy's wasm filters under wasmtime, without Envoy.
//!
//! It depends on kvoy-harness, kvoy-shared and kvoy-testkit (the one way to find the built
//! filters); never on the filter crates (it loads the built `.wasm`), kvoy-sim or
//! kvoy-aggregator (its tests start those in-process).
//!
//! The filters run in [`kvoy_harness`], a proxy-wasm ABI 0.2.1 host with Envoy's semantics, as
//! the chain Envoy would run (the combined `kvoy` filter of `envoy/kvoy.yaml`, or
//! `kvoy_session` -> `kvoy_admission` -> `kvoy_prefix_affinity` of `envoy/kvoy-separate.yaml`),
//! configured by a file ([`config`]):
//!
//! - [`decide`]: runs requests through the chain and reports the endpoint chosen (or the local
//!   reply), every scorer's score per endpoint and the time spent in each filter;
//! - [`serve`]: an HTTP/1.1 proxy that runs the chain and forwards to the chosen endpoint.
//!
//! ```no_run
//! use kvoy_local::{config::Config, decide, request::Request};
//!
//! # fn main() -> anyhow::Result<()> {
//! let config = Config::load("kvoy-local.yaml".as_ref())?;
//! let requests = Request::load("request.json".as_ref())?;
//! let reports = decide::decide(&config, &requests, &decide::DecideOptions::default())?;
//! print!("{}", kvoy_local::report::text(&reports));
//! # Ok(())
//! # }
//! ```

pub mod chain;
pub mod config;
pub mod decide;
pub mod document;
pub mod mirror;
pub mod report;
pub mod request;
pub mod serve;
