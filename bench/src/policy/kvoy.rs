//! kvoy's picker: kvoy-shared's [`Router`] run natively, exactly as the filter runs it.
//!
//! - `kvoy`: one proxy with the static pool. Its prefix index learns only from its own routing
//!   decisions; load is its own in-flight count per endpoint (prefix 3, in-flight 2, hot-spot
//!   guard 8 / 1.5: the crate defaults).
//! - `kvoy-aggregator`: the same router fed what kvoy-aggregator gives the filter. Every scrape
//!   (50 ms of virtual time, the aggregator's scrape interval) the servers' figures become a
//!   [`Snapshot`] of [`EndpointStatus`]es, turned into the live pool by
//!   [`kvoy_shared::snapshot_board::live_pool`] and installed with [`Router::set_pool`], as the filter does
//!   on a new snapshot version: queue length and KV usage then count (queue 2, KV 2), and a
//!   changed cache generation drops what the index believed of an endpoint. The snapshot carries
//!   no block identities, so the index is fed the engines' real cached blocks through the
//!   causal join of the design (a request's text keys linked to the server blocks its prefill
//!   stored): when a request's prompt is known cached on its endpoint (its first token came out
//!   before the scrape), its keys are applied with [`Router::apply_remote`]. Evictions are
//!   applied as kvoy-aggregator's linker applies them at best: each key is linked to the engine
//!   block that holds its last token (the simulation knows every request's blocks, where the
//!   live linker matches lengths and leaves ambiguous decisions unlinked), and a
//!   `BlockRemoved` makes the index forget the keys linked to that block and their suffix
//!   ([`Router::apply_removal`]) [`REMOVAL_DELAY`] later, on a scrape (the live proxies took
//!   25-154 ms from the event, `e2e/tests/envoy_removals.rs`). Each endpoint's
//!   prefill rate is kvoy-aggregator's own online estimate ([`PrefillEstimator`]) from the
//!   engines' prefill-time and computed-token histograms, observed as vLLM observes them (when
//!   a request finishes); before it has enough evidence, the model's configured rate stands.

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kvoy_aggregator::prefill::{PrefillEstimator, PrefillSample};

use kvoy_shared::prefix::BlockKey;
use kvoy_shared::prefix_affinity::{ConfigError, PluginConfig, Router, Scorer};
use kvoy_shared::request::Api;
use kvoy_shared::snapshot::{EndpointStatus, Snapshot};
use kvoy_shared::{snapshot_board, Charge, EndpointId, Outstanding, OutstandingDelta, Tier};

use kvoy_sim_engine::tokenizer::BYTES_PER_TOKEN;
use kvoy_sim_engine::{KvEvent, MEDIUM_GPU};

use super::{argmin_random, Pick, Policy, Prefilled, RouteRequest, View};
use crate::sim::block_hashes;
use kvoy_shared::Rng;

/// The model name every simulated endpoint serves.
pub const MODEL: &str = "sim";

/// The address of simulated endpoint `i`.
pub fn address(i: usize) -> SocketAddr {
    let [a, b] = (i as u16).to_be_bytes();
    SocketAddr::from((Ipv4Addr::new(10, 1, a, b), 8000))
}

/// Fields merged into the simulated kvoy's `cost` configuration (`--kvoy-cost`): a JSON object
/// with the filter's own field names, checked as the filter checks its configuration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostOverrides(pub serde_json::Map<String, serde_json::Value>);

impl std::str::FromStr for CostOverrides {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match serde_json::from_str(s) {
            Ok(serde_json::Value::Object(fields)) => Ok(CostOverrides(fields)),
            Ok(_) => Err("expected a JSON object, e.g. '{\"uncached_weight\": 2}'".to_owned()),
            Err(e) => Err(format!("not JSON: {e}")),
        }
    }
}

