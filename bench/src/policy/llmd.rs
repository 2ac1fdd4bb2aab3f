//! llm-d's pre-1.0 default picker (the Gateway API Inference Extension's, still llm-d-router's
//! default when no configuration is given; llm-d 1.0's guides use [`super::llmd_v1`]), from its
//! published algorithm:
//!
//! - queue scorer, weight 2: `1 - (q - min) / (max - min)` over the servers' waiting queues
//!   (1 for every endpoint when all queues are equal);
//! - KV-cache utilization scorer, weight 2: `1 - kv_cache_usage`;
//! - approximate prefix-cache scorer, weight 3: the prompt text cut into 64-character blocks
//!   (at most 256), chained hashes (`h0 = hash(model ‖ block0)`, `hi = hash(block_i ‖
//!   le64(h_{i-1}))`), a per-endpoint LRU of 31,250 block hashes recorded for the endpoint a
//!   request is routed to; score = leading blocks the endpoint holds / blocks of the request;
//! - max-score picker, ties broken at random.
//!
//! Queue and KV figures come from the last metrics scrape (every 50 ms). The reference hashes
//! with xxhash64; xxh3 is used here, which changes no decision (only collisions could).

use kvoy_shared::LruSet;
use xxhash_rust::xxh3::xxh3_64;

use super::{argmax_random, Policy, RouteRequest, View};
use kvoy_shared::Rng;

/// The reference's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlmDConfig {
    pub queue_weight: f64,
    pub kv_weight: f64,
    pub prefix_weight: f64,
    pub block_chars: usize,
    pub max_blocks: usize,
    pub lru_blocks: usize,
}

impl Default for LlmDConfig {
    fn default() -> Self {
        LlmDConfig {
            queue_weight: 2.0,
            kv_weight: 2.0,
            prefix_weight: 3.0,
            block_chars: 64,
            max_blocks: 256,
            lru_blocks: 31_250,
        }
    }
}

pub struct LlmD {
    config: LlmDConfig,
    model: &'static str,
    lru: Vec<LruSet>,
    rng: Rng,
    hashes: Vec<u64>,
    scratch: Vec<u8>,
    scores: Vec<f64>,
}

impl LlmD {
    pub fn new(replicas: usize, rng: Rng) -> Self {
        Self::with_config(replicas, LlmDConfig::default(), rng)
    }

    pub fn with_config(replicas: usize, config: LlmDConfig, rng: Rng) -> Self {
        LlmD {
            config,
            model: super::kvoy::MODEL,
            lru: (0..replicas)
                .map(|i| LruSet::new(config.lru_blocks, i as u64))
                .collect(),
            rng,
            hashes: Vec::new(),
            scratch: Vec::new(),
            scores: Vec::new(),
        }
    }

    /// Chained block hashes of `text` into `self.hashes`.
    fn hash_blocks(&mut self, text: &[u8]) {
        self.hashes.clear();
        let mut prev: Option<u64> = None;
        for block in text
            .chunks_exact(self.config.block_chars.max(1))
            .take(self.config.max_blocks)
        {
            self.scratch.clear();
            match prev {
                None => {
                    self.scratch.extend_from_slice(self.model.as_bytes());
                    self.scratch.extend_from_slice(block);
                }
                Some(p) => {
                    self.scratch.extend_from_slice(block);
                    self.scratch.extend_from_slice(&p.to_le_bytes());
                }
            }
            let h = xxh3_64(&self.scratch);
            self.hashes.push(h);
            prev = Some(h);
        }
    }

    /// The prefix score of endpoint `e` for the last hashed request.
    pub fn prefix_score(&self, e: usize) -> f64 {
        if self.hashes.is_empty() {
            return 0.0;
        }
        let Some(set) = self.lru.get(e) else {
            return 0.0;
        };
        let matched = self.hashes.iter().take_while(|&&h| set.contains(h)).count();
        matched as f64 / self.hashes.len() as f64
    }

    /// Scores every endpoint for `text` into `self.scores` (the weighted sum).
    pub fn score(&mut self, text: &[u8], view: &View<'_>) -> &[f64] {
        self.hash_blocks(text);
        let n = view.inflight.len();
        let queue = |e: usize| view.metrics.get(e).map_or(0, |m| m.waiting);
        let (min, max) = (0..n)
            .map(queue)
            .fold((u32::MAX, 0), |(lo, hi), q| (lo.min(q), hi.max(q)));
        self.scores.clear();
        for e in 0..n {
            let q_score = if max <= min {
                1.0
            } else {
                1.0 - f64::from(queue(e) - min) / f64::from(max - min)
            };
            let kv = view.metrics.get(e).map_or(0.0, |m| m.kv_cache_usage);
            let kv_score = (1.0 - kv).clamp(0.0, 1.0);
            let total = self.config.queue_weight * q_score
                + self.config.kv_weight * kv_score
                + self.config.prefix_weight * self.prefix_score(e);
            self.scores.push(total);
        }
        &self.scores
    }
}

impl Policy for LlmD {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        self.score(request.text.as_bytes(), view);
        let chosen = argmax_random(&self.scores, &mut self.rng);
        if let Some(set) = self.lru.get_mut(chosen) {
            for &h in &self.hashes {
                set.touch(h);
            }
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixture::{text_request, Observed};

    fn req(text: &str) -> RouteRequest<'_> {
        text_request(0, text)
    }

    #[test]
    fn prefix_scorer_counts_leading_blocks() {
        let mut p = LlmD::new(2, Rng::new(1));
        let fleet = Observed::idle(2);
        let view = fleet.view();
        // 4 blocks of 64 characters (plus a partial block, ignored).
        let a = format!(
            "{}{}{}{}tail",
            "a".repeat(64),
            "b".repeat(64),
            "c".repeat(64),
            "d".repeat(64)
        );
        let first = p.pick(&req(&a), &view);
        // Same first two blocks, then different: 2 of 4 blocks.
        let b = format!(
            "{}{}{}{}",
            "a".repeat(64),
            "b".repeat(64),
            "x".repeat(64),
            "d".repeat(64)
        );
        let scores = p.score(b.as_bytes(), &view).to_vec();
        assert_eq!(p.prefix_score(first), 0.5);
        assert_eq!(p.prefix_score(1 - first), 0.0);
        // Equal queues (1 each) and empty caches (1 each): 2 + 2 + 3 * prefix.
        assert!((scores[first] - 5.5).abs() < 1e-12);
        assert!((scores[1 - first] - 4.0).abs() < 1e-12);
        // A request shorter than a block has no prefix score anywhere.
        p.score(b"short", &view);
        assert_eq!(p.prefix_score(first), 0.0);
    }

    #[test]
    fn queue_and_kv_scorers() {
        let mut p = LlmD::new(3, Rng::new(1));
        let mut fleet = Observed::idle(3);
        fleet.metrics[0].waiting = 10;
        fleet.metrics[1].waiting = 5;
        fleet.metrics[2].waiting = 0;
        fleet.metrics[2].kv_cache_usage = 0.5;
        let view = fleet.view();
        let s = p.score(b"x", &view).to_vec();
        // queue: 0, 0.5, 1; kv: 1, 1, 0.5
        assert!((s[0] - 2.0).abs() < 1e-12);
        assert!((s[1] - 3.0).abs() < 1e-12);
        assert!((s[2] - 3.0).abs() < 1e-12);
        for _ in 0..20 {
            assert_ne!(p.pick(&req("x"), &view), 0);
        }
    }
}
