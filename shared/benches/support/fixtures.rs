//! Request bodies and the pool shared by the native bench (`shared/benches/request_path.rs`)
//! and the wasm bench (`harness/benches/filter_wasm.rs`), so their numbers compare.

/// A chat body whose prompt is about `tokens * 4` bytes of prose with newlines and quotes,
/// so that the JSON carries escapes like real prompts do.
pub fn chat_body(tokens: usize, question: &str) -> Vec<u8> {
    let line = "The quick brown fox jumps over the lazy dog; \"quoted\" text, code { x: 1 }.\n";
    let mut system = String::with_capacity(tokens * 4 + line.len());
    while system.len() < tokens * 4 {
        system.push_str(line);
    }
    serde_json::json!({
        "model": "llama",
        "stream": true,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question}
        ]
    })
    .to_string()
    .into_bytes()
}

/// The plugin configuration: 8 endpoints serving model `llama`.
pub fn config_json() -> String {
    let endpoints: Vec<String> = (1..=8)
        .map(|i| format!(r#"{{"address":"10.0.0.{i}:8000","models":["llama"]}}"#))
        .collect();
    format!(r#"{{"endpoints":[{}]}}"#, endpoints.join(","))
}

/// Times `Router::route_body` on `body` as `id` in `group`, with the index already holding the
/// body's prefix so that every route walks the full chain.
pub fn bench_route(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    id: criterion::BenchmarkId,
    body: &[u8],
) {
    use kvoy_shared::request::Api;
    use std::hint::black_box;
    let config = kvoy_shared::prefix_affinity::PluginConfig::from_json(config_json().as_bytes())
        .expect("valid config");
    let mut router = kvoy_shared::prefix_affinity::Router::new(config, 1);
    let inflight = [kvoy_shared::Outstanding::default(); 8];
    router
        .route_body(
            Api::ChatCompletions,
            body,
            &inflight,
            std::time::Duration::ZERO,
        )
        .expect("routes");
    group.bench_with_input(id, body, |b, body| {
        b.iter(|| {
            router
                .route_body(
                    Api::ChatCompletions,
                    black_box(body),
                    &inflight,
                    std::time::Duration::ZERO,
                )
                .map(|d| d.endpoint)
        })
    });
}
