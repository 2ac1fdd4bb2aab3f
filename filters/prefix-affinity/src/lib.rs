//! `kvoy_prefix_affinity`: a proxy-wasm HTTP filter that sends each OpenAI request to the pool
//! endpoint most likely to hold its prompt prefix in KV cache, weighed against load.
//!
//! It depends only on kvoy-shared, kvoy-filter-common, kvoy-filter-stages and proxy-wasm: nothing
//! native and no test crate.
//!
//! A thin adapter over the prefix-affinity stage ([`kvoy_filter_stages::prefix_affinity`],
//! logic in [`kvoy_shared::prefix_affinity::Router`]): it pauses at request headers (Envoy needs
//! `allow_on_headers_stop_iteration: true`), buffers the body, asks the router, and writes
//! `x-gateway-destination-endpoint` for an `ORIGINAL_DST` cluster. Cross-worker state lives in
//! Envoy shared data (see [`kvoy_shared::shared_data`]): outstanding work per endpoint (requests,
//! and the prefill tokens of those whose answer has not begun, for the cost model) and a
//! bounded log of decisions that each worker replays into its own prefix index. It honours the
//! session pin `kvoy_session` hands over in an internal header. The combined `kvoy` filter runs
//! the same stage with the other two in one pass.
//!
//! Plugin configuration: the JSON of [`kvoy_shared::prefix_affinity::PluginConfig`], e.g.
//! `{"endpoints":[{"address":"10.0.0.1:8000","models":["llama"]}]}`.

mod stream;

use proxy_wasm::traits::RootContext;
use proxy_wasm::types::LogLevel;

use kvoy_filter_stages::prefix_affinity::PrefixVm;
use kvoy_filter_stages::root::{SharedVm, StageRoot};

use crate::stream::RequestStream;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(StageRoot::<PrefixVm>::new(context_id, |vm, _| {
            Box::new(RequestStream::new(vm))
        }))
    });
}}

pub(crate) type SharedState = SharedVm<PrefixVm>;
