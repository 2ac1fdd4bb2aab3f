//! Routing policies behind one narrow trait: pick an endpoint for a request from what a proxy
//! can observe of the fleet.
//!
//! - [`basic`]: `round-robin`, `random`, `least-request` (fewest in flight at this proxy).
//! - [`kvoy`]: kvoy-shared's [`Router`](kvoy_shared::prefix_affinity::Router), alone (`kvoy`) or fed the
//!   aggregator's view (`kvoy-aggregator`).
//! - [`llmd`]: llm-d's pre-1.0 default scorers, still its config-less default (`llm-d`).
//! - [`llmd_v1`]: llm-d 1.0's guide default, "sticky until saturated" (`llm-d-1.0`, and
//!   `llm-d-1.0-calibrated` with the guide's calibration recipe run on the simulated engine).
//! - [`dynamo`]: NVIDIA Dynamo's KV router, fed the engines' KV events (`dynamo`).
//! - [`sglang`]: SGLang router's cache-aware policy (`sglang`).
//! - [`llmd_pd`]: llm-d's P/D configuration, decode first then its prefix-based decider
//!   (`llm-d-pd`), and [`dynamo::DynamoPd`], Dynamo's (`dynamo-pd`): for fleets with prefill
//!   replicas ([`PolicyKind::PD`]).

pub mod basic;
pub mod dynamo;
#[cfg(test)]
mod fixture;
pub mod kvoy;
pub mod llmd;
pub mod llmd_pd;
pub mod llmd_v1;
pub mod radix;
pub mod sglang;

use std::time::Duration;

use kvoy_shared::prefix_affinity::ConfigError;
use kvoy_sim_engine::{KvEvent, Profile};

use kvoy_shared::Rng;

/// The request being routed.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Request id (unique in the run).
    pub id: u64,
    /// The prompt text.
    pub text: &'a str,
    /// The OpenAI body a proxy would see (`/v1/completions`).
    pub body: &'a [u8],
    /// The prompt's exact token count (what a router that tokenizes would know; a router that
    /// does not must estimate it from `text`).
    pub prompt_tokens: u32,
}

