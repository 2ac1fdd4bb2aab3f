//! llm-d 1.0's guide default, "sticky until saturated": the `optimized-baseline` guide's picker
//! configuration (`approx-prefix-cache-producer` and `inflight-load-producer` feeding the
//! `prefix-cache-affinity-filter`, then the `token-load-scorer`, then the `max-score-picker` the
//! framework adds), every plugin at its built-in default. Sources and commits: bench/README.md.
//!
//! 1. **Token estimate** (`token-producer`, `estimate` backend, auto-created): the prompt's bytes
//!    packed 4 to a pseudo-token, the tail zero-padded: `ceil(bytes / 4)` tokens.
//! 2. **Prefix index** (`approx-prefix-cache-producer`, `autoTune`): blocks of
//!    `max(block size metric (16) or 16, 64)` = 64 pseudo-tokens (256 bytes), the trailing partial
//!    block included, at most `131,072 / 64` = 2,048 blocks; `h_0` chains from `hash(model)`,
//!    `h_i = hash(le64(hash(block_i)) ‖ le64(h_{i-1}))`. Each endpoint has an LRU of
//!    `num_gpu_blocks` entries (from the scrape; 31,250 before the first one), filled with the
//!    request's blocks when the request is routed there (never from the servers). Matching walks
//!    the request's blocks and stops at the first one no endpoint holds, counting per endpoint the
//!    blocks it holds; prefix score = matched / total blocks.
//! 3. **In-flight load** (`inflight-load-producer`): a request's uncached tokens on endpoint `e`
//!    are `(total - matched_e) * 64 + max(0, tokens - total * 64)`; the chosen endpoint's
//!    in-flight tokens grow by them at routing and drop by them at the first streamed chunk (at
//!    completion if no chunk came).
//! 4. **Affinity filter**: sticky endpoints have a prefix score >= 0.8. None sticky: all are kept.
//!    Otherwise, if some are not sticky and the best sticky estimated TTFT exceeds the best
//!    other's by more than 18,000 ms, stickiness breaks and all are kept; else only the sticky
//!    ones. Estimated TTFT = in-flight tokens / `peakPrefillThroughput` * 1000 ms (15,928
//!    tokens/s, calibrated for Qwen3-32B on H100 TP2), the request itself not counted.
//!    Exploration probability 0.
//! 5. **Token-load scorer** (weight 1): `1 - min(1, (in-flight + uncached) / 4,194,304)`.
//! 6. **Max-score picker**: the highest score, exact ties at random.
//!
//! [`LlmDV1Config::calibrated`] keeps every default but `peakPrefillThroughput`, which it measures
//! with the guide's calibration recipe (`CHUNK_SIZE / median TTFT` of `CHUNK_SIZE`-token cache
//! misses sent one at a time, `CHUNK_SIZE = max_num_batched_tokens`) on one simulated engine.
//! The reference hashes with xxhash64; xxh3 is used here, which changes no decision.

use std::collections::HashMap;
use std::time::Duration;

use kvoy_shared::LruSet;
use kvoy_sim_engine::{Engine, EngineRequest, OutputKind, Profile};
use xxhash_rust::xxh3::xxh3_64;

use super::{argmax_random, Policy, RouteRequest, View};
use kvoy_shared::Rng;

/// Bytes per pseudo-token of the `estimate` token producer.
pub(crate) const BYTES_PER_TOKEN: usize = 4;

/// The plugins' defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlmDV1Config {
    /// `affinityThreshold`.
    pub affinity_threshold: f64,
    /// `maxTTFTPenaltyMs` (0: always stick).
    pub max_ttft_penalty_ms: f64,
    /// `peakPrefillThroughput`, tokens/s.
    pub peak_prefill_throughput: f64,
    /// `explorationProbability`.
    pub exploration_probability: f64,
    /// `queueThresholdTokens` of the token-load scorer.
    pub queue_threshold_tokens: f64,
    /// `blockSizeTokens`, used when no endpoint reports a block size.
    pub block_tokens: usize,
    /// The floor the producer clamps the block size to.
    pub min_block_tokens: usize,
    /// `maxPrefixTokensToMatch` (0: the whole prompt).
    pub max_prefix_tokens: usize,
    /// `lruCapacityPerServer`, used when the endpoint reports no `num_gpu_blocks`.
    pub lru_blocks: usize,
}

