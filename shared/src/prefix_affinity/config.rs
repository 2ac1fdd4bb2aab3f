//! Plugin configuration: a raw serde shape (unknown fields rejected) checked into [`PluginConfig`].
//!
//! ```
//! let cfg = kvoy_shared::prefix_affinity::PluginConfig::from_json(br#"{
//!     "endpoints": [{"address": "10.0.0.1:8000", "models": ["llama"]}]
//! }"#).unwrap();
//! assert_eq!(cfg.block_size, 64);
//! ```

use std::net::SocketAddr;

use serde::Deserialize;
use thiserror::Error;

use crate::config::{out_of_range, within, EndpointAddresses, EndpointListError, OutOfRange};

use crate::allow::{Allowlist, AllowlistError, RawAllowlist, Refusal};
use crate::endpoint::{Endpoint, EndpointLoad, Pool, Role};
use crate::index::PrefixIndex;
use crate::prefix_affinity::cost::{CostParams, ModelCost};

/// What to do with a body that is not a valid OpenAI request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvalidBodyPolicy {
    /// Answer 400 with an OpenAI-style error.
    Reject,
    /// Route to the least-loaded endpoint and let the server answer.
    Fallback,
}

/// How candidates are compared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scorer {
    /// The token cost model ([`crate::prefix_affinity::cost`]): predicted time to first token, lowest wins.
    #[default]
    Cost,
    /// The weighted sum of normalised scores (prefix, in-flight, queue, KV) with the hot-spot
    /// guard: kvoy's first scorer, kept for comparison.
    Weighted,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModelCost {
    #[serde(default)]
    prefill_tokens_per_s: Option<f64>,
    #[serde(default)]
    bytes_per_token: Option<f64>,
    #[serde(default)]
    kv_capacity_tokens: Option<u32>,
    #[serde(default)]
    output_tokens: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawCost {
    prefill_tokens_per_s: f64,
    models: std::collections::BTreeMap<String, RawModelCost>,
    decode_s_per_sequence: f64,
    step_tokens: u32,
    bytes_per_token: f64,
    learn_bytes_per_token: bool,
    learn_output_tokens: bool,
    uncached_weight: f64,
    pressure_time_constant_s: f64,
    kv_high: f64,
    kv_full_s: f64,
    kv_capacity_tokens: Option<u32>,
    footprint_high: f64,
    tier_credit: RawTierCredit,
    output_tokens: f64,
    claim_weight: f64,
    max_num_seqs: u32,
}

/// `cost.tier_credit`: what a matched block offloaded from the GPU counts for (GPU: 1).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawTierCredit {
    cpu: f64,
    storage: f64,
}

impl Default for RawTierCredit {
    fn default() -> Self {
        let [cpu, storage] = CostParams::default().tier_credit;
        RawTierCredit { cpu, storage }
    }
}

impl Default for RawCost {
    fn default() -> Self {
        let d = CostParams::default();
        RawCost {
            prefill_tokens_per_s: d.prefill_tokens_per_s,
            models: Default::default(),
            decode_s_per_sequence: d.decode_s_per_sequence,
            step_tokens: d.step_tokens,
            bytes_per_token: d.bytes_per_token,
            learn_bytes_per_token: d.learn_bytes_per_token,
            learn_output_tokens: d.learn_output_tokens,
            uncached_weight: d.uncached_weight,
            pressure_time_constant_s: d.pressure_time_constant_s,
            kv_high: d.kv_high,
            kv_full_s: d.kv_full_s,
            kv_capacity_tokens: d.kv_capacity_tokens,
            footprint_high: d.footprint_high,
            tier_credit: RawTierCredit::default(),
            output_tokens: d.output_tokens,
            claim_weight: d.claim_weight,
            max_num_seqs: d.max_num_seqs,
        }
    }
}

/// A rate or ratio that must be a finite number above 0.
fn positive(field: &str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(ConfigError::NotPositive {
            field: field.to_owned(),
            value,
        })
    }
}

impl TryFrom<RawCost> for CostParams {
    type Error = ConfigError;

