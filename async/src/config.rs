//! kvoy-async's configuration file (YAML; JSON is YAML too). A raw serde shape with unknown
//! fields rejected is checked into [`Config`]; every error names the field.
//!
//! ```
//! let cfg = kvoy_async::config::Config::from_yaml("
//! proxy: 127.0.0.1:18000
//! aggregator: 127.0.0.1:18090
//! lanes:
//!   - name: async
//!     objective: async
//!   - name: batch
//!     objective: batch
//! tenants:
//!   team-a: {weight: 3}
//!   team-b: {weight: 1, max_concurrent: 4}
//! ").unwrap();
//! assert_eq!(cfg.lanes[0].stream, "kvoy-async:jobs:async");
//! assert_eq!(cfg.saturation_level, 0.8);
//! assert_eq!(cfg.tenant("team-b").max_concurrent, Some(4));
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

/// Why a configuration was refused.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// Not YAML of the expected shape (serde's message names the field and the line).
    #[error("{0}")]
    Syntax(String),
    /// A field's value is out of its range or inconsistent with another.
    #[error("`{field}`: {message}")]
    Invalid {
        /// The field, as a path (`lanes[1].name`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default = "defaults::redis_url")]
    redis_url: String,
    proxy: String,
    #[serde(default)]
    aggregator: Option<String>,
    #[serde(default)]
    listen: Option<String>,
    #[serde(default = "defaults::group")]
    group: String,
    #[serde(default)]
    consumer: Option<String>,
    lanes: Vec<RawLane>,
    #[serde(default)]
    tenants: BTreeMap<String, TenantQuota>,
    #[serde(default)]
    default_tenant: TenantQuota,
    #[serde(default = "defaults::tenant_metadata_key")]
    tenant_metadata_key: String,
    #[serde(default = "defaults::saturation_level")]
    saturation_level: f64,
    #[serde(default = "defaults::max_inflight")]
    max_inflight: u32,
    #[serde(default)]
    seats_per_endpoint: Option<u32>,
    #[serde(default = "defaults::reserve_seats")]
    reserve_seats: f64,
    #[serde(default = "defaults::read_ahead")]
    read_ahead: u32,
    #[serde(default = "defaults::max_read_ahead")]
    max_read_ahead: u32,
    #[serde(default = "defaults::max_attempts")]
    max_attempts: u32,
    #[serde(default = "defaults::max_deliveries")]
    max_deliveries: u32,
    #[serde(default = "defaults::backoff_ms")]
    backoff_ms: u64,
    #[serde(default = "defaults::max_backoff_ms")]
    max_backoff_ms: u64,
    #[serde(default = "defaults::max_job_bytes")]
    max_job_bytes: usize,
    #[serde(default = "defaults::request_timeout_ms")]
    request_timeout_ms: u64,
    #[serde(default = "defaults::claim_idle_ms")]
    claim_idle_ms: u64,
    #[serde(default = "defaults::poll_ms")]
    poll_ms: u64,
    #[serde(default = "defaults::gate_poll_ms")]
    gate_poll_ms: u64,
    #[serde(default)]
    models: Vec<String>,
    #[serde(default = "defaults::results_stream")]
    results_stream: String,
    #[serde(default = "defaults::dead_letter_stream")]
    dead_letter_stream: String,
    #[serde(default = "defaults::done_prefix")]
    done_prefix: String,
    #[serde(default = "defaults::done_ttl_s")]
    done_ttl_s: u64,
    #[serde(default = "defaults::default_output_tokens")]
    default_output_tokens: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLane {
    name: String,
    #[serde(default)]
    stream: Option<String>,
    objective: String,
    #[serde(default)]
    sorted_set: Option<String>,
    #[serde(default)]
    sorted_set_results: Option<String>,
}

mod defaults {
    pub fn redis_url() -> String {
        "redis://127.0.0.1:6379/".into()
    }
    pub fn group() -> String {
        "kvoy-async".into()
    }
    pub fn tenant_metadata_key() -> String {
        "tenant".into()
    }
    pub fn saturation_level() -> f64 {
        0.8
    }
    pub fn max_inflight() -> u32 {
        64
    }
    pub fn reserve_seats() -> f64 {
        // Measured in tests/envoy_async.rs (docs/async.md): 0.15 of 128 seats kept interactive
        // TTFT p90 within 16% while the jobs took 75% of the free capacity.
        0.15
    }
    pub fn read_ahead() -> u32 {
        256
    }
    pub fn max_read_ahead() -> u32 {
        2048
    }
    pub fn max_attempts() -> u32 {
        5
    }
    pub fn max_deliveries() -> u32 {
        10
    }
    pub fn backoff_ms() -> u64 {
        200
    }
    pub fn max_backoff_ms() -> u64 {
        10_000
    }
    pub fn max_job_bytes() -> usize {
        1 << 20
    }
    pub fn request_timeout_ms() -> u64 {
        600_000
    }
    pub fn claim_idle_ms() -> u64 {
        30_000
    }
    pub fn poll_ms() -> u64 {
        20
    }
    pub fn gate_poll_ms() -> u64 {
        100
    }
    pub fn results_stream() -> String {
        "kvoy-async:results".into()
    }
    pub fn dead_letter_stream() -> String {
        "kvoy-async:dead-letter".into()
    }
    pub fn done_prefix() -> String {
        "kvoy-async:done:".into()
    }
    pub fn done_ttl_s() -> u64 {
        7 * 24 * 3600
    }
    pub fn default_output_tokens() -> u32 {
        256
    }
}

/// A tenant's share and limits inside every lane.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantQuota {
    /// Its share of the lane's tokens against the other tenants with work waiting (default 1).
    #[serde(default = "one")]
    pub weight: f64,
    /// At most this many of its jobs run at once.
    #[serde(default)]
    pub max_concurrent: Option<u32>,
    /// At most this many tokens (prompt and output) of its jobs start in any 60 s.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
}

