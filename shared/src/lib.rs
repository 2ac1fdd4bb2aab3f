//! kvoy's core, as plain Rust with no proxy-wasm dependency: OpenAI request parsing, prefix
//! keys, the prefix index, scoring and picking, cross-worker state over a shared-data trait,
//! and the plugin configuration. The wasm filters are thin adapters over this crate; the
//! harness, simulator and benchmarks use it natively.
//!
//! It must not depend on proxy-wasm, on anything that does I/O (tokio, hyper, ZMQ) or on another
//! kvoy crate: it runs inside the wasm filters, the browser's explain panel and the native tools
//! alike.
//!
//! ```
//! use kvoy_shared::prefix_affinity::{PluginConfig, Router};
//! use kvoy_shared::request::Api;
//! let cfg = PluginConfig::from_json(br#"{"endpoints":[
//!     {"address":"10.0.0.1:8000","models":["m"]},
//!     {"address":"10.0.0.2:8000","models":["m"]}]}"#).unwrap();
//! let mut router = Router::new(cfg, 7);
//! let body = br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
//! let outstanding = [kvoy_shared::Outstanding::default(); 2];
//! let now = std::time::Duration::ZERO; // the caller's clock
//! let decision = router.route_body(Api::ChatCompletions, body, &outstanding, now).unwrap();
//! let address = &router.pool().get(decision.endpoint).unwrap().address_text;
//! assert!(address.starts_with("10.0.0."));
//! ```

pub mod admission;
pub mod allow;
pub mod config;
pub mod disagg;
mod endpoint;
pub mod header_map;
mod index;
mod lru;
mod once;
mod outstanding;
pub mod prefix;
pub mod prefix_affinity;
pub mod protocol;
pub mod relay;
pub mod request;
mod rng;
pub mod session;
pub mod shared_data;
pub mod snapshot;
pub mod snapshot_board;
pub mod usage;

// Settings every stage shares (the aggregator connection) and the pool's size limit.
pub use endpoint::{Endpoint, EndpointId, EndpointLoad, Health, Pool, Role};
pub use index::{Match, PrefixIndex, Tier};
pub use lru::LruSet;
pub use once::LogOnce;
pub use outstanding::{Charge, Outstanding, OutstandingDelta};
pub use prefix_affinity::{AggregatorSettings, BearerToken, MAX_ENDPOINTS};
pub use request::RequestError;
pub use rng::Rng;
