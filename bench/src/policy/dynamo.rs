//! NVIDIA Dynamo's KV router (`lib/kv-router`: the default worker selector and its active
//! sequence tracking) with its published defaults. Sources and commits: bench/README.md.
//!
//! The router tokenizes the request (here with the engines' own tokenizer) and cuts it into the
//! engine's KV blocks (16 tokens); it learns which blocks each worker holds from the workers' KV
//! events ([`Policy::on_kv_events`], applied after `kv_event_delay`, default 0). For worker `w`:
//!
//! - `overlap_w`: leading request blocks `w` holds on its device, and `host_w` the blocks after
//!   those it holds on its host (CPU) tier, when the engines offload (`kvoy-bench sim
//!   --cpu-offload-blocks`), credited at 0.75 a block (Dynamo's host credit; 0.25 for disk,
//!   which the simulated servers do not have);
//! - `raw_prefill_blocks = (active_prefill_tokens_w + isl) / block_size`, where
//!   `active_prefill_tokens_w` sums the uncached prompt tokens (`isl - overlap * block_size`) of
//!   the requests routed to `w` whose first token has not come back yet;
//! - `adjusted = max(raw_prefill_blocks - overlap_score_credit * overlap_w
//!   - host_credit * host_w, 0)`;
//! - `decode_blocks`: distinct complete prompt blocks of the requests active on `w` (added at
//!   routing, released at completion; output blocks not tracked), plus this request's blocks not
//!   already among them;
//! - `cost = prefill_load_scale * adjusted + decode_blocks
//!   + decode_active_request_weight * active_requests`.
//!
//! Defaults: `overlap_score_credit` 1.0, `prefill_load_scale` 1.0 (the renamed
//! `overlap_score_weight`), `decode_active_request_weight` 0, `overlap_score_credit_decay` 0
//! (off, not modelled), `router_temperature` 0: the lowest cost wins, exact ties at random; with a
//! temperature `t > 0` a worker is sampled with probability proportional to
//! `exp(-(cost - min) / ((max - min) * t))`. The optional router queue (holding requests while
//! every worker is over `threshold * max_num_batched_tokens` of active prefill) and the busy-worker
//! thresholds are off by default and not modelled.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::time::Duration;

use kvoy_sim_engine::tokenizer::{chunk_token, BYTES_PER_TOKEN};
use kvoy_sim_engine::{KvEvent, Profile};

use super::{Pick, Policy, RouteRequest, View};
use crate::ideal::PassThrough;
use crate::sim::{block_hashes_into, CacheMirror};
use kvoy_shared::Rng;

type BlockCounts = HashMap<u64, u32, BuildHasherDefault<PassThrough>>;

/// The router's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DynamoConfig {
    /// Tokens per KV block (the engine's).
    pub block_size: usize,
    pub overlap_score_credit: f64,
    /// Credit of a block held on the host (CPU) tier.
    pub host_credit: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    pub router_temperature: f64,
    /// Count prompt-side prefill tokens in the load (`router_track_prefill_tokens`).
    pub track_prefill_tokens: bool,
    /// Time from a worker's KV event to the router's index (event transport).
    pub kv_event_delay: Duration,
    /// Count the active requests' prompt blocks in the cost (`router_track_active_blocks`;
    /// off for Dynamo's prefill router).
    pub track_active_blocks: bool,
    /// Count a block shared by several active requests once (`assume_kv_reuse`; off for the
    /// decode router of a disaggregated deployment, which counts every request's blocks).
    pub assume_kv_reuse: bool,
}

impl DynamoConfig {
    /// The published defaults over engines of `profile`.
    pub fn for_profile(profile: &Profile) -> Self {
        DynamoConfig {
            block_size: profile.block_size as usize,
            overlap_score_credit: 1.0,
            host_credit: 0.75,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            router_temperature: 0.0,
            track_prefill_tokens: true,
            kv_event_delay: Duration::ZERO,
            track_active_blocks: true,
            assume_kv_reuse: true,
        }
    }
}

