//! The token cost model, kvoy's default scorer: each candidate's predicted time until this
//! request's first token, lowest wins.
//!
//! For a candidate endpoint `e` and a request of `T` prompt tokens, `M_e` of them believed
//! cached on `e`:
//!
//! ```text
//! uncached_e = max(T - M_e, 1)                       the last token is always computed
//! queued_e   = max(this proxy's prefill tokens pending at e,  server waiting x typical request)
//! work_e     = queued_e + uncached_e
//! claimed_e  = (KV claimed_e + uncached_e + expected output) / KV capacity_e,  at most 1.5
//! w_e        = w x (1 + claim_weight x claimed_e)      w: see the pressure below
//! prefill_e  = (queued_e + w_e x uncached_e) / rate_e  the prefill ahead of the first token
//! decode_e   = (1 + work_e / step_tokens) x running_e x decode_s_per_sequence
//! kv_e       = kv_full_s x (kv_use_e - kv_high) / (1 - kv_high)   when kv_use_e > kv_high
//! seat_e     = (held_e + 1 - max_num_seqs) x hold_e / max_num_seqs  when held_e >= max_num_seqs
//! cost_e     = prefill_e + decode_e + kv_e + footprint_e + seat_e
//! ```
//!
//! A request that *matches nowhere* (no candidate holds any of its blocks: no prefix at
//! stake, pure load balancing) is costed with two changes:
//! - `queued_e` is this proxy's part by the prefill clock ([`crate::Outstanding`]): the
//!   tokens still ahead given how long the endpoint has been at them, at its measured rate,
//!   instead of every token sent and not yet answered;
//! - `footprint_e = kv_full_s x (f - footprint_high) / (1 - footprint_high)` when
//!   `f = (prompt tokens of this proxy's requests in flight there + T) / KV capacity` is above
//!   `footprint_high`: the KV those requests hold while they decode, so that a slow endpoint,
//!   whose sequences live longer, is not filled until it preempts (needs the capacity:
//!   configured, or the aggregator's).
//!
//! For a request with a match neither applies: moving a prefix off its holder early costs
//! more in recomputed prefixes than it saves (measured in bench/README.md).
//!
//! - *Pending prefill tokens* are the uncached-token estimates of the requests this proxy sent
//!   to `e` that have not yet produced a first response byte, across all worker threads
//!   ([`crate::shared_data::OutstandingTable`]); with the aggregator's figures, the server's own
//!   queue (other proxies' requests included) stands in when it is larger.
//! - The *decode term* is what running sequences add: every engine step that carries this
//!   request's prefill (one per `step_tokens`, vLLM's `max_num_batched_tokens`) also runs one
//!   decode token for each running sequence. It is what keeps a prefix holder that is busy
//!   decoding from taking every request that shares its prefix.
//! - The *KV term* (aggregator figures only): a nearly full cache admits a new sequence only
//!   once running ones free blocks.
//! - The *KV-growth weight* ([`claimed_share`]): `KV claimed_e` is what this proxy's requests
//!   in flight at `e` will hold by the time they finish, each one's uncached prompt tokens and
//!   expected output tokens (`cost.output_tokens`, per model `cost.models.<m>.output_tokens`).
//!   A prefix computed again where the decodes in flight will fill the cache takes blocks they
//!   grow into: the server preempts them and later requests wait for the recomputation. So
//!   recomputing weighs more where the cache is claimed, and a request stays on its prefix's
//!   holder longer there (the half-slow fleet's shared-prefix: 962 preemptions and a 24 s TTFT
//!   p90 without it, none and 0.39 s with it; bench/README.md).
//! - The *seat term*: a server runs `max_num_seqs` sequences at once (vLLM's setting); a
//!   request sent where this proxy and the server's own counts hold that many waits for one to
//!   finish, about `hold_e / max_num_seqs` per request ahead of it, `hold_e` the measured time a
//!   request stays there ([`crate::Outstanding::hold_s`]). Queued prefill tokens do not show
//!   that wait: a fast endpoint busy decoding at its seat limit looked idle. Off by default
//!   (`max_num_seqs` 0): beside the KV-growth weight it only cost (bench/README.md).
//! - The uncached tokens are weighted by `uncached_weight x (1 + pressure)` ([`Pressure`]: the
//!   work queued at the least busy candidate, in typical requests, now or on recent average,
//!   whichever is larger; 0 while the fleet has idle endpoints, growing once none is).
//! - Tokens are estimated from prompt bytes with a per-model ratio ([`TokenRatio`]), learned
//!   from the servers' `usage` figures or configured.
//! - `rate_e` is the endpoint's own prefill rate (configured, or the aggregator's estimate),
//!   else its model's configured rate, else the default.
//!
//! A request with no match anywhere therefore goes where the pending work is least, not where
//! the request count is; a burst sharing a prefix stays on its holder until the work queued
//! there outweighs recomputing the prefix elsewhere, and the index then records the second
//! holder, so a hot prefix gets a second replica instead of flip-flopping.

use crate::prefix_affinity::score::Candidate;
use crate::rng::Rng;

