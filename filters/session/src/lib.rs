//! `kvoy_session`: a proxy-wasm HTTP filter, placed before `kvoy_prefix_affinity`, that keeps
//! a session on the endpoint that served it.
//!
//! A thin adapter over [`kvoy_shared::session`]: on the request it finds the session key (in
//! the configured order: `x-session-id`, a cookie, the stateless `x-session-token`, the
//! Responses API's `previous_response_id` and `conversation`), looks up its binding in a
//! bounded shared-data table, and hands the bound endpoint to the prefix-affinity filter in
//! an internal header; that filter honours it only for a healthy pool member (or breaks the
//! pin). On the response it binds the keys to the endpoint that actually served
//! (`x-gateway-destination-endpoint-served`, which the prefix-affinity filter validates), binds
//! a Responses API response `id` found in the body, and writes `x-session-token`.
//!
//! Plugin configuration: the JSON of [`kvoy_shared::session::SessionConfig`] (`{}` for the
//! defaults).

mod metrics;
mod stream;

use std::cell::RefCell;
use std::rc::Rc;

use log::{error, info};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use kvoy_shared::replica;
use kvoy_shared::session::{BindingTable, SessionConfig};

use crate::metrics::Metrics;
use crate::stream::SessionStream;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(SessionRoot { state: Rc::new(RefCell::new(None)) })
    });
}}

/// What one VM keeps between requests.
pub(crate) struct VmState {
    pub config: SessionConfig,
    pub table: BindingTable,
    pub metrics: Metrics,
}

pub(crate) type SharedState = Rc<RefCell<Option<VmState>>>;

struct SessionRoot {
    state: SharedState,
}

impl Context for SessionRoot {}

impl RootContext for SessionRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = self
            .get_plugin_configuration()
            .unwrap_or_else(|| b"{}".to_vec());
        let raw = if raw.iter().all(u8::is_ascii_whitespace) {
            b"{}".to_vec()
        } else {
            raw
        };
        let config = match SessionConfig::from_json(&raw) {
            Ok(c) => c,
            Err(e) => {
                error!("kvoy_session: bad configuration: {e}");
                return false;
            }
        };
        let namespace = replica::namespace("kvoy.session", &raw);
        let table = BindingTable::new(&namespace, config.max_bindings, config.ttl_ms);
        info!(
            "kvoy_session: sources {:?}, TTL {} ms, {} bindings at most",
            config
                .key_sources
                .iter()
                .map(|s| s.tag())
                .collect::<Vec<_>>(),
            config.ttl_ms,
            table.capacity()
        );
        *self.state.borrow_mut() = Some(VmState {
            config,
            table,
            metrics: Metrics::define(),
        });
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(SessionStream::new(self.state.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