/// A routed request still active on its worker.
struct Active {
    worker: usize,
    /// Its complete prompt blocks.
    blocks: Vec<u64>,
    /// Prefill tokens it still counts (0 once its first token came back).
    prefill_tokens: u64,
}

pub struct Dynamo {
    config: DynamoConfig,
    /// Each worker's cached blocks, from its KV events.
    index: Vec<CacheMirror>,
    /// Events not yet delivered (when `kv_event_delay` > 0): due time, worker, events.
    in_transit: VecDeque<(Duration, usize, Vec<KvEvent>)>,
    active_blocks: Vec<BlockCounts>,
    /// Per worker, the active requests' prompt blocks counted once per request.
    active_block_refs: Vec<u64>,
    active_prefill_tokens: Vec<u64>,
    active_requests: Vec<u32>,
    open: HashMap<u64, Active>,
    /// Block lists of finished requests, reused.
    spare: Vec<Vec<u64>>,
    rng: Rng,
    // Scratch.
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    hash_scratch: Vec<u8>,
    overlaps: Vec<usize>,
    costs: Vec<f64>,
    weights: Vec<f64>,
}

impl Dynamo {
    pub fn new(replicas: usize, config: DynamoConfig, rng: Rng) -> Self {
        Dynamo {
            config,
            index: (0..replicas).map(|_| CacheMirror::default()).collect(),
            in_transit: VecDeque::new(),
            active_blocks: (0..replicas).map(|_| BlockCounts::default()).collect(),
            active_block_refs: vec![0; replicas],
            active_prefill_tokens: vec![0; replicas],
            active_requests: vec![0; replicas],
            open: HashMap::new(),
            spare: Vec::new(),
            rng,
            tokens: Vec::new(),
            hashes: Vec::new(),
            hash_scratch: Vec::new(),
            overlaps: Vec::new(),
            costs: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// The costs of the last request, per worker.
    pub fn costs(&self) -> &[f64] {
        &self.costs
    }

    pub fn active_prefill_tokens(&self) -> &[u64] {
        &self.active_prefill_tokens
    }

    /// Distinct active prompt blocks per worker.
    pub fn active_blocks(&self, worker: usize) -> usize {
        self.active_blocks.get(worker).map_or(0, HashMap::len)
    }

    /// Applies the events in transit that are due at `now`.
    fn deliver(&mut self, now: Duration) {
        while self.in_transit.front().is_some_and(|(due, ..)| *due <= now) {
            if let Some((_, worker, events)) = self.in_transit.pop_front() {
                if let Some(index) = self.index.get_mut(worker) {
                    index.apply(&events);
                }
            }
        }
    }

    /// Tokenizes `text` and hashes its complete blocks into `self.tokens` and `self.hashes`.
    fn hash_request(&mut self, text: &str) {
        self.tokens.clear();
        self.tokens
            .extend(text.as_bytes().chunks(BYTES_PER_TOKEN).map(chunk_token));
        block_hashes_into(
            &self.tokens,
            self.config.block_size,
            usize::MAX,
            &mut self.hashes,
            &mut self.hash_scratch,
        );
    }

    /// Every worker's cost for the hashed request into `self.costs` (infinite for a worker
    /// `eligible` refuses).
    fn score(&mut self, n: usize, eligible: &dyn Fn(usize) -> bool) {
        let bs = self.config.block_size.max(1) as u64;
        let isl = self.tokens.len() as u64;
        self.overlaps.clear();
        self.costs.clear();
        for w in 0..n {
            if !eligible(w) {
                self.overlaps.push(0);
                self.costs.push(f64::INFINITY);
                continue;
            }
            let overlap = self.index[w].matched(&self.hashes);
            self.overlaps.push(overlap);
            let cached = (overlap as u64 * bs).min(isl);
            let raw_prefill_tokens = if self.config.track_prefill_tokens {
                self.active_prefill_tokens[w] + (isl - cached) + cached
            } else {
                0
            };
            let raw_prefill_blocks = raw_prefill_tokens as f64 / bs as f64;
            let host = self.index[w].matched_host(&self.hashes, overlap);
            let credit = self.config.overlap_score_credit * overlap as f64
                + self.config.host_credit * host as f64;
            let adjusted = (raw_prefill_blocks - credit).max(0.0);
            let decode_blocks = if !self.config.track_active_blocks {
                0.0
            } else if self.config.assume_kv_reuse {
                let active = &self.active_blocks[w];
                let new_blocks = self
                    .hashes
                    .iter()
                    .filter(|h| !active.contains_key(h))
                    .count();
                (active.len() + new_blocks) as f64
            } else {
                (self.active_block_refs[w] + self.hashes.len() as u64) as f64
            };
            let requests =
                self.config.decode_active_request_weight * f64::from(self.active_requests[w]);
            self.costs
                .push(self.config.prefill_load_scale * adjusted + decode_blocks + requests);
        }
    }

    /// The lowest cost (ties uniformly at random), or a softmax sample when the temperature is
    /// above 0.
    fn select(&mut self) -> usize {
        let t = self.config.router_temperature;
        if t > 0.0 {
            return self.softmax_sample(t);
        }
        let mut best = 0;
        let mut best_cost = f64::INFINITY;
        let mut ties = 0;
        for (w, &c) in self.costs.iter().enumerate() {
            if c < best_cost {
                (best, best_cost, ties) = (w, c, 1);
            } else if c == best_cost {
                ties += 1;
                if self.rng.below(ties) == 0 {
                    best = w;
                }
            }
        }
        best
    }

    fn softmax_sample(&mut self, temperature: f64) -> usize {
        // Over the workers with a finite cost (the eligible ones).
        let (min, max) = self
            .costs
            .iter()
            .filter(|c| c.is_finite())
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
                (lo.min(c), hi.max(c))
            });
        self.weights.clear();
        if min == max || !(max - min).is_finite() {
            self.weights.extend(
                self.costs
                    .iter()
                    .map(|c| if c.is_finite() { 1.0 } else { 0.0 }),
            );
        } else {
            let scale = (max - min) * temperature;
            self.weights
                .extend(self.costs.iter().map(|&c| (-(c - min) / scale).exp()));
        }
        let sum: f64 = self.weights.iter().sum();
        let sample = self.rng.unit() * sum;
        let mut cumulative = 0.0;
        for (w, &p) in self.weights.iter().enumerate() {
            cumulative += p;
            if p > 0.0 && sample <= cumulative {
                return w;
            }
        }
        self.weights.iter().rposition(|&p| p > 0.0).unwrap_or(0)
    }

