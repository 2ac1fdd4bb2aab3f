//! The `kvoy_admission` filter's configuration (JSON, unknown fields rejected).
//!
//! ```
//! use kvoy_shared::admission::{AdmissionConfig, Fairness};
//! let cfg = AdmissionConfig::from_json(br#"{
//!     "objectives": {"interactive": 10, "batch": -1},
//!     "saturation": {"max_inflight_per_endpoint": 32}
//! }"#).unwrap();
//! assert_eq!(cfg.objectives["batch"], -1);
//! assert_eq!(cfg.saturation.queue_depth, 5);
//! assert_eq!(cfg.fairness, Fairness::RoundRobin);
//! assert_eq!(cfg.queue_ttl_ms, 60_000);
//! ```

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};
use thiserror::Error;

use crate::config::{out_of_range, within, OutOfRange};

/// How a band shares its releases among flows (fairness ids).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fairness {
    /// Round-robin over the flows that have waiting requests, one request per turn.
    #[default]
    RoundRobin,
    /// No fairness between flows: the band is one queue, in the flow ordering (so global FCFS,
    /// or global EDF with [`FlowOrdering::Edf`]).
    Fcfs,
}

/// The order of requests inside one flow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlowOrdering {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Earliest deadline first: the deadline is arrival + `queue_ttl_ms`, or the request's own
    /// deadline when it is earlier.
    Edf,
}

/// When the pool counts as saturated (see [`super::saturation`]).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaturationThresholds {
    /// An endpoint whose waiting queue is this long counts as full (ratio 1.0).
    pub queue_depth: u32,
    /// An endpoint whose KV-cache use is this high counts as full (ratio 1.0).
    pub kv_cache_usage: f64,
    /// This proxy's own in-flight requests at which an endpoint counts as full.
    pub max_inflight_per_endpoint: Option<u32>,
    /// This proxy's own in-flight tokens (as the filter estimates them) at which an endpoint
    /// counts as full.
    pub max_inflight_tokens_per_endpoint: Option<u64>,
    /// The pool level from which sheddable requests (priority < 0) are refused (or held, with
    /// `queue_sheddable`), below the 1.0 at which every band waits: the headroom between the
    /// two keeps interactive traffic inside its SLO while the servers' figures lag admission.
    pub sheddable_level: f64,
}

impl Default for SaturationThresholds {
    /// The flow-control reference: waiting 5, KV 0.8; no in-flight limits. Sheddable requests
    /// stop at half that level (the reference sheds them only at 1.0; kvoy-bench's fleet
    /// simulation measured 0.5 against 0.4, 0.6 and 1.0: bench/README.md).
    fn default() -> Self {
        SaturationThresholds {
            queue_depth: 5,
            kv_cache_usage: 0.8,
            max_inflight_per_endpoint: None,
            max_inflight_tokens_per_endpoint: None,
            sheddable_level: 0.5,
        }
    }
}

