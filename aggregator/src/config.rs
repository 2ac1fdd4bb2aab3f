//! The aggregator's configuration file (YAML, or JSON when the name ends in `.json`): settings
//! plus the endpoint list, or a `kubernetes:` section naming the InferencePool the endpoints
//! come from ([`crate::k8s`]). A raw serde shape (unknown fields rejected) is checked into
//! [`AggregatorConfig`]; every error names the field.
//!
//! ```
//! let cfg = kvoy_aggregator::config::AggregatorConfig::from_yaml("
//! endpoints:
//!   - address: 10.0.0.1:8000
//!     models: [llama]
//!     kv_events_endpoint: tcp://10.0.0.1:5557
//! ").unwrap();
//! assert_eq!(cfg.scrape_interval.as_millis(), 50);
//! assert_eq!(cfg.endpoints[0].kv_events.as_ref().unwrap().endpoint, "tcp://10.0.0.1:5557");
//! ```

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use kvoy_shared::config::{out_of_range, within, EndpointAddresses, EndpointListError, OutOfRange};
use kvoy_shared::prefix::KeySchedule;
use kvoy_shared::snapshot::{MAX_MODELS, MAX_MODEL_NAME_BYTES};

use crate::k8s::KubernetesConfig;
use crate::kv_link::LinkSettings;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEndpoint {
    address: String,
    models: Vec<String>,
    #[serde(default)]
    metrics_path: Option<String>,
    #[serde(default)]
    kv_events_endpoint: Option<String>,
    #[serde(default)]
    kv_events_replay_endpoint: Option<String>,
    #[serde(default)]
    kv_events_topic: Option<String>,
    /// `decode` (the default), `prefill` or `both`.
    #[serde(default)]
    role: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    listen: Option<String>,
    #[serde(default = "defaults::scrape_interval_ms")]
    scrape_interval_ms: u64,
    #[serde(default = "defaults::scrape_timeout_ms")]
    scrape_timeout_ms: u64,
    #[serde(default = "defaults::stale_after_ms")]
    stale_after_ms: u64,
    #[serde(default = "defaults::unready_after_failures")]
    unready_after_failures: u32,
    #[serde(default = "defaults::reload_interval_ms")]
    reload_interval_ms: u64,
    #[serde(default)]
    endpoints: Vec<RawEndpoint>,
    #[serde(default)]
    kubernetes: Option<crate::k8s::RawKubernetes>,
    #[serde(default)]
    api_token_file: Option<String>,
    #[serde(default)]
    limits: RawLimits,
    #[serde(default)]
    links: RawLinks,
    #[serde(default)]
    peers: Vec<String>,
}

/// The `links:` section: how relayed decisions are linked to the servers' blocks
/// ([`crate::kv_link`]). The key schedule and bytes per token must be the filters'.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawLinks {
    enabled: bool,
    block_size: u64,
    max_blocks: u64,
    dense_blocks: u64,
    blocks_per_doubling: u64,
    bytes_per_token: f64,
    window_ms: u64,
    relay_lag_ms: u64,
    tolerance: f64,
    slack_tokens: u64,
    clock_skew_ms: u64,
}

impl Default for RawLinks {
    fn default() -> Self {
        let d = LinkSettings::default();
        RawLinks {
            enabled: d.enabled,
            block_size: d.schedule.block_size as u64,
            max_blocks: d.schedule.max_keys as u64,
            dense_blocks: d.schedule.dense as u64,
            blocks_per_doubling: d.schedule.group as u64,
            bytes_per_token: d.bytes_per_token,
            window_ms: d.window.as_millis() as u64,
            relay_lag_ms: d.relay_lag.as_millis() as u64,
            tolerance: d.tolerance,
            slack_tokens: d.slack_tokens,
            clock_skew_ms: (d.clock_skew_s * 1000.0) as u64,
        }
    }
}

