//! The cost of `kvoy_admission` per request when the pool is not saturated (the admit fast
//! path: classify, read the shared in-flight counter, offer to an empty queue, count the
//! request in flight; at the end of the stream release the count), through the real `.wasm`
//! under wasmtime. Beside it, in the same group, the harness's own per-stream floor: the SDK
//! test guest doing two header writes. The difference is what admission adds (DESIGN target:
//! under 20 us in the wasm VM).
//!
//! Run: `cargo bench -p kvoy-harness -j 2 --bench admission_wasm` (needs `make wasm`).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion};

use kvoy_harness::{testing, Action, Plugin};

const HEADERS: [(&str, &str); 6] = [
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    (":authority", "gw"),
    ("content-length", "4096"),
    ("x-gateway-inference-objective", "interactive"),
    ("x-gateway-inference-fairness-id", "tenant-a"),
];

fn stream(plugin: &Plugin, vm: usize, admitted: bool) {
    let s = plugin.http_stream(vm).expect("stream");
    let action = s.send_request_headers(&HEADERS, true).expect("headers");
    if admitted {
        assert_eq!(action, Action::Continue, "{:?}", s.local_reply());
    }
    s.finish().expect("finish");
}

fn bench(c: &mut Criterion) {
    let admission = testing::filter_host("kvoy_admission")
        .unwrap()
        .plugin()
        .configuration(
            r#"{"endpoints": 8, "flow": {"objectives": {"interactive": 10},
                "saturation": {"max_inflight_per_endpoint": 64}}}"#,
        )
        .vms(2)
        .start()
        .unwrap();
    let floor = testing::filter_host("kvoy_harness_guest")
        .unwrap()
        .plugin()
        .vms(2)
        .start()
        .unwrap();
    let mut g = c.benchmark_group("admission");
    g.sample_size(50);
    let mut vm = 0;
    g.bench_function("wasm_admit", |b| {
        b.iter(|| {
            vm ^= 1;
            stream(&admission, vm, true)
        })
    });
    g.bench_function("wasm_floor_guest", |b| {
        b.iter(|| {
            vm ^= 1;
            stream(&floor, vm, false)
        })
    });
    g.finish();
    assert_eq!(
        admission
            .counter("kvoy_admission_queued_total")
            .unwrap_or(0),
        0,
        "fast path only"
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
