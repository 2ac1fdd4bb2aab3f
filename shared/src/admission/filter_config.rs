//! The `kvoy_admission` filter's configuration: the flow-control settings plus what the filter
//! itself needs (the pool size it admits into, its release tick).
//!
//! ```
//! let cfg = kvoy_shared::admission::AdmissionFilterConfig::from_json(br#"{
//!     "endpoints": 3,
//!     "flow": {"saturation": {"max_inflight_per_endpoint": 8}}
//! }"#).unwrap();
//! assert_eq!((cfg.endpoints, cfg.tick_ms), (3, 20));
//! ```

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{AdmissionConfig, AdmissionConfigError};
use crate::allow::{Allowlist, RawAllowlist};
use crate::config::within;
use crate::prefix_affinity::config::AggregatorSettings;
use crate::snapshot::{EndpointStatus, Snapshot};
use crate::MAX_ENDPOINTS;

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
    #[serde(default)]
    allowed_destinations: Option<RawAllowlist>,
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
    /// The prefix-affinity filter's `allowed_destinations`: snapshot endpoints outside it are
    /// never routed to, so they are no capacity either ([`Allowlist::any`] when absent).
    pub allowed_destinations: Allowlist,
}

impl AdmissionFilterConfig {
    pub fn from_json(bytes: &[u8]) -> Result<Self, AdmissionConfigError> {
        let raw: RawFilterConfig<'_> =
            serde_json::from_slice(bytes).map_err(|e| AdmissionConfigError::Json(e.to_string()))?;
        within("endpoints", 1..=MAX_ENDPOINTS as u32, raw.endpoints)?;
        within("tick_ms", 1..=10_000, raw.tick_ms)?;
        let flow = match raw.flow {
            Some(f) => AdmissionConfig::from_json(f.get().as_bytes())
                .map_err(|e| AdmissionConfigError::Json(format!("`flow`: {e}")))?,
            None => AdmissionConfig::default(),
        };
        if let Some(a) = &raw.aggregator {
            crate::prefix_affinity::config::check_aggregator(a)
                .map_err(|e| AdmissionConfigError::Json(e.to_string()))?;
        }
        let allowed_destinations = match raw.allowed_destinations {
            Some(a) => {
                Allowlist::try_from(a).map_err(|e| AdmissionConfigError::Json(e.to_string()))?
            }
            None => Allowlist::any(),
        };
        Ok(AdmissionFilterConfig {
            endpoints: raw.endpoints,
            tick_ms: raw.tick_ms,
            flow,
            aggregator: raw.aggregator,
            allowed_destinations,
        })
    }

    /// The endpoints of `snapshot` that count for saturation: those inside
    /// `allowed_destinations` (all of them when it is not restricted, with no copy).
    /// `scratch` holds the filtered list, rebuilt only when the snapshot's
    /// `(epoch, version)` differs from `*key`.
    pub fn allowed_endpoints<'a>(
        &self,
        snapshot: &'a Snapshot,
        scratch: &'a mut Vec<EndpointStatus>,
        key: &mut Option<(u64, u64)>,
    ) -> &'a [EndpointStatus] {
        if !self.allowed_destinations.is_restricted() {
            return &snapshot.endpoints;
        }
        let now = Some((snapshot.epoch, snapshot.version));
        if *key != now {
            scratch.clear();
            scratch.extend(
                snapshot
                    .endpoints
                    .iter()
                    .filter(|e| self.allowed_destinations.check(e.address).is_ok())
                    .cloned(),
            );
            *key = now;
        }
        scratch
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

    fn status(slot: u16, address: &str) -> EndpointStatus {
        EndpointStatus {
            block_size: 16,
            capacity_blocks: 1000,
            ..EndpointStatus::ready(slot, address.parse().unwrap(), &["m"])
        }
    }

    /// An endpoint the router refuses (outside `allowed_destinations`) is no capacity: a
    /// snapshot naming one (a poisoned or mistaken aggregator) must not raise the limit.
    #[test]
    fn endpoints_outside_the_allowlist_are_no_capacity() {
        let c = AdmissionFilterConfig::from_json(
            br#"{"endpoints":3,"allowed_destinations":[{"cidr":"10.0.0.0/24","ports":[8000]}]}"#,
        )
        .unwrap();
        let mut snapshot = Snapshot {
            epoch: 1,
            version: 1,
            endpoints: vec![
                status(0, "10.0.0.1:8000"),
                status(1, "10.0.0.2:9000"),
                status(2, "192.168.1.1:8000"),
                status(3, "10.0.0.3:8000"),
            ],
        };
        let (mut scratch, mut key) = (Vec::new(), None);
        let slots: Vec<u16> = c
            .allowed_endpoints(&snapshot, &mut scratch, &mut key)
            .iter()
            .map(|e| e.slot)
            .collect();
        assert_eq!(slots, [0, 3]);
        // A new version is filtered again; the same one is not rebuilt.
        snapshot.version = 2;
        snapshot.endpoints.push(status(4, "10.0.0.4:8000"));
        assert_eq!(
            c.allowed_endpoints(&snapshot, &mut scratch, &mut key).len(),
            3
        );
        // Without a restriction: the snapshot itself.
        let open = AdmissionFilterConfig::from_json(br#"{"endpoints":3}"#).unwrap();
        let (mut scratch, mut key) = (Vec::new(), None);
        assert_eq!(
            open.allowed_endpoints(&snapshot, &mut scratch, &mut key)
                .len(),
            5
        );
        assert!(scratch.is_empty());
    }

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
                r#"{"endpoints":1,"allowed_destinations":[]}"#,
                "allowed_destinations",
            ),
            (
                r#"{"endpoints":1,"allowed_destinations":[{"cidr":"10.0.0.0/33"}]}"#,
                "allowed_destinations[0].cidr",
            ),
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