fn links(raw: &RawLinks) -> Result<LinkSettings, ConfigError> {
    let block_size = count_in("links.block_size", raw.block_size, 1..=65_536)?;
    let max_keys = count_in("links.max_blocks", raw.max_blocks, 1..=65_536)?;
    let dense = count_in("links.dense_blocks", raw.dense_blocks, 0..=65_536)?;
    let group = count_in(
        "links.blocks_per_doubling",
        raw.blocks_per_doubling,
        1..=65_536,
    )?;
    let window_ms = count_in("links.window_ms", raw.window_ms, 100..=600_000)?;
    let relay_lag_ms = count_in("links.relay_lag_ms", raw.relay_lag_ms, 0..=60_000)?;
    let slack_tokens = count_in("links.slack_tokens", raw.slack_tokens, 0..=65_536)?;
    let clock_skew_ms = count_in("links.clock_skew_ms", raw.clock_skew_ms, 0..=60_000)?;
    if !(raw.bytes_per_token.is_finite() && (0.1..=100.0).contains(&raw.bytes_per_token)) {
        return Err(out_of_range(
            "links.bytes_per_token",
            "within 0.1..=100",
            raw.bytes_per_token,
        ));
    }
    if !(raw.tolerance.is_finite() && (0.0..=1.0).contains(&raw.tolerance)) {
        return Err(out_of_range(
            "links.tolerance",
            "within 0..=1",
            raw.tolerance,
        ));
    }
    Ok(LinkSettings {
        enabled: raw.enabled,
        schedule: KeySchedule {
            block_size,
            max_keys,
            dense,
            group,
        },
        bytes_per_token: raw.bytes_per_token,
        window: Duration::from_millis(window_ms as u64),
        relay_lag: Duration::from_millis(relay_lag_ms as u64),
        tolerance: raw.tolerance,
        slack_tokens: slack_tokens as u64,
        clock_skew_s: clock_skew_ms as f64 / 1000.0,
        ..LinkSettings::default()
    })
}

/// The `limits:` section: bounds on what peers can make the aggregator hold.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawLimits {
    kv_events_max_message_bytes: u64,
    replay_max_batches: u64,
    replay_max_bytes: u64,
    replay_timeout_ms: u64,
    blocks_per_capacity_block: u64,
    blocks_without_capacity: u64,
    http_max_connections: u64,
    http_header_read_timeout_ms: u64,
}

impl Default for RawLimits {
    fn default() -> Self {
        let d = Limits::default();
        RawLimits {
            kv_events_max_message_bytes: d.kv_events_max_message_bytes as u64,
            replay_max_batches: d.replay_max_batches as u64,
            replay_max_bytes: d.replay_max_bytes as u64,
            replay_timeout_ms: d.replay_timeout.as_millis() as u64,
            blocks_per_capacity_block: d.blocks_per_capacity_block as u64,
            blocks_without_capacity: d.blocks_without_capacity as u64,
            http_max_connections: d.http_max_connections as u64,
            http_header_read_timeout_ms: d.http_header_read_timeout.as_millis() as u64,
        }
    }
}

/// Bounds on what peers can make the aggregator hold (`limits:` in the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// ZMQ frames larger than this drop the publisher's connection (`ZMQ_MAXMSGSIZE`).
    pub kv_events_max_message_bytes: usize,
    /// One replay returns at most this many batches ...
    pub replay_max_batches: usize,
    /// ... of at most this many payload bytes in all ...
    pub replay_max_bytes: usize,
    /// ... within this long.
    pub replay_timeout: Duration,
    /// An endpoint's block cap: this many blocks per block of its capacity
    /// (`num_gpu_blocks`), room for the GPU and the offload tiers.
    pub blocks_per_capacity_block: usize,
    /// The block cap while an endpoint's capacity is unknown.
    pub blocks_without_capacity: usize,
    /// Open HTTP connections at most; more are closed at once.
    pub http_max_connections: usize,
    /// A connection must send its request headers within this long.
    pub http_header_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            kv_events_max_message_bytes: 16 << 20,
            replay_max_batches: 10_000,
            replay_max_bytes: 64 << 20,
            replay_timeout: Duration::from_secs(1),
            blocks_per_capacity_block: 4,
            blocks_without_capacity: 1 << 20,
            http_max_connections: 1024,
            http_header_read_timeout: Duration::from_secs(10),
        }
    }
}