    fn try_from(raw: RawCost) -> Result<Self, ConfigError> {
        let mut models = Vec::with_capacity(raw.models.len());
        for (model, m) in raw.models {
            let rate = m
                .prefill_tokens_per_s
                .map(|v| positive(&format!("cost.models.{model}.prefill_tokens_per_s"), v))
                .transpose()?;
            let bpt = m
                .bytes_per_token
                .map(|v| positive(&format!("cost.models.{model}.bytes_per_token"), v))
                .transpose()?;
            if let Some(v) = m.kv_capacity_tokens {
                positive(
                    &format!("cost.models.{model}.kv_capacity_tokens"),
                    f64::from(v),
                )?;
            }
            let output = m
                .output_tokens
                .map(|v| positive(&format!("cost.models.{model}.output_tokens"), v))
                .transpose()?;
            models.push(ModelCost {
                model,
                prefill_tokens_per_s: rate,
                bytes_per_token: bpt,
                kv_capacity_tokens: m.kv_capacity_tokens,
                output_tokens: output,
            });
        }
        if !(raw.decode_s_per_sequence.is_finite() && raw.decode_s_per_sequence >= 0.0) {
            return Err(out_of_range(
                "cost.decode_s_per_sequence",
                "a finite number of seconds >= 0",
                raw.decode_s_per_sequence,
            ));
        }
        if !(raw.pressure_time_constant_s.is_finite() && raw.pressure_time_constant_s >= 0.0) {
            return Err(out_of_range(
                "cost.pressure_time_constant_s",
                "a finite number of seconds >= 0",
                raw.pressure_time_constant_s,
            ));
        }
        within("cost.kv_high", 0.0..=1.0, raw.kv_high)?;
        if !(raw.kv_full_s.is_finite() && raw.kv_full_s >= 0.0) {
            return Err(out_of_range(
                "cost.kv_full_s",
                "a finite number of seconds >= 0",
                raw.kv_full_s,
            ));
        }
        if raw.step_tokens == 0 {
            return Err(out_of_range("cost.step_tokens", "at least 1", 0));
        }
        if raw.kv_capacity_tokens == Some(0) {
            return Err(out_of_range("cost.kv_capacity_tokens", "at least 1", 0));
        }
        if !(0.0..1.0).contains(&raw.footprint_high) {
            return Err(out_of_range(
                "cost.footprint_high",
                "within 0..1",
                raw.footprint_high,
            ));
        }
        within("cost.output_tokens", 0.0..=1e7, raw.output_tokens)?;
        within("cost.claim_weight", 0.0..=100.0, raw.claim_weight)?;
        let RawTierCredit { cpu, storage } = raw.tier_credit;
        within("cost.tier_credit.cpu", 0.0..=1.0, cpu)?;
        if !(0.0..=cpu).contains(&storage) {
            return Err(out_of_range(
                "cost.tier_credit.storage",
                "within 0..=cost.tier_credit.cpu",
                storage,
            ));
        }
        Ok(CostParams {
            prefill_tokens_per_s: positive("cost.prefill_tokens_per_s", raw.prefill_tokens_per_s)?,
            models,
            decode_s_per_sequence: raw.decode_s_per_sequence,
            step_tokens: raw.step_tokens,
            bytes_per_token: positive("cost.bytes_per_token", raw.bytes_per_token)?,
            learn_bytes_per_token: raw.learn_bytes_per_token,
            learn_output_tokens: raw.learn_output_tokens,
            uncached_weight: positive("cost.uncached_weight", raw.uncached_weight)?,
            pressure_time_constant_s: raw.pressure_time_constant_s,
            kv_high: raw.kv_high,
            kv_full_s: raw.kv_full_s,
            kv_capacity_tokens: raw.kv_capacity_tokens,
            footprint_high: raw.footprint_high,
            tier_credit: [cpu, storage],
            output_tokens: raw.output_tokens,
            claim_weight: raw.claim_weight,
            max_num_seqs: raw.max_num_seqs,
        })
    }
}

/// Scorer weights; a weight of 0 turns a scorer off.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    pub prefix: f64,
    pub inflight: f64,
    pub queue: f64,
    pub kv_cache: f64,
    /// Added to the endpoint a request's session is pinned to (from `kvoy_session`).
    pub session: f64,
}

impl Default for Weights {
    /// llm-d's defaults (queue 2, KV 2, prefix 3) plus this proxy's own in-flight count at 2.
    fn default() -> Self {
        Weights {
            prefix: 3.0,
            inflight: 2.0,
            queue: 2.0,
            kv_cache: 2.0,
            // More than all the others together: a session stays put unless its pin breaks.
            session: 10.0,
        }
    }
}

/// How a session pin (from `kvoy_session`) is treated.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionPin {
    /// Always route to the pinned endpoint while it is a healthy candidate, however loaded.
    pub hard: bool,
    /// A soft pin breaks when the endpoint's load (in-flight + queue) is at least `break_abs`
    /// above the least-loaded candidate's *and* more than `break_rel` times it.
    pub break_abs: u32,
    pub break_rel: f64,
}

impl Default for SessionPin {
    fn default() -> Self {
        SessionPin {
            hard: false,
            break_abs: 16,
            break_rel: 2.0,
        }
    }
}

/// The hot-spot guard: an endpoint whose load exceeds the least-loaded candidate's by more than
/// `abs` requests *and* by more than a factor `rel` loses its prefix score for this decision.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HotspotGuard {
    pub abs: u32,
    pub rel: f64,
}