/// The cost model's parameters (checked; see `cost` in the plugin configuration).
#[derive(Clone, Debug, PartialEq)]
pub struct CostParams {
    /// Prefill tokens per second for a model with no rate of its own.
    pub prefill_tokens_per_s: f64,
    /// Per-model overrides.
    pub models: Vec<ModelCost>,
    /// Seconds one running sequence adds to each engine step.
    pub decode_s_per_sequence: f64,
    /// Prompt tokens one engine step prefills at most (vLLM `max_num_batched_tokens`).
    pub step_tokens: u32,
    /// Prompt bytes per token for a model with no ratio of its own.
    pub bytes_per_token: f64,
    /// Learn each model's bytes-per-token ratio from the servers' `usage` figures.
    pub learn_bytes_per_token: bool,
    /// Learn each model's expected output tokens (the mean) from the servers' `usage`
    /// figures (the answers' own counts), in place of `output_tokens`.
    pub learn_output_tokens: bool,
    /// How much more a token this request would compute counts than a token already queued,
    /// on an unloaded fleet (see [`Pressure`]).
    pub uncached_weight: f64,
    /// The time constant, seconds, over which the fleet's pressure is smoothed (0: each
    /// request's own figure).
    pub pressure_time_constant_s: f64,
    /// KV-cache use (as the aggregator reports it) above which an endpoint may have to wait
    /// for running sequences to free blocks before it admits this request.
    pub kv_high: f64,
    /// The wait predicted at a full KV cache, seconds (linear from `kv_high`).
    pub kv_full_s: f64,
    /// An endpoint's KV cache in tokens, for a model and endpoint with no figure of their own
    /// (vLLM logs it at start: "GPU KV cache size: N tokens"); none: no footprint term.
    pub kv_capacity_tokens: Option<u32>,
    /// The share of an endpoint's KV cache this proxy's requests in flight may fill before a
    /// request that matches nowhere starts to avoid it.
    pub footprint_high: f64,
    /// What a matched block offloaded from the GPU counts for, against 1 for one on the GPU:
    /// `[CPU, storage]` (the server loads it back instead of computing it; see
    /// [`crate::PrefixIndex::demote`]).
    pub tier_credit: [f64; 2],
    /// Output tokens a request is expected to generate, for a model with no figure of its own
    /// (the claim on the KV cache its decode grows into).
    pub output_tokens: f64,
    /// How much the uncached tokens' weight grows with the share of an endpoint's KV cache
    /// that the requests in flight there claim (the KV-growth term, [`claimed_share`]).
    pub claim_weight: f64,
    /// Sequences an endpoint runs at once (vLLM `max_num_seqs`): requests past them wait for
    /// one to finish (the seat term; 0: no term).
    pub max_num_seqs: u32,
}

/// A model's own figures.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCost {
    pub model: String,
    pub prefill_tokens_per_s: Option<f64>,
    pub bytes_per_token: Option<f64>,
    pub kv_capacity_tokens: Option<u32>,
    pub output_tokens: Option<f64>,
}

impl Default for CostParams {
    fn default() -> Self {
        CostParams {
            // llm-d's calibrated `peakPrefillThroughput` (Qwen 32B, H100 TP2) is 15,928; an
            // 8B model on one H100 does about 25,000. Calibrate (`kvoy-aggregator calibrate`)
            // or let the aggregator measure it.
            prefill_tokens_per_s: 20_000.0,
            models: Vec::new(),
            // An 8B model on an H100 at a few thousand tokens of context per sequence: about
            // 0.06 ms of per-sequence work plus 0.2 ms of KV reads per decode step.
            decode_s_per_sequence: 0.000_25,
            step_tokens: 8192,
            bytes_per_token: 4.0,
            learn_bytes_per_token: true,
            // Off: on the fleet simulation's agents at 2x the learned mean (167 tokens) priced
            // the KV growth lower than the 256 the claim weight was measured with, and TTFT
            // p90 rose from 0.470 to 0.830 s (median of 5 seeds; level elsewhere).
            learn_output_tokens: false,
            uncached_weight: 1.0,
            // Agents at 2x saturation, five seeds (bench/README.md): 3, 10 and 30 s tried.
            pressure_time_constant_s: 10.0,
            kv_high: 0.95,
            kv_full_s: 1.0,
            kv_capacity_tokens: None,
            // Measured on the half-slow fleet (bench/README.md): 0.3, 0.5 and 0.7 all avoid
            // the preemptions; 0.7 did best on both fleets.
            footprint_high: 0.7,
            // vLLM's router's (its `kv_aware` policy: 1.0 / 0.8 / 0.3); Dynamo's KV router
            // credits 1.0 / 0.75 / 0.25.
            tier_credit: [0.8, 0.3],
            output_tokens: 256.0,
            // Measured on the fleet simulation (bench/README.md): 2 still let the half-slow
            // fleet's shared-prefix preempt on one seed in three, 3 and 4 were level, 6 lost
            // on agents at 2x.
            claim_weight: 3.0,
            // Off: with the KV-growth weight it only cost (the half-slow fleet's shared-prefix at
            // 2x 108 s without, 138 s with 256 seats; bench/README.md).
            max_num_seqs: 0,
        }
    }
}

impl CostParams {
    /// The prompt bytes a match credits: each tier's share of `ends` (where each key ends in
    /// the prompt, in bytes) at that tier's credit.
    pub fn credited_bytes(&self, matched: crate::Match, ends: &[u32]) -> u64 {
        use crate::Tier;
        let end = |keys: usize| {
            keys.checked_sub(1)
                .and_then(|last| ends.get(last))
                .map_or(0.0, |&e| f64::from(e))
        };
        let gpu = end(matched.within(Tier::Gpu));
        let cpu = end(matched.within(Tier::Cpu));
        let all = end(matched.keys());
        let credited = gpu + (cpu - gpu) * self.tier_credit[0] + (all - cpu) * self.tier_credit[1];
        credited.round() as u64
    }

    pub fn model(&self, model: &str) -> Option<&ModelCost> {
        self.models.iter().find(|m| m.model == model)
    }

