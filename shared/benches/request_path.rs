//! Parse + hash + score on the request path, at prompt sizes of 1k, 8k and 100k tokens
//! (about 4 bytes per token), natively. The same bodies run through the wasm filter in
//! `harness/benches/filter_wasm.rs`.

// A benchmark fails loudly on bad fixtures, like a test.
#![allow(clippy::expect_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

use kvoy_shared::prefix::PrefixHasher;
use kvoy_shared::request::{parse, Api};

#[path = "support/fixtures.rs"]
mod fixtures;
use fixtures::{bench_route, chat_body};

fn bench(c: &mut Criterion) {
    let sizes = [1_000usize, 8_000, 100_000];
    let mut g = c.benchmark_group("native");
    for &tokens in &sizes {
        let body = chat_body(tokens, "What is the answer?");
        g.throughput(Throughput::Bytes(body.len() as u64));
        // The floor of any serde-based parser: validate the body, build nothing.
        g.bench_with_input(
            BenchmarkId::new("serde_json_ignored_any", tokens),
            &body,
            |b, body| {
                b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(body)).is_ok())
            },
        );
        g.bench_with_input(BenchmarkId::new("parse", tokens), &body, |b, body| {
            b.iter(|| {
                parse(Api::ChatCompletions, black_box(body), 16 << 20).map(|r| r.prompt.len())
            })
        });
        let req = parse(Api::ChatCompletions, &body, 16 << 20).expect("parses");
        let mut hasher = PrefixHasher::new(64, 256);
        g.bench_with_input(BenchmarkId::new("hash", tokens), &req, |b, req| {
            b.iter(|| hasher.hash(&req.model, None, black_box(&req.prompt)).len())
        });
        bench_route(&mut g, BenchmarkId::new("route", tokens), &body);
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