impl Default for HotspotGuard {
    fn default() -> Self {
        HotspotGuard { abs: 8, rel: 1.5 }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEndpoint {
    address: String,
    models: Vec<String>,
    #[serde(default)]
    waiting: Option<u32>,
    #[serde(default)]
    kv_cache_usage: Option<f64>,
    /// This endpoint's prefill rate (tokens/s), overriding the model's.
    #[serde(default)]
    prefill_tokens_per_s: Option<f64>,
    /// This endpoint's KV cache in tokens, overriding the model's.
    #[serde(default)]
    kv_capacity_tokens: Option<u32>,
    /// `decode` (the default), `prefill` or `both`.
    #[serde(default)]
    role: Option<String>,
}

/// Where the filter gets the live pool: `kvoy-aggregator`'s snapshot API, reached through an
/// Envoy cluster. One VM per proxy polls it (a shared-data lease) and shares the result.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AggregatorSettings {
    /// The Envoy cluster of the aggregator (`dispatch_http_call` needs one in the bootstrap).
    pub cluster: String,
    /// The clusters of the aggregator's other replicas (active-active: each follows the servers
    /// itself). The proxy polls one replica at a time, the next one when it fails or answers
    /// something unusable, and sends its routing decisions to all of them.
    #[serde(default)]
    pub failover_clusters: Vec<String>,
    /// `:authority` of the poll (default: the cluster name).
    #[serde(default)]
    pub authority: Option<String>,
    #[serde(default = "defaults::snapshot_path")]
    pub path: String,
    #[serde(default = "defaults::poll_interval_ms")]
    pub poll_interval_ms: u64,
    /// Timeout of one poll; a slow aggregator never holds requests up.
    #[serde(default = "defaults::poll_timeout_ms")]
    pub timeout_ms: u64,
    /// Load figures (queue, KV use) from a snapshot older than this are ignored: the filter
    /// routes on prefix and its own in-flight counts.
    #[serde(default = "defaults::load_max_age_ms")]
    pub load_max_age_ms: u64,
    /// A snapshot older than this is dropped for the static `endpoints` (when there are any).
    #[serde(default = "defaults::snapshot_max_age_ms")]
    pub snapshot_max_age_ms: u64,
    /// A snapshot answer larger than this is not copied into the VM (counted, logged once).
    #[serde(default = "defaults::max_snapshot_bytes")]
    pub max_snapshot_bytes: usize,
    /// Sent as `Authorization: Bearer <token>` on every poll, for an aggregator that requires
    /// it (its `--token-file`); 16 to 4096 visible ASCII characters.
    #[serde(default)]
    pub token: Option<BearerToken>,
    /// Exchange routing decisions with the other proxies through the aggregator
    /// (`POST /v1/decisions`), so that every proxy's index learns where the others sent each
    /// prefix. Off: each proxy knows only its own decisions.
    #[serde(default = "defaults::relay_decisions")]
    pub relay_decisions: bool,
    /// How often the relaying VM sends its proxy's new decisions (1 to 1,000 ms): a decision
    /// reaches the aggregator within this of being made.
    #[serde(default = "defaults::relay_flush_ms")]
    pub relay_flush_ms: u64,
    /// How long the aggregator may hold the relay's long poll for the other proxies' decisions
    /// (0 to 30,000 ms; 0: ask on every flush instead).
    #[serde(default = "defaults::relay_wait_ms")]
    pub relay_wait_ms: u64,
}

/// Aggregator replicas a proxy follows at most (`cluster` and `failover_clusters`).
pub const MAX_AGGREGATOR_REPLICAS: usize = 8;

impl AggregatorSettings {
    /// The aggregator replicas' clusters: `cluster` first, then `failover_clusters`.
    pub fn clusters(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.cluster.as_str())
            .chain(self.failover_clusters.iter().map(|c| c.as_str()))
    }

    /// How many replicas: 1 + `failover_clusters`.
    pub fn replicas(&self) -> usize {
        1 + self.failover_clusters.len()
    }

    /// The cluster of replica `i` (`cluster` for 0 and for one out of range).
    pub fn cluster_of(&self, i: usize) -> &str {
        i.checked_sub(1)
            .and_then(|j| self.failover_clusters.get(j))
            .map_or(self.cluster.as_str(), |c| c.as_str())
    }
}

/// A bearer token from the configuration; `Debug` does not show it.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct BearerToken(String);

impl BearerToken {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    endpoints: Vec<RawEndpoint>,
    #[serde(default)]
    aggregator: Option<AggregatorSettings>,
    #[serde(default)]
    scorer: Scorer,
    #[serde(default)]
    cost: RawCost,
    #[serde(default)]
    weights: Weights,
    #[serde(default)]
    hotspot: HotspotGuard,
    #[serde(default)]
    session: SessionPin,
    #[serde(default)]
    disaggregation: crate::disagg::RawDisagg,
    #[serde(default = "defaults::block_size")]
    block_size: usize,
    #[serde(default = "defaults::max_blocks")]
    max_blocks: usize,
    #[serde(default = "defaults::dense_blocks")]
    dense_blocks: usize,
    #[serde(default = "defaults::blocks_per_doubling")]
    blocks_per_doubling: usize,
    #[serde(default = "defaults::lru_blocks_per_endpoint")]
    lru_blocks_per_endpoint: usize,
    #[serde(default = "defaults::max_body_bytes")]
    max_body_bytes: usize,
    #[serde(default = "defaults::on_invalid_body")]
    on_invalid_body: InvalidBodyPolicy,
    #[serde(default = "defaults::decision_log_slots")]
    decision_log_slots: u32,
    #[serde(default)]
    allowed_destinations: Option<RawAllowlist>,
    #[serde(default = "defaults::max_endpoints")]
    max_endpoints: usize,
    #[serde(default = "defaults::max_prompt_segments")]
    max_prompt_segments: usize,
}

mod defaults {
    use super::InvalidBodyPolicy;
    pub fn block_size() -> usize {
        64
    }
    pub fn max_blocks() -> usize {
        512
    }
    pub fn dense_blocks() -> usize {
        128
    }
    pub fn blocks_per_doubling() -> usize {
        64
    }
    pub fn lru_blocks_per_endpoint() -> usize {
        31_250
    }
    pub fn max_body_bytes() -> usize {
        8 << 20
    }
    pub fn on_invalid_body() -> InvalidBodyPolicy {
        InvalidBodyPolicy::Reject
    }
    pub fn decision_log_slots() -> u32 {
        1024
    }
    pub fn snapshot_path() -> String {
        crate::protocol::SNAPSHOT_PATH.to_owned()
    }
    pub fn poll_interval_ms() -> u64 {
        100
    }
    pub fn relay_decisions() -> bool {
        true
    }
    pub fn relay_flush_ms() -> u64 {
        10
    }
    pub fn relay_wait_ms() -> u64 {
        1_000
    }
    pub fn poll_timeout_ms() -> u64 {
        250
    }
    pub fn load_max_age_ms() -> u64 {
        2_000
    }
    pub fn snapshot_max_age_ms() -> u64 {
        30_000
    }
    pub fn max_snapshot_bytes() -> usize {
        4 << 20
    }
    pub fn max_endpoints() -> usize {
        256
    }
    pub fn max_prompt_segments() -> usize {
        crate::request::DEFAULT_MAX_SEGMENTS
    }
}

