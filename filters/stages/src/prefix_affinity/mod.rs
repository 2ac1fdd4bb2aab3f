//! The prefix-affinity stage over [`kvoy_shared::prefix_affinity::Router`]: reads the OpenAI request, asks the
//! router for the pool endpoint most likely to hold its prompt prefix (weighed against load,
//! honouring a session pin for a healthy pool member) and writes
//! `x-gateway-destination-endpoint` for an `ORIGINAL_DST` cluster. Cross-worker state lives in
//! Envoy shared data (see [`kvoy_shared::shared_data`]): outstanding work per endpoint (requests,
//! and the prefill tokens of those whose answer has not begun, for the cost model) and a
//! bounded log of decisions that each worker replays into its own prefix index.
//!
//! Configuration: the JSON of [`kvoy_shared::prefix_affinity::PluginConfig`], e.g.
//! `{"endpoints":[{"address":"10.0.0.1:8000","models":["llama"]}]}`.

mod metrics;
mod pool;
mod relay;
mod stage;

use std::time::Duration;

use log::{info, warn};

use kvoy_filter_common::HostStore;
use kvoy_shared::prefix_affinity::{LogReplay, PluginConfig, Router};
use kvoy_shared::shared_data::{self, DecisionLog, Logged, OutstandingTable};
use kvoy_shared::{LogOnce, Outstanding};

pub use metrics::Metrics;
pub use stage::{
    request_body, BodyVerdict, HeadersVerdict, PrefixStage, DESTINATION_HEADER, PREFILLER_HEADER,
    SERVED_HEADER, USAGE_SAMPLE_EVERY,
};

/// Everything one VM keeps between requests.
pub struct PrefixVm {
    pub router: Router,
    pub outstanding: OutstandingTable,
    pub log: DecisionLog,
    pub metrics: Metrics,
    /// Scratch for the outstanding work read per request.
    pub counts: Vec<Outstanding>,
    /// The aggregator's pool, when configured.
    pub live: Option<pool::LivePool>,
    /// Decisions shared with the pool's other proxies through the aggregator (with `live`).
    pub relay: Option<relay::Relay>,
    /// Requests routed by their body; every [`USAGE_SAMPLE_EVERY`]th has its answer's
    /// `usage` read, to learn the model's bytes per token.
    pub scored: u64,
    /// Refused endpoints and requests already logged (each is logged once, counted always).
    pub logged: LogOnce,
}

/// How often a VM with a static pool wakes to replay other workers' decisions (a live pool's
/// VMs tick at the snapshot's period and replay then).
const CATCH_UP_TICK: Duration = Duration::from_millis(200);

impl PrefixVm {
    /// Checks the stage's JSON configuration and sets the VM up (`context_id`: the root
    /// context's, for this VM's random seed); the error says what is wrong. The VM should tick
    /// every [`PrefixVm::tick_period`].
    pub fn configure(raw: &[u8], context_id: u32) -> Result<PrefixVm, String> {
        let config = PluginConfig::from_json(raw).map_err(|e| e.to_string())?;
        // Shared-data keys are namespaced by the pool, not by the whole configuration: a new
        // configuration of the same pool keeps the outstanding work and the decision log (and
        // replays the log below); a new pool (other endpoints or order) starts apart.
        let namespace = shared_data::pool_namespace("kvoy.pa", &config);
        let seed = kvoy_filter_common::vm_seed(context_id);
        let endpoints = config.pool.id_bound();
        let metrics = Metrics::define();
        for r in &config.refused_endpoints {
            warn!(
                "kvoy_prefix_affinity: endpoint {} left out of the pool: {}",
                r.address, r.reason
            );
        }
        Metrics::add(
            metrics.endpoints_refused,
            config.refused_endpoints.len() as u64,
        );
        if config.aggregator.is_none() && !config.allowed_destinations.is_restricted() {
            info!(
                "kvoy_prefix_affinity: no allowed_destinations: the static endpoints are the pool"
            );
        }
        let live = config
            .aggregator
            .clone()
            .map(|a| pool::LivePool::new(a, &namespace, seed));
        if let Some(l) = &live {
            info!(
                "kvoy_prefix_affinity: live pool from the aggregator cluster {:?} every {} ms",
                l.snapshot.settings().cluster,
                l.snapshot.settings().poll_interval_ms
            );
        }
        let relay = live
            .as_ref()
            .filter(|l| l.snapshot.settings().relay_decisions)
            .map(|l| {
                let replicas = l.snapshot.settings().replicas();
                relay::Relay::new(&namespace, config.decision_log_slots, seed, replicas)
            });
        let mut log = DecisionLog::new(&namespace, config.decision_log_slots, seed);
        // Begin with the pool's recent decisions (a configuration change, a late worker), replayed
        // by the bounded catch-up of the first ticks and requests.
        log.start_with_history(&HostStore);
        info!(
            "kvoy_prefix_affinity: configured {endpoints} endpoints, block size {}, namespace {namespace}",
            config.block_size
        );
        Ok(PrefixVm {
            router: Router::new(config, seed),
            outstanding: OutstandingTable::new(&namespace),
            log,
            metrics,
            counts: Vec::with_capacity(endpoints),
            live,
            relay,
            scored: 0,
            logged: LogOnce::new(256),
        })
    }