impl Default for LlmDV1Config {
    fn default() -> Self {
        LlmDV1Config {
            affinity_threshold: 0.8,
            max_ttft_penalty_ms: 18_000.0,
            peak_prefill_throughput: 15_928.0,
            exploration_probability: 0.0,
            queue_threshold_tokens: 4_194_304.0,
            block_tokens: 16,
            min_block_tokens: 64,
            max_prefix_tokens: 131_072,
            lru_blocks: 31_250,
        }
    }
}

impl LlmDV1Config {
    /// The defaults with `peakPrefillThroughput` from the calibration recipe run on `profile`.
    pub fn calibrated(profile: &Profile) -> Self {
        let default = LlmDV1Config::default();
        let peak = calibrate_peak_prefill(profile).unwrap_or_else(|| {
            log::warn!(
                "calibration failed on profile {}; default kept",
                profile.name
            );
            default.peak_prefill_throughput
        });
        LlmDV1Config {
            peak_prefill_throughput: peak,
            ..default
        }
    }
}

/// The guide's calibration recipe on one simulated engine: 5 warm-up and 20 measured requests
/// of `max_num_batched_tokens` random token ids each (every one a cache miss), one at a time;
/// `CHUNK_SIZE / median(TTFT)`. `None` if the profile is invalid.
pub fn calibrate_peak_prefill(profile: &Profile) -> Option<f64> {
    const WARMUP: usize = 5;
    const MEASURED: usize = 20;
    let mut engine = Engine::new(profile).ok()?;
    let chunk = profile.max_num_batched_tokens as usize;
    let mut rng = Rng::derive(0, "calibrate-peak-prefill", 0);
    let mut now = Duration::ZERO;
    let mut ttfts = Vec::with_capacity(MEASURED);
    for id in 0..(WARMUP + MEASURED) as u64 {
        let prompt = (0..chunk).map(|_| rng.next_u64() as u32).collect();
        let request = EngineRequest {
            id,
            prompt,
            max_tokens: 1,
        };
        engine.submit(request, now).ok()?;
        while engine.has_work() {
            let step = engine.step(now);
            for out in &step.outputs {
                if let OutputKind::FirstToken { ttft, .. } = out.kind {
                    if id as usize >= WARMUP {
                        ttfts.push(ttft.as_secs_f64());
                    }
                }
            }
            if step.duration.is_zero() && step.outputs.is_empty() {
                return None;
            }
            now += step.duration;
        }
    }
    ttfts.sort_by(f64::total_cmp);
    let mid = ttfts.len() / 2;
    let median = match ttfts.len() {
        0 => return None,
        n if n % 2 == 0 => (ttfts[mid - 1] + ttfts[mid]) / 2.0,
        _ => ttfts[mid],
    };
    (median > 0.0).then(|| chunk as f64 / median)
}

/// What the affinity filter did with the last request (for tests and explanations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// No endpoint's prefix score reached the threshold: all kept.
    NoneSticky,
    /// Narrowed to the sticky endpoints.
    Sticky,
    /// Sticky endpoints were too loaded (TTFT gate): all kept.
    Broken,
}

pub struct LlmDV1 {
    config: LlmDV1Config,
    prefix: ApproxPrefix,
    /// In-flight uncached tokens per endpoint.
    inflight_tokens: Vec<u64>,
    /// Requests whose tokens still count: endpoint and tokens.
    open: HashMap<u64, (usize, u64)>,
    rng: Rng,
    last_gate: Option<Gate>,
    // Scratch, reused across requests.
    uncached: Vec<u64>,
    candidates: Vec<usize>,
    scores: Vec<f64>,
}

