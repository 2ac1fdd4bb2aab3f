//! What every kvoy filter needs from the proxy-wasm host, in one place: Envoy shared data as
//! a [`kvoy_shared::replica::SharedStore`] ([`HostStore`]), the host clock in milliseconds
//! ([`now_ms`]), and metrics that fail soft ([`counter`], [`gauge`], [`add`], [`set`]: a metric
//! that cannot be defined is skipped, never fatal), and the aggregator's snapshot as a filter
//! follows it ([`LiveSnapshot`]).

mod live;

pub use live::{call_response, CallBody, LiveSnapshot, PollStart};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MetricType, Status};

use kvoy_shared::replica::{SharedStore, StoreError};

/// Envoy shared data (process-wide per `vm_id`, compare-and-swap, no delete).
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Some((bytes, cas.unwrap_or(0))),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let cas = (cas != 0).then_some(cas);
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(status) => Err(StoreError::Unavailable(format!("{status:?}"))),
        }
    }
}

/// Host time in milliseconds since the Unix epoch (0 if unavailable).
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A per-VM random value: the host's random source (WASI `random_get`, through std's hash
/// keys) mixed with the clock and the root context id, so that VMs differ in tie-breaks,
/// log origin ids and lease ownership.
pub fn vm_seed(context_id: u32) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    h.write_u64(now);
    h.write_u32(context_id);
    h.finish()
}

/// Defines a counter; `None` if the host refuses.
pub fn counter(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

/// Defines a gauge; `None` if the host refuses.
pub fn gauge(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Gauge, name).ok()
}

/// Adds `n` to a counter defined with [`counter`] (nothing if it was not defined).
pub fn add(id: Option<u32>, n: u64) {
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id, n.min(i64::MAX as u64) as i64);
    }
}

/// Sets a gauge defined with [`gauge`].
pub fn set(id: Option<u32>, value: u64) {
    if let Some(id) = id {
        let _ = hostcalls::record_metric(id, value);
    }
}

/// Defines a histogram; `None` if the host refuses.
pub fn histogram(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Histogram, name).ok()
}

/// Records a value in a histogram defined with [`histogram`].
pub fn record(id: Option<u32>, value: u64) {
    if let Some(id) = id {
        let _ = hostcalls::record_metric(id, value);
    }
}