/// Largest pool one filter instance accepts; endpoint ids are `u16` and the in-flight table is
/// one shared-data value, so keep it small enough to copy on every request.
pub const MAX_ENDPOINTS: usize = 4096;

/// Most memory one VM's prefix index may take at its configured size
/// (`lru_blocks_per_endpoint` x endpoints, in the worst case: see
/// [`PrefixIndex::max_bytes`]): a wasm32 VM addresses 4 GiB at most, and the request bodies,
/// the snapshot and the allocator need the rest.
pub const INDEX_MEMORY_LIMIT: u64 = 2 << 30;

/// A static endpoint left out of the pool by `allowed_destinations`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedEndpoint {
    pub address: SocketAddr,
    pub reason: Refusal,
}

/// A checked plugin configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginConfig {
    pub pool: Pool,
    pub scorer: Scorer,
    pub cost: CostParams,
    /// The weighted scorer's weights (`weights.session` also applies to the cost scorer's
    /// explanations only; a soft pin is followed unless it breaks).
    pub weights: Weights,
    pub hotspot: HotspotGuard,
    pub session: SessionPin,
    /// When a request is split between a prefill and a decode endpoint (pools with prefill
    /// endpoints only).
    pub disagg: crate::disagg::DisaggParams,
    /// Bytes of prompt text per prefix block.
    pub block_size: usize,
    /// Prefix keys per request at most.
    pub max_blocks: usize,
    /// Leading keys of one block each; after them a key's span doubles every
    /// `blocks_per_doubling` keys (see [`crate::prefix::KeySchedule`]).
    pub dense_blocks: usize,
    pub blocks_per_doubling: usize,
    /// Blocks remembered per endpoint (LRU).
    pub lru_blocks_per_endpoint: usize,
    pub max_body_bytes: usize,
    pub on_invalid_body: InvalidBodyPolicy,
    /// Slots of the cross-worker decision log.
    pub decision_log_slots: u32,
    /// The aggregator, when the live pool comes from one.
    pub aggregator: Option<AggregatorSettings>,
    /// Where the filter may route: every pool (static or live) is filtered through it.
    pub allowed_destinations: Allowlist,
    /// Static endpoints `allowed_destinations` left out (to count and log at start).
    pub refused_endpoints: Vec<RefusedEndpoint>,
    /// Largest pool routed over; a live pool's extra endpoints are refused.
    pub max_endpoints: usize,
    /// Prompt runs a request body may have (see [`crate::request::parse_with`]).
    pub max_prompt_segments: usize,
}

#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("invalid configuration JSON: {0}")]
    Json(String),
    #[error("`endpoints` must list at least one endpoint (or set `aggregator`)")]
    NoEndpoints,
    #[error(transparent)]
    Endpoints(#[from] EndpointListError),
    #[error("`endpoints[{index}].models` must name at least one model")]
    NoModels { index: usize },
    #[error("`endpoints[{index}].kv_cache_usage` must be within 0..=1, got {value}")]
    BadKvUsage { index: usize, value: f64 },
    #[error("`endpoints[{index}].role` {value:?} must be `decode`, `prefill` or `both`")]
    BadRole { index: usize, value: String },
    #[error("`endpoints[{index}].prefill_tokens_per_s` must be a number above 0, got {value}")]
    BadPrefillRate { index: usize, value: f64 },
    #[error("`{field}` must be a number above 0, got {value}")]
    NotPositive { field: String, value: f64 },
    #[error(transparent)]
    Allowlist(#[from] AllowlistError),
    #[error(
        "`allowed_destinations` is required with `aggregator`: list the CIDR blocks (and ports) \
         of the model servers, so that no snapshot can route outside them"
    )]
    AllowlistRequired,
    #[error("every endpoint of `endpoints` is outside `allowed_destinations` (first: {0})")]
    AllEndpointsRefused(String),
    #[error(
        "the prefix index needs up to {need} bytes per VM (`lru_blocks_per_endpoint` {blocks} x \
         {endpoints} endpoints, `max_endpoints` with an aggregator), over the {limit} a wasm32 VM \
         can give it: lower `lru_blocks_per_endpoint` or `max_endpoints`"
    )]
    IndexTooLarge {
        need: u64,
        blocks: usize,
        endpoints: usize,
        limit: u64,
    },
    #[error("`endpoints` lists {count} endpoints, more than `max_endpoints` ({max})")]
    OverMaxEndpoints { count: usize, max: usize },
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
}

impl PluginConfig {
    /// Parses and checks a JSON configuration. An empty configuration is an error: a pool is
    /// required.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        let raw: RawConfig =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        Self::try_from(raw)
    }
}

