//! SGLang router's cache-aware policy, from its published algorithm (sgl-router
//! `cache_aware`, defaults of the current releases):
//!
//! 1. Load is the router's own count of open requests per worker. The fleet is *imbalanced*
//!    when `max_load - min_load > balance_abs_threshold` (64) **and**
//!    `max_load > balance_rel_threshold * min_load` (1.5): the request then goes to the least
//!    loaded worker.
//! 2. Otherwise the worker whose approximate radix tree (request text, per worker) matches the
//!    longest prefix of the request wins if its match rate (matched characters / request
//!    characters) is above `cache_threshold` (0.3); else the worker with the smallest tree
//!    (the most free cache).
//! 3. Either way the request text is inserted into the chosen worker's tree.
//! 4. Every `eviction_interval` (120 s of virtual time) each tree drops its least recently used
//!    leaves down to `max_tree_chars`.
//!
//! Ties (equal match, equal size, equal load) are broken at random. SGLang's default tree bound
//! is 2^26 characters per worker, about 40 times what a Llama-8B/H100 replica caches; the
//! default here is the replica's KV capacity in characters (`num_gpu_blocks * block_size * 4`,
//! 1,638,400 for `llama-8b-h100`) so that the tree does not claim far more than the server
//! holds; `--sglang-tree-chars` sets another bound.

use std::time::Duration;

use kvoy_sim_engine::tokenizer::BYTES_PER_TOKEN;
use kvoy_sim_engine::Profile;

use super::radix::RadixTree;
use super::{argmin_random, Policy, RouteRequest, View};
use kvoy_shared::Rng;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SglangConfig {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    pub eviction_interval: Duration,
    pub max_tree_chars: usize,
}

impl SglangConfig {
    /// The published defaults with a tree bound of `max_tree_chars`.
    pub fn with_tree_chars(max_tree_chars: usize) -> Self {
        SglangConfig {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval: Duration::from_secs(120),
            max_tree_chars,
        }
    }
}

/// The replica's KV capacity in characters of prompt text.
pub fn default_tree_chars(profile: &Profile) -> usize {
    (profile.capacity_tokens() as usize).saturating_mul(BYTES_PER_TOKEN)
}

/// Which branch a decision took (for tests and explanations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Branch {
    Imbalanced,
    CacheHit,
    SmallestTree,
}

pub struct Sglang {
    config: SglangConfig,
    trees: Vec<RadixTree>,
    rng: Rng,
    next_eviction: Duration,
    last_branch: Option<Branch>,
}

impl Sglang {
    pub fn new(replicas: usize, config: SglangConfig, rng: Rng) -> Self {
        Sglang {
            config,
            trees: (0..replicas).map(|_| RadixTree::default()).collect(),
            rng,
            next_eviction: config.eviction_interval,
            last_branch: None,
        }
    }

    pub fn last_branch(&self) -> Option<Branch> {
        self.last_branch
    }

    pub fn tree(&self, worker: usize) -> Option<&RadixTree> {
        self.trees.get(worker)
    }

    /// True when the loads count as imbalanced.
    pub fn imbalanced(&self, loads: &[u32]) -> bool {
        let min = loads.iter().copied().min().unwrap_or(0);
        let max = loads.iter().copied().max().unwrap_or(0);
        u64::from(max - min) > self.config.balance_abs_threshold
            && f64::from(max) > self.config.balance_rel_threshold * f64::from(min)
    }

    fn evict_if_due(&mut self, now: Duration) {
        if self.config.eviction_interval.is_zero() {
            return;
        }
        if now < self.next_eviction {
            return;
        }
        while self.next_eviction <= now {
            self.next_eviction += self.config.eviction_interval;
        }
        for t in &mut self.trees {
            t.evict_to(self.config.max_tree_chars);
        }
    }
}

