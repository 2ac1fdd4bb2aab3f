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

use std::cell::RefCell;
use std::rc::Rc;

use log::error;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use kvoy_filter_stages::prefix_affinity::PrefixVm;

use crate::stream::RequestStream;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(PrefixAffinityRoot { context_id, state: Rc::new(RefCell::new(None)) })
    });
}}

pub(crate) type SharedState = Rc<RefCell<Option<PrefixVm>>>;

struct PrefixAffinityRoot {
    context_id: u32,
    state: SharedState,
}

impl Context for PrefixAffinityRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            vm.on_http_call_response(token_id, num_headers, body_size);
        }
    }
}

impl RootContext for PrefixAffinityRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(raw) = self.get_plugin_configuration() else {
            error!("kvoy_prefix_affinity: no plugin configuration; an endpoint list is required");
            return false;
        };
        let vm = match PrefixVm::configure(&raw, self.context_id) {
            Ok(vm) => vm,
            Err(e) => {
                error!("kvoy_prefix_affinity: bad configuration: {e}");
                return false;
            }
        };
        if hostcalls::set_tick_period(vm.tick_period()).is_err() {
            error!("kvoy_prefix_affinity: cannot set the tick period; idle workers catch up on requests only, and an aggregator is not polled");
        }
        *self.state.borrow_mut() = Some(vm);
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            vm.on_tick();
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(RequestStream::new(self.state.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