impl Limits {
    /// The block cap of an endpoint whose capacity is `capacity_blocks` (0: unknown).
    pub fn block_cap(&self, capacity_blocks: u32) -> usize {
        if capacity_blocks == 0 {
            self.blocks_without_capacity
        } else {
            (capacity_blocks as usize).saturating_mul(self.blocks_per_capacity_block)
        }
    }
}

/// A bearer token the API requires (redacted in `Debug`).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(String);

impl ApiToken {
    /// A token from text (surrounding whitespace trimmed): 16 to 4096 visible ASCII characters.
    pub fn new(text: &str) -> Option<ApiToken> {
        let t = text.trim();
        let ok = (16..=4096).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_graphic());
        ok.then(|| ApiToken(t.to_owned()))
    }

    /// Reads a token file (a mounted Secret).
    pub fn from_file(path: &Path) -> Result<ApiToken, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: format!("the API token file {}", path.display()),
            reason: e.to_string(),
        })?;
        ApiToken::new(&text).ok_or(ConfigError::BadToken {
            origin: path.display().to_string(),
        })
    }

    /// The token's bytes.
    pub fn expose(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

mod defaults {
    pub fn scrape_interval_ms() -> u64 {
        50
    }
    pub fn scrape_timeout_ms() -> u64 {
        100
    }
    pub fn stale_after_ms() -> u64 {
        200
    }
    pub fn unready_after_failures() -> u32 {
        2
    }
    pub fn reload_interval_ms() -> u64 {
        1000
    }
}

/// Where one model server publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsSource {
    /// The ZMQ PUB endpoint, e.g. `tcp://10.0.0.1:5557`.
    pub endpoint: String,
    /// The ZMQ ROUTER endpoint that replays missed batches, when the server has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (empty: every topic).
    pub topic: String,
}

/// One model server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    pub address: SocketAddr,
    pub models: Vec<String>,
    /// Path of the Prometheus metrics (default `/metrics`).
    pub metrics_path: String,
    pub kv_events: Option<KvEventsSource>,
    /// The stages of a disaggregated request it serves (`role` in the file; on Kubernetes the
    /// pod's `llm-d.ai/role` label).
    pub role: kvoy_shared::Role,
}

/// A checked configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct AggregatorConfig {
    /// Where the HTTP API listens, when the file says (the command line may override it).
    pub listen: Option<SocketAddr>,
    pub scrape_interval: Duration,
    pub scrape_timeout: Duration,
    /// Metrics older than this mark the endpoint stale.
    pub stale_after: Duration,
    /// Consecutive failed scrapes after which the endpoint is not ready.
    pub unready_after_failures: u32,
    /// How often the endpoint source is checked for changes.
    pub reload_interval: Duration,
    pub endpoints: Vec<EndpointSpec>,
    /// Endpoints from an InferencePool instead of `endpoints` ([`crate::k8s`]).
    pub kubernetes: Option<KubernetesConfig>,
    /// The file holding the bearer token `/v1/snapshot` and `/v1/endpoints` require (a
    /// mounted Secret), read when the aggregator starts.
    pub api_token_file: Option<std::path::PathBuf>,
    /// The token itself (the command line's `--token-file` / `KVOY_AGGREGATOR_TOKEN`); wins
    /// over `api_token_file`. Neither: the API is open.
    pub api_token: Option<ApiToken>,
    pub limits: Limits,
    /// How relayed decisions are linked to the servers' blocks (`links:`).
    pub links: LinkSettings,
    /// The other aggregator replicas of the pool (`host:port`), whose relayed decisions this
    /// one reads as it starts, before it reports ready ([`crate::peers`]). Listing this
    /// replica too is harmless (it has none yet), so every replica can share one list.
    pub peers: Vec<String>,
}