    /// Routes `request` among the workers `eligible` admits and counts it there; `None` (and
    /// nothing counted) when it admits none.
    fn route_among(
        &mut self,
        request: &RouteRequest<'_>,
        view: &View<'_>,
        eligible: &dyn Fn(usize) -> bool,
    ) -> Option<usize> {
        self.deliver(view.now);
        let n = view.inflight.len().min(self.index.len());
        if !(0..n).any(eligible) {
            return None;
        }
        self.hash_request(request.text);
        self.score(n, eligible);
        let worker = self.select();
        self.admit(request.id, worker);
        Some(worker)
    }

    /// Adds the hashed request to `worker`'s active load.
    fn admit(&mut self, id: u64, worker: usize) {
        let bs = self.config.block_size.max(1) as u64;
        let isl = self.tokens.len() as u64;
        let cached = (self.overlaps.get(worker).copied().unwrap_or(0) as u64 * bs).min(isl);
        let prefill_tokens = if self.config.track_prefill_tokens {
            isl - cached
        } else {
            0
        };
        let mut blocks = self.spare.pop().unwrap_or_default();
        blocks.clear();
        blocks.extend_from_slice(&self.hashes);
        let active = &mut self.active_blocks[worker];
        for &h in &blocks {
            *active.entry(h).or_insert(0) += 1;
        }
        self.active_block_refs[worker] += blocks.len() as u64;
        self.active_prefill_tokens[worker] += prefill_tokens;
        self.active_requests[worker] += 1;
        let previous = self.open.insert(
            id,
            Active {
                worker,
                blocks,
                prefill_tokens,
            },
        );
        if let Some(previous) = previous {
            self.release(previous);
        }
    }

