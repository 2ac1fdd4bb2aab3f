//! The external picker's architecture, for the overhead benchmark's `ext_proc` row: the same
//! kvoy-shared picker the prefix-affinity filter runs, served natively as an Envoy
//! `envoy.filters.http.ext_proc` server (gRPC bidi stream, request body BUFFERED), answering
//! each body with the destination header. This is what an EPP-style deployment costs at best:
//! one in-process picker, no network between Envoy and it, no response phases.
//!
//! - [`proto`]: the ext_proc messages, only the fields used, as prost structs.
//! - [`grpc`]: gRPC message framing and status.
//! - [`picker`]: messages in, answers out, around kvoy-shared's `Router`.
//! - [`ExtProcServer`]: the HTTP/2 server on 127.0.0.1.
//! - [`ExtProcProxy`]: Envoy with `bench/envoy/extproc.yaml` and the picker behind it.
//!
//! ```no_run
//! use kvoy_bench::overhead::extproc::{ExtProcServer, Picker};
//! let config = br#"{"endpoints":[{"address":"127.0.0.1:8000","models":["m"]}]}"#;
//! let server = ExtProcServer::start(Picker::new(config, 1)?)?;
//! println!("ext_proc on {}", server.addr());
//! # anyhow::Ok(())
//! ```

pub mod grpc;
pub mod picker;
pub mod proto;
mod proxy;
mod server;

pub use picker::{Picker, StreamState, DESTINATION_HEADER};
pub use proxy::{picker_config, render, ExtProcProxy};
pub use server::{ExtProcServer, PROCESS_PATH};

#[cfg(test)]
mod tests;
