//! One request through the real `kvoy_prefix_affinity` wasm filter under wasmtime (this crate's
//! proxy-wasm host), beside the native `Router::route_body` on the same body, at prompt sizes
//! of 1k, 8k and 100k tokens (about 4 bytes per token). Both run in one group, so the wasm /
//! native ratio comes from one run on one machine.
//!
//! `filter/wasm/N` is what a worker does per request: a new stream, request headers (the filter
//! pauses), the whole body with end of stream (the filter parses, hashes, scores, sets
//! `x-gateway-destination-endpoint` and continues), then the end of the stream (`on_log`
//! releases the in-flight count). One plugin runs 2 VMs and iterations alternate between them,
//! so each request also replays the other VM's last decision from the shared decision log, as
//! on an Envoy with 2 workers. The index is warmed first: every request matches its full chain.
//! `filter/native/N` is `Router::route_body` on the same body with a warmed index.
//! `filter/wasm_cold/N` is `filter/wasm/N` with every key new (a prompt no VM has seen: its
//! chosen endpoint records the whole chain, the index evicting as it fills).
//! `filter/wasm_passthrough/get` is the per-stream floor: a `GET /v1/models` the filter routes
//! at the headers, with no body to parse.
//! `filter/wasm_weighted/N` is the same filter with `scorer: "weighted"` (the cost scorer's cost
//! alone), and `filter/wasm_previous/N` with the previous defaults as well (weighted, 256 dense
//! keys: a prompt keyed over its first 16 KB only), so the new defaults' cost per request is
//! read side by side in one run.
//! `filter/wasm_pd/N` and `filter/wasm_pd_cold/N` are `filter/wasm/N` and `filter/wasm_cold/N`
//! on a prefill/decode pool (the same 8 endpoints, the first 4 prefill-only): a warm request
//! is served whole by the decode endpoint holding its prefix, a cold one is split (the
//! prefill endpoint chosen as well and named in `x-prefiller-host-port`), issue 39's cost of
//! P/D against the aggregated path.
//!
//! Needs `make wasm`. `KVOY_BENCH_WASM=path/to/filter.wasm` benches another build of the filter
//! (e.g. one built with `-C target-feature=+simd128`); see BENCHMARKS.md.
//!
//! Run: `cargo bench -p kvoy-harness -j 2 --bench filter_wasm`.

// A benchmark fails loudly on a missing module or a filter that stops routing, like a test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};

use kvoy_harness::{testing, Action, Host, Plugin};

/// Points the bench at another build of the filter instead of `target/wasm32-wasip1/release`.
const WASM_ENV: &str = "KVOY_BENCH_WASM";
const FILTER: &str = "kvoy_prefix_affinity";
const DESTINATION: &str = "x-gateway-destination-endpoint";
const PREFILLER: &str = "x-prefiller-host-port";
const REQUESTED: &str = "kvoy_prefix_affinity_prefix_blocks_requested_total";
const MATCHED: &str = "kvoy_prefix_affinity_prefix_blocks_matched_total";
const SHARED_ERRORS: &str = "kvoy_prefix_affinity_shared_state_errors_total";
const VMS: usize = 2;

#[path = "../../shared/benches/support/fixtures.rs"]
mod fixtures;
use fixtures::{bench_route, chat_body, config_json};

