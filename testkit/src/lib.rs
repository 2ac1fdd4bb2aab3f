//! kvoy's test kit: the helpers that tests, benches and the local launchers share, each in one
//! place.
//!
//! - [`http`] holds a blocking HTTP/1.1 client on hyper (one-shot requests, streamed responses,
//!   kept-alive connections), its async core ([`http::aio`]) and a small server
//!   ([`http::server`]) for fake upstreams.
//! - [`net`] holds [`free_port`].
//! - [`wait`] holds [`wait_for`], polling a condition with a deadline.
//! - [`wasm`] holds [`wasm_dir`], the one way to find the built wasm filters.
//!
//! It must not depend on any kvoy crate that depends on it: it stays below the harness,
//! kvoy-e2e and kvoy-bench, so that each of them can use it.
//!
//! ```no_run
//! use std::time::Duration;
//! use kvoy_testkit::http::{self, Request};
//!
//! let addr = "127.0.0.1:8080".parse()?;
//! let reply = http::request(addr, &Request::get("/health").timeout(Duration::from_secs(5)))?;
//! assert_eq!(reply.status, 200);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod http;
pub mod net;
pub mod wait;
pub mod wasm;

pub use net::free_port;
pub use wait::{try_wait_for, wait_for, TimedOut};
pub use wasm::{target_dir, wasm_dir, workspace_root, WASM_DIR_ENV};
