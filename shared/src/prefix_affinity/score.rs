//! Scorers and the picker.
//!
//! Each scorer gives every candidate a score in [0, 1]; the picker takes the weighted sum and
//! breaks ties at random:
//! - prefix: prompt bytes matched / prompt bytes keyed;
//! - in-flight: this proxy's open requests per endpoint, `(max - x) / (max - min)`;
//! - queue: the server's waiting requests, same normalisation, when known;
//! - KV cache: `1 - usage`, when known.
//!
//! A scorer with no data for any candidate is left out; a candidate without data where others
//! have it scores 0 on that scorer (unknown load is treated as the worst).
//!
//! Hot-spot guard: a candidate's load is what it holds as far as this proxy knows
//! ([`Candidate::guard_load`]: the server's waiting + running when the aggregator reports them,
//! at least this proxy's in-flight count). A
//! candidate whose load is at least `abs` above the least-loaded candidate *and* more than `rel`
//! times it loses its prefix score for this decision. A burst of same-prefix requests therefore
//! fills the cache holder up to `abs` extra requests, then spills to the next best endpoint,
//! which then holds the prefix too. Defaults: `abs` 8, `rel` 1.5 (SGLang uses 64 / 1.5 on
//! server queues; kvoy's in-flight counts react sooner, so a smaller margin suffices).

use crate::endpoint::{EndpointId, EndpointLoad};
use crate::prefix_affinity::config::{HotspotGuard, Weights};
use crate::rng::Rng;

/// What the picker knows of one candidate endpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub id: EndpointId,
    /// Leading request blocks the endpoint holds.
    pub matched: u32,
    /// Prompt bytes those blocks cover.
    pub matched_bytes: u64,
    /// Requests this proxy has sent it that have not finished.
    pub inflight: u32,
    /// Of those, the ones that have not yet produced a first response byte.
    pub prefilling: u32,
    /// Their estimated uncached prompt tokens.
    pub prefill_tokens: u64,
    /// Of those, the ones still ahead of a request arriving now, by this proxy's prefill
    /// clock ([`crate::Outstanding::queued_tokens_at`]).
    pub queued_tokens: f64,
    /// Estimated prompt tokens of every request this proxy has in flight there.
    pub prompt_tokens: u64,
    /// The KV cache those requests will still claim: uncached prompt plus expected output
    /// tokens ([`crate::Outstanding::kv_tokens`]).
    pub kv_tokens: u64,
    /// How long a request stays there, seconds, as this proxy measured it (0: unknown;
    /// [`crate::Outstanding::hold_s`]).
    pub hold_s: f64,
    /// The endpoint's KV cache in tokens, when known (configured, or the aggregator's).
    pub kv_capacity_tokens: Option<u32>,
    /// The endpoint's prefill rate, tokens/s (see [`crate::prefix_affinity::cost`]).
    pub prefill_rate: f64,
    pub load: EndpointLoad,
    /// The request's session is pinned here (scored with `weights.session`).
    pub pinned: bool,
}

impl Candidate {
    /// The requests the endpoint holds, as well as this proxy knows: what the hot-spot guard
    /// and the session break compare. With the server's own figures (waiting + running, which
    /// count this proxy's requests too, up to a scrape late) the larger of those and this
    /// proxy's in-flight count, never the sum, which would count this proxy's requests twice;
    /// with a queue length alone (a static pool's `waiting`), in-flight plus waiting.
    pub fn guard_load(&self) -> u64 {
        let ours = u64::from(self.inflight);
        match (self.load.waiting, self.load.running) {
            (Some(waiting), Some(running)) => ours.max(u64::from(waiting) + u64::from(running)),
            (Some(waiting), None) => ours + u64::from(waiting),
            (None, _) => ours,
        }
    }
}

/// One candidate's scores, for explaining a decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EndpointScore {
    pub prefix: f64,
    pub inflight: f64,
    pub queue: f64,
    pub kv_cache: f64,
    pub total: f64,
    /// The hot-spot guard removed this candidate's prefix score.
    pub hot: bool,
}