impl TryFrom<RawConfig> for PluginConfig {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        if raw.endpoints.is_empty() && raw.aggregator.is_none() {
            return Err(ConfigError::NoEndpoints);
        }
        if let Some(a) = &raw.aggregator {
            check_aggregator(a)?;
        }
        let mut addresses = EndpointAddresses::for_list(raw.endpoints.len())?;
        let allowed = match raw.allowed_destinations {
            Some(list) => Allowlist::try_from(list)?,
            None if raw.aggregator.is_some() => return Err(ConfigError::AllowlistRequired),
            None => Allowlist::any(),
        };
        within("max_endpoints", 1..=MAX_ENDPOINTS, raw.max_endpoints)?;
        if raw.endpoints.len() > raw.max_endpoints {
            return Err(ConfigError::OverMaxEndpoints {
                count: raw.endpoints.len(),
                max: raw.max_endpoints,
            });
        }
        within(
            "max_prompt_segments",
            16..=1_048_576,
            raw.max_prompt_segments,
        )?;
        let configured = raw.endpoints.len();
        let mut refused_endpoints = Vec::new();
        let mut endpoints = Vec::with_capacity(raw.endpoints.len());
        for (index, e) in raw.endpoints.into_iter().enumerate() {
            let address = addresses.read(index, &e.address)?;
            if e.models.is_empty() || e.models.iter().any(|m| m.is_empty()) {
                return Err(ConfigError::NoModels { index });
            }
            if let Some(value) = e.kv_cache_usage {
                if !(0.0..=1.0).contains(&value) {
                    return Err(ConfigError::BadKvUsage { index, value });
                }
            }
            if let Some(value) = e.prefill_tokens_per_s {
                if !(value.is_finite() && value > 0.0) {
                    return Err(ConfigError::BadPrefillRate { index, value });
                }
            }
            if let Some(v) = e.kv_capacity_tokens {
                positive(
                    &format!("endpoints[{index}].kv_capacity_tokens"),
                    f64::from(v),
                )?;
            }
            let role = match e.role {
                None => Role::Decode,
                Some(value) => {
                    Role::from_name(&value).ok_or(ConfigError::BadRole { index, value })?
                }
            };
            if let Err(reason) = allowed.check(address) {
                refused_endpoints.push(RefusedEndpoint { address, reason });
                continue;
            }
            endpoints.push(Endpoint {
                load: EndpointLoad {
                    waiting: e.waiting,
                    running: None,
                    kv_cache_usage: e.kv_cache_usage,
                    prefill_tokens_per_s: e.prefill_tokens_per_s,
                    kv_capacity_tokens: e.kv_capacity_tokens,
                },
                role,
                ..Endpoint::new(address, e.models)
            });
        }
        let w = raw.weights;
        for (field, value) in [
            ("weights.prefix", w.prefix),
            ("weights.inflight", w.inflight),
            ("weights.queue", w.queue),
            ("weights.kv_cache", w.kv_cache),
            ("weights.session", w.session),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(out_of_range(field, "a finite number >= 0", value));
            }
        }
        if !(raw.session.break_rel.is_finite() && raw.session.break_rel >= 1.0) {
            return Err(out_of_range(
                "session.break_rel",
                "a number >= 1",
                raw.session.break_rel,
            ));
        }
        if !(raw.hotspot.rel.is_finite() && raw.hotspot.rel >= 1.0) {
            return Err(out_of_range(
                "hotspot.rel",
                "a number >= 1",
                raw.hotspot.rel,
            ));
        }
        within("block_size", 1..=65_536, raw.block_size)?;
        within("max_blocks", 1..=65_536, raw.max_blocks)?;
        if raw.blocks_per_doubling == 0 {
            return Err(out_of_range("blocks_per_doubling", "at least 1", 0));
        }
        within(
            "lru_blocks_per_endpoint",
            1..=16_000_000,
            raw.lru_blocks_per_endpoint,
        )?;
        if raw.max_body_bytes == 0 {
            return Err(out_of_range("max_body_bytes", "> 0", raw.max_body_bytes));
        }
        within("decision_log_slots", 1..=1_000_000, raw.decision_log_slots)?;
        if configured > 0 && endpoints.is_empty() && raw.aggregator.is_none() {
            let first = refused_endpoints
                .first()
                .map(|r| format!("{} ({})", r.address, r.reason))
                .unwrap_or_default();
            return Err(ConfigError::AllEndpointsRefused(first));
        }
        let index_endpoints = if raw.aggregator.is_some() {
            raw.max_endpoints
        } else {
            endpoints.len()
        };
        let need = PrefixIndex::max_bytes(index_endpoints, raw.lru_blocks_per_endpoint);
        if need > INDEX_MEMORY_LIMIT {
            return Err(ConfigError::IndexTooLarge {
                need,
                blocks: raw.lru_blocks_per_endpoint,
                endpoints: index_endpoints,
                limit: INDEX_MEMORY_LIMIT,
            });
        }
        Ok(PluginConfig {
            pool: Pool::new(endpoints),
            scorer: raw.scorer,
            cost: CostParams::try_from(raw.cost)?,
            weights: w,
            hotspot: raw.hotspot,
            session: raw.session,
            disagg: crate::disagg::DisaggParams::try_from(raw.disaggregation)?,
            block_size: raw.block_size,
            max_blocks: raw.max_blocks,
            dense_blocks: raw.dense_blocks,
            blocks_per_doubling: raw.blocks_per_doubling,
            lru_blocks_per_endpoint: raw.lru_blocks_per_endpoint,
            max_body_bytes: raw.max_body_bytes,
            on_invalid_body: raw.on_invalid_body,
            decision_log_slots: raw.decision_log_slots,
            aggregator: raw.aggregator,
            allowed_destinations: allowed,
            refused_endpoints,
            max_endpoints: raw.max_endpoints,
            max_prompt_segments: raw.max_prompt_segments,
        })
    }
}

