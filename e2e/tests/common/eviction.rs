//! What the tests of the servers' evictions and offloads reaching the proxies share
//! (`envoy_removals.rs`, `envoy_offload.rs`): a conversation long enough to fill many blocks,
//! unrelated prompts that push it out of a simulator's cache, and the readings of the
//! aggregator's links and the proxy's counters.

use kvoy_shared::protocol::{CHAT_COMPLETIONS_PATH, MODELS_PATH, POOL_PATH};
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;

use kvoy_aggregator::local::LocalAggregator;
use kvoy_testkit::{http, wait_for, Stack, StackConfig, SERVED_BY_HEADER};

use super::{AggregatorReads, FollowedPool};

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
    let r = http::post_json(to, CHAT_COMPLETIONS_PATH, &[], body, TIMEOUT)?;
    anyhow::ensure!(r.status == 200, "POST to {to}: {} {}", r.status, r.text());
    Ok(r)
}

/// The keys the aggregator's linker has linked on `endpoint` (`/v1/pool`).
pub fn linked_keys(agg: &LocalAggregator, endpoint: &str) -> anyhow::Result<u64> {
    Ok(
        agg.get_json(POOL_PATH)?["links"]["endpoints"][endpoint]["linked_keys"]
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

/// A relaying proxy in front of a [`FollowedPool`], both workers warmed up, and one
/// conversation's first turn routed and linked at the aggregator.
pub struct LinkedConversation {
    pub pool: FollowedPool,
    pub proxy: Stack,
    /// The simulator the first turn went to, as `ip:port`.
    pub served: String,
    /// The keys the aggregator linked there.
    pub linked: u64,
}

/// Starts two simulators with `sim_flags` and an aggregator following them (run `name`), a proxy relaying to it, then sends the conversation `name`'s
/// first turn and waits until it is linked.
pub fn linked_conversation(
    name: &str,
    sim_flags: &[&str],
    model: &str,
) -> anyhow::Result<LinkedConversation> {
    let pool = FollowedPool::start(name, 2, sim_flags, model, "scrape_interval_ms: 50\n")?;
    let mut config = StackConfig::new(pool.endpoints(model), pool.run_dir.join("proxy"));
    config.aggregator = Some(pool.agg.addr());
    let proxy = Stack::start(&config)?;
    std::thread::sleep(Duration::from_millis(500));
    // A few requests first, on new connections, so that both workers serve (a worker replays
    // the shared log on its tick once it serves; before, on its first request). `GET
    // /v1/models` makes no routing decision, so the linker has nothing more to tell apart.
    for _ in 0..16 {
        let r = http::get(proxy.listen, MODELS_PATH, TIMEOUT)?;
        anyhow::ensure!(r.status == 200, "GET /v1/models: {} {}", r.status, r.text());
    }
    let first = post_chat(proxy.listen, &long_turn(name, model, 0))?;
    let served = first
        .header(SERVED_BY_HEADER)
        .ok_or_else(|| anyhow::anyhow!("the first turn has no served-by header"))?
        .to_owned();
    wait_for(
        "the first turn linked at the aggregator",
        Duration::from_secs(10),
        || linked_keys(&pool.agg, &served).is_ok_and(|k| k > 0),
    );
    let linked = linked_keys(&pool.agg, &served)?;
    Ok(LinkedConversation {
        pool,
        proxy,
        served,
        linked,
    })
}