    /// The configured prefill rate of `model`.
    pub fn model_rate(&self, model: &str) -> f64 {
        self.model(model)
            .and_then(|m| m.prefill_tokens_per_s)
            .unwrap_or(self.prefill_tokens_per_s)
    }

    /// The configured output tokens of a request to `model`.
    pub fn model_output_tokens(&self, model: &str) -> f64 {
        self.model(model)
            .and_then(|m| m.output_tokens)
            .unwrap_or(self.output_tokens)
    }

    /// The configured KV capacity of `model`'s endpoints, tokens.
    pub fn model_kv_capacity(&self, model: &str) -> Option<u32> {
        self.model(model)
            .and_then(|m| m.kv_capacity_tokens)
            .or(self.kv_capacity_tokens)
    }
}

/// One candidate's cost terms, for explaining a decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostTerms {
    /// Prompt tokens the endpoint would compute for this request.
    pub uncached_tokens: f64,
    /// Prefill tokens ahead of this request there.
    pub queued_tokens: f64,
    /// Sequences decoding there.
    pub running: u32,
    /// The prefill rate used, tokens/s.
    pub rate: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// The KV-cache term: a wait for blocks to free on a nearly full cache.
    pub kv_s: f64,
    /// The footprint term (a request that matches nowhere only): the KV this proxy's
    /// requests in flight hold there.
    pub footprint_s: f64,
    /// The share of the KV cache the requests in flight there claim, this one included
    /// ([`claimed_share`]; 0 without a capacity): the uncached tokens weigh `1 +
    /// claim_weight x claimed` more.
    pub claimed: f64,
    /// The seat term: the wait for a running sequence to finish when the endpoint already
    /// holds `max_num_seqs` requests.
    pub seat_s: f64,
    /// Predicted time to first token (the cost), seconds.
    pub total_s: f64,
}

/// What the cost model needs to know of the request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestSize {
    /// Estimated prompt tokens.
    pub prompt_tokens: f64,
    /// The model's bytes per token (to turn matched bytes into tokens).
    pub bytes_per_token: f64,
    /// Uncached tokens of a typical request of this proxy (to size a server queue).
    pub typical_tokens: f64,
    /// Output tokens it is expected to generate.
    pub output_tokens: f64,
}

/// Prefill tokens queued at `c` ahead of a new request: this proxy's by the prefill clock for
/// a request that matches nowhere (`clock`), else every token it sent and has no answer for.
fn queued(c: &Candidate, req: &RequestSize, clock: bool) -> f64 {
    let ours = if clock {
        c.queued_tokens
    } else {
        c.prefill_tokens as f64
    };
    let server = c
        .load
        .waiting
        .map_or(0.0, |w| f64::from(w) * req.typical_tokens);
    ours.max(server)
}

/// How loaded the fleet is for a request: the prefill work queued at the least busy candidate,
/// in typical requests (0 while some candidate has nothing queued); `None` without candidates.
pub fn least_queued_requests(candidates: &[Candidate], req: &RequestSize) -> Option<f64> {
    let least = candidates
        .iter()
        .map(|c| queued(c, req, false))
        .fold(f64::INFINITY, f64::min);
    least
        .is_finite()
        .then(|| least / req.typical_tokens.max(1.0))
}

/// The fleet's pressure for weighing uncached tokens: [`least_queued_requests`] now, or its
/// recent average if larger (an exponentially weighted average over time, time constant
/// `cost.pressure_time_constant_s`, sampled at each routed request). Computing a prefix again
/// elsewhere costs the fleet capacity that every later request waits for once no endpoint is
/// idle, so the uncached tokens weigh `uncached_weight x (1 + pressure)`. The average, because
/// an overloaded fleet has lulls: an endpoint idle for a moment used to reset the weight to 1,
/// and the prefixes spilled then were paid for later (agents at 2x saturation); the figure now,
/// because the average lags a load that rises, and less weight then cost prefixes too (the
/// aggregator mode on the half-slow fleet's shared-prefix; both in bench/README.md).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pressure {
    smoothed: f64,
    at: Option<std::time::Duration>,
}

impl Pressure {
    /// Folds in the pressure `instant` seen at `now` and returns the pressure to weigh by:
    /// the larger of `instant` and the average. `time_constant_s` 0 keeps no history. A clock
    /// that went back counts as no time passed.
    pub fn observe(&mut self, instant: f64, now: std::time::Duration, time_constant_s: f64) -> f64 {
        let elapsed = match self.at {
            Some(at) => now.saturating_sub(at).as_secs_f64(),
            // The first sample is taken as it is.
            None => f64::INFINITY,
        };
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
        let keep = if time_constant_s > 0.0 {
            (-elapsed / time_constant_s).exp()
        } else {
            0.0
        };
        self.smoothed = instant + keep * (self.smoothed - instant);
        instant.max(self.smoothed)
    }

    /// The uncached tokens' weight at this pressure.
    pub fn weight(pressure: f64, params: &CostParams) -> f64 {
        params.uncached_weight * (1.0 + pressure.max(0.0))
    }
}

/// The claimed share is capped: past a cache claimed half again over, the endpoint preempts
/// whatever is sent, and an uncapped weight would only make it harder to leave.
const CLAIM_CAP: f64 = 1.5;

/// The share of `c`'s KV cache that the requests in flight there will claim by the time they
/// finish, this one included: each one's uncached prompt tokens and expected output tokens
/// (a cached prefix claims no new blocks), over the capacity; 0 without a capacity. A prefix
/// computed again where that share is high claims blocks the decodes in flight there grow
/// into: the server preempts them, and every later request waits for the recomputation.
pub fn claimed_share(c: &Candidate, uncached: f64, req: &RequestSize) -> f64 {
    match c.kv_capacity_tokens {
        Some(capacity) if capacity > 0 => {
            let claimed = c.kv_tokens as f64 + uncached + req.output_tokens.max(0.0);
            (claimed / f64::from(capacity)).min(CLAIM_CAP)
        }
        _ => 0.0,
    }
}