/// The `approx-prefix-cache-producer` (`autoTune`): per endpoint an LRU of the block hashes of
/// the requests routed there, and the last request's blocks matched against them. Shared by
/// every llm-d 1.x configuration modelled here (this guide's and the P/D one,
/// [`super::llmd_pd`]).
pub(crate) struct ApproxPrefix {
    model: &'static str,
    /// `blockSizeTokens`, used when no endpoint reports a block size.
    block_tokens: usize,
    /// The floor the block size is clamped to.
    min_block_tokens: usize,
    /// `maxPrefixTokensToMatch` (0: the whole prompt).
    max_prefix_tokens: usize,
    /// `lruCapacityPerServer`, used when the endpoint reports no `num_gpu_blocks`.
    lru_blocks: usize,
    /// Per endpoint, created on the first request recorded there.
    lru: Vec<Option<LruSet>>,
    /// The last request's chained block hashes.
    pub(crate) hashes: Vec<u64>,
    /// Per endpoint, the leading blocks of the last request it holds.
    pub(crate) matched: Vec<u64>,
    tail: Vec<u8>,
}

impl ApproxPrefix {
    pub(crate) fn new(
        replicas: usize,
        block_tokens: usize,
        min_block_tokens: usize,
        max_prefix_tokens: usize,
        lru_blocks: usize,
    ) -> Self {
        ApproxPrefix {
            model: super::kvoy::MODEL,
            block_tokens,
            min_block_tokens,
            max_prefix_tokens,
            lru_blocks,
            lru: (0..replicas).map(|_| None).collect(),
            hashes: Vec::new(),
            matched: Vec::new(),
            tail: Vec::new(),
        }
    }

    pub(crate) fn replicas(&self) -> usize {
        self.lru.len()
    }

    /// The prefix block size in tokens: the first endpoint's reported block size (or the
    /// configured one), clamped up to the floor.
    pub(crate) fn block_tokens(&self, view: &View<'_>) -> usize {
        let reported = view
            .metrics
            .first()
            .map(|m| m.block_size as usize)
            .filter(|&b| b > 0)
            .unwrap_or(self.block_tokens);
        reported.max(self.min_block_tokens).max(1)
    }

    /// Chained block hashes of `text` into `self.hashes`.
    pub(crate) fn hash_prompt(&mut self, text: &[u8], block_tokens: usize) {
        self.hashes.clear();
        let max_blocks = match self.max_prefix_tokens {
            0 => usize::MAX,
            t => t / block_tokens,
        };
        let mut prev = xxh3_64(self.model.as_bytes());
        for block in text.chunks(block_tokens * BYTES_PER_TOKEN).take(max_blocks) {
            let id = if block.len() % BYTES_PER_TOKEN == 0 {
                xxh3_64(block)
            } else {
                // The last pseudo-token is zero-padded.
                self.tail.clear();
                self.tail.extend_from_slice(block);
                self.tail
                    .resize(block.len().next_multiple_of(BYTES_PER_TOKEN), 0);
                xxh3_64(&self.tail)
            };
            let mut pair = [0u8; 16];
            pair[..8].copy_from_slice(&id.to_le_bytes());
            pair[8..].copy_from_slice(&prev.to_le_bytes());
            prev = xxh3_64(&pair);
            self.hashes.push(prev);
        }
    }