    /// How often the VM should tick: every VM replays the other workers' decisions, follows the
    /// board of a live pool, and the lease holder polls the aggregator.
    pub fn tick_period(&self) -> Duration {
        let Some(live) = self.live.as_ref() else {
            return CATCH_UP_TICK;
        };
        let poll = live.snapshot.tick_period();
        // The VM that relays (the lease holder) sends its proxy's decisions every
        // `relay_flush_ms`; the others tick once per poll interval. The period changes as the
        // lease moves: the root asks again after each tick.
        if live.relaying {
            poll.min(Duration::from_millis(
                live.snapshot.settings().relay_flush_ms,
            ))
        } else {
            poll
        }
    }

    /// The tick: the live pool, then every decision the other workers logged since the last.
    pub fn on_tick(&mut self) {
        self.on_tick_with(true, || None);
    }

    /// [`PrefixVm::on_tick`], replaying the other workers' decisions only if `catch_up` (a VM
    /// that routes no requests, such as Envoy's main-thread VM, need not keep an index); a
    /// poll of the aggregator it starts reports `held` (the requests the proxy's admission
    /// stage holds, asked only then).
    pub fn on_tick_with(&mut self, catch_up: bool, held: impl FnOnce() -> Option<u64>) {
        // A relay-only tick between two whole ones leaves the catch-up to the next whole tick
        // (and to the requests, which catch up on their way).
        let whole = self.live.is_none() || pool::on_tick(self, held);
        if catch_up && whole {
            self.catch_up(usize::MAX);
        }
    }

    /// Whether the HTTP call `token` is this stage's aggregator poll.
    pub fn owns_call(&self, token: u32) -> bool {
        self.live.as_ref().is_some_and(|l| l.snapshot.owns(token))
            || self.relay.as_ref().is_some_and(|r| r.owns(token))
    }

    /// The answer to an HTTP call (the aggregator's snapshot, if `token` is this stage's poll).
    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        if self.relay.as_ref().is_some_and(|r| r.owns(token)) {
            pool::on_relay_response(self, token, num_headers, body_size);
            return;
        }
        let Some(l) = self.live.as_ref() else {
            return;
        };
        if !l.snapshot.owns(token) {
            return;
        }
        let limit = l.snapshot.settings().max_snapshot_bytes;
        let (status, body) = kvoy_filter_common::call_response(num_headers, body_size, limit);
        pool::on_poll_response(self, token, status, &body);
    }

    /// Replays other workers' decisions and the aggregator's confirmed removals into this VM's
    /// index, reading at most `max_slots` records of the shared log (see
    /// [`DecisionLog::poll_at_most_with`]).
    pub fn catch_up(&mut self, max_slots: usize) {
        self.replay(None, max_slots);
    }

    /// [`PrefixVm::catch_up`] up to a log head already read with the outstanding work, on a
    /// request's path: it stops at a removal (a walk of the endpoint's holdings), which the
    /// next tick applies.
    pub fn catch_up_to(&mut self, head: u64, max_slots: usize) {
        self.replay(Some(head), max_slots);
    }

    fn replay(&mut self, head: Option<u64>, max_slots: usize) {
        let on_request = head.is_some();
        let PrefixVm {
            router,
            log,
            metrics,
            ..
        } = self;
        let mut replay = LogReplay::default();
        let apply = |logged: Logged<'_>| match logged {
            // A removal or an offload walks the endpoint's holdings: on a request's path, leave
            // it to the tick.
            Logged::Removed(..) | Logged::Offloaded(..) if on_request => false,
            logged => {
                replay.apply(router, logged);
                true
            }
        };
        match head {
            Some(head) => log.poll_to_with(&HostStore, head, max_slots, apply),
            None => log.poll_at_most_with(&HostStore, max_slots, apply),
        };
        replay.finish(router);
        let (applied, removed) = (replay.routed, replay.removed_keys);
        if applied > 0 {
            Metrics::add(metrics.remote_applied, applied);
        }
        if removed > 0 {
            Metrics::add(metrics.removed_keys, removed);
        }
        if replay.offloaded_keys > 0 {
            Metrics::add(metrics.offloaded_keys, replay.offloaded_keys);
        }
    }
}

impl crate::root::StageVm for PrefixVm {
    const FILTER: &'static str = "kvoy_prefix_affinity";
    const REQUIRED: Option<&'static str> = Some("an endpoint list is required");
    const WITHOUT_TICKS: &'static str =
        "; idle workers catch up on requests only, and an aggregator is not polled";

    fn configure(raw: &[u8], context_id: u32) -> Result<PrefixVm, String> {
        PrefixVm::configure(raw, context_id)
    }

    fn tick_period(&self) -> Option<Duration> {
        Some(PrefixVm::tick_period(self))
    }

    fn on_tick(&mut self) {
        PrefixVm::on_tick(self);
    }

    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        PrefixVm::on_http_call_response(self, token, num_headers, body_size);
    }
}
