//! `kvoy_admission`: a proxy-wasm HTTP filter, between `kvoy_session` and
//! `kvoy_prefix_affinity`, that admits requests at once while the pool has room and otherwise
//! holds them in priority bands with fair share between flows.
//!
//! It depends only on kvoy-shared, kvoy-filter-common, kvoy-filter-stages and proxy-wasm: nothing
//! native and no test crate.
//!
//! A thin adapter over the admission stage ([`kvoy_filter_stages::admission`], logic in
//! [`kvoy_shared::admission`]): admit (continue), queue (pause, also at the body callbacks), or
//! reject (429 with `x-kvoy-dropped-reason`). Held requests are released by the VM that holds
//! them, in the queue's order, when one of its requests completes and on every tick; those past
//! the queue TTL get 429 `ttl-expired`; a client that leaves while held is removed. The combined
//! `kvoy` filter runs the same stage with the other two in one pass.
//!
//! Plugin configuration: the JSON of [`kvoy_shared::admission::AdmissionFilterConfig`].

mod stream;

use std::cell::RefCell;
use std::rc::Rc;

use log::error;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use kvoy_filter_stages::admission::AdmissionVm;

use crate::stream::AdmissionStream;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(AdmissionRoot { context_id, state: Rc::new(RefCell::new(None)) })
    });
}}

pub(crate) type SharedState = Rc<RefCell<Option<AdmissionVm>>>;

/// Every released request is resumed at once (the filters after this one route it).
pub(crate) fn resume(_context: u32) -> bool {
    true
}

struct AdmissionRoot {
    context_id: u32,
    state: SharedState,
}

impl Context for AdmissionRoot {
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

impl RootContext for AdmissionRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(raw) = self.get_plugin_configuration() else {
            error!("kvoy_admission: no plugin configuration; `endpoints` is required");
            return false;
        };
        let vm = match AdmissionVm::configure(&raw, self.context_id) {
            Ok(vm) => vm,
            Err(e) => {
                error!("kvoy_admission: bad configuration: {e}");
                return false;
            }
        };
        if hostcalls::set_tick_period(vm.tick_period()).is_err() {
            error!("kvoy_admission: cannot set the tick period");
        }
        *self.state.borrow_mut() = Some(vm);
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            vm.on_tick(&mut resume);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(AdmissionStream::new(
            self.state.clone(),
            context_id,
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