/// How the simulated kvoy is configured.
#[derive(Clone, Debug, PartialEq)]
pub struct KvoyOptions {
    /// Fed the aggregator's view (`kvoy-aggregator`).
    pub aggregator: bool,
    pub scorer: Scorer,
    /// `cost.prefill_tokens_per_s`, as an operator sets it from `kvoy-aggregator calibrate`.
    pub prefill_tokens_per_s: f64,
    /// `cost.kv_capacity_tokens`, as an operator reads it from vLLM's start-up log ("GPU KV
    /// cache size: N tokens"); every replica has the same geometry.
    pub kv_capacity_tokens: u32,
    /// Set last, over the two above.
    pub cost: CostOverrides,
    /// Each endpoint's role (empty: all decode).
    pub roles: Vec<kvoy_shared::Role>,
    /// Fields set in the `disaggregation` configuration (`--kvoy-disaggregation`).
    pub disaggregation: CostOverrides,
}

/// A kvoy configuration over `replicas` simulated endpoints with the crate's defaults but for
/// the scorer and the model's prefill rate.
pub fn config(
    replicas: usize,
    o: &KvoyOptions,
    rates: &[f64],
) -> Result<PluginConfig, ConfigError> {
    let uniform = rates.windows(2).all(|w| w[0] == w[1]);
    let endpoints: Vec<serde_json::Value> = (0..replicas)
        .map(|i| {
            let mut e = serde_json::json!({"address": address(i).to_string(), "models": [MODEL]});
            if let Some(role) = o.roles.get(i) {
                e["role"] = serde_json::json!(role.name());
            }
            if let (false, Some(rate)) = (uniform, rates.get(i)) {
                e["prefill_tokens_per_s"] = serde_json::json!(rate);
            }
            e
        })
        .collect();
    let scorer = match o.scorer {
        Scorer::Cost => "cost",
        Scorer::Weighted => "weighted",
    };
    let mut json = serde_json::json!({
        "endpoints": endpoints,
        "scorer": scorer,
        "cost": {
            "prefill_tokens_per_s": o.prefill_tokens_per_s,
            "kv_capacity_tokens": o.kv_capacity_tokens,
        },
    });
    for (field, value) in &o.cost.0 {
        json["cost"][field] = value.clone();
    }
    if !o.disaggregation.0.is_empty() {
        json["disaggregation"] = serde_json::Value::Object(o.disaggregation.0.clone());
    }
    let json = json.to_string();
    PluginConfig::from_json(json.as_bytes())
}

/// A request this proxy sent and has not seen finish.
#[derive(Clone, Copy, Debug)]
struct Sent {
    endpoint: usize,
    charge: Charge,
    answered: bool,
    /// A split request's prefill endpoint and its charge, released when the answer begins.
    prefill: Option<(usize, Charge)>,
}

/// From a server's eviction to the proxies' index (aggregator mode): the proxies' decision
/// exchange and the workers' tick.
pub const REMOVAL_DELAY: Duration = Duration::from_millis(150);

/// A request routed but not yet known cached (aggregator mode): its keys, where they end, and
/// its engine blocks.
struct Pending {
    keys: Vec<BlockKey>,
    ends: Vec<u32>,
    blocks: Vec<u64>,
}

