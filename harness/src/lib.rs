//! A proxy-wasm ABI 0.2.1 host on wasmtime, for testing and benchmarking kvoy's filters without
//! Envoy.
//!
//! It depends on wasmtime, kvoy-shared and kvoy-testkit (its real callouts' HTTP client) only:
//! it loads the filters as `.wasm` files, never as crates. Only tests, benchmarks and kvoy-local
//! depend on it.
//!
//! It loads a filter built for `wasm32-wasip1`, starts a [`Plugin`] of N VMs the way Envoy
//! starts one per worker thread, and drives HTTP streams (or TCP connections through a network
//! filter, [`Connection`]) through them with Envoy's semantics
//! (see `harness/README.md` for what is implemented and where it differs). The VMs share
//! shared data (with CAS), shared queues, metrics, captured logs and a virtual clock that only
//! moves when the test calls [`Plugin::advance`]. HTTP and gRPC callouts and foreign functions
//! are recorded for the test to answer (or, with [`PluginBuilder::upstream`], HTTP callouts go
//! to a real address). A guest trap (a Rust panic) becomes an [`Error::Trap`] from the call
//! that caused it, with the panic message. A [`FilterChain`] runs several plugins in order, as
//! Envoy's `http_filters` (kvoy-local runs kvoy's chain with it).
//!
//! ```no_run
//! use kvoy_harness::{testing, Action};
//!
//! # fn main() -> Result<(), kvoy_harness::Error> {
//! let host = testing::filter_host("kvoy_prefix_affinity")?; // needs `make wasm`
//! let plugin = host
//!     .plugin()
//!     .configuration(r#"{"endpoints":[{"address":"127.0.0.1:18001","models":["m"]}]}"#)
//!     .vms(2)
//!     .start()?;
//!
//! let stream = plugin.vm(0).http_stream()?;
//! let headers = [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gw")];
//! assert_eq!(stream.send_request_headers(&headers, false)?, Action::Pause);
//! stream.send_request_body(br#"{"model":"m","messages":[]}"#, true)?;
//! let destination = stream.request_header("x-gateway-destination-endpoint");
//! stream.finish()?;
//!
//! plugin.advance(std::time::Duration::from_secs(1))?; // fires due proxy_on_tick calls
//! println!("{destination:?} {:?}", plugin.counter("kvoy_requests_total"));
//! # Ok(())
//! # }
//! ```
//!
//! Set `KVOY_HARNESS_LOG=1` to print the guests' log lines as they arrive.
//!
//! # Layout
//!
//! Modules follow the concerns of a proxy-wasm host. The guest calls of each concern (an
//! `impl VmInstance` block) live in its `driver.rs` (`http/`, `net/`, `grpc/`; HTTP callout
//! answers in `http/callouts.rs`); `vm/mod.rs` has the one call path into the guest and the root
//! context's own callbacks (start, tick, queue ready, foreign function):
//!
//! | module | what it holds |
//! |---|---|
//! | `abi/` | the host functions guests import (`env`, one file per area, and WASI) |
//! | `vm/` | one VM: the compiled module ([`Host`]), starting a VM, calling into the guest, its store data, call counts, callout tokens |
//! | `plugin/` | N VMs of one configuration ([`Plugin`]) and what they share: clock, shared data, queues, metrics, logs, foreign functions |
//! | `http/` | HTTP streams ([`HttpStream`]) and their driver, filter chains, header maps, HTTP callouts (recorded or real) |
//! | `net/` | TCP connections through a network filter ([`Connection`]) and their driver |
//! | `grpc/` | gRPC callouts: the records, the service argument, the test's answers |
//! | `types.rs`, `error.rs` | the ABI's enums, the crate's error |
//! | `testing` | helpers for tests and benchmarks that load the workspace's own filters |

mod abi;
mod error;
mod grpc;
mod http;
mod net;
mod plugin;
pub mod testing;
mod types;
mod vm;

pub use error::{Error, Result};
pub use grpc::{GrpcCall, GrpcOpening, GrpcStream, GrpcTarget};
pub use http::callouts::{HttpCall, HttpResponse};
pub use http::chain::{ChainState, ChainStream, Downstream, FilterChain, UpstreamRequest};
pub use http::headers::{decode_pairs, encode_pairs, HeaderMap, PairsError, RawPair};
pub use http::state::{LocalReply, StreamEvent};
pub use http::stream::HttpStream;
pub use net::connection::Connection;
pub use net::state::ConnectionEvent;
pub use plugin::foreign::{ForeignCall, ForeignFunction};
pub use plugin::logs::{LogEntry, LogSource, ECHO_ENV};
pub use plugin::metrics::Metric;
pub use plugin::{Plugin, PluginBuilder, VmRef};
pub use types::{Action, BufferType, CloseType, LogLevel, MapType, MetricType, Status, StreamType};
pub use vm::counts::{CallCounts, HostCallNames};
pub use vm::host::Host;