/// The cost terms of one candidate, its own uncached tokens weighted by `weight` (see
/// [`Pressure`]); `unmatched`: the request matches no candidate (module doc).
pub fn terms(
    c: &Candidate,
    req: &RequestSize,
    params: &CostParams,
    weight: f64,
    unmatched: bool,
) -> CostTerms {
    let bpt = req.bytes_per_token.max(0.01);
    let matched_tokens = c.matched_bytes as f64 / bpt;
    let uncached = (req.prompt_tokens - matched_tokens).max(1.0);
    let queued = queued(c, req, unmatched);
    let decoding_here = c.inflight.saturating_sub(c.prefilling);
    let running = match c.load.running {
        Some(r) => r.max(decoding_here),
        None => decoding_here,
    };
    let rate = if c.prefill_rate.is_finite() && c.prefill_rate > 0.0 {
        c.prefill_rate
    } else {
        params.prefill_tokens_per_s
    };
    let work = queued + uncached;
    let claimed = claimed_share(c, uncached, req);
    let weight = weight * (1.0 + params.claim_weight * claimed);
    let prefill_s = (queued + weight * uncached) / rate;
    let steps = 1.0 + work / f64::from(params.step_tokens.max(1));
    let decode_s = steps * f64::from(running) * params.decode_s_per_sequence;
    // Only the blocks this request must allocate wait: a request whose prefix is cached needs
    // few new ones.
    let needs = (uncached / req.prompt_tokens.max(1.0)).min(1.0);
    let kv_s = match c.load.kv_cache_usage {
        Some(u) if u > params.kv_high && params.kv_high < 1.0 => {
            ((u - params.kv_high) / (1.0 - params.kv_high)).min(1.0) * params.kv_full_s * needs
        }
        _ => 0.0,
    };
    let footprint_s = match c.kv_capacity_tokens {
        Some(capacity) if unmatched && capacity > 0 && params.footprint_high < 1.0 => {
            let filled = (c.prompt_tokens as f64 + req.prompt_tokens) / f64::from(capacity);
            let over = (filled - params.footprint_high) / (1.0 - params.footprint_high);
            over.max(0.0) * params.kv_full_s
        }
        _ => 0.0,
    };
    let seats = params.max_num_seqs;
    let holding = c.guard_load();
    let seat_s = if seats > 0 && c.hold_s > 0.0 && holding >= u64::from(seats) {
        (holding + 1 - u64::from(seats)) as f64 * c.hold_s / f64::from(seats)
    } else {
        0.0
    };
    CostTerms {
        uncached_tokens: uncached,
        queued_tokens: queued,
        running,
        rate,
        prefill_s,
        decode_s,
        kv_s,
        footprint_s,
        claimed,
        seat_s,
        total_s: prefill_s + decode_s + kv_s + footprint_s + seat_s,
    }
}

/// A split request's cost at decode endpoint `c` (prefill/decode disaggregation): its prompt is
/// computed on a prefill endpoint, so what it waits for here is the transfer of the blocks `c`
/// lacks (at `transfer_tokens_per_s`, weighed by the KV those in flight there claim, as the
/// aggregated model weighs recomputing), the prefill already queued there (whole requests
/// share its steps) and the running sequences' steps, plus the KV and seat terms.
pub fn decode_terms(
    c: &Candidate,
    req: &RequestSize,
    params: &CostParams,
    transfer_tokens_per_s: f64,
) -> CostTerms {
    let t = terms(c, req, params, 1.0, false);
    let transfer = if transfer_tokens_per_s.is_finite() && transfer_tokens_per_s > 0.0 {
        transfer_tokens_per_s
    } else {
        f64::INFINITY
    };
    let prefill_s = t.queued_tokens / t.rate
        + t.uncached_tokens * (1.0 + params.claim_weight * t.claimed) / transfer;
    let steps = 1.0 + t.queued_tokens / f64::from(params.step_tokens.max(1));
    let decode_s = steps * f64::from(t.running) * params.decode_s_per_sequence;
    CostTerms {
        prefill_s,
        decode_s,
        footprint_s: 0.0,
        total_s: prefill_s + decode_s + t.kv_s + t.seat_s,
        ..t
    }
}

/// Costs `candidates` into `out` (same order), their uncached tokens weighted by `weight`.
pub fn fill(
    candidates: &[Candidate],
    req: &RequestSize,
    params: &CostParams,
    weight: f64,
    out: &mut Vec<CostTerms>,
) {
    out.clear();
    let unmatched = candidates.iter().all(|c| c.matched == 0);
    out.extend(
        candidates
            .iter()
            .map(|c| terms(c, req, params, weight, unmatched)),
    );
}

/// Costs within this many seconds of the lowest are a tie, broken at random.
pub const TIE_S: f64 = 1e-9;

/// The indices of `terms` whose cost is within [`TIE_S`] of the lowest, in order: the
/// candidates [`pick`] chooses among at random (one, unless several cost the same).
pub fn cheapest(terms: &[CostTerms]) -> impl Iterator<Item = usize> + '_ {
    let best = terms
        .iter()
        .map(|t| t.total_s)
        .fold(f64::INFINITY, f64::min);
    terms
        .iter()
        .enumerate()
        .filter(move |(_, t)| t.total_s <= best + TIE_S)
        .map(|(i, _)| i)
}

