//! The snapshot the filters poll, for 8 endpoints whose caches hold 20k blocks each: the size
//! of a full and of an incremental snapshot (printed), and the time to build, encode and decode
//! them. The block count does not reach the wire (the snapshot carries per-endpoint summaries),
//! which is the point: a poll every 100 ms stays a few hundred bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};

use kvoy_aggregator::kv_index::{EndpointCache, Tier};
use kvoy_kvevents::{BlockHash, EventBatch, KvEvent, Medium};
use kvoy_shared::snapshot::{EndpointStatus, Snapshot, SnapshotDelta, SnapshotHistory};

const ENDPOINTS: u16 = 8;
const BLOCKS: u64 = 20_000;
const BLOCK_SIZE: u32 = 16;

/// A cache holding `BLOCKS` blocks in chains of 50, stored as the server would publish them.
fn filled_cache(endpoint: u16) -> EndpointCache {
    let mut cache = EndpointCache::new();
    let chain = 50u64;
    for c in 0..BLOCKS / chain {
        let base = (u64::from(endpoint) << 40) | (c << 16);
        let hashes: Vec<BlockHash> = (0..chain).map(|i| BlockHash::from_u64(base + i)).collect();
        let tokens: Vec<u32> = (0..chain as u32 * BLOCK_SIZE)
            .map(|t| t.wrapping_mul(2_654_435_761) ^ (c as u32))
            .collect();
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: None,
                token_ids: tokens,
                block_size: BLOCK_SIZE,
                lora_id: None,
                medium: Medium::Gpu,
                lora_name: None,
                group_idx: None,
            }],
            data_parallel_rank: None,
        };
        let _ = cache.apply_batch(&batch);
    }
    cache
}

fn status(slot: u16, cache: &EndpointCache, waiting: u32) -> EndpointStatus {
    EndpointStatus {
        slot,
        address: ([10, 0, 0, 10 + slot as u8], 8000).into(),
        models: vec!["llama-3.1-8b-instruct".into()],
        ready: true,
        stale: false,
        waiting,
        running: 24,
        kv_cache_usage: 0.62,
        block_size: BLOCK_SIZE,
        capacity_blocks: 25_600,
        cached_blocks: [
            cache.blocks(Tier::Gpu) as u32,
            cache.blocks(Tier::Cpu) as u32,
            cache.blocks(Tier::Storage) as u32,
        ],
        cache_generation: cache.generation(),
        prefix_hit_rate: Some(0.71),
        prefill_tokens_per_s: None,
        role: kvoy_shared::Role::Decode,
    }
}

fn bench(c: &mut Criterion) {
    let caches: Vec<EndpointCache> = (0..ENDPOINTS).map(filled_cache).collect();
    assert!(caches.iter().all(|c| c.blocks(Tier::Gpu) as u64 == BLOCKS));
    let statuses = |bump: u32| -> Vec<EndpointStatus> {
        caches
            .iter()
            .enumerate()
            .map(|(i, c)| status(i as u16, c, if i == 3 { bump } else { 2 }))
            .collect()
    };
    let mut history = SnapshotHistory::new(0x6b76_6f79);
    history.update(statuses(2));
    let base = history.snapshot();
    history.update(statuses(9));
    let mut full = Vec::new();
    history.delta_since(None, None).encode(&mut full);
    let mut incremental = Vec::new();
    history
        .delta_since(Some(base.epoch), Some(base.version))
        .encode(&mut incremental);
    let mut idle = Vec::new();
    history
        .delta_since(Some(base.epoch), Some(history.version()))
        .encode(&mut idle);
    println!(
        "snapshot sizes, {ENDPOINTS} endpoints x {BLOCKS} blocks: full {} B, incremental (1 endpoint changed) {} B, nothing changed {} B",
        full.len(),
        incremental.len(),
        idle.len()
    );

    let mut g = c.benchmark_group("snapshot");
    g.sample_size(30);
    g.measurement_time(std::time::Duration::from_secs(2));
    g.bench_function("summarise_8x20k", |b| {
        b.iter(|| black_box(statuses(black_box(9))))
    });
    g.bench_function("history_update_8", |b| {
        let mut h = SnapshotHistory::new(1);
        let mut bump = 0u32;
        b.iter(|| {
            bump = bump.wrapping_add(1);
            h.update(statuses(bump))
        })
    });
    g.bench_function("encode_full_8", |b| {
        let mut out = Vec::with_capacity(1024);
        b.iter(|| {
            out.clear();
            history.delta_since(None, None).encode(&mut out);
            black_box(out.len())
        })
    });
    g.bench_function("decode_full_8", |b| {
        b.iter(|| Snapshot::decode(black_box(&full)).unwrap())
    });
    g.bench_function("decode_apply_incremental_1_of_8", |b| {
        b.iter(|| {
            let mut s = base.clone();
            s.apply(SnapshotDelta::decode(black_box(&incremental)).unwrap())
                .unwrap();
            s
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