    fn release(&mut self, request: Active) {
        let w = request.worker;
        self.active_prefill_tokens[w] =
            self.active_prefill_tokens[w].saturating_sub(request.prefill_tokens);
        self.active_requests[w] = self.active_requests[w].saturating_sub(1);
        self.active_block_refs[w] =
            self.active_block_refs[w].saturating_sub(request.blocks.len() as u64);
        let active = &mut self.active_blocks[w];
        for h in &request.blocks {
            if let Entry::Occupied(mut e) = active.entry(*h) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
        self.spare.push(request.blocks);
    }
}

impl Policy for Dynamo {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        self.route_among(request, view, &|_| true).unwrap_or(0)
    }

    fn on_first_token(&mut self, request: u64, _endpoint: usize, _now: Duration) {
        if let Some(r) = self.open.get_mut(&request) {
            let w = r.worker;
            self.active_prefill_tokens[w] =
                self.active_prefill_tokens[w].saturating_sub(r.prefill_tokens);
            r.prefill_tokens = 0;
        }
    }

    fn on_finished(&mut self, request: u64, _endpoint: usize, _now: Duration) {
        if let Some(r) = self.open.remove(&request) {
            self.release(r);
        }
    }

    fn on_kv_events(&mut self, endpoint: usize, events: &[KvEvent], now: Duration) {
        if self.config.kv_event_delay.is_zero() {
            if let Some(index) = self.index.get_mut(endpoint) {
                index.apply(events);
            }
        } else {
            self.deliver(now);
            self.in_transit.push_back((
                now + self.config.kv_event_delay,
                endpoint,
                events.to_vec(),
            ));
        }
    }
}

/// Dynamo's disaggregated routing (`dynamo-pd`), its defaults (sources and commits:
/// bench/README.md): every request is prefilled remotely (conditional disaggregation is off by
/// default), the prefill worker chosen first by the KV router over the prefill workers with
/// active blocks untracked (`router_track_active_blocks` off: the cost is the prefill term
/// alone, prefill tokens released once the prefill's one token is out), then the decode worker
/// by load only (`overlap_score_credit` 0, `track_prefill_tokens` off, `assume_kv_reuse` off:
/// the fewest active prompt blocks, every request's counted). No prefill worker: the request is
/// served whole by the decode router.
pub struct DynamoPd {
    prefill: Dynamo,
    decode: Dynamo,
    roles: Vec<kvoy_shared::Role>,
}

impl DynamoPd {
    pub fn new(replicas: usize, roles: &[kvoy_shared::Role], profile: &Profile, rng: Rng) -> Self {
        let base = DynamoConfig::for_profile(profile);
        let prefill = DynamoConfig {
            track_active_blocks: false,
            ..base
        };
        let decode = DynamoConfig {
            overlap_score_credit: 0.0,
            host_credit: 0.0,
            track_prefill_tokens: false,
            assume_kv_reuse: false,
            ..base
        };
        let mut rng = rng;
        let decode_rng = Rng::new(rng.next_u64());
        DynamoPd {
            prefill: Dynamo::new(replicas, prefill, rng),
            decode: Dynamo::new(replicas, decode, decode_rng),
            roles: roles.to_vec(),
        }
    }
}

/// Endpoint `e`'s role; one past the list decodes.
fn role_of(roles: &[kvoy_shared::Role], e: usize) -> kvoy_shared::Role {
    roles.get(e).copied().unwrap_or_default()
}