/// `(max - x) / (max - min)` over the known values; 1 for all when they are equal.
fn normalise_low_is_good(
    values: impl Iterator<Item = Option<f64>> + Clone,
) -> impl Fn(Option<f64>) -> f64 {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.flatten() {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    move |v| match v {
        None => 0.0,
        Some(_) if hi <= lo => 1.0,
        Some(x) => (hi - x) / (hi - lo),
    }
}

/// Scores `candidates` into `scores` (same order) and returns the index of the chosen one,
/// or `None` when there are no candidates.
pub fn pick(
    candidates: &[Candidate],
    request_bytes: u64,
    weights: &Weights,
    guard: &HotspotGuard,
    rng: &mut Rng,
    scores: &mut Vec<EndpointScore>,
) -> Option<usize> {
    scores.clear();
    if candidates.is_empty() {
        return None;
    }
    let min_load = candidates
        .iter()
        .map(Candidate::guard_load)
        .min()
        .unwrap_or(0);
    let inflight = normalise_low_is_good(candidates.iter().map(|c| Some(f64::from(c.inflight))));
    let waiting_known = candidates.iter().any(|c| c.load.waiting.is_some());
    let queue = normalise_low_is_good(candidates.iter().map(|c| c.load.waiting.map(f64::from)));
    let kv_known = candidates.iter().any(|c| c.load.kv_cache_usage.is_some());

    let mut best = f64::NEG_INFINITY;
    for c in candidates {
        let load = c.guard_load();
        let hot = load >= min_load.saturating_add(u64::from(guard.abs))
            && load as f64 > guard.rel * min_load as f64
            && load > min_load;
        let prefix = if hot || request_bytes == 0 {
            0.0
        } else {
            (c.matched_bytes as f64 / request_bytes as f64).min(1.0)
        };
        let s_inflight = inflight(Some(f64::from(c.inflight)));
        let s_queue = if waiting_known {
            queue(c.load.waiting.map(f64::from))
        } else {
            0.0
        };
        let s_kv = if kv_known {
            c.load
                .kv_cache_usage
                .map_or(0.0, |u| (1.0 - u).clamp(0.0, 1.0))
        } else {
            0.0
        };
        let total = weights.prefix * prefix
            + weights.inflight * s_inflight
            + weights.queue * s_queue
            + weights.kv_cache * s_kv
            + if c.pinned { weights.session } else { 0.0 };
        best = best.max(total);
        scores.push(EndpointScore {
            prefix,
            inflight: s_inflight,
            queue: s_queue,
            kv_cache: s_kv,
            total,
            hot,
        });
    }
    // Random choice among the (near-)best, without allocating.
    let ties = best_scored(scores).count();
    let nth = rng.below(ties);
    best_scored(scores).nth(nth)
}

/// Scores within this much of the highest are a tie, broken at random.
pub const TIE_SCORE: f64 = 1e-9;

/// The indices of `scores` within [`TIE_SCORE`] of the highest total, in order: the
/// candidates [`pick`] chooses among at random.
pub fn best_scored(scores: &[EndpointScore]) -> impl Iterator<Item = usize> + '_ {
    let best = scores
        .iter()
        .map(|s| s.total)
        .fold(f64::NEG_INFINITY, f64::max);
    scores
        .iter()
        .enumerate()
        .filter(move |(_, s)| s.total >= best - TIE_SCORE)
        .map(|(i, _)| i)
}

/// The indices of `candidates` with the least [`Candidate::guard_load`], in order: those
/// [`least_loaded`] chooses among at random.
pub fn least_loaded_ties(candidates: &[Candidate]) -> impl Iterator<Item = usize> + '_ {
    let min = candidates
        .iter()
        .map(Candidate::guard_load)
        .min()
        .unwrap_or(0);
    candidates
        .iter()
        .enumerate()
        .filter(move |(_, c)| c.guard_load() == min)
        .map(|(i, _)| i)
}

