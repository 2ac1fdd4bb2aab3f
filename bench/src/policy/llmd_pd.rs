//! llm-d's P/D routing (`llm-d-pd`): the sample configuration for prefill/decode pools,
//! `deploy/config/pd-epp-config.yaml` in llm-d/llm-d-router at
//! `ebab687927f5331c1b39defcb579a07951bce56c`, every plugin it names at its defaults there.
//!
//! 1. **Prefix index**: the `approx-prefix-cache-producer` of [`super::llmd_v1`] (64-token
//!    blocks, `autoTune`), with the file's `maxPrefixTokensToMatch: 16384`. Its `PreRequest`
//!    records the prompt's blocks on the decode endpoint and, for a split request, on the prefill
//!    endpoint too (`dataproducer/approximateprefix/plugin.go`).
//! 2. **Decode first** (`disagg-profile-handler`): the `decode` profile runs over the
//!    `decode-filter`'s endpoints (role `decode`, `both`, or none: `filter/bylabel/roles.go`):
//!    `prefix-cache-scorer` weight 2 (matched / total blocks) plus `queue-scorer` weight 1
//!    (`(max - q) / (max - min)` over the candidates' scraped waiting queues, 1 when all are
//!    equal: `scorer/queuedepth/queue.go`), `max-score-picker`, ties at random.
//! 3. **Decider** (`prefix-based-pd-decider`, `nonCachedTokens: 16`,
//!    `profilehandler/disagg/prefix_based_pd_decider.go`): split when the prompt's tokens
//!    (`ceil(bytes / 4)`, the `estimate` token producer) less the decode endpoint's matched
//!    blocks times the block size reach 16 (and the prompt reaches `promptTokens` when set;
//!    unset in the file).
//! 4. **Prefill**: the `prefill` profile, the same scorers over the `prefill-filter`'s endpoints
//!    (role `prefill` or `both`). No prefill endpoint: the request is served whole.
//!
//! No in-flight load is tracked (the file has no `inflight-load-producer`): the queue scorer
//! reads the last scrape only.

use kvoy_shared::{Rng, Role};

use super::llmd_v1::{ApproxPrefix, BYTES_PER_TOKEN};
use super::{argmax_random, Pick, Policy, RouteRequest, View};

/// The configuration's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlmDPdConfig {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    /// The decider's `nonCachedTokens` (0: never split).
    pub non_cached_tokens: u64,
    /// The decider's `promptTokens` (0: no floor).
    pub prompt_tokens: u64,
    /// `maxPrefixTokensToMatch`.
    pub max_prefix_tokens: usize,
    /// `lruCapacityPerServer`, before an endpoint reports `num_gpu_blocks`.
    pub lru_blocks: usize,
    /// `blockSizeTokens`, before an endpoint reports its block size.
    pub block_tokens: usize,
    /// The producer's floor on the block size.
    pub min_block_tokens: usize,
}

impl Default for LlmDPdConfig {
    fn default() -> Self {
        LlmDPdConfig {
            prefix_weight: 2.0,
            queue_weight: 1.0,
            non_cached_tokens: 16,
            prompt_tokens: 0,
            max_prefix_tokens: 16_384,
            lru_blocks: 31_250,
            block_tokens: 16,
            min_block_tokens: 64,
        }
    }
}

pub struct LlmDPd {
    config: LlmDPdConfig,
    prefix: ApproxPrefix,
    roles: Vec<Role>,
    rng: Rng,
    candidates: Vec<usize>,
    scores: Vec<f64>,
}

impl LlmDPd {
    /// `roles` by endpoint index; an endpoint past its end decodes (llm-d's unlabelled pod).
    pub fn new(replicas: usize, roles: &[Role], config: LlmDPdConfig, rng: Rng) -> Self {
        LlmDPd {
            config,
            prefix: ApproxPrefix::new(
                replicas,
                config.block_tokens,
                config.min_block_tokens,
                config.max_prefix_tokens,
                config.lru_blocks,
            ),
            roles: roles.to_vec(),
            rng,
            candidates: Vec::new(),
            scores: Vec::new(),
        }
    }

    /// One profile's pick among the endpoints `keep` admits: prefix and queue scores,
    /// the highest wins. `None`: no endpoint admitted.
    fn profile(&mut self, n: usize, view: &View<'_>, keep: impl Fn(Role) -> bool) -> Option<usize> {
        self.candidates.clear();
        let roles = &self.roles;
        self.candidates
            .extend((0..n).filter(|&e| keep(roles.get(e).copied().unwrap_or_default())));
        let queue = |e: usize| view.metrics.get(e).map_or(0, |m| m.waiting);
        let (min, max) = self
            .candidates
            .iter()
            .map(|&e| queue(e))
            .fold((u32::MAX, 0), |(lo, hi), q| (lo.min(q), hi.max(q)));
        self.scores.clear();
        for &e in &self.candidates {
            let q_score = if max <= min {
                1.0
            } else {
                f64::from(max - queue(e)) / f64::from(max - min)
            };
            self.scores.push(
                self.config.prefix_weight * self.prefix.prefix_score(e)
                    + self.config.queue_weight * q_score,
            );
        }
        if self.candidates.is_empty() {
            return None;
        }
        let best = argmax_random(&self.scores, &mut self.rng);
        self.candidates.get(best).copied()
    }