pub(crate) fn check_aggregator(a: &AggregatorSettings) -> Result<(), ConfigError> {
    if a.cluster.trim().is_empty() {
        return Err(out_of_range("aggregator.cluster", "a cluster name", "\"\""));
    }
    if a.failover_clusters.len() > MAX_AGGREGATOR_REPLICAS - 1 {
        return Err(out_of_range(
            "aggregator.failover_clusters",
            "at most 7 clusters (8 replicas with aggregator.cluster)",
            a.failover_clusters.len(),
        ));
    }
    for (i, c) in a.failover_clusters.iter().enumerate() {
        let repeated = *c == a.cluster || a.failover_clusters[..i].contains(c);
        if c.trim().is_empty() || repeated {
            return Err(out_of_range(
                "aggregator.failover_clusters",
                "cluster names, each once and other than aggregator.cluster",
                format!("{c:?}"),
            ));
        }
    }
    if !a.path.starts_with('/') {
        return Err(out_of_range(
            "aggregator.path",
            "a path starting with /",
            &a.path,
        ));
    }
    within(
        "aggregator.max_snapshot_bytes",
        1024..=(64 << 20),
        a.max_snapshot_bytes,
    )?;
    if let Some(t) = &a.token {
        let t = t.as_str();
        if !(16..=4096).contains(&t.len()) || !t.bytes().all(|b| b.is_ascii_graphic()) {
            // The value itself is a secret: only its length is told.
            return Err(out_of_range(
                "aggregator.token",
                "16 to 4096 visible ASCII characters",
                format!("a token of {} bytes", t.len()),
            ));
        }
    }
    for (field, value, range) in [
        (
            "aggregator.poll_interval_ms",
            a.poll_interval_ms,
            10..=60_000,
        ),
        ("aggregator.timeout_ms", a.timeout_ms, 10..=60_000),
        ("aggregator.relay_flush_ms", a.relay_flush_ms, 1..=1_000),
        ("aggregator.relay_wait_ms", a.relay_wait_ms, 0..=30_000),
        (
            "aggregator.load_max_age_ms",
            a.load_max_age_ms,
            10..=3_600_000,
        ),
        (
            "aggregator.snapshot_max_age_ms",
            a.snapshot_max_age_ms,
            10..=86_400_000,
        ),
    ] {
        within(field, range, value)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        match PluginConfig::from_json(json.as_bytes()) {
            Ok(_) => panic!("accepted {json}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_apply() {
        let cfg =
            PluginConfig::from_json(br#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}]}"#)
                .unwrap();
        assert_eq!(cfg.block_size, 64);
        assert_eq!(cfg.max_blocks, 512);
        assert_eq!((cfg.dense_blocks, cfg.blocks_per_doubling), (128, 64));
        assert_eq!(cfg.lru_blocks_per_endpoint, 31_250);
        assert_eq!(cfg.on_invalid_body, InvalidBodyPolicy::Reject);
        assert_eq!(cfg.weights, Weights::default());
        assert_eq!(cfg.pool.len(), 1);
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = err(r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}],"blocksize":3}"#);
        assert!(e.contains("unknown field `blocksize`"), "{e}");
        let e = err(r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"],"modle":1}]}"#);
        assert!(e.contains("unknown field `modle`"), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}],"weights":{"prefx":1}}"#,
        );
        assert!(e.contains("unknown field `prefx`"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        let e = err(r#"{"endpoints":[{"address":"localhost","models":["m"]}]}"#);
        assert!(e.contains("endpoints[0].address"), "{e}");
        let e = err(r#"{"endpoints":[]}"#);
        assert!(e.contains("endpoints"), "{e}");
        let e = err(r#"{"endpoints":[{"address":"127.0.0.1:1","models":[]}]}"#);
        assert!(e.contains("endpoints[0].models"), "{e}");
        let e = err(r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"],"role":"prefil"}]}"#);
        assert!(e.contains("`endpoints[0].role` \"prefil\""), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}],"disaggregation":{"non_cached_tokens":-16}}"#,
        );
        assert!(e.contains("`disaggregation.non_cached_tokens`"), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]},{"address":"127.0.0.1:1","models":["m"]}]}"#,
        );
        assert!(e.contains("endpoints[1].address"), "{e}");
        let e = err(r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}],"block_size":0}"#);
        assert!(e.contains("block_size"), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}],"on_invalid_body":"drop"}"#,
        );
        assert!(e.contains("reject") && e.contains("fallback"), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"]}],"weights":{"prefix":-1}}"#,
        );
        assert!(e.contains("weights.prefix"), "{e}");
    }

    #[test]
    fn cost_section() {
        let ep =
            r#""endpoints":[{"address":"127.0.0.1:1","models":["m"],"prefill_tokens_per_s":9000}]"#;
        let cfg = PluginConfig::from_json(format!("{{{ep}}}").as_bytes()).unwrap();
        assert_eq!(cfg.scorer, Scorer::Cost);
        assert_eq!(cfg.cost, CostParams::default());
        let e = cfg.pool.get(crate::EndpointId(0)).unwrap();
        assert_eq!(e.load.prefill_tokens_per_s, Some(9000.0));
        let cfg = PluginConfig::from_json(
            format!(
                r#"{{{ep},"scorer":"weighted","cost":{{"prefill_tokens_per_s":15928,
                "models":{{"m":{{"prefill_tokens_per_s":25000,"bytes_per_token":3.5}}}}}}}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(cfg.scorer, Scorer::Weighted);
        assert_eq!(cfg.cost.model_rate("m"), 25000.0);
        assert_eq!(cfg.cost.model_rate("other"), 15928.0);
        assert_eq!(cfg.cost.model("m").unwrap().bytes_per_token, Some(3.5));
        let e = err(&format!(r#"{{{ep},"scorer":"fastest"}}"#));
        assert!(e.contains("cost") && e.contains("weighted"), "{e}");
        let e = err(&format!(r#"{{{ep},"cost":{{"prefill_rate":1}}}}"#));
        assert!(e.contains("unknown field `prefill_rate`"), "{e}");
        let e = err(&format!(r#"{{{ep},"cost":{{"prefill_tokens_per_s":0}}}}"#));
        assert!(e.contains("cost.prefill_tokens_per_s"), "{e}");
        let e = err(&format!(
            r#"{{{ep},"cost":{{"models":{{"m":{{"bytes_per_token":-1}}}}}}}}"#
        ));
        assert!(e.contains("cost.models.m.bytes_per_token"), "{e}");
        let e = err(&format!(r#"{{{ep},"cost":{{"step_tokens":0}}}}"#));
        assert!(e.contains("cost.step_tokens"), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"],"prefill_tokens_per_s":-5}]}"#,
        );
        assert!(e.contains("endpoints[0].prefill_tokens_per_s"), "{e}");
    }

    #[test]
    fn kv_capacities_resolve_endpoint_then_model_then_default() {
        let cfg = PluginConfig::from_json(
            br#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"],"kv_capacity_tokens":5000},
                {"address":"127.0.0.1:2","models":["m"]}],
                "cost":{"kv_capacity_tokens":100000,"footprint_high":0.5,
                        "models":{"m":{"kv_capacity_tokens":400000}}}}"#,
        )
        .unwrap();
        let e = cfg.pool.get(crate::EndpointId(0)).unwrap();
        assert_eq!(e.load.kv_capacity_tokens, Some(5000));
        assert_eq!(cfg.cost.model_kv_capacity("m"), Some(400_000));
        assert_eq!(cfg.cost.model_kv_capacity("other"), Some(100_000));
        assert_eq!(cfg.cost.footprint_high, 0.5);
        assert_eq!(cfg.cost.pressure_time_constant_s, 10.0);
        let ep = r#""endpoints":[{"address":"127.0.0.1:1","models":["m"]}]"#;
        let default = PluginConfig::from_json(format!("{{{ep}}}").as_bytes()).unwrap();
        assert_eq!(default.cost.model_kv_capacity("m"), None);
        for (bad, field) in [
            (
                r#""cost":{"kv_capacity_tokens":0}"#,
                "cost.kv_capacity_tokens",
            ),
            (
                r#""cost":{"models":{"m":{"kv_capacity_tokens":0}}}"#,
                "cost.models.m.kv_capacity_tokens",
            ),
            (r#""cost":{"footprint_high":1}"#, "cost.footprint_high"),
            (
                r#""cost":{"tier_credit":{"cpu":1.5}}"#,
                "cost.tier_credit.cpu",
            ),
            (
                r#""cost":{"tier_credit":{"cpu":0.5,"storage":0.6}}"#,
                "cost.tier_credit.storage",
            ),
            (r#""cost":{"tier_credit":{"gpu":1}}"#, "gpu"),
            (r#""cost":{"footprint_high":-0.1}"#, "cost.footprint_high"),
            (
                r#""cost":{"pressure_time_constant_s":-1}"#,
                "cost.pressure_time_constant_s",
            ),
        ] {
            let e = err(&format!("{{{ep},{bad}}}"));
            assert!(e.contains(field), "{bad}: {e}");
        }
        let e = err(
            r#"{"endpoints":[{"address":"127.0.0.1:1","models":["m"],"kv_capacity_tokens":0}]}"#,
        );
        assert!(e.contains("endpoints[0].kv_capacity_tokens"), "{e}");
    }

    #[test]
    fn kv_growth_and_seat_settings_resolve_and_are_checked() {
        let cfg = PluginConfig::from_json(
            br#"{"endpoints":[{"address":"127.0.0.1:1","models":["m","n"]}],
                "cost":{"output_tokens":500,"claim_weight":1.5,"max_num_seqs":64,
                        "models":{"m":{"output_tokens":2000}}}}"#,
        )
        .unwrap();
        assert_eq!(cfg.cost.model_output_tokens("m"), 2000.0);
        assert_eq!(cfg.cost.model_output_tokens("n"), 500.0);
        assert_eq!(cfg.cost.claim_weight, 1.5);
        assert_eq!(cfg.cost.max_num_seqs, 64);
        let ep = r#""endpoints":[{"address":"127.0.0.1:1","models":["m"]}]"#;
        let default = PluginConfig::from_json(format!("{{{ep}}}").as_bytes()).unwrap();
        assert_eq!(default.cost.model_output_tokens("m"), 256.0);
        assert_eq!(default.cost.claim_weight, 3.0);
        assert_eq!(default.cost.max_num_seqs, 0);
        for (bad, field) in [
            (r#""cost":{"output_tokens":-1}"#, "cost.output_tokens"),
            (r#""cost":{"claim_weight":-0.5}"#, "cost.claim_weight"),
            (r#""cost":{"claim_weight":1000}"#, "cost.claim_weight"),
            (
                r#""cost":{"models":{"m":{"output_tokens":0}}}"#,
                "cost.models.m.output_tokens",
            ),
            (r#""cost":{"max_num_seqs":-1}"#, "expected u32"),
        ] {
            let e = err(&format!("{{{ep},{bad}}}"));
            assert!(e.contains(field), "{bad}: {e}");
        }
    }

    #[test]
    fn aggregator_section() {
        let e = err(r#"{"aggregator":{"cluster":"kvoy_aggregator"}}"#);
        assert!(e.contains("`allowed_destinations` is required"), "{e}");
        let cfg = PluginConfig::from_json(
            br#"{"aggregator":{"cluster":"kvoy_aggregator"},"allowed_destinations":[{"cidr":"10.0.0.0/8"}]}"#,
        )
        .unwrap();
        assert!(cfg.pool.is_empty());
        assert_eq!(cfg.max_endpoints, 256);
        let a = cfg.aggregator.unwrap();
        assert_eq!(
            (a.path.as_str(), a.poll_interval_ms, a.timeout_ms),
            ("/v1/snapshot", 100, 250)
        );
        assert_eq!(a.max_snapshot_bytes, 4 << 20);
        assert_eq!((a.relay_flush_ms, a.relay_wait_ms), (10, 1_000));
        let e = err(r#"{"aggregator":{"cluster":"c","relay_flush_ms":0}}"#);
        assert!(e.contains("aggregator.relay_flush_ms"), "{e}");
        let e = err(r#"{"aggregator":{"cluster":"c","relay_wait_ms":60000}}"#);
        assert!(e.contains("aggregator.relay_wait_ms"), "{e}");
        let e = err(r#"{"aggregator":{"cluster":"c","max_snapshot_bytes":10}}"#);
        assert!(e.contains("aggregator.max_snapshot_bytes"), "{e}");
        let e = err(r#"{"aggregator":{"cluster":"c","poll_interval_ms":0}}"#);
        assert!(e.contains("aggregator.poll_interval_ms"), "{e}");
        let e = err(r#"{"aggregator":{"cluster":"c","path":"v1"}}"#);
        assert!(e.contains("aggregator.path"), "{e}");
        let e = err(r#"{"aggregator":{"cluster":"c","interval":5}}"#);
        assert!(e.contains("unknown field `interval`"), "{e}");
        let e = err(r#"{}"#);
        assert!(e.contains("aggregator"), "{e}");
    }

    #[test]
    fn allowed_destinations_drop_static_endpoints_outside() {
        let cfg = PluginConfig::from_json(
            br#"{"endpoints":[{"address":"10.0.0.1:8000","models":["m"]},
                             {"address":"10.0.0.2:9901","models":["m"]},
                             {"address":"169.254.169.254:80","models":["m"]}],
                 "allowed_destinations":[{"cidr":"10.0.0.0/8","ports":["8000-8100"]}]}"#,
        )
        .unwrap();
        assert_eq!(cfg.pool.len(), 1);
        assert_eq!(
            cfg.refused_endpoints,
            vec![
                RefusedEndpoint {
                    address: "10.0.0.2:9901".parse().unwrap(),
                    reason: Refusal::Port
                },
                RefusedEndpoint {
                    address: "169.254.169.254:80".parse().unwrap(),
                    reason: Refusal::Address
                },
            ]
        );
        let e = err(
            r#"{"endpoints":[{"address":"10.0.0.1:8000","models":["m"]}],
                "allowed_destinations":[{"cidr":"127.0.0.0/8"}]}"#,
        );
        assert!(
            e.contains("outside `allowed_destinations`") && e.contains("10.0.0.1:8000"),
            "{e}"
        );
        let e = err(
            r#"{"endpoints":[{"address":"10.0.0.1:8000","models":["m"]}],
                "allowed_destinations":[{"cidr":"10.0.0.0/33"}]}"#,
        );
        assert!(e.contains("allowed_destinations[0].cidr"), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"10.0.0.1:8000","models":["m"]}],
                "allowed_destinations":[{"cidr":"10.0.0.0/8","prots":[1]}]}"#,
        );
        assert!(e.contains("unknown field `prots`"), "{e}");
    }

    #[test]
    fn bounds_are_checked_at_configuration() {
        let agg = r#""aggregator":{"cluster":"c"},"allowed_destinations":[{"cidr":"10.0.0.0/8"}]"#;
        // 4096 endpoints of the default 31,250 blocks: up to about 16-18 GiB of index (one-block
        // prompts), over a wasm32 VM; 2,000 blocks each is about 1-1.1 GiB.
        let e = err(&format!(r#"{{{agg},"max_endpoints":4096}}"#));
        assert!(
            e.contains("prefix index")
                && e.contains("lru_blocks_per_endpoint")
                && e.contains("max_endpoints"),
            "{e}"
        );
        let cfg = PluginConfig::from_json(
            format!(r#"{{{agg},"max_endpoints":4096,"lru_blocks_per_endpoint":2000}}"#).as_bytes(),
        )
        .unwrap();
        assert_eq!(cfg.max_endpoints, 4096);
        let e = err(&format!(r#"{{{agg},"max_endpoints":0}}"#));
        assert!(e.contains("max_endpoints"), "{e}");
        let e = err(
            r#"{"endpoints":[{"address":"10.0.0.1:1","models":["m"]},{"address":"10.0.0.1:2","models":["m"]}],"max_endpoints":1}"#,
        );
        assert!(e.contains("more than `max_endpoints`"), "{e}");
        let e = err(&format!(r#"{{{agg},"max_prompt_segments":3}}"#));
        assert!(e.contains("max_prompt_segments"), "{e}");
        let cfg = PluginConfig::from_json(format!(r#"{{{agg}}}"#).as_bytes()).unwrap();
        assert_eq!(
            cfg.max_prompt_segments,
            crate::request::DEFAULT_MAX_SEGMENTS
        );
    }

    #[test]
    fn aggregator_token() {
        let cfg = PluginConfig::from_json(
            br#"{"aggregator":{"cluster":"c","token":"0123456789abcdef"},"allowed_destinations":[{"cidr":"10.0.0.0/8"}]}"#,
        )
        .unwrap();
        let a = cfg.aggregator.unwrap();
        assert_eq!(
            a.token.as_ref().map(BearerToken::as_str),
            Some("0123456789abcdef")
        );
        assert!(!format!("{a:?}").contains("0123456789abcdef"), "redacted");
        for bad in [r#""short""#, r#""0123456789 abcdef""#] {
            let e = err(&format!(
                r#"{{"aggregator":{{"cluster":"c","token":{bad}}},"allowed_destinations":[{{"cidr":"10.0.0.0/8"}}]}}"#
            ));
            assert!(e.contains("aggregator.token"), "{bad}: {e}");
            assert!(
                !e.contains("0123456789"),
                "{bad}: the token is not echoed: {e}"
            );
        }
    }
}