impl Policy for DynamoPd {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        self.pick_pd(request, view).decode
    }

    fn pick_pd(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> Pick {
        let roles = &self.roles;
        let role = |e: usize| role_of(roles, e);
        let prefill = self
            .prefill
            .route_among(request, view, &|e| role(e).prefills());
        let decode = self
            .decode
            .route_among(request, view, &|e| role(e).decodes() && Some(e) != prefill)
            .unwrap_or(0);
        Pick { decode, prefill }
    }

    fn on_prefilled(&mut self, request: u64, endpoint: usize, now: Duration) {
        // The prefill request's one token ends its stream: its load goes at once.
        self.prefill.on_finished(request, endpoint, now);
    }

    fn on_finished(&mut self, request: u64, endpoint: usize, now: Duration) {
        self.decode.on_finished(request, endpoint, now);
        // A split request refused before its prefill answered.
        self.prefill.on_finished(request, endpoint, now);
    }

    fn on_kv_events(&mut self, endpoint: usize, events: &[KvEvent], now: Duration) {
        // Only the prefill router reads the cache (the decode one credits no overlap).
        if role_of(&self.roles, endpoint).prefills() {
            self.prefill.on_kv_events(endpoint, events, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixture::{text_request, Observed};
    use crate::sim::block_hashes;
    use kvoy_sim_engine::{tokenizer, Engine, EngineRequest, MEDIUM_GPU};

    fn policy(n: usize) -> Dynamo {
        Dynamo::new(
            n,
            DynamoConfig::for_profile(&Profile::llama_8b_h100()),
            Rng::new(5),
        )
    }

    fn pick_at(p: &mut Dynamo, id: u64, text: &str, n: usize, now: Duration) -> usize {
        p.pick(&text_request(id, text), &Observed::idle(n).at(now).view())
    }

    fn pick(p: &mut Dynamo, id: u64, text: &str, n: usize) -> usize {
        pick_at(p, id, text, n, Duration::ZERO)
    }

    /// The event a server emits once `text`'s complete blocks are cached.
    fn stored(text: &str) -> KvEvent {
        let mut hashes = Vec::new();
        block_hashes(&tokenizer::tokenize(text), 16, usize::MAX, &mut hashes);
        KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 16,
            medium: MEDIUM_GPU,
        }
    }

    #[test]
    fn cost_credits_cached_blocks_and_charges_active_load() {
        let mut p = policy(2);
        // 64 tokens: 4 blocks, cached on worker 1.
        let prompt = "abcd".repeat(64);
        p.on_kv_events(1, &[stored(&prompt)], Duration::ZERO);
        assert_eq!(pick(&mut p, 1, &prompt, 2), 1);
        // Worker 0: 4 prefill blocks + 4 new decode blocks; worker 1: 4 - 4 credited + 4.
        assert_eq!(p.costs(), &[8.0, 4.0]);
        // Fully cached: request 1 adds no prefill tokens, its 4 blocks stay active on 1.
        assert_eq!(p.active_prefill_tokens(), &[0, 0]);
        assert_eq!(p.active_blocks(1), 4);
        // The same prompt again shares those active blocks: no new decode blocks on 1.
        assert_eq!(pick(&mut p, 2, &prompt, 2), 1);
        assert_eq!(p.costs(), &[8.0, 4.0]);
        // A cold prompt of 10 blocks: worker 1 carries 4 active blocks, so worker 0 wins.
        let cold = "wxyz".repeat(160);
        assert_eq!(pick(&mut p, 3, &cold, 2), 0);
        assert_eq!(p.costs(), &[20.0, 24.0]);
        assert_eq!(p.active_prefill_tokens(), &[160, 0]);
    }

    #[test]
    fn prefill_is_released_at_first_token_and_blocks_at_completion() {
        let mut p = policy(2);
        let cold = "wxyz".repeat(160);
        let w = pick(&mut p, 7, &cold, 2);
        assert_eq!(p.active_prefill_tokens()[w], 160);
        assert_eq!(p.active_blocks(w), 10);
        p.on_first_token(7, w, Duration::ZERO);
        assert_eq!(p.active_prefill_tokens()[w], 0);
        assert_eq!(
            p.active_blocks(w),
            10,
            "decode blocks stay until completion"
        );
        p.on_finished(7, w, Duration::ZERO);
        assert_eq!(p.active_blocks(w), 0);
        assert!(p.open.is_empty());
    }

    #[test]
    fn heavy_prefill_load_outweighs_the_cache() {
        let mut p = policy(2);
        // A cold 1,000-token request (62 complete blocks) somewhere, still prefilling.
        let busy = pick(&mut p, 1, &"mnop".repeat(1000), 2);
        assert_eq!(p.active_prefill_tokens()[busy], 1000);
        // The prompt is cached on that worker only.
        let prompt = "abcd".repeat(64);
        p.on_kv_events(busy, &[stored(&prompt)], Duration::ZERO);
        assert_eq!(pick(&mut p, 2, &prompt, 2), 1 - busy);
        // Busy: (1000 + 64) / 16 - 4 + 62 + 4; idle: 64 / 16 + 4.
        assert_eq!(p.costs()[busy], 128.5);
        assert_eq!(p.costs()[1 - busy], 8.0);
    }

    #[test]
    fn evictions_remove_the_credit_and_delayed_events_arrive_late() {
        let mut config = DynamoConfig::for_profile(&Profile::llama_8b_h100());
        config.kv_event_delay = Duration::from_millis(10);
        let mut p = Dynamo::new(2, config, Rng::new(1));
        let prompt = "abcd".repeat(64);
        p.on_kv_events(1, &[stored(&prompt)], Duration::ZERO);
        pick_at(&mut p, 1, &prompt, 2, Duration::from_millis(9));
        assert_eq!(p.costs(), &[8.0, 8.0], "not delivered yet");
        p.on_finished(1, 0, Duration::ZERO);
        p.on_finished(1, 1, Duration::ZERO);
        assert_eq!(pick_at(&mut p, 2, &prompt, 2, Duration::from_millis(10)), 1);
        p.on_finished(2, 1, Duration::ZERO);
        let KvEvent::BlockStored { block_hashes, .. } = stored(&prompt) else {
            unreachable!()
        };
        let removed = KvEvent::BlockRemoved {
            block_hashes: block_hashes[2..].to_vec(),
            medium: MEDIUM_GPU,
        };
        p.on_kv_events(1, &[removed], Duration::from_millis(10));
        pick_at(&mut p, 3, &prompt, 2, Duration::from_millis(20));
        // Two blocks left cached on worker 1: 4 - 2 + 4.
        assert_eq!(p.costs(), &[8.0, 6.0]);
    }

    #[test]
    fn ties_are_random_and_temperature_samples_by_cost() {
        let mut p = policy(3);
        let mut seen = [0; 3];
        for id in 0..300 {
            let w = pick(&mut p, id, "same", 3);
            p.on_finished(id, w, Duration::ZERO);
            seen[w] += 1;
        }
        assert!(seen.iter().all(|&s| s > 60), "{seen:?}");
        let mut config = DynamoConfig::for_profile(&Profile::llama_8b_h100());
        config.router_temperature = 0.5;
        let mut p = Dynamo::new(2, config, Rng::new(9));
        p.costs = vec![10.0, 20.0];
        let mut low = 0;
        for _ in 0..1000 {
            low += usize::from(p.select() == 0);
        }
        // exp(0) : exp(-1 / 0.5): the cheaper worker about 88% of the time.
        assert!((830..930).contains(&low), "{low}");
    }

    #[test]
    fn learns_the_engine_blocks_from_its_events() {
        let profile = Profile::llama_8b_h100();
        let mut engine = Engine::new(&profile).unwrap();
        let mut p = policy(2);
        let prompt = "abcd".repeat(100);
        engine
            .submit(
                EngineRequest {
                    id: 1,
                    prompt: tokenizer::tokenize(&prompt),
                    max_tokens: 2,
                },
                Duration::ZERO,
            )
            .unwrap();
        let mut now = Duration::ZERO;
        while engine.has_work() {
            let step = engine.step(now);
            p.on_kv_events(1, &step.events, now);
            now += step.duration;
        }
        assert_eq!(pick(&mut p, 2, &prompt, 2), 1);
        assert_eq!(p.overlaps, [0, 6]);
    }
}
