//! Black-box tests of the engine under virtual time: calibration, caching, pressure, queueing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use kvoy_sim::engine::{
    tokenizer, BatchItem, Engine, EngineRequest, KvEvent, OutputKind, Profile, ResetError,
    SubmitError, MEDIUM_CPU,
};

/// What a run observed for one request.
#[derive(Debug, Default, Clone)]
struct Seen {
    ttft: Option<Duration>,
    latency: Option<Duration>,
    tokens: u32,
    cached_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    preempted: u32,
}

/// A discrete-event driver: submits requests at their arrival times, steps the engine, checks
/// invariants after every step and replays every event into a subscriber set.
struct Driver {
    engine: Engine,
    now: Duration,
    seen: BTreeMap<u64, Seen>,
    /// GPU hashes, from the events.
    subscriber: HashSet<u64>,
    /// CPU-tier hashes, from the events.
    cpu_subscriber: HashSet<u64>,
    /// GPU removals.
    removed_events: usize,
    max_usage: f64,
    step_durations: Vec<Duration>,
}

impl Driver {
    fn new(profile: &Profile) -> Driver {
        Driver {
            engine: Engine::new(profile).unwrap(),
            now: Duration::ZERO,
            seen: BTreeMap::new(),
            subscriber: HashSet::new(),
            cpu_subscriber: HashSet::new(),
            removed_events: 0,
            max_usage: 0.0,
            step_durations: Vec::new(),
        }
    }

    fn submit(&mut self, id: u64, prompt: Vec<u32>, max_tokens: u32) {
        let req = EngineRequest {
            id,
            prompt,
            max_tokens,
        };
        self.engine.submit(req, self.now).unwrap();
    }

    fn apply(&mut self, events: Vec<KvEvent>) {
        for event in events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } if medium == MEDIUM_CPU => self.cpu_subscriber.extend(block_hashes),
                KvEvent::BlockStored { block_hashes, .. } => self.subscriber.extend(block_hashes),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } if medium == MEDIUM_CPU => {
                    for h in block_hashes {
                        assert!(self.cpu_subscriber.remove(&h), "removed unknown {h:#x}");
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    self.removed_events += 1;
                    for h in block_hashes {
                        assert!(self.subscriber.remove(&h), "removed unknown {h:#x}");
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.subscriber.clear();
                    self.cpu_subscriber.clear();
                }
            }
        }
    }

    fn step(&mut self) {
        let step = self.engine.step(self.now);
        self.now += step.duration;
        self.step_durations.push(step.duration);
        for out in step.outputs {
            let seen = self.seen.entry(out.id).or_default();
            match out.kind {
                OutputKind::FirstToken {
                    cached_tokens,
                    ttft,
                    ..
                } => {
                    assert_eq!(seen.tokens, 0);
                    seen.tokens += 1;
                    seen.ttft = Some(ttft);
                    seen.cached_tokens = Some(cached_tokens);
                }
                OutputKind::Token { token, index } => {
                    assert_eq!(index, seen.tokens, "tokens in order, none repeated");
                    assert_eq!(token, tokenizer::generated_token(out.id, index));
                    seen.tokens += 1;
                }
                OutputKind::Finished { usage, latency } => {
                    assert_eq!(usage.cached_tokens, seen.cached_tokens.unwrap());
                    seen.completion_tokens = Some(usage.completion_tokens);
                    seen.latency = Some(latency);
                }
                OutputKind::Preempted => seen.preempted += 1,
            }
        }
        self.apply(step.events);
        self.engine.check_invariants().unwrap();
        let usage = self.engine.stats().kv_cache_usage;
        assert!((0.0..=1.0).contains(&usage), "{usage}");
        self.max_usage = self.max_usage.max(usage);
        assert_eq!(self.subscriber, self.cached());
        let cpu: HashSet<u64> = self.engine.cpu_cached_block_hashes().collect();
        assert_eq!(self.cpu_subscriber, cpu);
    }

    fn cached(&self) -> HashSet<u64> {
        self.engine.cached_block_hashes().collect()
    }

    fn run_to_idle(&mut self) {
        let mut guard = 0;
        while self.engine.has_work() {
            self.step();
            guard += 1;
            assert!(guard < 1_000_000, "engine does not drain");
        }
    }
}

/// `n` tokens unique to `salt`.
fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            i.wrapping_mul(2_654_435_761)
                .wrapping_add(salt.wrapping_mul(97))
        })
        .collect()
}

fn small_profile(num_gpu_blocks: u32, max_num_seqs: u32) -> Profile {
    Profile {
        name: "small".to_owned(),
        num_gpu_blocks,
        max_num_seqs,
        max_num_batched_tokens: 512,
        ..Profile::llama_8b_h100()
    }
}

