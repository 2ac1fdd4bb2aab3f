//! The admission filter's per-request work at the request headers: classify + saturation over
//! 8 endpoints + offer, on the fast path (pool not saturated, queue empty: admitted with no
//! allocation), and a queued round trip (offer + release) for comparison.

// A benchmark fails loudly on bad fixtures, like a test.
#![allow(clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

use kvoy_shared::admission::{classify, saturation, AdmissionConfig, FlowQueue, Offer};
use kvoy_shared::snapshot::EndpointStatus;

fn endpoints(n: u16) -> Vec<EndpointStatus> {
    (0..n)
        .map(|slot| EndpointStatus {
            waiting: u32::from(slot % 3),
            running: 8,
            kv_cache_usage: 0.3,
            block_size: 16,
            capacity_blocks: 4096,
            cached_blocks: [1000, 0, 0],
            cache_generation: 1,
            prefix_hit_rate: Some(0.5),
            ..EndpointStatus::ready(slot, ([10, 0, 0, 1], 8000 + slot).into(), &["llama"])
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let cfg = AdmissionConfig::from_json(
        br#"{"objectives":{"interactive":10,"standard":0,"batch":-1},
            "saturation":{"max_inflight_per_endpoint":64,
                "max_inflight_tokens_per_endpoint":1000000}}"#,
    )
    .expect("config");
    let eps = endpoints(8);
    let inflight = [3u32; 8];
    let tokens = [20_000u64; 8];
    let mut queue = FlowQueue::new(&cfg);
    let mut g = c.benchmark_group("admission");
    // Criterion calls each routine more than once: ids must stay unique across calls.
    let mut id = 0u64;
    g.bench_function("fast_path_8_endpoints", |b| {
        b.iter(|| {
            id += 1;
            let class = classify(
                &cfg,
                black_box(Some("interactive")),
                black_box(Some("tenant-a")),
                black_box(Some(32_768)),
            );
            let s = saturation(&cfg, black_box(&eps), black_box(&inflight), Some(&tokens));
            let offer = queue.offer(id, &class, 1_000, s.saturated);
            debug_assert_eq!(offer, Offer::Admit);
            offer
        })
    });
    // Saturated, 1,000 requests of 100 flows waiting: one offer and one release per iteration.
    let mut queue = FlowQueue::new(&cfg);
    let flows: Vec<String> = (0..100).map(|i| format!("tenant-{i}")).collect();
    for id in 0..1_000u64 {
        let class = classify(&cfg, None, Some(&flows[id as usize % 100]), Some(1_000));
        queue.offer(id, &class, 0, true);
    }
    let (mut released, mut expired) = (Vec::new(), Vec::new());
    let mut id = 1_000u64;
    g.bench_function("queued_offer_release_1000_waiting", |b| {
        b.iter(|| {
            id += 1;
            let class = classify(&cfg, None, Some(&flows[id as usize % 100]), Some(1_000));
            queue.offer(id, &class, 1, true);
            released.clear();
            queue.release(1, 1, &mut released, &mut expired);
            released.len()
        })
    });
    g.finish();
    assert_eq!(queue.len(), 1_000);
}

criterion_group!(benches, bench);
criterion_main!(benches);
