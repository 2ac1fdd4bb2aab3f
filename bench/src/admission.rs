//! The admission stage in front of a policy, for plans with a sheddable band
//! (`kvoy-bench sim --sheddable SHARE`): what each router does with a request before it picks
//! an endpoint, when the pool is saturated.
//!
//! - [`KvoyGate`]: kvoy's own stage ([`kvoy_shared::admission::AdmissionPolicy`], the code the
//!   filter runs) with its defaults: strict priority between bands, a sheddable request
//!   refused (429) from a pool level of `sheddable_level` (0.5), counting what the proxy
//!   admitted since the last scrape (or held, with `queue_sheddable`), an interactive one
//!   held while the pool is saturated (level 1.0), released on the filter's 20 ms tick and on
//!   every completion. The pool's level is what the filter reads from kvoy-aggregator's
//!   snapshot: the servers' waiting queues and KV use, as last scraped.
//! - [`LlmdLegacyGate`]: llm-d's default with the flow-control feature gate off (the default):
//!   the `LegacyAdmissionController` refuses a sheddable request (priority < 0) when the
//!   saturation detector's pool level is at least 1.0, and lets every other request through
//!   (llm-d/llm-d-router at ebab687, `cmd/epp/runner/runner.go` `initAdmissionControl` and
//!   `pkg/epp/requestcontrol/admission.go` `rejectIfSheddableAndSaturated`). The level is the
//!   utilization detector's: the mean over endpoints of max(waiting / 5, KV use / 0.8)
//!   (`pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization/config.go`,
//!   defaults `DefaultQueueDepthThreshold` 5 and `DefaultKVCacheUtilThreshold` 0.8).
//! - No gate: the routers without priority bands (Dynamo's KV router, SGLang's router and
//!   the cache-blind baselines) send everything.
//!
//! Both gates read the same scrape (every 50 ms), so they differ only in what they do with it.

use std::net::SocketAddr;
use std::time::Duration;

use kvoy_shared::admission::{
    classify, AdmissionConfig, AdmissionFilterConfig, AdmissionPolicy, Arrival, PoolState, Release,
    Room, RoomScratch, SaturationThresholds, UnseenInflight,
};
use kvoy_shared::snapshot::EndpointStatus;

use crate::policy::{EndpointMetrics, PolicyKind, View};

/// The objective names the simulated requests carry.
pub const INTERACTIVE: &str = "interactive";
pub const SHEDDABLE: &str = "sheddable";

/// What a gate does with an arriving request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gated {
    /// Route it now.
    Admit,
    /// Hold it until a release names it.
    Held,
    /// Refuse it (429).
    Shed,
}

