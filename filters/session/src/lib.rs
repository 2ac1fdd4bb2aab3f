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

use std::cell::RefCell;
use std::rc::Rc;

use log::error;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use kvoy_filter_stages::session::SessionVm;

use crate::stream::SessionStream;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(SessionRoot { state: Rc::new(RefCell::new(None)) })
    });
}}

pub(crate) type SharedState = Rc<RefCell<Option<SessionVm>>>;

struct SessionRoot {
    state: SharedState,
}

impl Context for SessionRoot {}

impl RootContext for SessionRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        match SessionVm::configure(&raw) {
            Ok(vm) => {
                *self.state.borrow_mut() = Some(vm);
                true
            }
            Err(e) => {
                error!("kvoy_session: bad configuration: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(SessionStream::new(self.state.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
