//! A subscriber that applies every published KV event reconstructs exactly the engine's set of
//! cached block hashes, per medium (GPU, and the CPU offload tier when there is one), after
//! randomized workloads with shared prefixes, evictions, preemptions, aborts and resets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::Duration;

use kvoy_shared::Rng;
use kvoy_sim::engine::{Engine, EngineRequest, KvEvent, Profile, MEDIUM_CPU, MEDIUM_GPU};
use proptest::prelude::*;

/// What a subscriber keeps: the hashes on each medium, and counts for coverage checks.
#[derive(Default)]
struct Subscriber {
    gpu: HashSet<u64>,
    cpu: HashSet<u64>,
    gpu_removed: usize,
    cpu_removed: usize,
}

impl Subscriber {
    fn medium(&mut self, medium: &str) -> (&mut HashSet<u64>, &mut usize) {
        match medium {
            MEDIUM_GPU => (&mut self.gpu, &mut self.gpu_removed),
            MEDIUM_CPU => (&mut self.cpu, &mut self.cpu_removed),
            other => panic!("unexpected medium {other}"),
        }
    }

    fn apply(&mut self, events: Vec<KvEvent>) {
        for event in events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    block_size,
                    medium,
                    ..
                } => {
                    // On the GPU a block's tokens travel with it; the CPU tier announces
                    // hashes only, as vLLM's offloading connector does.
                    let want = if medium == MEDIUM_GPU {
                        block_hashes.len() * block_size as usize
                    } else {
                        0
                    };
                    assert_eq!(token_ids.len(), want);
                    let (set, _) = self.medium(medium);
                    for h in block_hashes {
                        assert!(set.insert(h), "stored twice on {medium}: {h:#x}");
                    }
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    let (set, removed) = self.medium(medium);
                    for h in block_hashes {
                        assert!(set.remove(&h), "removed unknown {h:#x} from {medium}");
                        *removed += 1;
                    }
                }
                // Clears both tiers, as the engine's reset does.
                KvEvent::AllBlocksCleared => {
                    self.gpu.clear();
                    self.cpu.clear();
                }
            }
        }
    }

    fn assert_matches(&self, engine: &Engine) {
        let gpu: HashSet<u64> = engine.cached_block_hashes().collect();
        let cpu: HashSet<u64> = engine.cpu_cached_block_hashes().collect();
        assert_eq!(self.gpu, gpu);
        assert_eq!(self.cpu, cpu);
    }
}

/// What one workload exercised.
struct Coverage {
    gpu_removed: usize,
    cpu_removed: usize,
    preemptions: u64,
    cpu_hits: u64,
}

/// Runs one randomized workload, with a CPU tier of `cpu_offload_blocks` (0: none).
fn workload(seed: u64, cpu_offload_blocks: u32) -> Coverage {
    // kvoy-shared's seeded generator, seeded by proptest.
    let mut rng = Rng::new(seed);
    let profile = Profile {
        name: "tiny".to_owned(),
        block_size: 4,
        num_gpu_blocks: 48 + rng.below(48) as u32,
        max_num_seqs: 2 + rng.below(6) as u32,
        max_num_batched_tokens: 16 + rng.below(64) as u32,
        cpu_offload_blocks,
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
    let mut subscriber = Subscriber::default();
    let mut now = Duration::ZERO;
    let mut next_id = 0u64;
    let mut live: Vec<u64> = Vec::new();
    for _ in 0..400 {
        match rng.below(10) {
            0..=3 => {
                let mut prompt = prefixes[rng.below(4)].clone();
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
                let id = live.swap_remove(rng.below(live.len()));
                engine.abort(id);
            }
            5 if rng.below(8) == 0 => {
                if let Ok(events) = engine.reset_cache() {
                    subscriber.apply(events);
                }
            }
            _ => {
                let step = engine.step(now);
                now += step.duration;
                subscriber.apply(step.events);
            }
        }
        engine.check_invariants().unwrap();
        assert!(engine.stats().kv_cache_usage <= 1.0);
        subscriber.assert_matches(&engine);
    }
    while engine.has_work() {
        let step = engine.step(now);
        now += step.duration;
        subscriber.apply(step.events);
        engine.check_invariants().unwrap();
    }
    subscriber.assert_matches(&engine);
    let stats = engine.stats();
    assert_eq!(stats.kv_cache_usage, 0.0);
    assert!(stats.num_cpu_cached_blocks <= cpu_offload_blocks as usize);
    Coverage {
        gpu_removed: subscriber.gpu_removed,
        cpu_removed: subscriber.cpu_removed,
        preemptions: stats.preemptions,
        cpu_hits: stats.external_prefix_cache_hits,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn subscriber_reconstructs_cached_hashes(seed in any::<u64>(), cpu in 0u32..3) {
        // No tier, a tier smaller than the GPU, or a larger one.
        workload(seed, [0, 24, 200][cpu as usize]);
    }
}

#[test]
fn seeded_workloads_evict_and_preempt() {
    let mut evictions_seen = 0;
    let mut preemptions = 0;
    for seed in 0..32 {
        let c = workload(seed, 0);
        if c.gpu_removed > 0 {
            evictions_seen += 1;
        }
        assert_eq!((c.cpu_removed, c.cpu_hits), (0, 0), "no tier, no CPU event");
        preemptions += c.preemptions;
    }
    assert!(evictions_seen > 0);
    assert!(preemptions > 0);
}

#[test]
fn seeded_workloads_with_a_cpu_tier_evict_and_load_from_it() {
    let (mut cpu_evictions, mut cpu_hits) = (0, 0);
    for seed in 0..32 {
        let c = workload(seed, 24);
        cpu_evictions += c.cpu_removed;
        cpu_hits += c.cpu_hits;
    }
    assert!(cpu_evictions > 0);
    assert!(cpu_hits > 0);
}