pub struct Kvoy {
    router: Router,
    aggregator: bool,
    pending: HashMap<u64, Pending>,
    /// Aggregator mode: the keys linked to each engine block, per endpoint.
    links: Vec<HashMap<u64, Vec<BlockKey>>>,
    /// Aggregator mode: the blocks each endpoint holds on its CPU tier, and the linked ones of
    /// those it evicted from its GPU (offloaded: their keys stay linked).
    host: Vec<HashSet<u64>>,
    off_gpu: Vec<HashSet<u64>>,
    /// Removals and offloads on their way to the index: when they arrive, the endpoint, the
    /// tier the keys moved to (`None`: removed), the keys.
    removals: Vec<(Duration, usize, Option<Tier>, Vec<BlockKey>)>,
    /// Keys the removals made the index forget.
    pub removed_keys: u64,
    /// Keys the offloads moved down a tier.
    pub offloaded_keys: u64,
    /// What the filter keeps in its shared outstanding table, per endpoint.
    outstanding: Vec<Outstanding>,
    sent: HashMap<u64, Sent>,
    version: u64,
    /// The aggregator's prefill-rate estimate per endpoint, from the scraped metrics.
    prefill: Vec<PrefillEstimator>,
    /// Virtual time 0 as the estimator's clock (it reads only differences).
    epoch: Instant,
    fallback: Rng,
    /// Requests the router refused (routed to the least-loaded endpoint instead).
    pub refused: u64,
    /// Answers ended, of which every [`kvoy_shared::usage::SAMPLE_EVERY`]th teaches the
    /// router its output length.
    answers: u64,
    /// Each endpoint's role, as the aggregator reports it.
    roles: Vec<kvoy_shared::Role>,
}

impl Kvoy {
    /// Fails when kvoy-shared refuses the pool (e.g. more than its endpoint limit).
    pub fn new(
        replicas: usize,
        seed: u64,
        options: &KvoyOptions,
        rates: &[f64],
    ) -> Result<Self, ConfigError> {
        Ok(Kvoy {
            router: Router::new(config(replicas, options, rates)?, seed),
            aggregator: options.aggregator,
            pending: HashMap::new(),
            links: vec![HashMap::new(); replicas],
            host: vec![HashSet::new(); replicas],
            off_gpu: vec![HashSet::new(); replicas],
            removals: Vec::new(),
            removed_keys: 0,
            offloaded_keys: 0,
            outstanding: vec![Outstanding::default(); replicas],
            sent: HashMap::new(),
            version: 0,
            prefill: (0..replicas).map(|_| PrefillEstimator::default()).collect(),
            epoch: Instant::now(),
            fallback: Rng::derive(seed, "kvoy/fallback", 0),
            refused: 0,
            answers: 0,
            roles: options.roles.clone(),
        })
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    fn apply(&mut self, endpoint: usize, delta: OutstandingDelta, now: Duration) {
        if let Some(o) = self.outstanding.get_mut(endpoint) {
            o.apply(delta, now);
        }
    }

    /// The aggregator's snapshot of the fleet.
    fn snapshot(&mut self, view: &View<'_>) -> Snapshot {
        self.version += 1;
        let now = self.epoch + view.now;
        for (e, m) in self.prefill.iter_mut().zip(view.metrics) {
            let p = m.prefill;
            let sample = PrefillSample::from_histogram(
                p.seconds,
                p.requests as f64,
                p.computed_tokens as f64,
            );
            e.observe(Some(sample), now);
        }
        let endpoints = view
            .metrics
            .iter()
            .enumerate()
            .map(|(i, m)| EndpointStatus {
                slot: i as u16,
                address: address(i),
                models: vec![MODEL.to_owned()],
                ready: true,
                stale: false,
                waiting: m.waiting,
                running: m.running,
                kv_cache_usage: m.kv_cache_usage as f32,
                block_size: m.block_size,
                capacity_blocks: m.num_gpu_blocks,
                cached_blocks: [m.cached_blocks, 0, 0],
                // The simulated servers never drop their cache.
                cache_generation: 0,
                prefix_hit_rate: m.prefix_hit_rate.map(|r| r as f32),
                prefill_tokens_per_s: self.prefill[i].estimate().map(|e| e.tokens_per_s as f32),
                role: self.roles.get(i).copied().unwrap_or_default(),
            })
            .collect();
        Snapshot {
            epoch: 1,
            version: self.version,
            endpoints,
        }
    }
}

impl Policy for Kvoy {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        self.pick_pd(request, view).decode
    }