/// Peers a replica reads decisions from at most.
const MAX_PEERS: usize = 16;

#[derive(Debug, Error, PartialEq)]
pub enum ConfigError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("invalid configuration: {0}")]
    Syntax(String),
    #[error("`listen` {0:?} is not an ip:port address")]
    BadListen(String),
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    #[error(transparent)]
    Endpoints(#[from] EndpointListError),
    #[error("`endpoints[{index}].models` must name 1 to {MAX_MODELS} models of 1 to {MAX_MODEL_NAME_BYTES} bytes")]
    BadModels { index: usize },
    #[error("`endpoints[{index}].role` {value:?} must be `decode`, `prefill` or `both`")]
    BadRole { index: usize, value: String },
    #[error("`endpoints[{index}].metrics_path` {value:?} must start with `/`")]
    BadMetricsPath { index: usize, value: String },
    #[error("`endpoints[{index}].{field}` {value:?} is not a ZMQ endpoint (tcp://host:port, ipc://path or inproc://name)")]
    BadZmqEndpoint {
        index: usize,
        field: &'static str,
        value: String,
    },
    #[error("`endpoints[{index}].{field}` is set without `kv_events_endpoint`")]
    ReplayWithoutEvents { index: usize, field: &'static str },
    #[error("`kubernetes.{field}` {value:?} {reason}")]
    BadKubernetes {
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("`kubernetes.models` must name 1 to {MAX_MODELS} models of 1 to {MAX_MODEL_NAME_BYTES} bytes")]
    BadKubernetesModels,
    #[error("`kubernetes` and `endpoints` are exclusive: with `kubernetes` the endpoints come from the InferencePool")]
    KubernetesWithEndpoints,
    #[error("the API token from {origin} must be 16 to 4096 visible ASCII characters")]
    BadToken { origin: String },
}

impl AggregatorConfig {
    /// Parses YAML (JSON is YAML too, but [`AggregatorConfig::from_json`] gives JSON's errors).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig =
            serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        Self::try_from(raw)
    }

    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        Self::try_from(raw)
    }

    /// Reads a file: JSON when its name ends in `.json`, YAML otherwise.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        {
            Self::from_json(&text)
        } else {
            Self::from_yaml(&text)
        }
    }
}

/// [`within`], a number of milliseconds.
pub(crate) fn ms_in(
    field: &'static str,
    value: u64,
    range: RangeInclusive<u64>,
) -> Result<Duration, ConfigError> {
    Ok(Duration::from_millis(within(field, range, value)?))
}

/// [`within`], a count.
fn count_in(
    field: &'static str,
    value: u64,
    range: RangeInclusive<u64>,
) -> Result<usize, ConfigError> {
    let v = within(field, range, value)?;
    Ok(usize::try_from(v).unwrap_or(usize::MAX))
}

fn zmq_endpoint(index: usize, field: &'static str, value: String) -> Result<String, ConfigError> {
    let value = value.trim().to_owned();
    let ok = ["tcp://", "ipc://", "inproc://"]
        .iter()
        .any(|scheme| value.len() > scheme.len() && value.starts_with(scheme));
    if ok {
        Ok(value)
    } else {
        Err(ConfigError::BadZmqEndpoint {
            index,
            field,
            value,
        })
    }
}

