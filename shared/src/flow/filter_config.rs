//! The `kvoy_admission` filter's configuration: the flow-control settings plus what the filter
//! itself needs (the pool size it admits into, its release tick).
//!
//! ```
//! let cfg = kvoy_shared::flow::AdmissionFilterConfig::from_json(br#"{
//!     "endpoints": 3,
//!     "flow": {"saturation": {"max_inflight_per_endpoint": 8}}
//! }"#).unwrap();
//! assert_eq!((cfg.endpoints, cfg.tick_ms), (3, 20));
//! ```

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{AdmissionConfig, AdmissionConfigError};
use crate::config::AggregatorSettings;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFilterConfig<'a> {
    endpoints: u32,
    #[serde(default = "default_tick_ms")]
    tick_ms: u64,
    #[serde(borrow, default)]
    flow: Option<&'a RawValue>,
    #[serde(default)]
    aggregator: Option<AggregatorSettings>,
}

fn default_tick_ms() -> u64 {
    20
}

/// A checked admission filter configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmissionFilterConfig {
    /// Endpoints of the pool this proxy admits into (the in-flight limits are per endpoint).
    pub endpoints: u32,
    /// How often held requests are looked at (release, expiry), besides request completions.
    pub tick_ms: u64,
    pub flow: AdmissionConfig,
    /// kvoy-aggregator, when saturation also comes from the servers' queues and KV use.
    pub aggregator: Option<AggregatorSettings>,
}

impl AdmissionFilterConfig {
    pub fn from_json(bytes: &[u8]) -> Result<Self, AdmissionConfigError> {
        let raw: RawFilterConfig<'_> =
            serde_json::from_slice(bytes).map_err(|e| AdmissionConfigError::Json(e.to_string()))?;
        if !(1..=4096).contains(&raw.endpoints) {
            return Err(AdmissionConfigError::Json(format!(
                "`endpoints` must be within 1..=4096, got {}",
                raw.endpoints
            )));
        }
        if !(1..=10_000).contains(&raw.tick_ms) {
            return Err(AdmissionConfigError::Json(format!(
                "`tick_ms` must be within 1..=10000, got {}",
                raw.tick_ms
            )));
        }
        let flow = match raw.flow {
            Some(f) => AdmissionConfig::from_json(f.get().as_bytes())
                .map_err(|e| AdmissionConfigError::Json(format!("`flow`: {e}")))?,
            None => AdmissionConfig::default(),
        };
        if let Some(a) = &raw.aggregator {
            crate::config::check_aggregator(a)
                .map_err(|e| AdmissionConfigError::Json(e.to_string()))?;
        }
        Ok(AdmissionFilterConfig {
            endpoints: raw.endpoints,
            tick_ms: raw.tick_ms,
            flow,
            aggregator: raw.aggregator,
        })
    }

    /// This proxy's in-flight total spread over the endpoints of a snapshot, by slot.
    pub fn spread_by_slot(total: u32, slots: &[u16], out: &mut Vec<u32>) {
        out.clear();
        let Some(&max) = slots.iter().max() else {
            return;
        };
        out.resize(usize::from(max) + 1, 0);
        let n = slots.len() as u32;
        for (i, &slot) in slots.iter().enumerate() {
            out[usize::from(slot)] = total / n + u32::from((i as u32) < total % n);
        }
    }

    /// This proxy's in-flight total spread over the endpoints, as the per-endpoint limits
    /// expect (the admission filter runs before the endpoint is chosen).
    pub fn spread(&self, total: u32, out: &mut Vec<u32>) {
        out.clear();
        let n = self.endpoints.max(1);
        out.extend((0..n).map(|i| total / n + u32::from(i < total % n)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_the_flow_config() {
        let c = AdmissionFilterConfig::from_json(br#"{"endpoints":2}"#).unwrap();
        assert_eq!(c.flow, AdmissionConfig::default());
        let mut out = Vec::new();
        c.spread(5, &mut out);
        assert_eq!(out, [3, 2]);
        for (json, needle) in [
            (r#"{}"#, "endpoints"),
            (r#"{"endpoints":0}"#, "endpoints"),
            (r#"{"endpoints":1,"tick_ms":0}"#, "tick_ms"),
            (r#"{"endpoints":1,"flw":{}}"#, "flw"),
            (
                r#"{"endpoints":1,"flow":{"queue_ttl_ms":"x"}}"#,
                "queue_ttl_ms",
            ),
        ] {
            let e = AdmissionFilterConfig::from_json(json.as_bytes())
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{json}: {e}");
        }
    }
}