    fn pick_pd(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> Pick {
        match self
            .router
            .route_body(Api::Completions, request.body, &self.outstanding, view.now)
        {
            Ok(decision) => {
                if self.aggregator {
                    let block_size = view.metrics.first().map_or(16, |m| m.block_size) as usize;
                    let mut blocks = Vec::new();
                    let tokens = kvoy_sim_engine::tokenizer::tokenize(request.text);
                    block_hashes(&tokens, block_size.max(1), usize::MAX, &mut blocks);
                    self.pending.insert(
                        request.id,
                        Pending {
                            keys: self.router.last_keys().to_vec(),
                            ends: self.router.last_key_ends().to_vec(),
                            blocks,
                        },
                    );
                }
                let endpoint = decision.endpoint.index();
                let charge = decision.charge;
                self.apply(endpoint, OutstandingDelta::sent(charge), view.now);
                let prefill = decision.prefill.map(|p| (p.endpoint.index(), p.charge));
                if let Some((p, charge)) = prefill {
                    self.apply(p, OutstandingDelta::sent(charge), view.now);
                }
                self.sent.insert(
                    request.id,
                    Sent {
                        endpoint,
                        charge,
                        answered: false,
                        prefill,
                    },
                );
                Pick {
                    decode: endpoint,
                    prefill: prefill.map(|(p, _)| p),
                }
            }
            Err(e) => {
                log::warn!("kvoy refused request {}: {e}", request.id);
                self.refused += 1;
                Pick {
                    decode: argmin_random(
                        view.inflight.iter().map(|&n| u64::from(n)),
                        &mut self.fallback,
                    ),
                    prefill: None,
                }
            }
        }
    }

    fn on_first_token(&mut self, request: u64, _endpoint: usize, now: Duration) {
        if let Some(sent) = self.sent.get_mut(&request).filter(|s| !s.answered) {
            sent.answered = true;
            let (endpoint, charge, prefill) = (sent.endpoint, sent.charge, sent.prefill.take());
            self.apply(endpoint, OutstandingDelta::answered(charge), now);
            // The prefill is done when the answer begins (as the filter releases it).
            if let Some((p, charge)) = prefill {
                self.apply(p, OutstandingDelta::finished(charge, false), now);
            }
        }
    }

    fn on_output(&mut self, _request: u64, output_tokens: u32) {
        // The filter reads one answer in SAMPLE_EVERY (per worker).
        self.answers += 1;
        if self.answers % kvoy_shared::usage::SAMPLE_EVERY == 1 {
            self.router.observe_output(MODEL, u64::from(output_tokens));
        }
    }

    fn on_finished(&mut self, request: u64, _endpoint: usize, now: Duration) {
        if let Some(sent) = self.sent.remove(&request) {
            self.apply(
                sent.endpoint,
                OutstandingDelta::finished(sent.charge, sent.answered),
                now,
            );
            if let Some((p, charge)) = sent.prefill {
                self.apply(p, OutstandingDelta::finished(charge, false), now);
            }
        }
    }

    fn on_scrape(&mut self, view: &View<'_>, prefilled: &[Prefilled]) {
        if !self.aggregator {
            return;
        }
        let snapshot = self.snapshot(view);
        self.router
            .set_pool(snapshot_board::live_pool(&snapshot, true));
        for p in prefilled {
            if let Some(pending) = self.pending.remove(&p.request) {
                let id = EndpointId(p.endpoint as u16);
                self.router.apply_remote(id, &pending.keys);
                let block_size = view.metrics.get(p.endpoint).map_or(16, |m| m.block_size);
                if let Some(links) = self.links.get_mut(p.endpoint) {
                    link(links, &pending, block_size.max(1) as usize);
                }
            }
        }
        let now = view.now;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.removals)
            .into_iter()
            .partition(|r| r.0 <= now);
        self.removals = later;
        for (_, endpoint, fate, keys) in due {
            let id = EndpointId(endpoint as u16);
            match fate {
                None => self.removed_keys += self.router.apply_removal(id, &keys) as u64,
                Some(tier) => {
                    self.offloaded_keys += self.router.apply_demotion(id, &keys, tier) as u64
                }
            }
        }
    }