fn within(actual: f64, target: f64, tolerance: f64) -> bool {
    (actual - target).abs() <= target * tolerance
}

/// Cold then warm TTFT of one prompt of `len` tokens, alone on the engine.
fn cold_warm(profile: &Profile, len: usize) -> (Duration, Duration) {
    let mut d = Driver::new(profile);
    d.submit(1, prompt(len, 1), 1);
    d.run_to_idle();
    d.submit(2, prompt(len, 1), 1);
    d.run_to_idle();
    (d.seen[&1].ttft.unwrap(), d.seen[&2].ttft.unwrap())
}

#[test]
fn warm_prefix_cuts_ttft_by_the_model_factor() {
    let p = Profile::llama_8b_h100();
    let (cold, warm) = cold_warm(&p, 8192);
    let item = |c, n| BatchItem {
        context_tokens: c,
        new_tokens: n,
    };
    // Whole blocks up to the last token hit: 8,176 cached, 16 computed.
    assert_eq!(cold, p.step_duration(&[item(0, 8192)]));
    assert_eq!(warm, p.step_duration(&[item(8176, 16)]));
    let ratio = cold.as_secs_f64() / warm.as_secs_f64();
    assert!(within(ratio, 49.0, 0.2), "ratio {ratio}");
}

#[test]
fn calibration_8k_cold_and_warm_ttft_match_the_documented_figures() {
    let (cold, warm) = cold_warm(&Profile::llama_8b_h100(), 8192);
    assert!(within(cold.as_secs_f64(), 0.378, 0.2), "{cold:?}");
    assert!(within(warm.as_secs_f64(), 0.0078, 0.2), "{warm:?}");
    let (cold, warm) = cold_warm(&Profile::qwen_32b_h100_tp2(), 10_000);
    assert!(within(cold.as_secs_f64(), 0.869, 0.2), "{cold:?}");
    assert!(within(warm.as_secs_f64(), 0.0125, 0.2), "{warm:?}");
}

#[test]
fn calibration_decode_step_at_batch_one_is_about_7ms() {
    let mut d = Driver::new(&Profile::llama_8b_h100());
    d.submit(1, prompt(1000, 2), 20);
    d.run_to_idle();
    assert_eq!(d.step_durations.len(), 20);
    for t in &d.step_durations[1..] {
        assert!(within(t.as_secs_f64(), 0.007, 0.2), "{t:?}");
    }
    assert_eq!(d.seen[&1].completion_tokens, Some(20));
}

#[test]
fn long_prompt_prefills_in_chunks() {
    let mut d = Driver::new(&Profile::llama_8b_h100());
    d.submit(1, prompt(20_000, 3), 1);
    d.step();
    d.step();
    assert_eq!(d.seen.get(&1).map_or(0, |s| s.tokens), 0);
    d.step();
    assert_eq!(d.seen[&1].completion_tokens, Some(1));
    assert!(!d.engine.has_work());
}

#[test]
fn identical_prompts_admitted_together_share_blocks() {
    let mut d = Driver::new(&Profile::llama_8b_h100());
    d.submit(1, prompt(1000, 4), 2);
    d.submit(2, prompt(1000, 4), 2);
    d.run_to_idle();
    assert_eq!(d.seen[&1].cached_tokens, Some(0));
    assert_eq!(d.seen[&2].cached_tokens, Some(992));
    let stats = d.engine.stats();
    assert_eq!(stats.prefix_cache_queries, 2000);
    assert_eq!(stats.prefix_cache_hits, 992);
}

#[test]
fn memory_pressure_evicts_and_usage_stays_bounded() {
    // 64 blocks = 1,024 tokens; 30 distinct prompts of 200 tokens.
    let mut d = Driver::new(&small_profile(64, 8));
    for id in 0..30 {
        d.submit(id, prompt(200, id as u32 + 10), 20);
    }
    d.run_to_idle();
    assert!(d.removed_events > 0, "LRU never evicted");
    assert!(d.max_usage <= 1.0 && d.max_usage > 0.5, "{}", d.max_usage);
    assert!(d.engine.stats().num_cached_blocks <= 64);
    for id in 0..30 {
        assert_eq!(d.seen[&id].completion_tokens, Some(20));
    }
}

