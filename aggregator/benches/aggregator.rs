//! KV-event throughput of the aggregator's block index, in events per second (DESIGN target:
//! at least 1M events/s per core decoded and indexed).
//!
//! One pass is a vLLM server's steady state on a Llama-8B/H100-sized cache (25,600 blocks of
//! 16 tokens): `BlockStored` chains of 1-4 blocks, 60% continuing a recent chain, and one
//! single-hash `BlockRemoved` per evicted block (as vLLM emits them), the oldest block evicted
//! as each new one is stored, in batches of 10 events. The pass wraps around (its first
//! evictions are the blocks its end stored), so after the warm-up every pass sees a full
//! cache. Measured: decode + apply (the aggregator's work per message), apply alone on decoded
//! batches, and decode alone; u64 hashes (vLLM's integer form) and 32-byte hashes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use kvoy_aggregator::kv_index::{ApplyStats, EndpointCache, DEFAULT_RECENT_REMOVED};
use kvoy_kvevents::{decode_batch, encode_batch, BlockHash, EventBatch, KvEvent, Medium, WireForm};
use kvoy_shared::Rng;

const CACHE_BLOCKS: usize = 25_600;
/// Blocks stored (and evicted) per pass.
const PASS_BLOCKS: u64 = 40_000;
const BATCH_EVENTS: usize = 10;
const BLOCK_SIZE: u32 = 16;

/// Block number `i`'s engine hash.
fn hash(i: u64, wide: bool) -> BlockHash {
    let v = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    if wide {
        let mut b = [0u8; 32];
        for (k, chunk) in b.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&v.rotate_left(k as u32 * 17).to_be_bytes());
        }
        BlockHash::from_canonical(b)
    } else {
        BlockHash::from_u64(v)
    }
}

/// One pass of events, in batches; returns the batches and the event count.
fn pass(wide: bool) -> (Vec<EventBatch>, u64) {
    let mut rng = Rng::new(0x0123_4567_89ab_cdef);
    let mut events = Vec::new();
    let mut next = 0u64;
    let mut last: Option<u64> = None;
    // Evicting block j - CACHE_BLOCKS (mod the pass) after storing block j.
    let mut evict = VecDeque::new();
    while next < PASS_BLOCKS {
        let n = (1 + rng.below(4) as u64).min(PASS_BLOCKS - next);
        let parent = match (last, rng.below(10)) {
            (Some(p), 0..=5) => Some(hash(p, wide)),
            _ => None,
        };
        events.push(KvEvent::BlockStored {
            block_hashes: (next..next + n).map(|i| hash(i, wide)).collect(),
            parent_block_hash: parent,
            token_ids: (0..n * u64::from(BLOCK_SIZE))
                .map(|_| rng.below(128_000) as u32)
                .collect(),
            block_size: BLOCK_SIZE,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            group_idx: None,
        });
        for i in next..next + n {
            evict.push_back((i + PASS_BLOCKS - CACHE_BLOCKS as u64) % PASS_BLOCKS);
        }
        next += n;
        last = Some(next - 1);
        while let Some(old) = evict.pop_front() {
            events.push(KvEvent::BlockRemoved {
                block_hashes: vec![hash(old, wide)],
                medium: Medium::Gpu,
                group_idx: None,
            });
        }
    }
    let count = events.len() as u64;
    let batches = events
        .chunks(BATCH_EVENTS)
        .enumerate()
        .map(|(i, chunk)| EventBatch {
            ts: 1.7e9 + i as f64 * 1e-3,
            events: chunk.to_vec(),
            data_parallel_rank: Some(0),
        })
        .collect();
    (batches, count)
}

fn cache() -> EndpointCache {
    EndpointCache::with_capacity(CACHE_BLOCKS + DEFAULT_RECENT_REMOVED)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv_index");
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (name, wide, form) in [
        ("u64_map", false, WireForm::Map),
        ("u64_array", false, WireForm::Array),
        ("bin32_map", true, WireForm::Map),
    ] {
        let (batches, events) = pass(wide);
        let payloads: Vec<Vec<u8>> = batches.iter().map(|b| encode_batch(b, form)).collect();
        g.throughput(Throughput::Elements(events));

        let mut c1 = cache();
        g.bench_function(format!("decode_apply/{name}"), |b| {
            b.iter(|| {
                let mut stats = ApplyStats::default();
                for p in &payloads {
                    let batch = decode_batch(black_box(p)).unwrap();
                    stats.add(&c1.apply_batch(&batch));
                }
                stats
            })
        });
        if form == WireForm::Map {
            let mut c2 = cache();
            g.bench_function(format!("apply/{name}"), |b| {
                b.iter(|| {
                    let mut stats = ApplyStats::default();
                    for batch in &batches {
                        stats.add(&c2.apply_batch(black_box(batch)));
                    }
                    stats
                })
            });
            // After warm-up, every pass meets a full cache and removes only what it holds.
            let s = (0..3).fold(ApplyStats::default(), |_, _| {
                batches.iter().fold(ApplyStats::default(), |mut s, b| {
                    s.add(&c2.apply_batch(b));
                    s
                })
            });
            assert_eq!(
                (s.events(), s.unknown_removals, s.orphan_blocks),
                (events, 0, 0)
            );
        }
        g.bench_function(format!("decode/{name}"), |b| {
            b.iter(|| {
                payloads
                    .iter()
                    .map(|p| decode_batch(black_box(p)).unwrap().events.len())
                    .sum::<usize>()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
