//! Starting the configured filter chain under the harness.

use std::time::SystemTime;

use kvoy_harness::{FilterChain, Host, LogLevel};

use crate::config::Config;

/// How `proxy_http_call` is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callouts {
    /// Recorded for the caller to answer (`decide`); any cluster name is accepted.
    Recorded,
    /// Sent to the configured cluster addresses (`serve`); other names are `BadArgument`, as
    /// for a cluster Envoy does not know.
    Real,
}

/// A filter that failed to load or start.
#[derive(Debug, thiserror::Error)]
#[error("filter `{name}`: {source}")]
pub struct StartError {
    pub name: String,
    #[source]
    pub source: kvoy_harness::Error,
}

/// Loads every filter's module and starts one plugin per filter, `config.workers` VMs each,
/// as Envoy does at startup (a filter whose `on_configure` fails is an error). The virtual
/// clocks start at `start` (default: the harness's fixed date).
pub fn start(
    config: &Config,
    callouts: Callouts,
    start: Option<SystemTime>,
) -> Result<FilterChain, StartError> {
    let mut chain = FilterChain::new();
    for (index, filter) in config.filters.iter().enumerate() {
        let fail = |source| StartError {
            name: filter.name.clone(),
            source,
        };
        let host = Host::load(&filter.wasm).map_err(fail)?;
        let mut builder = host
            .plugin()
            .name(&filter.name)
            .root_id(&filter.root_id)
            .vm_id(&filter.vm_id)
            .configuration(filter.configuration.clone())
            .vms(config.workers)
            .log_level(LogLevel::Info)
            // Each filter its own random stream, all derived from the one seed.
            .seed(config.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        if let Some(start) = start {
            builder = builder.start_time(start);
        }
        if callouts == Callouts::Real {
            builder = builder.clusters(config.clusters.keys().cloned());
            for (name, addr) in &config.clusters {
                builder = builder.upstream(name, *addr);
            }
        }
        chain = chain.filter(&filter.name, builder.start().map_err(fail)?);
    }
    Ok(chain)
}