#[test]
fn preemption_under_pressure_and_every_request_completes() {
    // 40 blocks = 640 tokens; 10 sequences growing to 150 tokens (10 blocks) each.
    let mut d = Driver::new(&small_profile(40, 16));
    for id in 0..10 {
        d.submit(id, prompt(50, id as u32 + 100), 100);
    }
    d.run_to_idle();
    let stats = d.engine.stats();
    assert!(stats.preemptions > 0);
    let preempted: u32 = d.seen.values().map(|s| s.preempted).sum();
    assert_eq!(u64::from(preempted), stats.preemptions);
    for id in 0..10 {
        let seen = &d.seen[&id];
        assert_eq!(seen.tokens, 100, "request {id}");
        assert_eq!(seen.completion_tokens, Some(100));
    }
    // Re-prefills after preemption hit what survived of their own blocks.
    assert!(stats.prefix_cache_hits > 0);
    assert_eq!((stats.running, stats.waiting), (0, 0));
    assert_eq!(stats.kv_cache_usage, 0.0);
}

#[test]
fn queueing_appears_when_max_num_seqs_is_reached() {
    let mut d = Driver::new(&small_profile(1024, 4));
    for id in 0..12 {
        d.submit(id, prompt(100, id as u32 + 200), 50);
    }
    d.step();
    let stats = d.engine.stats();
    assert_eq!((stats.running, stats.waiting), (4, 8));
    d.run_to_idle();
    let ttft = |id: u64| d.seen[&id].ttft.unwrap();
    let latency = |id: u64| d.seen[&id].latency.unwrap();
    for late in 4..8 {
        assert!(
            ttft(late) >= latency(0),
            "request {late} started before a slot freed"
        );
    }
    for later in 8..12 {
        assert!(ttft(later) > ttft(later - 4));
    }
}

#[test]
fn invalid_requests_are_refused_with_typed_errors() {
    let mut engine = Engine::new(&small_profile(8, 4)).unwrap();
    let req = |id, prompt: Vec<u32>, max_tokens| EngineRequest {
        id,
        prompt,
        max_tokens,
    };
    let now = Duration::ZERO;
    assert_eq!(
        engine.submit(req(1, vec![], 5), now),
        Err(SubmitError::EmptyPrompt)
    );
    assert_eq!(
        engine.submit(req(1, vec![1], 0), now),
        Err(SubmitError::ZeroMaxTokens)
    );
    // 8 blocks of 16 = 128 tokens of capacity caps max_model_len.
    assert_eq!(engine.max_model_len(), 128);
    assert!(matches!(
        engine.submit(req(1, prompt(120, 0), 9), now),
        Err(SubmitError::TooLong { requested: 129, .. })
    ));
    engine.submit(req(1, prompt(120, 0), 8), now).unwrap();
    assert_eq!(
        engine.submit(req(1, vec![1], 1), now),
        Err(SubmitError::DuplicateId(1))
    );
    assert!(!engine.abort(99));
    let mut bad = Profile::llama_8b_h100();
    bad.max_num_seqs = 0;
    assert_eq!(Engine::new(&bad).unwrap_err().field, "max_num_seqs");
}

#[test]
fn a_prompt_filling_the_whole_cache_completes() {
    let mut d = Driver::new(&small_profile(8, 4));
    d.submit(1, prompt(120, 5), 8);
    d.submit(2, prompt(60, 6), 4);
    d.run_to_idle();
    assert_eq!(d.seen[&1].completion_tokens, Some(8));
    assert_eq!(d.seen[&2].completion_tokens, Some(4));
}

#[test]
fn reset_only_when_no_request_runs() {
    let mut d = Driver::new(&small_profile(64, 4));
    d.submit(1, prompt(100, 7), 5);
    d.step();
    assert_eq!(d.engine.reset_cache(), Err(ResetError::Busy { running: 1 }));
    d.run_to_idle();
    assert!(!d.cached().is_empty());
    let events = d.engine.reset_cache().unwrap();
    assert_eq!(events, vec![KvEvent::AllBlocksCleared]);
    d.apply(events);
    assert!(d.cached().is_empty() && d.subscriber.is_empty());
    let idle = d.engine.step(d.now);
    assert_eq!(idle.duration, Duration::ZERO);
    assert!(idle.outputs.is_empty() && idle.events.is_empty());
}

#[test]
fn aborts_free_blocks_without_events() {
    let mut d = Driver::new(&small_profile(64, 4));
    d.submit(1, prompt(100, 8), 50);
    d.submit(2, prompt(100, 9), 50);
    d.step();
    assert!(d.engine.abort(1));
    assert!(d.engine.abort(2));
    d.engine.check_invariants().unwrap();
    let stats = d.engine.stats();
    assert_eq!(
        (stats.running, stats.waiting, stats.kv_cache_usage),
        (0, 0, 0.0)
    );
    assert!(!d.engine.has_work());
    assert_eq!(d.subscriber, d.cached());
}