/// Costs `candidates` into `out` (same order) and returns the index of the cheapest, ties
/// (within [`TIE_S`]) at random; `None` when there are no candidates.
pub fn pick(
    candidates: &[Candidate],
    req: &RequestSize,
    params: &CostParams,
    weight: f64,
    rng: &mut Rng,
    out: &mut Vec<CostTerms>,
) -> Option<usize> {
    fill(candidates, req, params, weight, out);
    let ties = cheapest(out).count();
    if ties == 0 {
        return None;
    }
    let nth = rng.below(ties);
    cheapest(out).nth(nth)
}

/// What is learned per model, for at most [`RATIO_MAX_MODELS`] models (bounded memory; the
/// others use the configuration).
#[derive(Clone, Debug)]
struct PerModel<T> {
    models: Vec<(String, T)>,
}

impl<T> Default for PerModel<T> {
    fn default() -> Self {
        PerModel { models: Vec::new() }
    }
}

impl<T: Copy> PerModel<T> {
    /// `model`'s entry, made `fresh` on first sight while there is room; `None` past the cap.
    fn entry(&mut self, model: &str, fresh: T) -> Option<&mut T> {
        let i = match self.models.iter().position(|(m, _)| m == model) {
            Some(i) => i,
            None if self.models.len() < RATIO_MAX_MODELS => {
                self.models.push((model.to_owned(), fresh));
                self.models.len() - 1
            }
            None => return None,
        };
        self.models.get_mut(i).map(|(_, v)| v)
    }

    fn get(&self, model: &str) -> Option<T> {
        self.models
            .iter()
            .find(|(m, _)| m == model)
            .map(|&(_, v)| v)
    }
}

/// Bytes per token for each model, learned from the servers' own `usage` figures: an
/// exponentially weighted ratio of prompt bytes to prompt tokens, weighted by tokens so that
/// long prompts (where the estimate matters) count most.
#[derive(Clone, Debug, Default)]
pub struct TokenRatio {
    /// (weighted bytes, weighted tokens) per model.
    models: PerModel<(f64, f64)>,
}

/// Evidence decays by half every this many observed tokens.
const RATIO_HALF_LIFE_TOKENS: f64 = 2_000_000.0;
/// Learned ratios are trusted once this many tokens were observed.
const RATIO_MIN_TOKENS: f64 = 2_000.0;
/// At most this many models are learned (bounded memory; others use the configuration): per
/// learned figure ([`PerModel`]).
const RATIO_MAX_MODELS: usize = 64;

impl TokenRatio {
    /// Records that a prompt of `bytes` bytes was `tokens` tokens for `model`. Implausible
    /// figures (below 0.5 or above 32 bytes a token) are ignored: a server's count can
    /// include a chat template, never a tenfold error.
    pub fn observe(&mut self, model: &str, bytes: u64, tokens: u64) {
        if tokens == 0 || bytes == 0 {
            return;
        }
        let ratio = bytes as f64 / tokens as f64;
        if !(0.5..=32.0).contains(&ratio) {
            return;
        }
        let Some((b, t)) = self.models.entry(model, (0.0, 0.0)) else {
            return;
        };
        let decay = 0.5f64.powf(tokens as f64 / RATIO_HALF_LIFE_TOKENS);
        *b = *b * decay + bytes as f64;
        *t = *t * decay + tokens as f64;
    }

    /// The learned ratio of `model`, once there is enough evidence.
    pub fn get(&self, model: &str) -> Option<f64> {
        self.models
            .get(model)
            .filter(|&(_, t)| t >= RATIO_MIN_TOKENS)
            .map(|(b, t)| b / t)
    }
}

/// Each model's mean output length, learned from the answers' own counts: the KV-growth
/// term's expectation of what a request in flight will still add.
#[derive(Clone, Debug, Default)]
pub struct OutputLength {
    /// (mean output tokens, answers observed, capped at [`OUTPUT_WINDOW`]) per model.
    models: PerModel<(f64, u32)>,
}

/// Learned lengths are trusted once this many answers were observed.
const OUTPUT_MIN_ANSWERS: u32 = 16;
/// The mean weighs the last this many answers about equally (an exponential average past
/// them): a model whose traffic changes shape is followed within a few hundred answers.
const OUTPUT_WINDOW: u32 = 256;
/// Counts above this are not an answer's length (the configured bound of `output_tokens`).
const OUTPUT_MAX_TOKENS: u64 = 10_000_000;

impl OutputLength {
    /// Records that an answer of `model` had `tokens` output tokens. Empty answers (errors,
    /// aborted streams) and implausible counts are ignored.
    pub fn observe(&mut self, model: &str, tokens: u64) {
        if tokens == 0 || tokens > OUTPUT_MAX_TOKENS {
            return;
        }
        let Some((mean, n)) = self.models.entry(model, (0.0, 0)) else {
            return;
        };
        *n = (*n + 1).min(OUTPUT_WINDOW);
        *mean += (tokens as f64 - *mean) / f64::from(*n);
    }

