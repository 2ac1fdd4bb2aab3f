//! A subscriber that applies every published KV event reconstructs exactly the engine's set of
//! cached block hashes, after randomized workloads with shared prefixes, evictions,
//! preemptions, aborts and resets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::Duration;

use kvoy_sim::engine::{Engine, EngineRequest, KvEvent, Profile};
use proptest::prelude::*;

/// A tiny deterministic generator (xorshift64*), seeded by proptest.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn apply(subscriber: &mut HashSet<u64>, events: Vec<KvEvent>, removed: &mut usize) {
    for event in events {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                token_ids,
                block_size,
                ..
            } => {
                assert_eq!(token_ids.len(), block_hashes.len() * block_size as usize);
                for h in block_hashes {
                    assert!(subscriber.insert(h), "stored twice without removal: {h:#x}");
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    assert!(subscriber.remove(&h), "removed unknown {h:#x}");
                    *removed += 1;
                }
            }
            KvEvent::AllBlocksCleared => subscriber.clear(),
        }
    }
}

/// Runs one randomized workload; returns (blocks evicted, preemptions) for coverage checks.
fn workload(seed: u64) -> (usize, u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let profile = Profile {
        name: "tiny".to_owned(),
        block_size: 4,
        num_gpu_blocks: 48 + rng.below(48) as u32,
        max_num_seqs: 2 + rng.below(6) as u32,
        max_num_batched_tokens: 16 + rng.below(64) as u32,
        ..Profile::llama_8b_h100()
    };
    let mut engine = Engine::new(&profile).unwrap();
    let prefixes: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            (0..4 + rng.below(40))
                .map(|_| rng.below(8) as u32)
                .collect()
        })
        .collect();
    let mut subscriber = HashSet::new();
    let mut removed = 0;
    let mut now = Duration::ZERO;
    let mut next_id = 0u64;
    let mut live: Vec<u64> = Vec::new();
    for _ in 0..400 {
        match rng.below(10) {
            0..=3 => {
                let mut prompt = prefixes[rng.below(4) as usize].clone();
                prompt.extend((0..rng.below(30)).map(|_| rng.below(8) as u32));
                let req = EngineRequest {
                    id: next_id,
                    prompt,
                    max_tokens: 1 + rng.below(30) as u32,
                };
                // Too-long or empty prompts are refused; that is fine here.
                if engine.submit(req, now).is_ok() {
                    live.push(next_id);
                }
                next_id += 1;
            }
            4 if !live.is_empty() => {
                let id = live.swap_remove(rng.below(live.len() as u64) as usize);
                engine.abort(id);
            }
            5 if rng.below(8) == 0 => {
                if let Ok(events) = engine.reset_cache() {
                    apply(&mut subscriber, events, &mut removed);
                }
            }
            _ => {
                let step = engine.step(now);
                now += step.duration;
                apply(&mut subscriber, step.events, &mut removed);
            }
        }
        engine.check_invariants().unwrap();
        assert!(engine.stats().kv_cache_usage <= 1.0);
        let cached: HashSet<u64> = engine.cached_block_hashes().collect();
        assert_eq!(subscriber, cached);
    }
    while engine.has_work() {
        let step = engine.step(now);
        now += step.duration;
        apply(&mut subscriber, step.events, &mut removed);
        engine.check_invariants().unwrap();
    }
    let cached: HashSet<u64> = engine.cached_block_hashes().collect();
    assert_eq!(subscriber, cached);
    assert_eq!(engine.stats().kv_cache_usage, 0.0);
    (removed, engine.stats().preemptions)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn subscriber_reconstructs_cached_hashes(seed in any::<u64>()) {
        workload(seed);
    }
}

#[test]
fn seeded_workloads_evict_and_preempt() {
    let mut evictions_seen = 0;
    let mut preemptions = 0;
    for seed in 0..32 {
        let (evicted, preempted) = workload(seed);
        if evicted > 0 {
            evictions_seen += 1;
        }
        preemptions += preempted;
    }
    assert!(evictions_seen > 0);
    assert!(preemptions > 0);
}