    /// Per endpoint, the blocks of the hashed request its LRU holds, walking the blocks until
    /// one that no endpoint holds.
    pub(crate) fn match_prefix(&mut self, n: usize) {
        self.matched.clear();
        self.matched.resize(n, 0);
        for &h in &self.hashes {
            let mut any = false;
            for (e, m) in self.matched.iter_mut().enumerate() {
                if self
                    .lru
                    .get(e)
                    .and_then(Option::as_ref)
                    .is_some_and(|s| s.contains(h))
                {
                    *m += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
    }

    /// Matched blocks over the request's blocks, for endpoint `e`.
    pub(crate) fn prefix_score(&self, e: usize) -> f64 {
        let total = self.hashes.len();
        if total == 0 {
            return 0.0;
        }
        self.matched
            .get(e)
            .map_or(0.0, |&m| m as f64 / total as f64)
    }

    /// `PreRequest`: the hashed request's blocks into `e`'s LRU (sized by the endpoint's
    /// reported `num_gpu_blocks`).
    pub(crate) fn record(&mut self, e: usize, view: &View<'_>) {
        let capacity = view
            .metrics
            .get(e)
            .map(|m| m.num_gpu_blocks as usize)
            .filter(|&c| c > 0)
            .unwrap_or(self.lru_blocks);
        let Some(slot) = self.lru.get_mut(e) else {
            return;
        };
        let set = slot.get_or_insert_with(|| LruSet::new(capacity, e as u64));
        for &h in &self.hashes {
            set.touch(h);
        }
    }
}

impl LlmDV1 {
    pub fn new(replicas: usize, config: LlmDV1Config, rng: Rng) -> Self {
        LlmDV1 {
            config,
            prefix: ApproxPrefix::new(
                replicas,
                config.block_tokens,
                config.min_block_tokens,
                config.max_prefix_tokens,
                config.lru_blocks,
            ),
            inflight_tokens: vec![0; replicas],
            open: HashMap::new(),
            rng,
            last_gate: None,
            uncached: Vec::new(),
            candidates: Vec::new(),
            scores: Vec::new(),
        }
    }

    pub fn config(&self) -> &LlmDV1Config {
        &self.config
    }

    pub fn last_gate(&self) -> Option<Gate> {
        self.last_gate
    }

    /// In-flight uncached tokens per endpoint.
    pub fn inflight_tokens(&self) -> &[u64] {
        &self.inflight_tokens
    }

    fn ttft_ms(&self, e: usize) -> f64 {
        let tokens = self.inflight_tokens.get(e).copied().unwrap_or(0);
        tokens as f64 / self.config.peak_prefill_throughput * 1000.0
    }

    /// The affinity filter: the kept endpoints into `self.candidates`.
    fn filter(&mut self, n: usize) {
        self.candidates.clear();
        self.candidates.extend(0..n);
        let threshold = self.config.affinity_threshold;
        if n <= 1 || threshold <= 0.0 {
            self.last_gate = Some(Gate::NoneSticky);
            return;
        }
        if self.config.exploration_probability > 0.0
            && self.rng.unit() < self.config.exploration_probability
        {
            self.last_gate = Some(Gate::NoneSticky);
            return;
        }
        let (mut best_sticky, mut best_other) = (f64::MAX, f64::MAX);
        let mut sticky = 0;
        for e in 0..n {
            let ttft = self.ttft_ms(e);
            if self.prefix.prefix_score(e) >= threshold {
                sticky += 1;
                best_sticky = best_sticky.min(ttft);
            } else {
                best_other = best_other.min(ttft);
            }
        }
        if sticky == 0 {
            self.last_gate = Some(Gate::NoneSticky);
            return;
        }
        if self.config.max_ttft_penalty_ms > 0.0
            && sticky < n
            && best_sticky - best_other > self.config.max_ttft_penalty_ms
        {
            self.last_gate = Some(Gate::Broken);
            return;
        }
        let prefix = &self.prefix;
        self.candidates
            .retain(|&e| prefix.prefix_score(e) >= threshold);
        self.last_gate = Some(Gate::Sticky);
    }
}

impl Policy for LlmDV1 {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        let n = view.inflight.len().min(self.prefix.replicas());
        let text = request.text.as_bytes();
        let block_tokens = self.prefix.block_tokens(view);
        self.prefix.hash_prompt(text, block_tokens);
        self.prefix.match_prefix(n);
        let input_tokens = text.len().div_ceil(BYTES_PER_TOKEN) as u64;
        let total = self.prefix.hashes.len() as u64;
        let bt = block_tokens as u64;
        self.uncached.clear();
        for e in 0..n {
            let matched = self.prefix.matched[e].min(total);
            let tail = input_tokens.saturating_sub(total * bt);
            self.uncached.push((total - matched) * bt + tail);
        }
        self.filter(n);
        self.scores.clear();
        let q = self.config.queue_threshold_tokens;
        for &e in &self.candidates {
            let tokens = (self.inflight_tokens[e] + self.uncached[e]) as f64;
            self.scores.push(if tokens <= 0.0 {
                1.0
            } else {
                1.0 - tokens.min(q) / q
            });
        }
        let best = argmax_random(&self.scores, &mut self.rng);
        let Some(&chosen) = self.candidates.get(best) else {
            return 0;
        };
        // PreRequest: the index records the blocks, the load counts the uncached tokens.
        self.prefix.record(chosen, view);
        let tokens = self.uncached[chosen];
        self.inflight_tokens[chosen] += tokens;
        if let Some((e, t)) = self.open.insert(request.id, (chosen, tokens)) {
            self.inflight_tokens[e] = self.inflight_tokens[e].saturating_sub(t);
        }
        chosen
    }

    fn on_first_token(&mut self, request: u64, _endpoint: usize, _now: Duration) {
        if let Some((e, t)) = self.open.remove(&request) {
            self.inflight_tokens[e] = self.inflight_tokens[e].saturating_sub(t);
        }
    }

    fn on_finished(&mut self, request: u64, endpoint: usize, now: Duration) {
        self.on_first_token(request, endpoint, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixture::{text_request, Observed};
    use kvoy_sim_engine::BatchItem;

    fn pick(p: &mut LlmDV1, id: u64, text: &str, n: usize) -> usize {
        p.pick(&text_request(id, text), &Observed::idle(n).view())
    }

    /// `blocks` whole 256-byte blocks, block `i` filled with `tag(i)`.
    fn text(blocks: usize, tag: impl Fn(usize) -> char) -> String {
        (0..blocks)
            .map(|i| tag(i).to_string().repeat(256))
            .collect()
    }

    fn policy(n: usize) -> LlmDV1 {
        LlmDV1::new(n, LlmDV1Config::default(), Rng::new(3))
    }

    #[test]
    fn tokens_blocks_and_uncached_follow_the_estimate() {
        let mut p = policy(2);
        // 10 blocks and 10 bytes: 643 tokens, 11 blocks (the partial one included).
        let prompt = format!("{}0123456789", text(10, |i| (b'a' + i as u8) as char));
        let first = pick(&mut p, 1, &prompt, 2);
        assert_eq!(p.prefix.hashes.len(), 11);
        // A cold request counts its partial block whole: 11 * 64 tokens.
        assert_eq!(p.inflight_tokens()[first], 704);
        assert_eq!(p.last_gate(), Some(Gate::NoneSticky));
        // The same prompt again: sticky, and nothing uncached on `first`.
        assert_eq!(pick(&mut p, 2, &prompt, 2), first);
        assert_eq!(p.last_gate(), Some(Gate::Sticky));
        assert_eq!(p.uncached[first], 0);
        assert_eq!(p.uncached[1 - first], 704);
    }

    #[test]
    fn affinity_threshold_is_inclusive_at_0_8() {
        let mut p = policy(2);
        let base = text(10, |i| (b'a' + i as u8) as char);
        let first = pick(&mut p, 1, &base, 2);
        // 8 of 10 blocks shared: 0.8 is sticky.
        let eight = text(10, |i| if i < 8 { (b'a' + i as u8) as char } else { 'z' });
        assert_eq!(pick(&mut p, 2, &eight, 2), first);
        assert_eq!(p.last_gate(), Some(Gate::Sticky));
        // 7 of 10: not sticky, the less loaded endpoint wins.
        let seven = text(10, |i| if i < 7 { (b'a' + i as u8) as char } else { 'y' });
        assert_ne!(pick(&mut p, 3, &seven, 2), first);
        assert_eq!(p.last_gate(), Some(Gate::NoneSticky));
    }

    #[test]
    fn stickiness_breaks_just_past_the_ttft_penalty() {
        let mut p = policy(2);
        let prompt = text(4, |_| 'q');
        let sticky = pick(&mut p, 1, &prompt, 2);
        p.on_first_token(1, sticky, Duration::ZERO);
        assert_eq!(p.inflight_tokens(), &[0, 0]);
        // 18 s at 15,928 tokens/s is 286,704 tokens: a penalty of exactly 18,000 ms sticks.
        p.inflight_tokens[sticky] = 286_704;
        assert_eq!(pick(&mut p, 2, &prompt, 2), sticky);
        assert_eq!(p.last_gate(), Some(Gate::Sticky));
        p.on_first_token(2, sticky, Duration::ZERO);
        // One token more and the gate breaks: the token-load scorer picks the other.
        p.inflight_tokens[sticky] = 286_705;
        assert_eq!(pick(&mut p, 3, &prompt, 2), 1 - sticky);
        assert_eq!(p.last_gate(), Some(Gate::Broken));
    }

    #[test]
    fn load_picks_among_the_sticky_and_releases_at_first_token() {
        let mut p = policy(3);
        let prompt = text(2, |_| 's');
        // Seed the prefix on endpoint 0, then on 1 while 0 is past the TTFT gate.
        p.inflight_tokens = vec![0, 500, 500];
        assert_eq!(pick(&mut p, 1, &prompt, 3), 0);
        p.inflight_tokens = vec![300_000, 0, 500];
        assert_eq!(pick(&mut p, 2, &prompt, 3), 1);
        assert_eq!(p.last_gate(), Some(Gate::Broken));
        // Both sticky now; the less loaded sticky one wins even though 2 is idle.
        p.inflight_tokens = vec![300, 200, 0];
        assert_eq!(pick(&mut p, 3, &prompt, 3), 1);
        assert_eq!(p.last_gate(), Some(Gate::Sticky));
        // Request 3 counted nothing (fully matched); request 2 still counts its 128 tokens.
        assert_eq!(p.inflight_tokens()[1], 200);
        p.inflight_tokens[1] = 328;
        p.on_first_token(2, 1, Duration::ZERO);
        assert_eq!(p.inflight_tokens()[1], 200);
        // A completion after the first token releases nothing twice.
        p.on_finished(2, 1, Duration::ZERO);
        assert_eq!(p.inflight_tokens()[1], 200);
    }

    #[test]
    fn lru_capacity_comes_from_the_scrape() {
        let mut p = policy(1);
        let mut fleet = Observed::idle(1);
        fleet.metrics[0].num_gpu_blocks = 2;
        fleet.metrics[0].block_size = 16;
        let view = fleet.view();
        p.pick(
            &text_request(1, &text(3, |i| (b'a' + i as u8) as char)),
            &view,
        );
        assert_eq!(p.prefix.lru[0].as_ref().map(LruSet::capacity), Some(2));
        assert_eq!(p.prefix.block_tokens(&view), 64, "16 is clamped up to 64");
    }

    #[test]
    fn calibration_recipe_on_the_simulated_engine() {
        let profile = Profile::llama_8b_h100();
        let peak = calibrate_peak_prefill(&profile).unwrap();
        // An idle 8,192-token miss is one step: 6.9 + 0.06 + 327.7 + 43.6 ms, 21,657 tokens/s.
        let step = profile.step_duration(&[BatchItem {
            context_tokens: 0,
            new_tokens: 8192,
        }]);
        assert!((peak - 8192.0 / step.as_secs_f64()).abs() < 1e-6, "{peak}");
        assert_eq!(peak.round(), 21_657.0);
        assert_eq!(
            calibrate_peak_prefill(&Profile::llama_8b_h100()),
            Some(peak)
        );
        let c = LlmDV1Config::calibrated(&Profile::llama_8b_h100());
        assert_eq!(c.peak_prefill_throughput, peak);
        assert_eq!(c.max_ttft_penalty_ms, 18_000.0);
    }
}