    /// The learned mean of `model`, once there is enough evidence.
    pub fn get(&self, model: &str) -> Option<f64> {
        self.models
            .get(model)
            .filter(|&(_, n)| n >= OUTPUT_MIN_ANSWERS)
            .map(|(mean, _)| mean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{EndpointId, EndpointLoad};
    use std::time::Duration;

    fn cand(id: u16, matched_bytes: u64, inflight: u32, prefill_tokens: u64) -> Candidate {
        Candidate {
            id: EndpointId(id),
            matched: (matched_bytes / 64) as u32,
            matched_bytes,
            inflight,
            prefilling: u32::from(prefill_tokens > 0).min(inflight),
            prefill_tokens,
            queued_tokens: prefill_tokens as f64,
            prompt_tokens: prefill_tokens,
            kv_tokens: prefill_tokens,
            hold_s: 0.0,
            kv_capacity_tokens: None,
            prefill_rate: 20_000.0,
            load: EndpointLoad::default(),
            pinned: false,
        }
    }

    fn req(tokens: f64) -> RequestSize {
        RequestSize {
            prompt_tokens: tokens,
            bytes_per_token: 4.0,
            typical_tokens: 1000.0,
            output_tokens: 0.0,
        }
    }

    /// The pressure of these candidates alone, as a router with no history sees it.
    fn weight(c: &[Candidate], r: &RequestSize, p: &CostParams) -> f64 {
        Pressure::weight(least_queued_requests(c, r).unwrap_or(0.0), p)
    }

    fn choose(c: &[Candidate], r: &RequestSize) -> (usize, Vec<CostTerms>) {
        let mut out = Vec::new();
        let p = CostParams::default();
        let i = pick(c, r, &p, weight(c, r, &p), &mut Rng::new(1), &mut out).unwrap();
        (i, out)
    }

    #[test]
    fn the_weight_grows_with_the_least_busy_candidates_queue() {
        let r = req(1000.0);
        let p = CostParams::default();
        assert_eq!(
            weight(&[cand(0, 0, 1, 3_000), cand(1, 0, 0, 0)], &r, &p),
            1.0
        );
        assert_eq!(
            weight(&[cand(0, 0, 1, 3_000), cand(1, 0, 1, 2_000)], &r, &p),
            3.0
        );
        assert_eq!(least_queued_requests(&[], &r), None);
    }

    #[test]
    fn pressure_outlasts_a_lull() {
        let s = Duration::from_secs;
        let mut p = Pressure::default();
        // The first sample is taken as it is.
        assert_eq!(p.observe(4.0, s(100), 10.0), 4.0);
        // An endpoint idle for a moment, 1 s later: most of the pressure stays.
        let after = p.observe(0.0, s(101), 10.0);
        assert!((after - 4.0 * (-0.1f64).exp()).abs() < 1e-12, "{after}");
        // Many seconds of an idle endpoint: it fades.
        let later = p.observe(0.0, s(161), 10.0);
        assert!(later < 0.01, "{later}");
        // A load that rises counts at once, the average behind it.
        assert_eq!(p.observe(9.0, s(161), 10.0), 9.0);
        assert!(
            p.observe(0.0, s(161), 10.0) < 0.01,
            "no time passed: no history gained"
        );
        // A clock that goes back counts as no time passed.
        assert!(p.observe(0.0, s(50), 10.0) < 0.01);
        // No time constant: no history.
        assert_eq!(p.observe(2.5, s(162), 0.0), 2.5);
        assert_eq!(p.observe(0.0, s(163), 0.0), 0.0);
        assert_eq!(Pressure::weight(2.5, &CostParams::default()), 3.5);
        assert_eq!(Pressure::weight(-1.0, &CostParams::default()), 1.0);
    }

    #[test]
    fn the_holder_wins_until_its_queue_outweighs_the_prefix() {
        // 8,000-token prompt, 6,000 cached on endpoint 1 (24,000 bytes).
        let r = req(8000.0);
        let (i, t) = choose(&[cand(0, 0, 0, 0), cand(1, 24_000, 0, 0)], &r);
        assert_eq!(i, 1);
        assert_eq!(t[1].uncached_tokens, 2000.0);
        assert!((t[1].prefill_s - 0.1).abs() < 1e-12);
        // 5,000 tokens already pending there: 7,000 vs 8,000, still the holder.
        let (i, _) = choose(&[cand(0, 0, 0, 0), cand(1, 24_000, 1, 5_000)], &r);
        assert_eq!(i, 1);
        // 7,000 pending: 9,000 vs 8,000, the prefix is recomputed elsewhere.
        let (i, _) = choose(&[cand(0, 0, 0, 0), cand(1, 24_000, 1, 7_000)], &r);
        assert_eq!(i, 0);
    }

    #[test]
    fn no_match_goes_where_pending_work_is_least_not_fewest_requests() {
        let r = req(1000.0);
        // Endpoint 0: one request of 20,000 pending tokens; endpoint 1: three small ones.
        let mut a = cand(0, 0, 1, 20_000);
        a.prefilling = 1;
        let mut b = cand(1, 0, 3, 1_500);
        b.prefilling = 3;
        let (i, _) = choose(&[a, b], &r);
        assert_eq!(i, 1);
    }

    #[test]
    fn a_request_that_matches_nowhere_sees_how_far_each_queue_has_got() {
        let r = req(1000.0);
        // Endpoint 0 was sent 6,000 tokens long ago, 500 of them still ahead by its clock;
        // endpoint 1 was just sent 1,000.
        let mut a = cand(0, 0, 1, 6_000);
        a.queued_tokens = 500.0;
        let b = cand(1, 0, 1, 1_000);
        let (i, t) = choose(&[a, b], &r);
        assert_eq!(i, 0);
        assert_eq!(t[0].queued_tokens, 500.0);
        // With a prefix at stake (a match on endpoint 1), every token sent and not answered
        // counts: moving a prefix on a guess about progress costs more than it saves.
        let mut b = b;
        b.matched = 1;
        b.matched_bytes = 64;
        let (i, t) = choose(&[a, b], &r);
        assert_eq!(t[0].queued_tokens, 6_000.0);
        assert_eq!(i, 1);
    }

    #[test]
    fn a_request_that_matches_nowhere_avoids_a_cache_its_requests_fill() {
        let r = req(1000.0);
        let p = CostParams {
            kv_capacity_tokens: Some(10_000),
            ..CostParams::default()
        };
        // Endpoint 0 holds 8,000 prompt tokens of this proxy's requests: 9,000 of 10,000 with
        // this one, past 0.7, (0.9 - 0.7) / 0.3 of kv_full_s. Endpoint 1 holds none.
        let mut a = cand(0, 0, 4, 0);
        a.prompt_tokens = 8_000;
        a.kv_capacity_tokens = p.kv_capacity_tokens;
        let mut b = cand(1, 0, 0, 0);
        b.kv_capacity_tokens = p.kv_capacity_tokens;
        let mut out = Vec::new();
        let i = pick(&[a, b], &r, &p, 1.0, &mut Rng::new(1), &mut out).unwrap();
        assert_eq!(i, 1);
        assert!(
            (out[0].footprint_s - 0.2 / 0.3).abs() < 1e-9,
            "{:?}",
            out[0]
        );
        assert_eq!(out[1].footprint_s, 0.0);
        // Unknown capacity: no term.
        a.kv_capacity_tokens = None;
        assert_eq!(terms(&a, &r, &p, 1.0, true).footprint_s, 0.0);
        // A request with a match anywhere: no term either.
        a.kv_capacity_tokens = p.kv_capacity_tokens;
        assert_eq!(terms(&a, &r, &p, 1.0, false).footprint_s, 0.0);
    }

    #[test]
    fn requests_past_the_seats_wait_for_one_to_free() {
        let r = req(1000.0);
        let p = CostParams {
            max_num_seqs: 4,
            ..CostParams::default()
        };
        // Six requests held where four run at once, each staying 2 s: this one is the third
        // past the seats, 3 x 2 / 4 s.
        let mut c = cand(0, 0, 6, 0);
        c.hold_s = 2.0;
        let t = terms(&c, &r, &p, 1.0, false);
        assert!((t.seat_s - 1.5).abs() < 1e-12, "{t:?}");
        assert!(t.total_s >= t.seat_s);
        // Below the seats, an unknown hold time, or no seat limit: no term.
        c.inflight = 3;
        assert_eq!(terms(&c, &r, &p, 1.0, false).seat_s, 0.0);
        c.inflight = 6;
        c.hold_s = 0.0;
        assert_eq!(terms(&c, &r, &p, 1.0, false).seat_s, 0.0);
        c.hold_s = 2.0;
        let off = CostParams {
            max_num_seqs: 0,
            ..p.clone()
        };
        assert_eq!(terms(&c, &r, &off, 1.0, false).seat_s, 0.0);
        // The server's own count, when larger, is what is held.
        c.inflight = 1;
        c.load.waiting = Some(3);
        c.load.running = Some(4);
        assert!((terms(&c, &r, &p, 1.0, false).seat_s - 2.0).abs() < 1e-12);
    }

    #[test]
    fn uncached_tokens_weigh_more_where_the_requests_in_flight_claim_the_cache() {
        let p = CostParams {
            claim_weight: 2.0,
            ..CostParams::default()
        };
        let mut r = req(1000.0);
        r.output_tokens = 1000.0;
        let mut c = cand(0, 0, 3, 0);
        c.kv_capacity_tokens = Some(10_000);
        // 6,000 tokens claimed, plus this request's 1,000 + 1,000: 0.8 of the cache, so each
        // uncached token weighs 1 + 2 x 0.8 = 2.6.
        c.kv_tokens = 6_000;
        let t = terms(&c, &r, &p, 1.0, false);
        assert!((t.claimed - 0.8).abs() < 1e-12, "{t:?}");
        assert!(
            (t.prefill_s - 2.6 * 1000.0 / 20_000.0).abs() < 1e-12,
            "{t:?}"
        );
        // A cached prefix claims nothing new: 3,000 of 4,000 bytes matched leaves 250 tokens.
        c.matched = 47;
        c.matched_bytes = 3_000;
        let t = terms(&c, &r, &p, 1.0, false);
        assert!((t.claimed - 0.725).abs() < 1e-12, "{t:?}");
        // The pressure's weight multiplies it.
        let t = terms(&c, &r, &p, 2.0, false);
        assert!(
            (t.prefill_s - 2.0 * 2.45 * 250.0 / 20_000.0).abs() < 1e-12,
            "{t:?}"
        );
        // Capped at 1.5 claimed.
        c.kv_tokens = 100_000;
        assert_eq!(terms(&c, &r, &p, 1.0, false).claimed, 1.5);
        // No capacity, or no weight: the plain cost.
        c.kv_capacity_tokens = None;
        let t = terms(&c, &r, &p, 1.0, false);
        assert_eq!(t.claimed, 0.0);
        assert!((t.prefill_s - 250.0 / 20_000.0).abs() < 1e-12, "{t:?}");
        c.kv_capacity_tokens = Some(10_000);
        let off = CostParams {
            claim_weight: 0.0,
            ..p
        };
        let t = terms(&c, &r, &off, 1.0, false);
        assert!((t.prefill_s - 250.0 / 20_000.0).abs() < 1e-12, "{t:?}");
    }

    #[test]
    fn decoding_sequences_cost_each_step() {
        let r = req(1000.0);
        // Same prefix, same queue; endpoint 0 decodes 200 sequences, endpoint 1 none.
        let a = cand(0, 0, 200, 0);
        let b = cand(1, 0, 0, 0);
        let (i, t) = choose(&[a, b], &r);
        assert_eq!(i, 1);
        assert_eq!(t[0].running, 200);
        let steps = 1.0 + 1000.0 / 8192.0;
        assert!((t[0].decode_s - steps * 200.0 * 0.000_25).abs() < 1e-12);
        // The server's running count, when larger, is used.
        let mut c = cand(2, 0, 0, 0);
        c.load = EndpointLoad {
            running: Some(50),
            ..EndpointLoad::default()
        };
        assert_eq!(
            terms(&c, &r, &CostParams::default(), 1.0, false).running,
            50
        );
    }

    #[test]
    fn the_server_queue_counts_when_larger_than_ours() {
        let r = req(1000.0);
        let mut c = cand(0, 0, 1, 500);
        c.load.waiting = Some(4);
        assert_eq!(
            terms(&c, &r, &CostParams::default(), 1.0, false).queued_tokens,
            4000.0
        );
        c.load.waiting = Some(0);
        assert_eq!(
            terms(&c, &r, &CostParams::default(), 1.0, false).queued_tokens,
            500.0
        );
    }

    #[test]
    fn a_faster_endpoint_takes_more() {
        let r = req(4000.0);
        let mut fast = cand(0, 0, 1, 4_000);
        fast.prefill_rate = 40_000.0;
        let slow = cand(1, 0, 0, 0);
        // 8,000 tokens at 40k/s (0.2 s) beat 4,000 at 20k/s (0.2 s)? Tie; a bit more on the
        // slow one tips it.
        let mut slow_busy = slow;
        slow_busy.prefill_tokens = 100;
        slow_busy.inflight = 1;
        slow_busy.prefilling = 1;
        let (i, _) = choose(&[fast, slow_busy], &r);
        assert_eq!(i, 0);
        // A bad rate falls back to the default instead of dividing by zero.
        let mut broken = slow;
        broken.prefill_rate = 0.0;
        assert_eq!(
            terms(&broken, &r, &CostParams::default(), 1.0, false).rate,
            20_000.0
        );
    }

    #[test]
    fn a_nearly_full_kv_cache_costs_a_wait() {
        let r = req(1000.0);
        let mut c = cand(0, 0, 0, 0);
        let p = CostParams::default();
        c.load.kv_cache_usage = Some(0.9);
        assert_eq!(terms(&c, &r, &p, 1.0, false).kv_s, 0.0);
        c.load.kv_cache_usage = Some(0.975);
        assert!((terms(&c, &r, &p, 1.0, false).kv_s - 0.5).abs() < 1e-9);
        c.load.kv_cache_usage = Some(1.5);
        assert!((terms(&c, &r, &p, 1.0, false).kv_s - 1.0).abs() < 1e-9);
        // A request whose prefix is cached there (3,000 of 4,000 bytes) waits for a quarter.
        c.matched_bytes = 3000;
        let t = terms(&c, &r, &p, 1.0, false);
        assert!((t.kv_s - 0.25).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn ties_break_at_random() {
        let r = req(100.0);
        let c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        let mut seen = [0; 3];
        let mut rng = Rng::new(3);
        let mut out = Vec::new();
        for _ in 0..300 {
            seen[pick(&c, &r, &CostParams::default(), 1.0, &mut rng, &mut out).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
        assert_eq!(
            pick(&[], &r, &CostParams::default(), 1.0, &mut rng, &mut out),
            None
        );
    }

    #[test]
    fn token_ratio_learns_and_ignores_nonsense() {
        let mut t = TokenRatio::default();
        assert_eq!(t.get("m"), None);
        t.observe("m", 3000, 1000);
        assert_eq!(t.get("m"), None, "too little evidence yet");
        t.observe("m", 6000, 2000);
        assert!((t.get("m").unwrap() - 3.0).abs() < 1e-9);
        t.observe("m", 10, 100_000); // 0.0001 bytes a token: ignored
        t.observe("m", 0, 0);
        assert!((t.get("m").unwrap() - 3.0).abs() < 1e-9);
        // New evidence moves it, old evidence fades.
        for _ in 0..200 {
            t.observe("m", 50_000, 10_000);
        }
        assert!((t.get("m").unwrap() - 5.0).abs() < 0.05, "{:?}", t.get("m"));
        assert_eq!(t.get("other"), None);
        // Bounded: models past the limit are not learned.
        for i in 0..100 {
            t.observe(&format!("x{i}"), 8000, 2000);
        }
        assert!(t.get("x10").is_some());
        assert!(t.get("x99").is_none());
    }

    #[test]
    fn output_lengths_are_learned_per_model_once_there_is_evidence() {
        let mut o = OutputLength::default();
        for _ in 0..15 {
            o.observe("a", 100);
        }
        assert_eq!(o.get("a"), None, "15 answers are not enough");
        o.observe("a", 100);
        assert_eq!(o.get("a"), Some(100.0));
        // empty and implausible answers are ignored
        o.observe("a", 0);
        o.observe("a", 20_000_000);
        assert_eq!(o.get("a"), Some(100.0));
        // a change of shape is followed: 256 answers of 400 take the mean most of the way
        for _ in 0..256 {
            o.observe("a", 400);
        }
        let a = o.get("a").unwrap();
        assert!(a > 280.0 && a < 400.0, "{a}");
        assert_eq!(o.get("b"), None);
        // bounded: models past the cap are not learned
        for m in 0..100 {
            for _ in 0..16 {
                o.observe(&format!("m{m}"), 7);
            }
        }
        assert_eq!(o.get("m0"), Some(7.0));
        assert_eq!(o.get("m99"), None);
    }
}