/// The least-loaded candidate (in-flight + known waiting), ties at random.
pub fn least_loaded(candidates: &[Candidate], rng: &mut Rng) -> Option<usize> {
    let ties = least_loaded_ties(candidates).count();
    if ties == 0 {
        return None;
    }
    let nth = rng.below(ties);
    least_loaded_ties(candidates).nth(nth)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: u16, matched: u32, inflight: u32) -> Candidate {
        Candidate {
            pinned: false,
            id: EndpointId(id),
            matched,
            matched_bytes: u64::from(matched) * 64,
            inflight,
            prefilling: 0,
            prefill_tokens: 0,
            queued_tokens: 0.0,
            prompt_tokens: 0,
            kv_tokens: 0,
            hold_s: 0.0,
            kv_capacity_tokens: None,
            prefill_rate: 20_000.0,
            load: EndpointLoad::default(),
        }
    }

    /// The default policy's pick for a prompt of `blocks` blocks, and every candidate's score.
    fn scored(c: &[Candidate], blocks: u64, seed: u64) -> (Option<usize>, Vec<EndpointScore>) {
        let mut scores = Vec::new();
        let picked = pick(
            c,
            blocks * 64,
            &Weights::default(),
            &HotspotGuard::default(),
            &mut Rng::new(seed),
            &mut scores,
        );
        (picked, scores)
    }

    fn choose(c: &[Candidate], blocks: u64, seed: u64) -> usize {
        scored(c, blocks, seed).0.unwrap()
    }

    #[test]
    fn prefix_wins_when_load_is_even() {
        let c = [cand(0, 0, 0), cand(1, 10, 0), cand(2, 3, 0)];
        for seed in 0..20 {
            assert_eq!(choose(&c, 10, seed), 1);
        }
    }

    #[test]
    fn prefix_outweighs_a_small_load_difference() {
        let c = [cand(0, 0, 0), cand(1, 10, 3)];
        assert_eq!(choose(&c, 10, 1), 1);
    }

    #[test]
    fn guard_spills_a_hot_cache_holder() {
        // Endpoint 1 holds the prefix but carries 8 more requests than endpoint 0.
        let c = [cand(0, 0, 0), cand(1, 10, 8), cand(2, 0, 4)];
        assert_eq!(choose(&c, 10, 1), 0);
        let (_, scores) = scored(&c, 10, 1);
        assert!(scores[1].hot && !scores[0].hot && !scores[2].hot);
        // One request less and affinity still wins.
        let c = [cand(0, 0, 0), cand(1, 10, 7)];
        assert_eq!(choose(&c, 10, 1), 1);
    }

    #[test]
    fn guard_needs_the_relative_margin_too() {
        // 40 vs 30: 10 above the least loaded but only 1.33x: not hot.
        let c = [cand(0, 0, 30), cand(1, 10, 40)];
        let (_, scores) = scored(&c, 10, 1);
        assert!(!scores[1].hot);
    }

    #[test]
    fn ties_break_at_random_over_all_tied() {
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0)];
        let mut seen = [0u32; 3];
        for seed in 0..300 {
            seen[choose(&c, 4, seed)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    }

    #[test]
    fn known_queue_and_kv_count() {
        let mut a = cand(0, 0, 0);
        let mut b = cand(1, 0, 0);
        a.load = EndpointLoad {
            waiting: Some(10),
            running: None,
            kv_cache_usage: Some(0.9),
            prefill_tokens_per_s: None,
            kv_capacity_tokens: None,
        };
        b.load = EndpointLoad {
            waiting: Some(0),
            running: None,
            kv_cache_usage: Some(0.1),
            prefill_tokens_per_s: None,
            kv_capacity_tokens: None,
        };
        assert_eq!(choose(&[a, b], 4, 3), 1);
        // unknown load where others are known scores as the worst
        let c = cand(2, 0, 0);
        assert_eq!(choose(&[c, b], 4, 3), 1);
    }

    #[test]
    fn the_servers_own_count_is_not_added_to_this_proxys() {
        // 10 in flight from this proxy, which the server reports as 8 running + 2 waiting.
        let mut c = cand(0, 0, 10);
        c.load = EndpointLoad {
            waiting: Some(2),
            running: Some(8),
            kv_cache_usage: None,
            prefill_tokens_per_s: None,
            kv_capacity_tokens: None,
        };
        assert_eq!(c.guard_load(), 10);
        // Other proxies' requests show in the server's count.
        c.load.running = Some(30);
        assert_eq!(c.guard_load(), 32);
        // A queue length alone (no running count) adds, as before.
        c.load.running = None;
        assert_eq!(c.guard_load(), 12);
        c.load.waiting = None;
        assert_eq!(c.guard_load(), 10);
    }

    #[test]
    fn least_loaded_picks_min() {
        let c = [cand(0, 0, 5), cand(1, 0, 2), cand(2, 0, 9)];
        assert_eq!(least_loaded(&c, &mut Rng::new(0)), Some(1));
        assert_eq!(least_loaded(&[], &mut Rng::new(0)), None);
        assert_eq!(
            pick(
                &[],
                1,
                &Weights::default(),
                &HotspotGuard::default(),
                &mut Rng::new(0),
                &mut Vec::new()
            ),
            None
        );
    }
}
