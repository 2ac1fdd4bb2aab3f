//! The session stage (see [`kvoy_shared::session`]): on the request it finds the session key
//! (in the configured order: `x-session-id`, a cookie, the stateless `x-session-token`, the
//! Responses API's `previous_response_id` and `conversation`) and looks up its binding in a
//! bounded shared-data table: the bound endpoint is the pin the prefix-affinity stage honours
//! for a healthy pool member. On the response it binds the keys to the endpoint that served,
//! binds a Responses API response `id` found in the body, and writes `x-session-token`.
//!
//! Configuration: the JSON of [`kvoy_shared::session::SessionConfig`] (`{}` for the defaults).

mod metrics;
mod stage;

use log::info;

use kvoy_shared::session::{BindingTable, SessionConfig};
use kvoy_shared::shared_data;

pub use metrics::Metrics;
pub use stage::SessionStage;

/// What one VM keeps between requests.
pub struct SessionVm {
    pub config: SessionConfig,
    pub table: BindingTable,
    pub metrics: Metrics,
}

impl SessionVm {
    /// Checks the stage's JSON configuration (empty or blank: the defaults) and sets the VM up;
    /// the error says what is wrong.
    pub fn configure(raw: &[u8]) -> Result<SessionVm, String> {
        let raw = if raw.iter().all(u8::is_ascii_whitespace) {
            b"{}".as_slice()
        } else {
            raw
        };
        let config = SessionConfig::from_json(raw).map_err(|e| e.to_string())?;
        let namespace = shared_data::namespace("kvoy.session", raw);
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
        Ok(SessionVm {
            config,
            table,
            metrics: Metrics::define(),
        })
    }
}

impl crate::root::StageVm for SessionVm {
    const FILTER: &'static str = "kvoy_session";

    fn configure(raw: &[u8], _context_id: u32) -> Result<SessionVm, String> {
        SessionVm::configure(raw)
    }
}