/// [`config_json`]'s 8 endpoints, the first 4 prefill-only (a prefill/decode pool).
fn pd_config_json() -> String {
    let endpoints: Vec<String> = (1..=8)
        .map(|i| {
            let role = if i <= 4 { "prefill" } else { "decode" };
            format!(r#"{{"address":"10.0.0.{i}:8000","models":["llama"],"role":"{role}"}}"#)
        })
        .collect();
    format!(r#"{{"endpoints":[{}]}}"#, endpoints.join(","))
}

fn load_host() -> Host {
    match std::env::var_os(WASM_ENV) {
        Some(path) => {
            let path = Path::new(&path);
            eprintln!("filter_wasm: benching {} ({WASM_ENV})", path.display());
            Host::load(path).unwrap_or_else(|e| panic!("{WASM_ENV}={}: {e}", path.display()))
        }
        // The error says which file is missing and to run `make wasm`.
        None => testing::filter_host(FILTER).unwrap_or_else(|e| panic!("filter_wasm: {e}")),
    }
}

/// One request as Envoy drives it; panics if the filter does not route it. Whether it named a
/// prefill endpoint.
fn request(plugin: &Plugin, vm: usize, headers: &[(&str, &str)], body: &[u8]) -> bool {
    let stream = plugin.http_stream(vm).expect("new stream");
    let action = stream
        .send_request_headers(headers, false)
        .expect("request headers");
    assert_eq!(action, Action::Pause, "the filter must hold the headers");
    let action = stream.send_request_body(body, true).expect("request body");
    assert_eq!(
        action,
        Action::Continue,
        "the filter did not route the request: {:?}",
        stream.local_reply()
    );
    assert!(
        stream.request_header(DESTINATION).is_some(),
        "no {DESTINATION} header"
    );
    let split = stream.request_header(PREFILLER).is_some();
    stream.finish().expect("finish");
    split
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn counter(plugin: &Plugin, name: &str) -> u64 {
    plugin.counter(name).unwrap_or(0)
}

/// `config_json()` with `extra` fields.
fn config_with(extra: &str) -> String {
    let base = config_json();
    match base.strip_suffix('}') {
        Some(head) if !extra.is_empty() => format!("{head},{extra}}}"),
        _ => base,
    }
}

fn bench(c: &mut Criterion) {
    let host = load_host();
    let start = |config: String| {
        host.plugin()
            .configuration(config.as_bytes())
            .vms(VMS)
            .start()
            .expect("plugin starts")
    };
    let plugin = start(config_with(""));
    let variants = [
        ("wasm", plugin),
        (
            "wasm_weighted",
            start(config_with(r#""scorer":"weighted""#)),
        ),
        (
            "wasm_previous",
            start(config_with(
                r#""scorer":"weighted","max_blocks":256,"dense_blocks":256"#,
            )),
        ),
        ("wasm_pd", start(pd_config_json())),
    ];
    let plugin = &variants[0].1;
    let mut g = c.benchmark_group("filter");

    // The fixed cost of a stream: `GET /v1/models` is routed at the headers (least loaded, no
    // body, no prefix), then the stream ends.
    let get = [
        (":method", "GET"),
        (":path", "/v1/models"),
        (":authority", "gateway"),
    ];
    let mut next_vm = 0;
    g.bench_function(BenchmarkId::new("wasm_passthrough", "get"), |b| {
        b.iter(|| {
            let stream = plugin.http_stream(next_vm).expect("new stream");
            let action = stream.send_request_headers(&get, true).expect("headers");
            assert_eq!(action, Action::Continue, "{:?}", stream.local_reply());
            assert!(stream.request_header(DESTINATION).is_some());
            stream.finish().expect("finish");
            next_vm = (next_vm + 1) % VMS;
        })
    });

    for tokens in [1_000usize, 8_000, 100_000] {
        let body = chat_body(tokens, "What is the answer?");
        let length = body.len().to_string();
        let headers = [
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "gateway"),
            ("content-type", "application/json"),
            ("content-length", length.as_str()),
        ];
        g.throughput(Throughput::Bytes(body.len() as u64));

        for (name, plugin) in &variants {
            // Warm both VMs' indexes, then check that a request matches its whole chain.
            for vm in 0..VMS {
                request(plugin, vm, &headers, &body);
            }
            let (requested, matched) = (counter(plugin, REQUESTED), counter(plugin, MATCHED));
            request(plugin, 0, &headers, &body);
            let requested = counter(plugin, REQUESTED) - requested;
            let matched = counter(plugin, MATCHED) - matched;
            assert!(
                requested > 0 && matched == requested,
                "{name}: warm request matched {matched} of {requested} blocks"
            );

            let mut next_vm = 0;
            g.bench_with_input(BenchmarkId::new(*name, tokens), &body, |b, body| {
                b.iter(|| {
                    request(plugin, next_vm, &headers, black_box(body));
                    next_vm = (next_vm + 1) % VMS;
                })
            });
            assert_eq!(counter(plugin, SHARED_ERRORS), 0, "shared state errors");
        }

        // Every key new: the same body with a counter stamped over the start of its system
        // prompt, so its first block (and so every chained key) was never seen. The copy is
        // made outside the timed part.
        let at = find(&body, b"The quick").expect("the fixture's system prompt");
        let mut stamp = 0u64;
        let mut fresh = || {
            stamp += 1;
            let mut b = body.clone();
            b[at..at + 16].copy_from_slice(format!("{stamp:016x}").as_bytes());
            b
        };
        let pd = &variants[3].1;
        for (name, plugin, splits) in [("wasm_cold", plugin, false), ("wasm_pd_cold", pd, true)] {
            let (requested, matched) = (counter(plugin, REQUESTED), counter(plugin, MATCHED));
            assert_eq!(request(plugin, 0, &headers, &fresh()), splits, "{name}");
            assert!(
                counter(plugin, REQUESTED) > requested && counter(plugin, MATCHED) == matched,
                "a fresh prompt matched"
            );
            let mut next_vm = 0;
            g.bench_function(BenchmarkId::new(name, tokens), |b| {
                b.iter_batched(
                    &mut fresh,
                    |body| {
                        request(plugin, next_vm, &headers, black_box(&body));
                        next_vm = (next_vm + 1) % VMS;
                    },
                    BatchSize::SmallInput,
                )
            });
            assert_eq!(counter(plugin, SHARED_ERRORS), 0, "shared state errors");
        }

        bench_route(&mut g, BenchmarkId::new("native", tokens), &body);
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