/// An admission stage. Ids are request ids; time is virtual.
pub trait Gate {
    /// Request `id` (sheddable or not) arrives; `view` is the proxy's last scrape.
    fn arrive(&mut self, id: u64, sheddable: bool, view: &View<'_>) -> Gated;

    /// Lets go what the pool has room for at `view.now`: the ids to route now into `resume`,
    /// those that waited too long (429) into `expired` (both cleared first).
    fn release(&mut self, view: &View<'_>, resume: &mut Vec<u64>, expired: &mut Vec<u64>);

    /// How often held requests are looked at, besides completions.
    fn tick(&self) -> Duration;

    /// Whether anything is held.
    fn holds_any(&self) -> bool;
}

/// The gate `policy` runs by default, `None` for a router without priority bands. `kvoy_flow`:
/// fields set over kvoy's `flow` configuration (`--kvoy-flow`).
pub fn for_policy(
    policy: PolicyKind,
    replicas: usize,
    kvoy_flow: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<Box<dyn Gate>>, String> {
    Ok(match policy {
        PolicyKind::Kvoy | PolicyKind::KvoyAggregator | PolicyKind::KvoyWeighted => {
            Some(Box::new(KvoyGate::new(replicas, kvoy_flow)?))
        }
        PolicyKind::LlmD | PolicyKind::LlmD1 | PolicyKind::LlmD1Calibrated | PolicyKind::LlmDPd => {
            Some(Box::new(LlmdLegacyGate::default()))
        }
        PolicyKind::RoundRobin
        | PolicyKind::LeastRequest
        | PolicyKind::Random
        | PolicyKind::Sglang
        | PolicyKind::Dynamo
        | PolicyKind::DynamoPd => None,
    })
}

/// The endpoints as the aggregator's snapshot carries them, from a scrape.
fn statuses(metrics: &[EndpointMetrics], out: &mut Vec<EndpointStatus>) {
    out.clear();
    out.extend(metrics.iter().enumerate().map(|(i, m)| EndpointStatus {
        slot: i as u16,
        address: SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 8000)),
        models: Vec::new(),
        ready: true,
        stale: false,
        waiting: m.waiting,
        running: m.running,
        kv_cache_usage: m.kv_cache_usage as f32,
        block_size: m.block_size,
        capacity_blocks: m.num_gpu_blocks,
        cached_blocks: [m.cached_blocks, 0, 0],
        cache_generation: 0,
        prefix_hit_rate: None,
        prefill_tokens_per_s: None,
        role: kvoy_shared::Role::Decode,
    }));
}

/// kvoy's admission stage, as one filter worker runs it.
pub struct KvoyGate {
    config: AdmissionFilterConfig,
    policy: AdmissionPolicy,
    scratch: RoomScratch,
    endpoints: Vec<EndpointStatus>,
    unseen: UnseenInflight,
    release: Release,
}

impl KvoyGate {
    /// The filter's configuration for `replicas` endpoints, with the two objectives and the
    /// `flow` fields of `overrides` set over its defaults (checked as the filter checks them).
    pub fn new(
        replicas: usize,
        overrides: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, String> {
        let mut flow = serde_json::Map::new();
        flow.insert(
            "objectives".to_owned(),
            serde_json::json!({ INTERACTIVE: 0, SHEDDABLE: -1 }),
        );
        for (k, v) in overrides {
            flow.insert(k.clone(), v.clone());
        }
        let raw = serde_json::json!({ "endpoints": replicas, "flow": flow });
        let config = AdmissionFilterConfig::from_json(raw.to_string().as_bytes())
            .map_err(|e| format!("kvoy's admission configuration: {e}"))?;
        Ok(KvoyGate {
            policy: AdmissionPolicy::new(&config.flow),
            config,
            scratch: RoomScratch::default(),
            endpoints: Vec::new(),
            unseen: UnseenInflight::default(),
            release: Release::default(),
        })
    }

    fn room(&mut self, view: &View<'_>) -> Room {
        statuses(view.metrics, &mut self.endpoints);
        let inflight: u32 = view.inflight.iter().sum();
        Room::measure(
            &self.config,
            PoolState::Live {
                endpoints: &self.endpoints,
                with_loads: true,
                unseen: self.unseen.measure(0, &self.endpoints, inflight),
            },
            inflight,
            &mut self.scratch,
        )
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Gate for KvoyGate {
    fn arrive(&mut self, id: u64, sheddable: bool, view: &View<'_>) -> Gated {
        let room = self.room(view);
        let objective = if sheddable { SHEDDABLE } else { INTERACTIVE };
        let class = classify(&self.config.flow, Some(objective), None, None);
        let now = millis(view.now);
        // One worker: no other holds a higher band.
        match self
            .policy
            .arrive(id, &class, room, &mut || now, |_, _| false)
        {
            Arrival::Admit => Gated::Admit,
            Arrival::Queued => Gated::Held,
            Arrival::Reject(_) | Arrival::NoEndpoint => Gated::Shed,
        }
    }

    fn release(&mut self, view: &View<'_>, resume: &mut Vec<u64>, expired: &mut Vec<u64>) {
        resume.clear();
        expired.clear();
        if self.policy.is_empty() {
            return;
        }
        let room = self.room(view);
        self.policy
            .release(millis(view.now), room, |_| false, &mut self.release);
        resume.extend(self.release.resume.iter().map(|&(id, _)| id));
        expired.extend(&self.release.expired);
        expired.extend(&self.release.no_endpoint);
    }

    fn tick(&self) -> Duration {
        Duration::from_millis(self.config.tick_ms)
    }

    fn holds_any(&self) -> bool {
        !self.policy.is_empty()
    }
}

/// llm-d's legacy admission controller (see the module docs).
#[derive(Debug)]
pub struct LlmdLegacyGate {
    thresholds: SaturationThresholds,
    endpoints: Vec<EndpointStatus>,
}

impl Default for LlmdLegacyGate {
    fn default() -> Self {
        LlmdLegacyGate {
            // waiting 5, KV 0.8: the utilization detector's defaults, as kvoy's
            thresholds: AdmissionConfig::default().saturation,
            endpoints: Vec::new(),
        }
    }
}

impl Gate for LlmdLegacyGate {
    fn arrive(&mut self, _id: u64, sheddable: bool, view: &View<'_>) -> Gated {
        if !sheddable {
            return Gated::Admit;
        }
        statuses(view.metrics, &mut self.endpoints);
        if kvoy_shared::admission::pool_level(&self.thresholds, &self.endpoints) >= 1.0 {
            Gated::Shed
        } else {
            Gated::Admit
        }
    }

    fn release(&mut self, _view: &View<'_>, resume: &mut Vec<u64>, expired: &mut Vec<u64>) {
        resume.clear();
        expired.clear();
    }

    fn tick(&self) -> Duration {
        Duration::from_millis(20)
    }

    fn holds_any(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(waiting: u32, kv: f64) -> EndpointMetrics {
        EndpointMetrics {
            waiting,
            kv_cache_usage: kv,
            num_gpu_blocks: 1000,
            block_size: 16,
            ..EndpointMetrics::default()
        }
    }

    fn view<'a>(ms: u64, inflight: &'a [u32], m: &'a [EndpointMetrics]) -> View<'a> {
        View {
            now: Duration::from_millis(ms),
            inflight,
            metrics: m,
        }
    }

    #[test]
    fn llmd_sheds_only_sheddable_requests_at_a_level_of_one() {
        let mut g = LlmdLegacyGate::default();
        let inflight = [0, 0];
        // level (1.0 + 0.5) / 2 = 0.75: room
        let m = [metrics(5, 0.0), metrics(0, 0.4)];
        assert_eq!(g.arrive(1, true, &view(0, &inflight, &m)), Gated::Admit);
        // level (1.0 + 1.0) / 2 = 1.0: saturated (at the thresholds exactly)
        let m = [metrics(5, 0.0), metrics(0, 0.8)];
        assert_eq!(g.arrive(2, true, &view(0, &inflight, &m)), Gated::Shed);
        assert_eq!(g.arrive(3, false, &view(0, &inflight, &m)), Gated::Admit);
        assert!(!g.holds_any());
    }

    #[test]
    fn kvoy_holds_interactive_sheds_sheddable_and_releases_when_there_is_room() {
        let mut g = KvoyGate::new(2, &serde_json::Map::new()).unwrap();
        let inflight = [3, 3];
        let idle = [metrics(0, 0.1), metrics(0, 0.1)];
        let full = [metrics(8, 0.9), metrics(6, 0.5)];
        assert_eq!(g.arrive(1, true, &view(0, &inflight, &idle)), Gated::Admit);
        assert_eq!(g.arrive(2, false, &view(0, &inflight, &idle)), Gated::Admit);
        assert_eq!(g.arrive(3, true, &view(5, &inflight, &full)), Gated::Shed);
        assert_eq!(g.arrive(4, false, &view(5, &inflight, &full)), Gated::Held);
        assert_eq!(g.arrive(5, false, &view(6, &inflight, &full)), Gated::Held);
        assert!(g.holds_any());
        let (mut resume, mut expired) = (Vec::new(), Vec::new());
        g.release(&view(20, &inflight, &full), &mut resume, &mut expired);
        assert_eq!((resume.len(), expired.len()), (0, 0));
        g.release(&view(40, &inflight, &idle), &mut resume, &mut expired);
        assert_eq!(resume, vec![4, 5]);
        assert!(expired.is_empty() && !g.holds_any());
    }

    #[test]
    fn kvoy_sheds_sheddable_requests_from_half_the_saturation_level() {
        let mut g = KvoyGate::new(2, &serde_json::Map::new()).unwrap();
        // level 3/5 = 0.6: sheddable refused, interactive admitted
        let busy = [metrics(3, 0.0), metrics(3, 0.0)];
        assert_eq!(g.arrive(1, true, &view(0, &[0, 0], &busy)), Gated::Shed);
        assert_eq!(g.arrive(2, false, &view(0, &[0, 0], &busy)), Gated::Admit);
        // level 0.4: admitted; one more in flight on the same figures counts 1 / (5 x 2)
        let fair = [metrics(2, 0.0), metrics(2, 0.0)];
        assert_eq!(g.arrive(3, true, &view(50, &[1, 0], &fair)), Gated::Admit);
        assert_eq!(g.arrive(4, true, &view(51, &[1, 1], &fair)), Gated::Shed);
        // the next scrape shows it: the count starts again
        let next = [metrics(2, 0.0), metrics(1, 0.0)];
        assert_eq!(g.arrive(5, true, &view(100, &[1, 1], &next)), Gated::Admit);
    }

    #[test]
    fn kvoy_queues_sheddable_requests_when_asked_and_expires_them_after_the_ttl() {
        let flow = serde_json::json!({"queue_sheddable": true, "queue_ttl_ms": 100});
        let mut g = KvoyGate::new(1, flow.as_object().unwrap()).unwrap();
        let inflight = [1];
        let full = [metrics(9, 0.2)];
        assert_eq!(g.arrive(7, true, &view(0, &inflight, &full)), Gated::Held);
        let (mut resume, mut expired) = (Vec::new(), Vec::new());
        g.release(&view(150, &inflight, &full), &mut resume, &mut expired);
        assert_eq!((resume, expired), (vec![], vec![7]));
        let bad = serde_json::json!({"queue_ttl": 5});
        let err = KvoyGate::new(1, bad.as_object().unwrap()).err().unwrap();
        assert!(err.contains("queue_ttl"), "{err}");
    }
}
