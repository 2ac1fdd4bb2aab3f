//! Decode throughput in events per second (DESIGN target: >= 1M events/s/core decoded).
//!
//! Batches of 1,000 events as a vLLM server emits them under load: one-block `BlockStored`
//! (16 token ids) and `BlockRemoved` events, with u64 or 32-byte hashes, in both wire forms;
//! plus long `BlockStored` chains (64 blocks, 1,024 token ids) for the per-token cost.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvoy_kvevents::{decode_batch, encode_batch, BlockHash, EventBatch, KvEvent, Medium, WireForm};

fn hash(i: u64, wide: bool) -> BlockHash {
    if wide {
        let mut b = [0x5au8; 32];
        b[24..].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
        BlockHash::from_canonical(b)
    } else {
        BlockHash::from_u64(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }
}

fn batch(n: u64, blocks_per_store: u64, wide: bool) -> EventBatch {
    let events = (0..n)
        .map(|i| {
            if i % 4 == 3 {
                KvEvent::BlockRemoved {
                    block_hashes: vec![hash(i, wide)],
                    medium: Medium::Gpu,
                    group_idx: None,
                }
            } else {
                KvEvent::BlockStored {
                    block_hashes: (0..blocks_per_store)
                        .map(|b| hash(i * 1000 + b, wide))
                        .collect(),
                    parent_block_hash: Some(hash(i + 7, wide)),
                    token_ids: (0..16 * blocks_per_store as u32)
                        .map(|t| 1000 + t * 37 % 120_000)
                        .collect(),
                    block_size: 16,
                    lora_id: None,
                    medium: Medium::Gpu,
                    lora_name: None,
                    group_idx: None,
                }
            }
        })
        .collect();
    EventBatch {
        ts: 1.7e9,
        events,
        data_parallel_rank: Some(0),
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    for (name, n, blocks, wide) in [
        ("1k_events_1block_u64", 1000, 1, false),
        ("1k_events_1block_bin32", 1000, 1, true),
        ("100_events_64blocks_u64", 100, 64, false),
    ] {
        let b = batch(n, blocks, wide);
        for form in [WireForm::Map, WireForm::Array] {
            let payload = encode_batch(&b, form);
            g.throughput(Throughput::Elements(n));
            g.bench_function(format!("{name}_{form:?}"), |bench| {
                bench.iter(|| decode_batch(std::hint::black_box(&payload)).unwrap())
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