/// A conversation's second turn after other prompts pushed its first turn out of the GPU cache:
/// with a CPU tier it loads the prefix (cached tokens, load time) instead of prefilling it again.
fn second_turn_after_gpu_eviction(cpu_offload_blocks: u32) -> (Driver, Seen) {
    // 64 blocks of 16 = 1,024 tokens of GPU cache; one step can prefill a whole prompt.
    let profile = Profile {
        name: "small".to_owned(),
        num_gpu_blocks: 64,
        max_num_batched_tokens: 8192,
        cpu_offload_blocks,
        ..Profile::llama_8b_h100()
    };
    let mut d = Driver::new(&profile);
    let first = prompt(800, 300); // 50 full blocks
    d.submit(1, first.clone(), 1);
    d.run_to_idle();
    for id in 2..5 {
        d.submit(id, prompt(800, 300 + id as u32), 1);
        d.run_to_idle();
    }
    assert!(
        d.removed_events >= 50,
        "the first turn was evicted from GPU"
    );
    let mut second = first;
    second.extend(prompt(200, 400));
    d.submit(10, second, 1);
    d.run_to_idle();
    let seen = d.seen[&10].clone();
    (d, seen)
}

#[test]
fn a_prefix_evicted_from_gpu_but_on_cpu_loads_instead_of_prefilling() {
    let (on, with_tier) = second_turn_after_gpu_eviction(1000);
    let (off, without) = second_turn_after_gpu_eviction(0);
    let p = on.engine.profile().clone();
    let item = |c, n| BatchItem {
        context_tokens: c,
        new_tokens: n,
    };
    // Without the tier: the whole 1,000-token prompt is prefilled again.
    assert_eq!(without.cached_tokens, Some(0));
    assert_eq!(without.ttft, Some(p.step_duration(&[item(0, 1000)])));
    // With it: 800 tokens loaded (800 / 200,000 tokens/s = 4 ms), 200 prefilled.
    assert_eq!(with_tier.cached_tokens, Some(800));
    assert_eq!(
        with_tier.ttft,
        Some(p.step_duration(&[item(800, 200)]) + p.load_duration(800))
    );
    let (fast, slow) = (with_tier.ttft.unwrap(), without.ttft.unwrap());
    assert!(fast * 2 < slow, "{fast:?} vs {slow:?}");
    let stats = on.engine.stats();
    assert_eq!(stats.external_prefix_cache_hits, 800);
    assert_eq!(stats.external_prefix_cache_queries, 4 * 800 + 1000);
    let off_stats = off.engine.stats();
    assert_eq!(
        (
            off_stats.external_prefix_cache_queries,
            off_stats.external_prefix_cache_hits
        ),
        (0, 0)
    );
    assert!(off.cpu_subscriber.is_empty());
    // The loaded blocks are cached on GPU again: a third turn hits all of the second turn's
    // full blocks there (62 blocks = 992 tokens), none on CPU.
    let mut on = on;
    let mut third = prompt(800, 300);
    third.extend(prompt(200, 400));
    third.extend(prompt(10, 500));
    let gpu_hits = stats.prefix_cache_hits;
    on.submit(11, third, 1);
    on.run_to_idle();
    assert_eq!(on.seen[&11].cached_tokens, Some(992));
    let stats = on.engine.stats();
    assert_eq!(stats.prefix_cache_hits - gpu_hits, 992);
    assert_eq!(stats.external_prefix_cache_hits, 800);
}

#[test]
fn a_transferred_prompt_computes_only_what_its_blocks_do_not_cover() {
    let p = Profile::llama_8b_h100();
    let item = |c, n| BatchItem {
        context_tokens: c,
        new_tokens: n,
    };
    let mut d = Driver::new(&p);
    d.engine
        .submit_transferred(
            EngineRequest {
                id: 1,
                prompt: prompt(8192, 3),
                max_tokens: 2,
            },
            None,
            d.now,
        )
        .unwrap();
    d.run_to_idle();
    let seen = &d.seen[&1];
    // As a warm prefix: 8,176 tokens arrived with their blocks, 16 computed here.
    assert_eq!(seen.ttft, Some(p.step_duration(&[item(8176, 16)])));
    assert_eq!(
        seen.cached_tokens,
        Some(8176),
        "counted as cached, as vLLM counts them"
    );
    assert_eq!(seen.completion_tokens, Some(2));
    // The blocks are this engine's now: announced, and a second request hits them locally.
    assert_eq!(d.subscriber.len(), 8192 / 16);
    d.submit(2, prompt(8192, 3), 1);
    d.run_to_idle();
    assert_eq!(d.seen[&2].cached_tokens, Some(8176));
}