fn one() -> f64 {
    1.0
}

impl Default for TenantQuota {
    fn default() -> Self {
        TenantQuota {
            weight: 1.0,
            max_concurrent: None,
            tokens_per_minute: None,
        }
    }
}

/// One lane: a Redis stream of jobs, sent with one admission objective.
#[derive(Clone, Debug, PartialEq)]
pub struct Lane {
    /// Its name (metrics, results).
    pub name: String,
    /// The stream its jobs are added to (default `kvoy-async:jobs:<name>`).
    pub stream: String,
    /// The `x-gateway-inference-objective` its requests carry: the proxy's admission config
    /// should give it a negative (sheddable) priority.
    pub objective: String,
    /// llm-d-async's sorted-set queue (score = deadline) moved into `stream` atomically.
    pub sorted_set: Option<String>,
    /// The list llm-d-async's callers read results of `sorted_set` jobs from (LPUSH).
    pub sorted_set_results: Option<String>,
}

/// The checked configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Redis, as a `redis://` URL.
    pub redis_url: String,
    /// The kvoy proxy (Envoy's listener) the jobs are sent through.
    pub proxy: SocketAddr,
    /// kvoy-aggregator's API, for the pool's saturation and models; without it the gate is
    /// open and every model is accepted.
    pub aggregator: Option<SocketAddr>,
    /// Where `/metrics` and `/v1/status` are served.
    pub listen: Option<SocketAddr>,
    /// The consumer group on every lane's stream.
    pub group: String,
    /// This process's consumer name (default: `kvoy-async-<pid>-<start ms>`); also its name
    /// in the pool view.
    pub consumer: Option<String>,
    /// Lanes in strict priority order, highest first.
    pub lanes: Vec<Lane>,
    tenants: BTreeMap<String, TenantQuota>,
    default_tenant: TenantQuota,
    /// The llm-d message `metadata` key naming the tenant.
    pub tenant_metadata_key: String,
    /// The pool saturation at which dispatch stops (llm-d-async's gate closes at 0.8).
    pub saturation_level: f64,
    /// Jobs in flight at most, at saturation 0.
    pub max_inflight: u32,
    /// The servers' seats (vLLM's `max_num_seqs`): when set, jobs also stop where they would
    /// take the last `reserve_seats` of the pool's seats ([`crate::gate::seat_limit`]).
    pub seats_per_endpoint: Option<u32>,
    /// The share of the seats kept for interactive requests.
    pub reserve_seats: f64,
    /// Jobs read ahead per lane (pending in Redis until done).
    pub read_ahead: u32,
    /// Jobs read ahead per lane at most while a tenant that ran lately has few waiting: a
    /// lane's stream mixes tenants, and a tenant's share needs its next jobs in view.
    pub max_read_ahead: u32,
    /// Failures (errors other than 429/503) before a job is dead-lettered.
    pub max_attempts: u32,
    /// Deliveries (kvoy-async restarts mid-job) before a job is dead-lettered.
    pub max_deliveries: u32,
    /// First retry backoff; doubles per retry up to `max_backoff`.
    pub backoff: Duration,
    /// Longest retry backoff.
    pub max_backoff: Duration,
    /// Largest job entry accepted.
    pub max_job_bytes: usize,
    /// A request's longest time (less if its deadline is nearer).
    pub request_timeout: Duration,
    /// A job pending this long without its consumer's heartbeat is reclaimed.
    pub claim_idle: Duration,
    /// How often empty lanes are polled.
    pub poll: Duration,
    /// How often the aggregator's saturation is read.
    pub gate_poll: Duration,
    /// Models accepted when the aggregator names none.
    pub models: Vec<String>,
    /// Where results go.
    pub results_stream: String,
    /// Where dead-lettered jobs go.
    pub dead_letter_stream: String,
    /// Prefix of the per-job key that makes a result unique.
    pub done_prefix: String,
    /// How long that key is kept.
    pub done_ttl_s: u64,
    /// Output tokens assumed for a job without `max_tokens` (quota estimates).
    pub default_output_tokens: u32,
}