impl Policy for Sglang {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        self.evict_if_due(view.now);
        let text = request.text.as_bytes();
        let loads = view.inflight;
        let (branch, chosen) = if self.imbalanced(loads) {
            let i = argmin_random(loads.iter().map(|&l| u64::from(l)), &mut self.rng);
            (Branch::Imbalanced, i)
        } else {
            let matched: Vec<u64> = self
                .trees
                .iter()
                .map(|t| t.match_len(text) as u64)
                .collect();
            let best = matched.iter().copied().max().unwrap_or(0);
            let rate = if text.is_empty() {
                0.0
            } else {
                best as f64 / text.len() as f64
            };
            if rate > self.config.cache_threshold {
                // The longest match, ties at random.
                let i = argmin_random(matched.iter().map(|&m| best - m), &mut self.rng);
                (Branch::CacheHit, i)
            } else {
                let sizes = self.trees.iter().map(|t| t.size() as u64);
                (Branch::SmallestTree, argmin_random(sizes, &mut self.rng))
            }
        };
        if let Some(t) = self.trees.get_mut(chosen) {
            t.insert(text);
        }
        self.last_branch = Some(branch);
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::fixture::{text_request, Observed};

    fn pick(p: &mut Sglang, text: &str, inflight: &[u32]) -> usize {
        p.pick(&text_request(0, text), &Observed::loads(inflight).view())
    }

    fn policy(n: usize) -> Sglang {
        Sglang::new(n, SglangConfig::with_tree_chars(1 << 20), Rng::new(2))
    }

    #[test]
    fn balance_switch_at_exactly_the_thresholds() {
        let p = policy(2);
        // Difference 64 is not above 64.
        assert!(!p.imbalanced(&[0, 64]));
        assert!(p.imbalanced(&[0, 65]));
        // Difference 65 but 195 = 1.5 x 130: not above the relative threshold.
        assert!(!p.imbalanced(&[130, 195]));
        assert!(p.imbalanced(&[130, 196]));
        let mut p = policy(2);
        assert_eq!(pick(&mut p, "anything", &[100, 0]), 1);
        assert_eq!(p.last_branch(), Some(Branch::Imbalanced));
        // The text went into worker 1's tree even so.
        assert_eq!(p.tree(1).unwrap().match_len(b"anything"), 8);
    }

    #[test]
    fn cache_threshold_and_smallest_tree() {
        let mut p = policy(3);
        let system = "s".repeat(70);
        let a = format!("{system}{}", "a".repeat(30));
        let first = pick(&mut p, &a, &[0; 3]);
        assert_eq!(p.last_branch(), Some(Branch::SmallestTree));
        // 70 of 100 characters match: 0.7 > 0.3.
        let b = format!("{system}{}", "b".repeat(30));
        assert_eq!(pick(&mut p, &b, &[0; 3]), first);
        assert_eq!(p.last_branch(), Some(Branch::CacheHit));
        // 30 of 100 characters is not above 0.3: the smallest tree (not `first`).
        let c = format!("{}{}", "s".repeat(30), "c".repeat(70));
        let third = pick(&mut p, &c, &[0; 3]);
        assert_eq!(p.last_branch(), Some(Branch::SmallestTree));
        assert_ne!(third, first);
    }

    #[test]
    fn trees_are_evicted_on_the_interval() {
        let mut cfg = SglangConfig::with_tree_chars(10);
        cfg.eviction_interval = Duration::from_secs(120);
        let mut p = Sglang::new(1, cfg, Rng::new(1));
        pick(&mut p, &"x".repeat(100), &[0]);
        assert_eq!(p.tree(0).unwrap().size(), 100);
        let fleet = Observed::loads(&[0]).at(Duration::from_secs(121));
        p.pick(&text_request(1, "y"), &fleet.view());
        assert_eq!(p.tree(0).unwrap().size(), 1, "evicted, then 'y' inserted");
        assert_eq!(default_tree_chars(&Profile::llama_8b_h100()), 1_638_400);
    }
}
