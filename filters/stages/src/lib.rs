//! The three request stages of kvoy's filters, as plain types a proxy-wasm adapter drives:
//!
//! It depends only on kvoy-shared, kvoy-filter-common and proxy-wasm; the decisions themselves live
//! in kvoy-shared, and no filter crate is a dependency.
//!
//! - [`session`]: finds a request's session key and the endpoint it is bound to (the pin), and
//!   binds the keys to the endpoint that served it;
//! - [`admission`]: admits a request, holds it in priority bands while the pool is saturated,
//!   or sheds it (429 / 503);
//! - [`prefix_affinity`]: routes a request to the endpoint most likely to hold its prompt
//!   prefix (sets `x-gateway-destination-endpoint`).
//! - [`root`]: the root context a separate filter runs its stage under (configure, tick, answer
//!   the stage's HTTP calls, start a stream per request).
//!
//! Each stage has a per-VM state (`*Vm`, configured from the stage's JSON) and a per-request
//! state (`*Stage`). The separate filters (`kvoy_session`, `kvoy_admission`,
//! `kvoy_prefix_affinity`) each drive one stage and hand the session pin and the served
//! endpoint between them in headers; the combined `kvoy` filter drives all three in one VM pass
//! and hands them over as values. The stages read headers through
//! [`kvoy_filter_common::Headers`], so the combined filter reads each header once.
//!
//! ```no_run
//! use kvoy_filter_common::HostHeaders;
//! use kvoy_filter_stages::session::{SessionStage, SessionVm};
//! use proxy_wasm::types::MapType;
//!
//! let vm = SessionVm::configure(b"{}").expect("the defaults");
//! let mut stage = SessionStage::new();
//! let needs_body = stage.on_request_headers(&vm, &HostHeaders(MapType::HttpRequestHeaders), true);
//! assert!(!needs_body);
//! let pin = stage.pin(&vm, None, None);
//! # let _ = pin;
//! ```

pub mod admission;
pub mod prefix_affinity;
pub mod root;
pub mod session;