fn address(field: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse()
        .map_err(|_| invalid(field, format!("{text:?} is not an ip:port address")))
}

fn positive_ms(field: &str, ms: u64) -> Result<Duration, ConfigError> {
    if ms == 0 {
        return Err(invalid(field, "must be at least 1"));
    }
    Ok(Duration::from_millis(ms))
}

impl Config {
    /// Parses and checks a configuration.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig =
            serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        Self::try_from(raw)
    }

    /// The quota of `tenant` (the default tenant's when it is not named).
    pub fn tenant(&self, tenant: &str) -> &TenantQuota {
        self.tenants.get(tenant).unwrap_or(&self.default_tenant)
    }

    /// The lane named `name`.
    pub fn lane(&self, name: &str) -> Option<(usize, &Lane)> {
        self.lanes.iter().enumerate().find(|(_, l)| l.name == name)
    }
}

fn check_quota(field: &str, q: &TenantQuota) -> Result<(), ConfigError> {
    if !(q.weight.is_finite() && q.weight > 0.0) {
        return Err(invalid(format!("{field}.weight"), "must be above 0"));
    }
    if q.max_concurrent == Some(0) {
        return Err(invalid(
            format!("{field}.max_concurrent"),
            "must be at least 1",
        ));
    }
    if q.tokens_per_minute == Some(0) {
        return Err(invalid(
            format!("{field}.tokens_per_minute"),
            "must be at least 1",
        ));
    }
    Ok(())
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, ConfigError> {
        if !raw.redis_url.starts_with("redis://") && !raw.redis_url.starts_with("unix://") {
            return Err(invalid("redis_url", "must be a redis:// or unix:// URL"));
        }
        if raw.lanes.is_empty() {
            return Err(invalid("lanes", "name at least one lane"));
        }
        let mut lanes: Vec<Lane> = Vec::with_capacity(raw.lanes.len());
        for (i, l) in raw.lanes.into_iter().enumerate() {
            let field = format!("lanes[{i}]");
            if l.name.is_empty() || l.name.len() > 64 || l.name.contains(char::is_whitespace) {
                return Err(invalid(
                    format!("{field}.name"),
                    "must be 1-64 characters without spaces",
                ));
            }
            if lanes.iter().any(|o| o.name == l.name) {
                return Err(invalid(format!("{field}.name"), "names another lane"));
            }
            if l.objective.is_empty() {
                return Err(invalid(format!("{field}.objective"), "must not be empty"));
            }
            if l.sorted_set_results.is_some() && l.sorted_set.is_none() {
                return Err(invalid(
                    format!("{field}.sorted_set_results"),
                    "needs `sorted_set`",
                ));
            }
            let stream = l
                .stream
                .unwrap_or_else(|| format!("kvoy-async:jobs:{}", l.name));
            if lanes.iter().any(|o| o.stream == stream) {
                return Err(invalid(
                    format!("{field}.stream"),
                    "is another lane's stream",
                ));
            }
            lanes.push(Lane {
                name: l.name,
                stream,
                objective: l.objective,
                sorted_set: l.sorted_set,
                sorted_set_results: l.sorted_set_results,
            });
        }
        for (name, q) in &raw.tenants {
            check_quota(&format!("tenants.{name}"), q)?;
        }
        check_quota("default_tenant", &raw.default_tenant)?;
        if !(raw.saturation_level > 0.0 && raw.saturation_level <= 10.0) {
            return Err(invalid("saturation_level", "must be in (0, 10]"));
        }
        if raw.max_inflight == 0 {
            return Err(invalid("max_inflight", "must be at least 1"));
        }
        if raw.seats_per_endpoint == Some(0) {
            return Err(invalid("seats_per_endpoint", "must be at least 1"));
        }
        if !(0.0..1.0).contains(&raw.reserve_seats) {
            return Err(invalid("reserve_seats", "must be in [0, 1)"));
        }
        if raw.read_ahead == 0 {
            return Err(invalid("read_ahead", "must be at least 1"));
        }
        if raw.max_read_ahead < raw.read_ahead {
            return Err(invalid("max_read_ahead", "must be at least read_ahead"));
        }
        if raw.max_attempts == 0 {
            return Err(invalid("max_attempts", "must be at least 1"));
        }
        if raw.max_deliveries == 0 {
            return Err(invalid("max_deliveries", "must be at least 1"));
        }
        if raw.max_backoff_ms < raw.backoff_ms {
            return Err(invalid("max_backoff_ms", "must be at least backoff_ms"));
        }
        if raw.max_job_bytes < 64 {
            return Err(invalid("max_job_bytes", "must be at least 64"));
        }
        if raw.done_ttl_s == 0 {
            return Err(invalid("done_ttl_s", "must be at least 1"));
        }
        Ok(Config {
            redis_url: raw.redis_url,
            proxy: address("proxy", &raw.proxy)?,
            aggregator: raw
                .aggregator
                .as_deref()
                .map(|a| address("aggregator", a))
                .transpose()?,
            listen: raw
                .listen
                .as_deref()
                .map(|a| address("listen", a))
                .transpose()?,
            group: raw.group,
            consumer: raw.consumer,
            lanes,
            tenants: raw.tenants,
            default_tenant: raw.default_tenant,
            tenant_metadata_key: raw.tenant_metadata_key,
            saturation_level: raw.saturation_level,
            max_inflight: raw.max_inflight,
            seats_per_endpoint: raw.seats_per_endpoint,
            reserve_seats: raw.reserve_seats,
            read_ahead: raw.read_ahead,
            max_read_ahead: raw.max_read_ahead,
            max_attempts: raw.max_attempts,
            max_deliveries: raw.max_deliveries,
            backoff: positive_ms("backoff_ms", raw.backoff_ms)?,
            max_backoff: positive_ms("max_backoff_ms", raw.max_backoff_ms)?,
            max_job_bytes: raw.max_job_bytes,
            request_timeout: positive_ms("request_timeout_ms", raw.request_timeout_ms)?,
            claim_idle: positive_ms("claim_idle_ms", raw.claim_idle_ms)?,
            poll: positive_ms("poll_ms", raw.poll_ms)?,
            gate_poll: positive_ms("gate_poll_ms", raw.gate_poll_ms)?,
            models: raw.models,
            results_stream: raw.results_stream,
            dead_letter_stream: raw.dead_letter_stream,
            done_prefix: raw.done_prefix,
            done_ttl_s: raw.done_ttl_s,
            default_output_tokens: raw.default_output_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "proxy: 127.0.0.1:1\nlanes: [{name: batch, objective: batch}]\n";

    fn err(text: &str) -> String {
        match Config::from_yaml(text) {
            Ok(_) => panic!("accepted: {text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_apply() {
        let c = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.redis_url, "redis://127.0.0.1:6379/");
        assert_eq!(c.lanes[0].stream, "kvoy-async:jobs:batch");
        assert_eq!(c.max_inflight, 64);
        assert_eq!(c.claim_idle, Duration::from_secs(30));
        assert_eq!(c.tenant("anyone"), &TenantQuota::default());
        assert!(c.aggregator.is_none());
    }

    #[test]
    fn unknown_fields_are_named() {
        assert!(err(&format!("{MINIMAL}lane: x\n")).contains("unknown field `lane`"));
        let e = err("proxy: 127.0.0.1:1\nlanes: [{name: a, objective: a, prio: 1}]\n");
        assert!(e.contains("unknown field `prio`"), "{e}");
        let e = err(&format!("{MINIMAL}tenants: {{a: {{weigth: 2}}}}\n"));
        assert!(e.contains("unknown field `weigth`"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        assert!(err("proxy: nowhere\nlanes: [{name: a, objective: a}]\n").contains("`proxy`"));
        assert!(err("proxy: 127.0.0.1:1\nlanes: []\n").contains("`lanes`"));
        let two = "proxy: 127.0.0.1:1\nlanes: [{name: a, objective: a}, {name: a, objective: b}]\n";
        assert!(err(two).contains("`lanes[1].name`"));
        assert!(err(&format!("{MINIMAL}tenants: {{t: {{weight: 0}}}}\n"))
            .contains("`tenants.t.weight`"));
        assert!(err(&format!("{MINIMAL}saturation_level: 0\n")).contains("`saturation_level`"));
        assert!(err(&format!("{MINIMAL}max_inflight: 0\n")).contains("`max_inflight`"));
        assert!(err(&format!("{MINIMAL}reserve_seats: 1\n")).contains("`reserve_seats`"));
        assert!(err(&format!("{MINIMAL}seats_per_endpoint: 0\n")).contains("`seats_per_endpoint`"));
        assert!(
            err(&format!("{MINIMAL}backoff_ms: 50\nmax_backoff_ms: 10\n"))
                .contains("`max_backoff_ms`")
        );
        assert!(err(&format!("{MINIMAL}redis_url: http://x\n")).contains("`redis_url`"));
    }
}