    fn on_kv_events(&mut self, endpoint: usize, events: &[KvEvent], now: Duration) {
        if !self.aggregator {
            return;
        }
        let (Some(links), Some(host), Some(off_gpu)) = (
            self.links.get_mut(endpoint),
            self.host.get_mut(endpoint),
            self.off_gpu.get_mut(endpoint),
        ) else {
            return;
        };
        // As the aggregator's linker does: a linked block evicted from the GPU with a copy on
        // the CPU tier is offloaded (its keys stay linked), else removed; an offloaded block
        // whose CPU copy goes is removed; stored on the GPU again, it is back there.
        let (mut removed, mut offloaded) = (Vec::new(), Vec::new());
        for e in events {
            match e {
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } if *medium == MEDIUM_GPU => {
                    for h in block_hashes {
                        if host.contains(h) {
                            if let Some(keys) = links.get(h) {
                                off_gpu.insert(*h);
                                offloaded.extend_from_slice(keys);
                            }
                        } else {
                            removed.extend(links.remove(h).into_iter().flatten());
                        }
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for h in block_hashes {
                        host.remove(h);
                        if off_gpu.remove(h) {
                            removed.extend(links.remove(h).into_iter().flatten());
                        }
                    }
                }
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } if *medium == MEDIUM_GPU => {
                    for h in block_hashes {
                        off_gpu.remove(h);
                    }
                }
                KvEvent::BlockStored { block_hashes, .. } => host.extend(block_hashes),
                // The index forgets the endpoint with its cache generation.
                KvEvent::AllBlocksCleared => {
                    links.clear();
                    host.clear();
                    off_gpu.clear();
                }
            }
        }
        if !removed.is_empty() {
            self.removals
                .push((now + REMOVAL_DELAY, endpoint, None, removed));
        }
        if !offloaded.is_empty() {
            self.removals
                .push((now + REMOVAL_DELAY, endpoint, Some(Tier::Cpu), offloaded));
        }
    }
}