fn endpoint(
    index: usize,
    e: RawEndpoint,
    addresses: &mut EndpointAddresses,
) -> Result<EndpointSpec, ConfigError> {
    let address = addresses.read(index, &e.address)?;
    let models_ok = !e.models.is_empty()
        && e.models.len() <= MAX_MODELS
        && e.models
            .iter()
            .all(|m| !m.is_empty() && m.len() <= MAX_MODEL_NAME_BYTES);
    if !models_ok {
        return Err(ConfigError::BadModels { index });
    }
    let role = match e.role {
        None => kvoy_shared::Role::Decode,
        Some(value) => {
            kvoy_shared::Role::from_name(&value).ok_or(ConfigError::BadRole { index, value })?
        }
    };
    let metrics_path = e.metrics_path.unwrap_or_else(|| "/metrics".to_owned());
    if !metrics_path.starts_with('/') || metrics_path.contains(char::is_whitespace) {
        return Err(ConfigError::BadMetricsPath {
            index,
            value: metrics_path,
        });
    }
    let kv_events = match e.kv_events_endpoint {
        Some(ep) => Some(KvEventsSource {
            endpoint: zmq_endpoint(index, "kv_events_endpoint", ep)?,
            replay_endpoint: e
                .kv_events_replay_endpoint
                .map(|r| zmq_endpoint(index, "kv_events_replay_endpoint", r))
                .transpose()?,
            topic: e.kv_events_topic.unwrap_or_default(),
        }),
        None => {
            for (field, set) in [
                (
                    "kv_events_replay_endpoint",
                    e.kv_events_replay_endpoint.is_some(),
                ),
                ("kv_events_topic", e.kv_events_topic.is_some()),
            ] {
                if set {
                    return Err(ConfigError::ReplayWithoutEvents { index, field });
                }
            }
            None
        }
    };
    Ok(EndpointSpec {
        address,
        models: e.models,
        metrics_path,
        kv_events,
        role,
    })
}

impl TryFrom<RawConfig> for AggregatorConfig {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        let listen = raw
            .listen
            .map(|l| l.trim().parse().map_err(|_| ConfigError::BadListen(l)))
            .transpose()?;
        let scrape_interval = ms_in("scrape_interval_ms", raw.scrape_interval_ms, 10..=60_000)?;
        let scrape_timeout = ms_in("scrape_timeout_ms", raw.scrape_timeout_ms, 10..=60_000)?;
        let stale_after = ms_in("stale_after_ms", raw.stale_after_ms, 10..=600_000)?;
        let reload_interval = ms_in("reload_interval_ms", raw.reload_interval_ms, 100..=600_000)?;
        within(
            "unready_after_failures",
            1..=1000,
            u64::from(raw.unready_after_failures),
        )?;
        if raw.kubernetes.is_some() && !raw.endpoints.is_empty() {
            return Err(ConfigError::KubernetesWithEndpoints);
        }
        let kubernetes = raw.kubernetes.map(KubernetesConfig::try_from).transpose()?;
        let mut addresses = EndpointAddresses::for_list(raw.endpoints.len())?;
        let limits = limits(&raw.limits)?;
        let links = links(&raw.links)?;
        let api_token_file = match raw.api_token_file.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(path) => Some(std::path::PathBuf::from(path)),
        };
        if raw.peers.len() > MAX_PEERS {
            return Err(out_of_range(
                "peers",
                "at most 16 replicas",
                raw.peers.len(),
            ));
        }
        for peer in &raw.peers {
            let ok = peer
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                return Err(out_of_range(
                    "peers",
                    "host:port of each replica",
                    format!("{peer:?}"),
                ));
            }
        }
        let mut endpoints = Vec::with_capacity(raw.endpoints.len());
        for (index, e) in raw.endpoints.into_iter().enumerate() {
            endpoints.push(endpoint(index, e, &mut addresses)?);
        }
        Ok(AggregatorConfig {
            listen,
            scrape_interval,
            scrape_timeout,
            stale_after,
            unready_after_failures: raw.unready_after_failures,
            reload_interval,
            endpoints,
            kubernetes,
            api_token_file,
            api_token: None,
            links,
            limits,
            peers: raw.peers,
        })
    }
}