/// One endpoint's figures as a metrics scrape (and the aggregator) reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EndpointMetrics {
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:kv_cache_usage_perc`, 0-1.
    pub kv_cache_usage: f64,
    /// Blocks holding a cached hash (what the aggregator counts from KV events).
    pub cached_blocks: u32,
    pub num_gpu_blocks: u32,
    pub block_size: u32,
    /// `prefix_cache_hits / prefix_cache_queries` so far, when any query was made.
    pub prefix_hit_rate: Option<f64>,
    /// `vllm:request_prefill_time_seconds` sum and count, and
    /// `vllm:request_prefill_kv_computed_tokens` sum, of the requests finished so far (vLLM
    /// observes both when a request finishes): what kvoy-aggregator estimates prefill rates from.
    pub prefill: PrefillTotals,
}

/// Cumulative prefill figures of the requests an engine finished.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillTotals {
    pub seconds: f64,
    pub requests: u64,
    pub computed_tokens: u64,
}

impl PrefillTotals {
    /// Counts a finished request that took `prefill_time` to its first token, as vLLM's
    /// histograms observe it.
    pub fn observe(&mut self, prefill_time: Duration, usage: &kvoy_sim_engine::Usage) {
        self.seconds += prefill_time.as_secs_f64();
        self.requests += 1;
        self.computed_tokens += u64::from(usage.prompt_tokens.saturating_sub(usage.cached_tokens));
    }
}

/// What a proxy observes when it routes.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    /// Virtual time.
    pub now: Duration,
    /// This proxy's open requests per endpoint.
    pub inflight: &'a [u32],
    /// The last scrape (refreshed every scrape interval, 50 ms by default).
    pub metrics: &'a [EndpointMetrics],
}

/// A request whose prompt became cached on an endpoint (its first token came out) since the
/// last scrape: what KV events tell the aggregator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefilled {
    pub endpoint: usize,
    pub request: u64,
}

/// Where a request goes: the endpoint that answers it and, for a disaggregated request, the one
/// that computes its prompt first (prefill/decode disaggregation, [`kvoy_shared::disagg`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    pub decode: usize,
    pub prefill: Option<usize>,
}

/// A routing policy. Deterministic given its seed and the calls it receives.
pub trait Policy {
    /// The endpoint (index below `view.inflight.len()`) for `request`.
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize;

    /// [`Policy::pick`] on a fleet with prefill endpoints: also names the prefill endpoint of a
    /// request it splits. A policy that knows no roles answers every request whole.
    fn pick_pd(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> Pick {
        Pick {
            decode: self.pick(request, view),
            prefill: None,
        }
    }

    /// Called after each scrape with the fresh `view` and the prompts cached since the last
    /// scrape. Policies that read server metrics only at `pick` ignore it.
    fn on_scrape(&mut self, _view: &View<'_>, _prefilled: &[Prefilled]) {}

    /// The first byte of request `request`'s answer reached the proxy from `endpoint` (its
    /// prefill is done): what a proxy sees at once, unlike a scrape.
    fn on_first_token(&mut self, _request: u64, _endpoint: usize, _now: Duration) {}

    /// The prefill half of split request `request` produced its one token on `endpoint` (its
    /// KV then leaves for the decode engine): what a router that sent the prefill itself sees.
    /// A proxy that only forwards the request to its decode endpoint does not.
    fn on_prefilled(&mut self, _request: u64, _endpoint: usize, _now: Duration) {}

    /// Request `request` on `endpoint` finished (or was refused by the engine).
    fn on_finished(&mut self, _request: u64, _endpoint: usize, _now: Duration) {}

    /// Request `request`'s answer ended with `output_tokens` in its `usage` (called before
    /// [`Policy::on_finished`]): what a proxy reading the answer's body sees.
    fn on_output(&mut self, _request: u64, _output_tokens: u32) {}

    /// `endpoint` emitted `events` (blocks stored, evicted, cache cleared) at `now`: what a
    /// router subscribed to the servers' KV events receives. In the order they must be applied.
    fn on_kv_events(&mut self, _endpoint: usize, _events: &[KvEvent], _now: Duration) {}
}

/// The policies, by command-line name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    RoundRobin,
    LeastRequest,
    Random,
    Kvoy,
    KvoyAggregator,
    LlmD,
    Sglang,
    // Appended after the first seven so that their discriminants (which seed their random
    // streams) stay as they were.
    LlmD1,
    LlmD1Calibrated,
    Dynamo,
    /// kvoy's first scorer (weighted sum with the hot-spot guard), for comparison.
    KvoyWeighted,
    /// llm-d's P/D configuration (fleets with prefill replicas).
    LlmDPd,
    /// Dynamo's disaggregated routing (fleets with prefill replicas).
    DynamoPd,
}

/// Settings shared by the policies that need them.
#[derive(Clone, Debug)]
pub struct PolicyOptions {
    pub replicas: usize,
    pub seed: u64,
    pub profile: Profile,
    /// Each replica's profile, by endpoint index (`replicas` of them; on a mixed fleet some are
    /// slower versions of `profile`, see [`crate::fleet`]): what an operator who knows the fleet
    /// can configure. No policy reads it yet.
    pub replica_profiles: Vec<Profile>,
    /// SGLang's per-worker tree bound in characters (`None`: the replica's KV capacity in
    /// characters, see [`sglang`]).
    pub sglang_tree_chars: Option<usize>,
    /// kvoy's `cost` fields set over the bench's (`--kvoy-cost`).
    pub kvoy_cost: kvoy::CostOverrides,
    /// Round-robin and least-request as Envoy runs them on this many worker threads
    /// ([`basic::EnvoyRoundRobin`], [`basic::PowerOfTwo`]); `None`: strict rotation and a full
    /// scan.
    pub envoy_workers: Option<usize>,
    /// Each replica's role (empty: every one decodes, the aggregated fleet).
    pub roles: Vec<kvoy_shared::Role>,
    /// kvoy's `disaggregation` fields set over the filter's (`--kvoy-disaggregation`).
    pub kvoy_disaggregation: kvoy::CostOverrides,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 11] = [
        PolicyKind::RoundRobin,
        PolicyKind::LeastRequest,
        PolicyKind::Random,
        PolicyKind::Kvoy,
        PolicyKind::KvoyAggregator,
        PolicyKind::KvoyWeighted,
        PolicyKind::LlmD,
        PolicyKind::Sglang,
        PolicyKind::LlmD1,
        PolicyKind::LlmD1Calibrated,
        PolicyKind::Dynamo,
    ];

    /// The P/D references: what a fleet with prefill replicas is also run with (not in
    /// [`PolicyKind::ALL`], the aggregated fleet's default).
    pub const PD: [PolicyKind; 2] = [PolicyKind::LlmDPd, PolicyKind::DynamoPd];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::LlmDPd => "llm-d-pd",
            PolicyKind::DynamoPd => "dynamo-pd",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastRequest => "least-request",
            PolicyKind::Random => "random",
            PolicyKind::Kvoy => "kvoy",
            PolicyKind::KvoyAggregator => "kvoy-aggregator",
            PolicyKind::KvoyWeighted => "kvoy-weighted",
            PolicyKind::LlmD => "llm-d",
            PolicyKind::LlmD1 => "llm-d-1.0",
            PolicyKind::LlmD1Calibrated => "llm-d-1.0-calibrated",
            PolicyKind::Dynamo => "dynamo",
            PolicyKind::Sglang => "sglang",
        }
    }

    pub fn from_name(name: &str) -> Option<PolicyKind> {
        PolicyKind::ALL
            .into_iter()
            .chain(PolicyKind::PD)
            .find(|p| p.name() == name)
    }

    /// One of the published prefix-aware routers kvoy is measured against (llm-d before and
    /// since 1.0, SGLang's, Dynamo's): the references of the summary's verdict.
    pub fn is_reference_router(self) -> bool {
        matches!(
            self,
            PolicyKind::LlmD
                | PolicyKind::Sglang
                | PolicyKind::LlmD1
                | PolicyKind::LlmD1Calibrated
                | PolicyKind::Dynamo
                | PolicyKind::LlmDPd
                | PolicyKind::DynamoPd
        )
    }

    /// A fresh policy for one run. Fails only when kvoy-shared refuses the pool.
    pub fn build(self, o: &PolicyOptions) -> Result<Box<dyn Policy>, ConfigError> {
        let rng = Rng::derive(o.seed, "policy", self as u64);
        Ok(match self {
            PolicyKind::RoundRobin => match o.envoy_workers {
                Some(workers) => Box::new(basic::EnvoyRoundRobin::new(workers, rng)),
                None => Box::new(basic::RoundRobin::default()),
            },
            PolicyKind::LeastRequest => match o.envoy_workers {
                Some(_) => Box::new(basic::PowerOfTwo::new(rng)),
                None => Box::new(basic::LeastRequest::new(rng)),
            },
            PolicyKind::Random => Box::new(basic::Random::new(rng)),
            PolicyKind::Kvoy | PolicyKind::KvoyAggregator | PolicyKind::KvoyWeighted => {
                let options = kvoy::KvoyOptions {
                    aggregator: self == PolicyKind::KvoyAggregator,
                    scorer: if self == PolicyKind::KvoyWeighted {
                        kvoy_shared::prefix_affinity::Scorer::Weighted
                    } else {
                        kvoy_shared::prefix_affinity::Scorer::Cost
                    },
                    prefill_tokens_per_s: o.profile.prefill_tokens_per_s,
                    kv_capacity_tokens: o
                        .profile
                        .num_gpu_blocks
                        .saturating_mul(o.profile.block_size),
                    cost: o.kvoy_cost.clone(),
                    roles: o.roles.clone(),
                    disaggregation: o.kvoy_disaggregation.clone(),
                };
                let rates: Vec<f64> = o
                    .replica_profiles
                    .iter()
                    .map(|p| p.prefill_tokens_per_s)
                    .collect();
                Box::new(kvoy::Kvoy::new(o.replicas, o.seed, &options, &rates)?)
            }
            PolicyKind::LlmD => Box::new(llmd::LlmD::new(o.replicas, rng)),
            PolicyKind::LlmD1 => Box::new(llmd_v1::LlmDV1::new(
                o.replicas,
                llmd_v1::LlmDV1Config::default(),
                rng,
            )),
            PolicyKind::LlmD1Calibrated => Box::new(llmd_v1::LlmDV1::new(
                o.replicas,
                llmd_v1::LlmDV1Config::calibrated(&o.profile),
                rng,
            )),
            PolicyKind::Dynamo => Box::new(dynamo::Dynamo::new(
                o.replicas,
                dynamo::DynamoConfig::for_profile(&o.profile),
                rng,
            )),
            PolicyKind::LlmDPd => Box::new(llmd_pd::LlmDPd::new(
                o.replicas,
                &o.roles,
                llmd_pd::LlmDPdConfig::default(),
                rng,
            )),
            PolicyKind::DynamoPd => {
                Box::new(dynamo::DynamoPd::new(o.replicas, &o.roles, &o.profile, rng))
            }
            PolicyKind::Sglang => {
                let chars = o
                    .sglang_tree_chars
                    .unwrap_or_else(|| sglang::default_tree_chars(&o.profile));
                Box::new(sglang::Sglang::new(
                    o.replicas,
                    sglang::SglangConfig::with_tree_chars(chars),
                    rng,
                ))
            }
        })
    }
}

/// The index of a smallest value, ties broken at random.
pub(crate) fn argmin_random(values: impl Iterator<Item = u64> + Clone, rng: &mut Rng) -> usize {
    let Some(min) = values.clone().min() else {
        return 0;
    };
    let ties = values.clone().filter(|&v| v == min).count();
    let nth = rng.below(ties);
    values
        .enumerate()
        .filter(|&(_, v)| v == min)
        .nth(nth)
        .map_or(0, |(i, _)| i)
}

/// The index of a largest score (within 1e-9), ties broken at random.
pub(crate) fn argmax_random(scores: &[f64], rng: &mut Rng) -> usize {
    const EPS: f64 = 1e-9;
    let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let ties = scores.iter().filter(|&&s| s >= best - EPS).count();
    let nth = rng.below(ties);
    scores
        .iter()
        .enumerate()
        .filter(|&(_, &s)| s >= best - EPS)
        .nth(nth)
        .map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in PolicyKind::ALL.into_iter().chain(PolicyKind::PD) {
            assert_eq!(PolicyKind::from_name(p.name()), Some(p));
        }
        assert_eq!(PolicyKind::from_name("nope"), None);
    }

    #[test]
    fn ties_are_random_among_the_best() {
        let mut rng = Rng::new(1);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[argmin_random([2u64, 1, 1].into_iter(), &mut rng)] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 100 && seen[2] > 100, "{seen:?}");
        assert_eq!(argmax_random(&[0.5, 3.0, 1.0], &mut rng), 1);
    }
}
