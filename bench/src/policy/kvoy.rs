//! kvoy's picker: kvoy-shared's [`Router`] run natively, exactly as the filter runs it.
//!
//! - `kvoy`: one proxy with the static pool. Its prefix index learns only from its own routing
//!   decisions; load is its own in-flight count per endpoint (prefix 3, in-flight 2, hot-spot
//!   guard 8 / 1.5: the crate defaults).
//! - `kvoy-aggregator`: the same router fed what kvoy-aggregator gives the filter. Every scrape
//!   (50 ms of virtual time, the aggregator's scrape interval) the servers' figures become a
//!   [`Snapshot`] of [`EndpointStatus`]es, turned into the live pool by
//!   [`kvoy_shared::live::live_pool`] and installed with [`Router::set_pool`], as the filter does
//!   on a new snapshot version: queue length and KV usage then count (queue 2, KV 2), and a
//!   changed cache generation drops what the index believed of an endpoint. The snapshot carries
//!   no block identities, so the index is fed the engines' real cached blocks through the
//!   causal join of the design (a request's text keys linked to the server blocks its prefill
//!   stored): when a request's prompt is known cached on its endpoint (its first token came out
//!   before the scrape), its keys are applied with [`Router::apply_remote`]. Evictions cannot be
//!   applied: the index has no removal (its LRU bound stands in for them).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};

use kvoy_shared::prefix::BlockKey;
use kvoy_shared::request::Api;
use kvoy_shared::snapshot::{EndpointStatus, Snapshot};
use kvoy_shared::{live, ConfigError, EndpointId, PluginConfig, Router};

use super::{argmin_random, Policy, Prefilled, RouteRequest, View};
use crate::rng::Rng;

/// The model name every simulated endpoint serves.
pub const MODEL: &str = "sim";

/// The address of simulated endpoint `i`.
pub fn address(i: usize) -> SocketAddr {
    let [a, b] = (i as u16).to_be_bytes();
    SocketAddr::from((Ipv4Addr::new(10, 1, a, b), 8000))
}

/// A kvoy configuration over `replicas` simulated endpoints with the crate's defaults.
pub fn config(replicas: usize) -> Result<PluginConfig, ConfigError> {
    let endpoints: Vec<serde_json::Value> = (0..replicas)
        .map(|i| serde_json::json!({"address": address(i).to_string(), "models": [MODEL]}))
        .collect();
    let json = serde_json::json!({ "endpoints": endpoints }).to_string();
    PluginConfig::from_json(json.as_bytes())
}

pub struct Kvoy {
    router: Router,
    aggregator: bool,
    /// Keys of requests routed but not yet known cached (aggregator mode).
    pending: HashMap<u64, Vec<BlockKey>>,
    version: u64,
    fallback: Rng,
    /// Requests the router refused (routed to the least-loaded endpoint instead).
    pub refused: u64,
}

impl Kvoy {
    /// Fails when kvoy-shared refuses the pool (e.g. more than its endpoint limit).
    pub fn new(replicas: usize, seed: u64, aggregator: bool) -> Result<Self, ConfigError> {
        Ok(Kvoy {
            router: Router::new(config(replicas)?, seed),
            aggregator,
            pending: HashMap::new(),
            version: 0,
            fallback: Rng::derive(seed, "kvoy/fallback", 0),
            refused: 0,
        })
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The aggregator's snapshot of the fleet.
    fn snapshot(&mut self, view: &View<'_>) -> Snapshot {
        self.version += 1;
        let endpoints = view
            .metrics
            .iter()
            .enumerate()
            .map(|(i, m)| EndpointStatus {
                slot: i as u16,
                address: address(i),
                models: vec![MODEL.to_owned()],
                ready: true,
                stale: false,
                waiting: m.waiting,
                running: m.running,
                kv_cache_usage: m.kv_cache_usage as f32,
                block_size: m.block_size,
                capacity_blocks: m.num_gpu_blocks,
                cached_blocks: [m.cached_blocks, 0, 0],
                // The simulated servers never drop their cache.
                cache_generation: 0,
                prefix_hit_rate: m.prefix_hit_rate.map(|r| r as f32),
                // The fleet simulation runs no aggregator estimator.
                prefill_tokens_per_s: None,
            })
            .collect();
        Snapshot {
            epoch: 1,
            version: self.version,
            endpoints,
        }
    }
}

impl Policy for Kvoy {
    fn pick(&mut self, request: &RouteRequest<'_>, view: &View<'_>) -> usize {
        match self
            .router
            .route_body(Api::Completions, request.body, view.inflight)
        {
            Ok(decision) => {
                if self.aggregator {
                    self.pending
                        .insert(request.id, self.router.last_keys().to_vec());
                }
                decision.endpoint.index()
            }
            Err(e) => {
                log::warn!("kvoy refused request {}: {e}", request.id);
                self.refused += 1;
                argmin_random(
                    view.inflight.iter().map(|&n| u64::from(n)),
                    &mut self.fallback,
                )
            }
        }
    }

    fn on_scrape(&mut self, view: &View<'_>, prefilled: &[Prefilled]) {
        if !self.aggregator {
            return;
        }
        let snapshot = self.snapshot(view);
        self.router.set_pool(live::live_pool(&snapshot, true));
        for p in prefilled {
            if let Some(keys) = self.pending.remove(&p.request) {
                self.router
                    .apply_remote(EndpointId(p.endpoint as u16), &keys);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::EndpointMetrics;
    use std::time::Duration;

    fn body(text: &str) -> Vec<u8> {
        serde_json::json!({"model": MODEL, "prompt": text})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn same_prefix_same_endpoint_and_loads_from_scrapes() {
        let mut p = Kvoy::new(4, 3, true).unwrap();
        let inflight = [0u32; 4];
        let mut metrics = [EndpointMetrics::default(); 4];
        let system = "abc ".repeat(500);
        let b = body(&format!("{system}first"));
        let view = View {
            now: Duration::ZERO,
            inflight: &inflight,
            metrics: &metrics,
        };
        let req = RouteRequest {
            id: 1,
            text: "",
            body: &b,
            prompt_tokens: 0,
        };
        let first = p.pick(&req, &view);
        let b2 = body(&format!("{system}second"));
        let req2 = RouteRequest {
            id: 2,
            text: "",
            body: &b2,
            prompt_tokens: 0,
        };
        assert_eq!(p.pick(&req2, &view), first);
        // The holder's queue grows past the others: the scrape makes the router see it.
        metrics[first].waiting = 50;
        metrics[first].kv_cache_usage = 0.95;
        let view = View {
            now: Duration::from_millis(50),
            inflight: &inflight,
            metrics: &metrics,
        };
        p.on_scrape(
            &view,
            &[Prefilled {
                endpoint: first,
                request: 1,
            }],
        );
        assert!(!p.pending.contains_key(&1));
        let load = p
            .router()
            .pool()
            .get(EndpointId(first as u16))
            .unwrap()
            .load;
        assert_eq!(load.waiting, Some(50));
        let b3 = body(&format!("{system}third"));
        let req3 = RouteRequest {
            id: 3,
            text: "",
            body: &b3,
            prompt_tokens: 0,
        };
        assert_ne!(p.pick(&req3, &view), first, "the hot-spot guard spills");
    }
}