    /// The decider: whether the prompt's tokens not cached on `decode` reach the threshold.
    fn splits(&self, input_tokens: u64, decode: usize, block_tokens: usize) -> bool {
        let c = &self.config;
        if c.non_cached_tokens == 0
            || (c.prompt_tokens > 0 && input_tokens < c.prompt_tokens)
            || input_tokens < c.non_cached_tokens
        {
            return false;
        }
        let hit = self.prefix.matched.get(decode).copied().unwrap_or(0) * block_tokens as u64;
        input_tokens.saturating_sub(hit) >= c.non_cached_tokens && input_tokens >= hit
    }
}

impl Policy for LlmDPd {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        self.pick_pd(request, view).decode
    }

    fn pick_pd(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> Pick {
        let n = view.inflight.len().min(self.prefix.replicas());
        let text = request.text.as_bytes();
        let block_tokens = self.prefix.block_tokens(view);
        self.prefix.hash_prompt(text, block_tokens);
        self.prefix.match_prefix(n);
        let decode = self.profile(n, view, Role::decodes).unwrap_or(0);
        let input_tokens = text.len().div_ceil(BYTES_PER_TOKEN) as u64;
        let prefill = if self.splits(input_tokens, decode, block_tokens) {
            self.profile(n, view, |r| r.prefills())
                .filter(|&p| p != decode)
        } else {
            None
        };
        self.prefix.record(decode, view);
        if let Some(p) = prefill {
            self.prefix.record(p, view);
        }
        Pick { decode, prefill }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixture::{text_request, Observed};

    const ROLES: [Role; 4] = [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode];

    fn policy() -> LlmDPd {
        LlmDPd::new(4, &ROLES, LlmDPdConfig::default(), Rng::new(1))
    }

    #[test]
    fn decode_first_then_the_decider_splits_an_uncached_prompt() {
        let mut p = policy();
        let fleet = Observed::idle(4);
        let view = fleet.view();
        let long = "x".repeat(4096);
        let first = p.pick_pd(&text_request(0, &long), &view);
        assert!(ROLES[first.decode].decodes());
        let prefill = first.prefill.expect("a 1,024-token uncached prompt splits");
        assert!(ROLES[prefill].prefills());
        // The same prompt again: the decode endpoint holds every block, nothing to split; the
        // prefix scorer keeps it there.
        let again = p.pick_pd(&text_request(1, &long), &view);
        assert_eq!(
            again,
            Pick {
                decode: first.decode,
                prefill: None
            }
        );
        // The prompt plus 256 new bytes (64 tokens, one more block): split again, and the
        // prefill endpoint that holds the rest is chosen.
        let longer = format!("{long}{}", "y".repeat(256));
        let third = p.pick_pd(&text_request(2, &longer), &view);
        assert_eq!(
            third,
            Pick {
                decode: first.decode,
                prefill: Some(prefill)
            }
        );
    }

    #[test]
    fn below_the_threshold_is_never_split_and_zero_disables() {
        let fleet = Observed::idle(4);
        let view = fleet.view();
        let mut p = policy();
        // 15 tokens.
        let short = "z".repeat(60);
        assert_eq!(p.pick_pd(&text_request(0, &short), &view).prefill, None);
        let mut off = LlmDPd::new(
            4,
            &ROLES,
            LlmDPdConfig {
                non_cached_tokens: 0,
                ..LlmDPdConfig::default()
            },
            Rng::new(1),
        );
        assert_eq!(
            off.pick_pd(&text_request(0, &"x".repeat(9000)), &view)
                .prefill,
            None
        );
    }

    #[test]
    fn the_queue_scorer_ranks_within_each_role() {
        let mut p = policy();
        let mut fleet = Observed::idle(4);
        // Prefill 0 and decode 2 have a queue; the others none.
        fleet.metrics[0].waiting = 5;
        fleet.metrics[2].waiting = 3;
        let view = fleet.view();
        for id in 0..20 {
            let text = format!("{id} {}", "q".repeat(2000));
            let pick = p.pick_pd(&text_request(id, &text), &view);
            assert_eq!(
                pick,
                Pick {
                    decode: 3,
                    prefill: Some(1)
                }
            );
        }
    }
}