fn limits(raw: &RawLimits) -> Result<Limits, ConfigError> {
    Ok(Limits {
        kv_events_max_message_bytes: count_in(
            "limits.kv_events_max_message_bytes",
            raw.kv_events_max_message_bytes,
            4096..=1 << 30,
        )?,
        replay_max_batches: count_in(
            "limits.replay_max_batches",
            raw.replay_max_batches,
            1..=1_000_000,
        )?,
        replay_max_bytes: count_in(
            "limits.replay_max_bytes",
            raw.replay_max_bytes,
            4096..=1 << 32,
        )?,
        replay_timeout: ms_in(
            "limits.replay_timeout_ms",
            raw.replay_timeout_ms,
            10..=60_000,
        )?,
        blocks_per_capacity_block: count_in(
            "limits.blocks_per_capacity_block",
            raw.blocks_per_capacity_block,
            1..=1024,
        )?,
        blocks_without_capacity: count_in(
            "limits.blocks_without_capacity",
            raw.blocks_without_capacity,
            1..=1 << 32,
        )?,
        http_max_connections: count_in(
            "limits.http_max_connections",
            raw.http_max_connections,
            1..=1_000_000,
        )?,
        http_header_read_timeout: ms_in(
            "limits.http_header_read_timeout_ms",
            raw.http_header_read_timeout_ms,
            10..=600_000,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_yaml() {
        let cfg = AggregatorConfig::from_yaml(
            "listen: 127.0.0.1:9090
scrape_interval_ms: 75
scrape_timeout_ms: 60
stale_after_ms: 300
unready_after_failures: 3
endpoints:
  - address: 10.0.0.1:8000
    models: [a, b]
    metrics_path: /custom
    kv_events_endpoint: tcp://10.0.0.1:5557
    kv_events_replay_endpoint: tcp://10.0.0.1:5558
    kv_events_topic: kv@
  - address: '[::1]:8001'
    models: [a]
    role: prefill
",
        )
        .unwrap();
        assert_eq!(cfg.listen, Some("127.0.0.1:9090".parse().unwrap()));
        assert_eq!(cfg.scrape_interval, Duration::from_millis(75));
        assert_eq!(cfg.unready_after_failures, 3);
        assert_eq!(cfg.endpoints.len(), 2);
        let kv = cfg.endpoints[0].kv_events.as_ref().unwrap();
        assert_eq!(kv.replay_endpoint.as_deref(), Some("tcp://10.0.0.1:5558"));
        assert_eq!(kv.topic, "kv@");
        assert_eq!(cfg.endpoints[0].metrics_path, "/custom");
        assert_eq!(cfg.endpoints[1].metrics_path, "/metrics");
        assert!(cfg.endpoints[1].kv_events.is_none());
        assert_eq!(
            (cfg.endpoints[0].role, cfg.endpoints[1].role),
            (kvoy_shared::Role::Decode, kvoy_shared::Role::Prefill)
        );
    }

    #[test]
    fn kubernetes_section() {
        let cfg = AggregatorConfig::from_yaml(
            "reload_interval_ms: 2000
kubernetes:
  inference_pool: llama-pool
  namespace: llm
  api_server: https://10.96.0.1:443
  models: [llama-3.1-8b]
  kv_events_port: 5557
  kv_events_replay_port: 5558
  token_file: ''
",
        )
        .unwrap();
        let k = cfg.kubernetes.unwrap();
        assert_eq!(k.inference_pool, "llama-pool");
        assert_eq!(k.namespace.as_deref(), Some("llm"));
        assert_eq!(k.api_server.unwrap().authority(), "10.96.0.1:443");
        assert_eq!(k.token_file, None, "an empty token_file sends no token");
        assert_eq!(
            k.ca_file,
            std::path::Path::new(crate::k8s::SERVICE_ACCOUNT_DIR).join("ca.crt")
        );
        assert_eq!(k.kv_events.unwrap().replay_port, Some(5558));
        assert_eq!(k.metrics_path, "/metrics");
        assert!(cfg.endpoints.is_empty());
        // The defaults are the in-cluster ones.
        let k = AggregatorConfig::from_yaml("kubernetes: {inference_pool: p, models: [m]}")
            .unwrap()
            .kubernetes
            .unwrap();
        assert_eq!(k, crate::k8s::KubernetesConfig::for_pool("p", &["m"]));
    }

    #[test]
    fn links_section() {
        let cfg = AggregatorConfig::from_yaml("{}").unwrap();
        assert_eq!(cfg.links, LinkSettings::default());
        assert!(cfg.links.enabled, "on unless switched off");
        let off = AggregatorConfig::from_yaml("links: {enabled: false}").unwrap();
        assert!(!off.links.enabled);
        let cfg = AggregatorConfig::from_yaml(
            "links: {enabled: true, block_size: 32, bytes_per_token: 3.5, window_ms: 2000, relay_lag_ms: 0, clock_skew_ms: 5}",
        )
        .unwrap();
        assert_eq!(cfg.links.clock_skew_s, 0.005);
        assert!(cfg.links.enabled);
        assert_eq!(cfg.links.schedule.block_size, 32);
        assert_eq!(cfg.links.bytes_per_token, 3.5);
        assert_eq!(cfg.links.window, Duration::from_secs(2));
        assert_eq!(cfg.links.relay_lag, Duration::ZERO);
        for (yaml, field) in [
            ("links: {block_size: 0}", "links.block_size"),
            ("links: {bytes_per_token: 0}", "links.bytes_per_token"),
            ("links: {bytes_per_token: .nan}", "links.bytes_per_token"),
            ("links: {tolerance: 2}", "links.tolerance"),
            ("links: {window_ms: 1}", "links.window_ms"),
            ("links: {clock_skew_ms: 60001}", "links.clock_skew_ms"),
            (
                "links: {blocks_per_doubling: 0}",
                "links.blocks_per_doubling",
            ),
            ("links: {colour: red}", "colour"),
        ] {
            let e = AggregatorConfig::from_yaml(yaml).unwrap_err().to_string();
            assert!(e.contains(field), "{yaml}: {e}");
        }
    }

    #[test]
    fn limits_and_token() {
        let cfg = AggregatorConfig::from_yaml("limits: {http_max_connections: 8}").unwrap();
        assert_eq!(cfg.limits.http_max_connections, 8);
        assert_eq!(
            cfg.limits.replay_max_batches,
            Limits::default().replay_max_batches
        );
        assert_eq!(cfg.limits.block_cap(1000), 4000);
        assert_eq!(cfg.limits.block_cap(0), 1 << 20);
        assert_eq!((&cfg.api_token, &cfg.api_token_file), (&None, &None));
        let cfg = AggregatorConfig::from_yaml("api_token_file: /run/secret/token").unwrap();
        assert_eq!(
            cfg.api_token_file.as_deref(),
            Some(Path::new("/run/secret/token")),
            "read when the aggregator starts"
        );
        assert!(ApiToken::new("short").is_none());
        assert!(ApiToken::new("sixteen chars!!!").is_none(), "no spaces");
        let t = ApiToken::new(" 0123456789abcdef\n").unwrap();
        assert_eq!(t.expose(), b"0123456789abcdef");
        assert_eq!(format!("{t:?}"), "ApiToken(<redacted>)");
    }

    #[test]
    fn json_and_empty() {
        let cfg = AggregatorConfig::from_json(
            r#"{"endpoints":[{"address":"10.0.0.1:8000","models":["m"]}]}"#,
        )
        .unwrap();
        assert_eq!(cfg.endpoints.len(), 1);
        // An empty pool is allowed: a source may fill it later.
        assert!(AggregatorConfig::from_yaml("{}")
            .unwrap()
            .endpoints
            .is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("endpoints: [{address: x, models: [m]}]", "endpoints[0].address"),
            ("endpoints: [{address: '1.2.3.4:1', models: []}]", "endpoints[0].models"),
            (
                "endpoints: [{address: '1.2.3.4:1', models: [m]}, {address: '1.2.3.4:1', models: [m]}]",
                "endpoints[1].address",
            ),
            (
                "endpoints: [{address: '1.2.3.4:1', models: [m], kv_events_endpoint: '5557'}]",
                "endpoints[0].kv_events_endpoint",
            ),
            (
                "endpoints: [{address: '1.2.3.4:1', models: [m], kv_events_topic: t}]",
                "endpoints[0].kv_events_topic",
            ),
            (
                "endpoints: [{address: '1.2.3.4:1', models: [m], metrics_path: metrics}]",
                "endpoints[0].metrics_path",
            ),
            (
                "endpoints: [{address: '1.2.3.4:1', models: [m], role: encode}]",
                "endpoints[0].role",
            ),
            ("scrape_interval_ms: 1", "scrape_interval_ms"),
            ("unready_after_failures: 0", "unready_after_failures"),
            ("listen: nowhere", "listen"),
            ("scrape_every: 5", "scrape_every"),
            ("endpoints: [{address: '1.2.3.4:1', models: [m], weight: 2}]", "weight"),
            ("kubernetes: {inference_pool: p, models: [m], pool: x}", "pool"),
            ("kubernetes: {models: [m]}", "inference_pool"),
            ("kubernetes: {inference_pool: p}", "models"),
            ("kubernetes: {inference_pool: P_1, models: [m]}", "kubernetes.inference_pool"),
            ("kubernetes: {inference_pool: p, models: [m], namespace: a.b}", "kubernetes.namespace"),
            ("kubernetes: {inference_pool: p, models: []}", "kubernetes.models"),
            ("kubernetes: {inference_pool: p, models: [m], api_server: 'kube:6443'}", "kubernetes.api_server"),
            ("kubernetes: {inference_pool: p, models: [m], ca_file: ''}", "kubernetes.ca_file"),
            ("kubernetes: {inference_pool: p, models: [m], metrics_path: m}", "kubernetes.metrics_path"),
            ("kubernetes: {inference_pool: p, models: [m], kv_events_port: 0}", "kubernetes.kv_events_port"),
            ("kubernetes: {inference_pool: p, models: [m], kv_events_port: 70000}", "kv_events_port"),
            ("kubernetes: {inference_pool: p, models: [m], kv_events_replay_port: 5558}", "kubernetes.kv_events_replay_port"),
            ("kubernetes: {inference_pool: p, models: [m], kv_events_topic: t}", "kubernetes.kv_events_topic"),
            ("kubernetes: {inference_pool: p, models: [m], request_timeout_ms: 5}", "kubernetes.request_timeout_ms"),
            ("limits: {kv_events_max_message_bytes: 10}", "limits.kv_events_max_message_bytes"),
            ("limits: {http_max_connections: 0}", "limits.http_max_connections"),
            ("limits: {http_header_read_timeout_ms: 0}", "limits.http_header_read_timeout_ms"),
            ("limits: {blocks_per_capacity_block: 0}", "limits.blocks_per_capacity_block"),
            ("limits: {replay_bytes: 5}", "replay_bytes"),
            (
                "kubernetes: {inference_pool: p, models: [m]}\nendpoints: [{address: '1.2.3.4:1', models: [m]}]",
                "`kubernetes` and `endpoints`",
            ),
        ];
        for (text, field) in cases {
            let err = AggregatorConfig::from_yaml(text).unwrap_err().to_string();
            assert!(err.contains(field), "{text}: {err}");
        }
    }
}
