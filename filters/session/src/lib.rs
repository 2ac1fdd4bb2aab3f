//! `kvoy_session`: a proxy-wasm HTTP filter, placed before `kvoy_prefix_affinity`, that keeps
//! a session on the endpoint that served it.
//!
//! It depends only on kvoy-shared, kvoy-filter-common, kvoy-filter-stages and proxy-wasm: nothing
//! native and no test crate.
//!
//! A thin adapter over the session stage ([`kvoy_filter_stages::session`], logic in
//! [`kvoy_shared::session`]): on the request it finds the session key and hands the endpoint it
//! is bound to over to the prefix-affinity filter in an internal header
//! ([`kvoy_shared::session::PIN_HEADER`]); that filter honours it only for a healthy pool member
//! (or breaks the pin). On the response it binds the keys to the endpoint that actually served
//! (`x-gateway-destination-endpoint-served`, which the prefix-affinity filter validates), binds
//! a Responses API response `id` found in the body, and writes `x-session-token`. The combined
//! `kvoy` filter runs the same stage with the other two in one pass, without the header.
//!
//! Plugin configuration: the JSON of [`kvoy_shared::session::SessionConfig`] (`{}` for the
//! defaults).

mod stream;

use proxy_wasm::traits::RootContext;
use proxy_wasm::types::LogLevel;

use kvoy_filter_stages::root::{SharedVm, StageRoot};
use kvoy_filter_stages::session::SessionVm;

use crate::stream::SessionStream;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(StageRoot::<SessionVm>::new(context_id, |vm, _| {
            Box::new(SessionStream::new(vm))
        }))
    });
}}

pub(crate) type SharedState = SharedVm<SessionVm>;