impl SaturationThresholds {
    /// Whether an in-flight limit is set, so that [`super::Saturation::free_slots`] is known.
    pub fn limits_inflight(&self) -> bool {
        self.max_inflight_per_endpoint.is_some() || self.max_inflight_tokens_per_endpoint.is_some()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmissionConfig {
    #[serde(default)]
    objectives: BTreeMap<String, i32>,
    #[serde(default)]
    default_priority: i32,
    #[serde(default)]
    saturation: SaturationThresholds,
    #[serde(default)]
    fairness: Fairness,
    #[serde(default)]
    ordering: FlowOrdering,
    #[serde(default = "defaults::queue_ttl_ms")]
    queue_ttl_ms: u64,
    #[serde(default = "defaults::band_max_requests")]
    band_max_requests: u32,
    #[serde(default = "defaults::band_max_bytes")]
    band_max_bytes: u64,
    #[serde(default = "defaults::max_requests")]
    max_requests: u32,
    #[serde(default)]
    queue_sheddable: bool,
}

mod defaults {
    pub fn queue_ttl_ms() -> u64 {
        60_000
    }
    pub fn band_max_requests() -> u32 {
        5_000
    }
    pub fn band_max_bytes() -> u64 {
        1 << 30
    }
    pub fn max_requests() -> u32 {
        10_000
    }
}

/// Objectives one configuration may name.
pub const MAX_OBJECTIVES: usize = 1024;
/// Longest objective name, in bytes (a Kubernetes object name is at most 253).
pub const MAX_OBJECTIVE_NAME_BYTES: usize = 253;
/// Most requests one queue may hold, per band and in all.
pub const MAX_QUEUED: u32 = 1_000_000;

/// A checked admission configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmissionConfig {
    /// InferenceObjective name -> priority (higher first; negative = sheddable).
    pub objectives: BTreeMap<String, i32>,
    /// The priority of a request with no objective, or one not in `objectives`.
    pub default_priority: i32,
    pub saturation: SaturationThresholds,
    pub fairness: Fairness,
    pub ordering: FlowOrdering,
    /// A request queued this long is dropped (429 `ttl-expired`).
    pub queue_ttl_ms: u64,
    /// Per band (priority): requests queued at most.
    pub band_max_requests: u32,
    /// Per band: bytes (sum of `content-length`) queued at most.
    pub band_max_bytes: u64,
    /// Requests queued at most, all bands together.
    pub max_requests: u32,
    /// Queue sheddable requests (priority < 0) when saturated, instead of rejecting them.
    pub queue_sheddable: bool,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            objectives: BTreeMap::new(),
            default_priority: 0,
            saturation: SaturationThresholds::default(),
            fairness: Fairness::default(),
            ordering: FlowOrdering::default(),
            queue_ttl_ms: defaults::queue_ttl_ms(),
            band_max_requests: defaults::band_max_requests(),
            band_max_bytes: defaults::band_max_bytes(),
            max_requests: defaults::max_requests(),
            queue_sheddable: false,
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum AdmissionConfigError {
    #[error("invalid admission configuration JSON: {0}")]
    Json(String),
    #[error("`objectives` key {name:?} must be {expected}")]
    BadObjective {
        name: String,
        expected: &'static str,
    },
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
}

impl AdmissionConfig {
    /// Parses and checks a JSON configuration; `{}` gives the defaults. Every error names the
    /// field at fault.
    pub fn from_json(bytes: &[u8]) -> Result<Self, AdmissionConfigError> {
        match serde_json::from_slice::<RawAdmissionConfig>(bytes) {
            Ok(raw) => Self::try_from(raw),
            Err(e) => Err(AdmissionConfigError::Json(
                locate_error(bytes).unwrap_or_else(|| e.to_string()),
            )),
        }
    }

    /// The priority of an objective name (already trimmed); unknown names get
    /// `default_priority`.
    pub fn priority(&self, objective: Option<&str>) -> i32 {
        objective
            .and_then(|o| self.objectives.get(o))
            .copied()
            .unwrap_or(self.default_priority)
    }
}

/// serde_json's errors give a line and column, not a field: find the field by deserializing
/// each one alone (only on the error path, so the cost does not matter).
fn locate_error(bytes: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(bytes).ok()?;
    let (field, message) = failing_field::<RawAdmissionConfig>(&value)?;
    if field == "saturation" {
        if let Some((inner, message)) = value
            .get("saturation")
            .and_then(failing_field::<SaturationThresholds>)
        {
            return Some(format!("`saturation.{inner}`: {message}"));
        }
    }
    Some(format!("`{field}`: {message}"))
}

/// The first field of a JSON object that does not deserialize as part of a `T`.
fn failing_field<T: DeserializeOwned>(value: &Value) -> Option<(String, String)> {
    value.as_object()?.iter().find_map(|(key, v)| {
        let mut one = Map::new();
        one.insert(key.clone(), v.clone());
        serde_json::from_value::<T>(Value::Object(one))
            .err()
            .map(|e| (key.clone(), e.to_string()))
    })
}

impl TryFrom<RawAdmissionConfig> for AdmissionConfig {
    type Error = AdmissionConfigError;

    fn try_from(raw: RawAdmissionConfig) -> Result<Self, AdmissionConfigError> {
        if raw.objectives.len() > MAX_OBJECTIVES {
            return Err(out_of_range(
                "objectives",
                "at most 1024 entries",
                raw.objectives.len(),
            ));
        }
        for name in raw.objectives.keys() {
            let expected = if name.is_empty() {
                Some("a non-empty name")
            } else if name.len() > MAX_OBJECTIVE_NAME_BYTES {
                Some("at most 253 bytes long")
            } else if name.trim() != name {
                Some("free of surrounding whitespace")
            } else {
                None
            };
            if let Some(expected) = expected {
                return Err(AdmissionConfigError::BadObjective {
                    name: name.clone(),
                    expected,
                });
            }
        }
        let s = raw.saturation;
        within("saturation.queue_depth", 1..=1_000_000, s.queue_depth)?;
        if !(s.kv_cache_usage > 0.0 && s.kv_cache_usage <= 1.0) {
            return Err(out_of_range(
                "saturation.kv_cache_usage",
                "a number in (0, 1]",
                s.kv_cache_usage,
            ));
        }
        if !(s.sheddable_level > 0.0 && s.sheddable_level <= 1.0) {
            return Err(out_of_range(
                "saturation.sheddable_level",
                "a number in (0, 1]",
                s.sheddable_level,
            ));
        }
        if s.max_inflight_per_endpoint == Some(0) {
            return Err(out_of_range(
                "saturation.max_inflight_per_endpoint",
                "at least 1 (or absent)",
                0,
            ));
        }
        if s.max_inflight_tokens_per_endpoint == Some(0) {
            return Err(out_of_range(
                "saturation.max_inflight_tokens_per_endpoint",
                "at least 1 (or absent)",
                0,
            ));
        }
        within("queue_ttl_ms", 1..=86_400_000, raw.queue_ttl_ms)?;
        for (field, value) in [
            ("band_max_requests", raw.band_max_requests),
            ("max_requests", raw.max_requests),
        ] {
            within(field, 1..=MAX_QUEUED, value)?;
        }
        if raw.band_max_bytes == 0 {
            return Err(out_of_range("band_max_bytes", "at least 1", 0));
        }
        Ok(AdmissionConfig {
            objectives: raw.objectives,
            default_priority: raw.default_priority,
            saturation: s,
            fairness: raw.fairness,
            ordering: raw.ordering,
            queue_ttl_ms: raw.queue_ttl_ms,
            band_max_requests: raw.band_max_requests,
            band_max_bytes: raw.band_max_bytes,
            max_requests: raw.max_requests,
            queue_sheddable: raw.queue_sheddable,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        match AdmissionConfig::from_json(json.as_bytes()) {
            Ok(_) => panic!("accepted {json}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_apply() {
        let cfg = AdmissionConfig::from_json(b"{}").unwrap();
        assert_eq!(cfg, AdmissionConfig::default());
        assert!(cfg.objectives.is_empty());
        assert_eq!(cfg.default_priority, 0);
        assert_eq!(cfg.saturation.queue_depth, 5);
        assert_eq!(cfg.saturation.kv_cache_usage, 0.8);
        assert_eq!(cfg.saturation.max_inflight_per_endpoint, None);
        assert_eq!(cfg.saturation.max_inflight_tokens_per_endpoint, None);
        assert_eq!(cfg.saturation.sheddable_level, 0.5);
        assert!(!cfg.saturation.limits_inflight());
        assert_eq!(cfg.fairness, Fairness::RoundRobin);
        assert_eq!(cfg.ordering, FlowOrdering::Fcfs);
        assert_eq!(cfg.queue_ttl_ms, 60_000);
        assert_eq!(cfg.band_max_requests, 5_000);
        assert_eq!(cfg.band_max_bytes, 1 << 30);
        assert_eq!(cfg.max_requests, 10_000);
        assert!(!cfg.queue_sheddable);
    }

    #[test]
    fn every_field_parses() {
        let cfg = AdmissionConfig::from_json(
            br#"{"objectives":{"chat":7,"batch":-2},"default_priority":1,
                "saturation":{"queue_depth":9,"kv_cache_usage":0.9,
                    "max_inflight_per_endpoint":16,"max_inflight_tokens_per_endpoint":100000,
                    "sheddable_level":0.7},
                "fairness":"fcfs","ordering":"edf","queue_ttl_ms":1500,
                "band_max_requests":10,"band_max_bytes":4096,"max_requests":20,
                "queue_sheddable":true}"#,
        )
        .unwrap();
        assert_eq!(cfg.priority(Some("chat")), 7);
        assert_eq!(cfg.priority(Some("batch")), -2);
        assert_eq!(cfg.priority(Some("other")), 1);
        assert_eq!(cfg.priority(None), 1);
        assert_eq!(
            cfg.saturation,
            SaturationThresholds {
                queue_depth: 9,
                kv_cache_usage: 0.9,
                max_inflight_per_endpoint: Some(16),
                max_inflight_tokens_per_endpoint: Some(100_000),
                sheddable_level: 0.7,
            }
        );
        assert_eq!(
            (cfg.fairness, cfg.ordering, cfg.queue_ttl_ms),
            (Fairness::Fcfs, FlowOrdering::Edf, 1500)
        );
        assert_eq!(
            (cfg.band_max_requests, cfg.band_max_bytes, cfg.max_requests),
            (10, 4096, 20)
        );
        assert!(cfg.queue_sheddable);
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = err(r#"{"queue_ttl":5}"#);
        assert!(e.contains("unknown field `queue_ttl`"), "{e}");
        let e = err(r#"{"saturation":{"queue":5}}"#);
        assert!(
            e.contains("`saturation.queue`: unknown field `queue`"),
            "{e}"
        );
        let e = err(r#"{"objectives":{"a":1},"band_max_bytes":-1}"#);
        assert!(e.contains("`band_max_bytes`: invalid value"), "{e}");
        let e = err("[1]");
        assert!(e.contains("invalid admission configuration JSON"), "{e}");
        let e = err("{");
        assert!(e.contains("EOF"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        for (json, field) in [
            (r#"{"objectives":{"":1}}"#, "objectives"),
            (r#"{"objectives":{" chat":1}}"#, "objectives"),
            (r#"{"objectives":{"chat":1.5}}"#, "objectives"),
            (r#"{"objectives":[]}"#, "objectives"),
            (r#"{"default_priority":"high"}"#, "default_priority"),
            (
                r#"{"saturation":{"queue_depth":0}}"#,
                "saturation.queue_depth",
            ),
            (
                r#"{"saturation":{"kv_cache_usage":0}}"#,
                "saturation.kv_cache_usage",
            ),
            (
                r#"{"saturation":{"kv_cache_usage":1.5}}"#,
                "saturation.kv_cache_usage",
            ),
            (
                r#"{"saturation":{"sheddable_level":0}}"#,
                "saturation.sheddable_level",
            ),
            (
                r#"{"saturation":{"sheddable_level":1.01}}"#,
                "saturation.sheddable_level",
            ),
            (
                r#"{"saturation":{"max_inflight_per_endpoint":0}}"#,
                "saturation.max_inflight_per_endpoint",
            ),
            (
                r#"{"saturation":{"max_inflight_tokens_per_endpoint":0}}"#,
                "saturation.max_inflight_tokens_per_endpoint",
            ),
            (r#"{"queue_ttl_ms":0}"#, "queue_ttl_ms"),
            (r#"{"band_max_requests":0}"#, "band_max_requests"),
            (r#"{"band_max_requests":2000000}"#, "band_max_requests"),
            (r#"{"band_max_bytes":0}"#, "band_max_bytes"),
            (r#"{"max_requests":0}"#, "max_requests"),
            (r#"{"queue_sheddable":"yes"}"#, "queue_sheddable"),
        ] {
            let e = err(json);
            assert!(e.contains(field), "{json}: {e}");
        }
        let e = err(r#"{"fairness":"wfq"}"#);
        assert!(e.contains("round_robin") && e.contains("fcfs"), "{e}");
        let e = err(r#"{"ordering":"lifo"}"#);
        assert!(e.contains("fcfs") && e.contains("edf"), "{e}");
        let long = "o".repeat(MAX_OBJECTIVE_NAME_BYTES + 1);
        let e = err(&format!(r#"{{"objectives":{{"{long}":1}}}}"#));
        assert!(e.contains("objectives") && e.contains("253"), "{e}");
    }
}