/// Links each key of a cached request to the block holding its last token (keys in a partial
/// last block stay unlinked: no event names that block).
fn link(links: &mut HashMap<u64, Vec<BlockKey>>, pending: &Pending, block_size: usize) {
    for (key, &end) in pending.keys.iter().zip(&pending.ends) {
        let last_token = (end as usize).div_ceil(BYTES_PER_TOKEN).saturating_sub(1);
        if let Some(block) = pending.blocks.get(last_token / block_size) {
            links.entry(*block).or_default().push(*key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixture::Observed;
    use std::time::Duration;

    /// kvoy-aggregator with `scorer`, the profile's prefill rate and KV capacity.
    fn aggregator_mode(scorer: Scorer) -> KvoyOptions {
        KvoyOptions {
            aggregator: true,
            scorer,
            prefill_tokens_per_s: 25_000.0,
            kv_capacity_tokens: 409_600,
            cost: CostOverrides::default(),
            roles: Vec::new(),
            disaggregation: CostOverrides::default(),
        }
    }

    #[test]
    fn cost_overrides_reach_the_filter_configuration_and_are_checked_as_it_checks_them() {
        let mut o = aggregator_mode(Scorer::Cost);
        o.cost = r#"{"uncached_weight": 2, "max_num_seqs": 64}"#.parse().unwrap();
        let c = config(2, &o, &[]).unwrap();
        assert_eq!(c.cost.uncached_weight, 2.0);
        assert_eq!(c.cost.max_num_seqs, 64);
        // The bench's own figures stay unless overridden.
        assert_eq!(c.cost.prefill_tokens_per_s, 25_000.0);
        o.cost = r#"{"uncached_wieght": 2}"#.parse().unwrap();
        let e = config(2, &o, &[]).unwrap_err().to_string();
        assert!(e.contains("uncached_wieght"), "{e}");
        assert!("[1]".parse::<CostOverrides>().is_err());
        assert!("{".parse::<CostOverrides>().is_err());
    }

    fn body(text: &str) -> Vec<u8> {
        serde_json::json!({"model": MODEL, "prompt": text})
            .to_string()
            .into_bytes()
    }

    /// Request `id` as the filter sees it: the body alone.
    fn body_request(id: u64, body: &[u8]) -> RouteRequest<'_> {
        RouteRequest {
            id,
            text: "",
            body,
            prompt_tokens: 0,
        }
    }

    #[test]
    fn same_prefix_same_endpoint_and_loads_from_scrapes() {
        let mut p = Kvoy::new(4, 3, &aggregator_mode(Scorer::Weighted), &[]).unwrap();
        let mut fleet = Observed::idle(4);
        let system = "abc ".repeat(500);
        let b = body(&format!("{system}first"));
        let first = p.pick(&body_request(1, &b), &fleet.view());
        let b2 = body(&format!("{system}second"));
        assert_eq!(p.pick(&body_request(2, &b2), &fleet.view()), first);
        // The holder's queue grows past the others: the scrape makes the router see it.
        fleet.metrics[first].waiting = 50;
        fleet.metrics[first].kv_cache_usage = 0.95;
        let fleet = fleet.at(Duration::from_millis(50));
        let view = fleet.view();
        p.on_scrape(
            &view,
            &[Prefilled {
                endpoint: first,
                request: 1,
            }],
        );
        assert!(!p.pending.contains_key(&1));
        let load = p
            .router()
            .pool()
            .get(EndpointId(first as u16))
            .unwrap()
            .load;
        assert_eq!(load.waiting, Some(50));
        let b3 = body(&format!("{system}third"));
        assert_ne!(
            p.pick(&body_request(3, &b3), &view),
            first,
            "the hot-spot guard spills"
        );
    }

    /// An aggregator-mode policy over two endpoints of 16-token blocks that routed one prompt
    /// of 2,000 bytes (500 tokens, 31 full blocks; keys of 64 bytes, 16 tokens, each) and saw
    /// it prefilled: the policy, the endpoint, the prompt's keys and its engine blocks.
    fn one_prompt_prefilled() -> (Kvoy, usize, Vec<BlockKey>, Vec<u64>) {
        let mut p = Kvoy::new(2, 1, &aggregator_mode(Scorer::Cost), &[]).unwrap();
        let text = "abcd".repeat(500);
        let b = body(&text);
        let req = RouteRequest {
            id: 1,
            text: &text,
            body: &b,
            prompt_tokens: 500,
        };
        let e = p.pick(&req, &sixteen_token_blocks(Duration::ZERO).view());
        let keys = p.router().last_keys().to_vec();
        let mut blocks = Vec::new();
        block_hashes(
            &kvoy_sim_engine::tokenizer::tokenize(&text),
            16,
            usize::MAX,
            &mut blocks,
        );
        p.on_scrape(
            &sixteen_token_blocks(Duration::from_millis(50)).view(),
            &[Prefilled {
                endpoint: e,
                request: 1,
            }],
        );
        (p, e, keys, blocks)
    }

    /// Two idle endpoints of 16-token blocks at `now`.
    fn sixteen_token_blocks(now: Duration) -> Observed {
        let mut fleet = Observed::idle(2).at(now);
        for m in &mut fleet.metrics {
            m.block_size = 16;
        }
        fleet
    }

    #[test]
    fn an_engines_eviction_reaches_the_index_after_the_relay_delay() {
        let (mut p, e, keys, blocks) = one_prompt_prefilled();
        let scrape = |p: &mut Kvoy, now| p.on_scrape(&sixteen_token_blocks(now).view(), &[]);
        let id = EndpointId(e as u16);
        let held = p.router().index().matched(id, &keys);
        assert!(held >= 20, "{held} of {} keys held", keys.len());
        // The engine evicts the block holding the 11th key's last token (block 10).
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![blocks[10]],
            medium: kvoy_sim_engine::MEDIUM_GPU,
        };
        p.on_kv_events(e, &[removed], Duration::from_millis(60));
        scrape(&mut p, Duration::from_millis(100));
        assert_eq!(p.router().index().matched(id, &keys), held, "not yet");
        scrape(&mut p, Duration::from_millis(60) + REMOVAL_DELAY);
        assert_eq!(p.router().index().matched(id, &keys), 10);
        assert_eq!(p.removed_keys, (held - 10) as u64);
    }

    #[test]
    fn a_block_offloaded_to_the_cpu_tier_keeps_its_keys_at_the_cpu_tier() {
        use kvoy_sim_engine::MEDIUM_CPU;
        let (mut p, e, keys, blocks) = one_prompt_prefilled();
        let scrape = |p: &mut Kvoy, now| p.on_scrape(&sixteen_token_blocks(now).view(), &[]);
        let id = EndpointId(e as u16);
        let held = p.router().index().matched(id, &keys);
        let stored = |medium| KvEvent::BlockStored {
            block_hashes: blocks.clone(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 16,
            medium,
        };
        let removed = |i: usize, medium| KvEvent::BlockRemoved {
            block_hashes: vec![blocks[i]],
            medium,
        };
        // Written through to the CPU tier; then the GPU evicts block 10: offloaded, not removed.
        p.on_kv_events(
            e,
            &[stored(MEDIUM_CPU), removed(10, MEDIUM_GPU)],
            Duration::from_millis(60),
        );
        scrape(&mut p, Duration::from_millis(60) + REMOVAL_DELAY);
        let mut m = Vec::new();
        p.router().index().matched_all(&keys, &mut m);
        assert_eq!((m[e].keys(), m[e].within(Tier::Gpu)), (held, 10));
        assert_eq!((p.offloaded_keys, p.removed_keys), ((held - 10) as u64, 0));
        // Its CPU copy goes too: removed.
        p.on_kv_events(e, &[removed(10, MEDIUM_CPU)], Duration::from_millis(300));
        scrape(&mut p, Duration::from_millis(300) + REMOVAL_DELAY);
        assert_eq!(p.router().index().matched(id, &keys), 10);
        assert_eq!(p.removed_keys, (held - 10) as u64);
    }

    #[test]
    fn the_aggregator_view_carries_each_endpoints_estimated_prefill_rate() {
        let mut p = Kvoy::new(2, 1, &aggregator_mode(Scorer::Cost), &[]).unwrap();
        let mut fleet = Observed::idle(2);
        let rate = |p: &Kvoy, i: u16| {
            let e = p.router().pool().get(EndpointId(i)).unwrap();
            e.load.prefill_tokens_per_s
        };
        // Endpoint 1 prefills at half endpoint 0's speed: a request a second, alone, 2,000
        // computed tokens each (10 ms fixed cost).
        for s in 0..120u64 {
            for (i, m) in fleet.metrics.iter_mut().enumerate() {
                let r = [40_000.0, 20_000.0][i];
                m.prefill.requests += 1;
                m.prefill.computed_tokens += 2_000;
                m.prefill.seconds += 0.010 + 2_000.0 / r;
            }
            fleet.now = Duration::from_secs(s);
            p.on_scrape(&fleet.view(), &[]);
            if s == 0 {
                assert_eq!(rate(&p, 0), None, "no estimate without evidence");
            }
        }
        let (fast, slow) = (rate(&p, 0).unwrap(), rate(&p, 1).unwrap());
        // One prompt length does not separate the fixed cost: the average rate, fixed cost
        // included (2,000 / 0.060 and 2,000 / 0.110 tokens/s).
        assert!((fast / 33_333.0 - 1.0).abs() < 0.02, "{fast}");
        assert!((slow / 18_182.0 - 1.0).abs() < 0.02, "{slow}");
    }
}
