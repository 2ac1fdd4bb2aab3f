//! What the tests of the servers' evictions and offloads reaching the proxies share
//! (`envoy_removals.rs`, `envoy_offload.rs`): a conversation long enough to fill many blocks,
//! unrelated prompts that push it out of a simulator's cache, and the readings of the
//! aggregator's links and the proxy's counters.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;

use crate::{http, LocalAggregator, Stack};

const TIMEOUT: Duration = Duration::from_secs(30);

/// Turn `t` of the conversation named `name`: a long system prompt (about 18 blocks of 16
/// tokens) and `t` earlier exchanges.
pub fn long_turn(name: &str, model: &str, t: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content":
        format!("The {name} conversation. {}", "You are a careful assistant with a long brief. ".repeat(24))})];
    for k in 0..t {
        messages.push(json!({"role": "user", "content": format!("Question {k}?")}));
        messages
            .push(json!({"role": "assistant", "content": format!("Answer {k}, at some length.")}));
    }
    messages.push(json!({"role": "user", "content": format!("Question {t}?")}));
    serde_json::to_vec(&json!({"model": model, "max_tokens": 2, "messages": messages}))
        .unwrap_or_default()
}

/// Unrelated prompt `i` (about 16 blocks), sent straight to a simulator to fill its cache.
pub fn flood_prompt(model: &str, i: usize) -> Vec<u8> {
    let text = format!(
        "Unrelated prompt {i}. {}",
        "Other work fills the cache. ".repeat(36)
    );
    serde_json::to_vec(&json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": text}]}))
    .unwrap_or_default()
}

/// A chat completion to `to`, which must answer 200.
pub fn post_chat(to: SocketAddr, body: &[u8]) -> anyhow::Result<http::Response> {
    let r = http::post_json(to, "/v1/chat/completions", &[], body, TIMEOUT)?;
    anyhow::ensure!(r.status == 200, "POST to {to}: {} {}", r.status, r.text());
    Ok(r)
}

/// The keys the aggregator's linker has linked on `endpoint` (`/v1/pool`).
pub fn linked_keys(agg: &LocalAggregator, endpoint: &str) -> anyhow::Result<u64> {
    Ok(
        agg.get_json("/v1/pool")?["links"]["endpoints"][endpoint]["linked_keys"]
            .as_u64()
            .unwrap_or(0),
    )
}

/// Seconds since the Unix epoch, as the simulators stamp their event batches.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A filter counter of `proxy`, summed over its workers (0 when absent): read from the admin
/// endpoint now (`now`), or after the filters' next metrics flush.
pub fn proxy_counter(proxy: &Stack, name: &str, now: bool) -> anyhow::Result<u64> {
    let stats = if now {
        proxy.admin_stats(name)?
    } else {
        proxy.stats(name)?
    };
    Ok(stats.values().sum())
}
