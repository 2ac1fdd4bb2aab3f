//! `kvoy_prefix_affinity`: a proxy-wasm HTTP filter that sends each OpenAI request to the pool
//! endpoint most likely to hold its prompt prefix in KV cache, weighed against load.
//!
//! A thin adapter over [`kvoy_shared::Router`]: it pauses at request headers (Envoy needs
//! `allow_on_headers_stop_iteration: true`), buffers the body, asks the router, and writes
//! `x-gateway-destination-endpoint` for an `ORIGINAL_DST` cluster. Cross-worker state lives in
//! Envoy shared data (see [`kvoy_shared::replica`]): outstanding work per endpoint (requests,
//! and the prefill tokens of those whose answer has not begun, for the cost model) and a
//! bounded log of decisions that each worker replays into its own prefix index.
//!
//! Plugin configuration: the JSON of [`kvoy_shared::PluginConfig`], e.g.
//! `{"endpoints":[{"address":"10.0.0.1:8000","models":["llama"]}]}`.

mod live;
mod metrics;
mod stream;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use kvoy_shared::replica::{self, DecisionLog, OutstandingTable};
use kvoy_shared::{LogOnce, Outstanding, PluginConfig, Router};

use crate::metrics::Metrics;
use crate::stream::RequestStream;
use kvoy_filter_common::HostStore;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(PrefixAffinityRoot { context_id, state: Rc::new(RefCell::new(None)) })
    });
}}

/// Everything one VM keeps between requests.
pub(crate) struct VmState {
    pub router: Router,
    pub outstanding: OutstandingTable,
    pub log: DecisionLog,
    pub metrics: Metrics,
    /// Scratch for the outstanding work read per request.
    pub counts: Vec<Outstanding>,
    /// The aggregator's pool, when configured.
    pub live: Option<live::LivePool>,
    /// Requests routed by their body; every [`stream::USAGE_SAMPLE_EVERY`]th has its answer's
    /// `usage` read, to learn the model's bytes per token.
    pub scored: u64,
    /// Refused endpoints and requests already logged (each is logged once, counted always).
    pub logged: LogOnce,
}

pub(crate) type SharedState = Rc<RefCell<Option<VmState>>>;

/// How often a VM with a static pool wakes to replay other workers' decisions (a live pool's
/// VMs tick at the snapshot's period and replay then).
const CATCH_UP_TICK: Duration = Duration::from_millis(200);

impl VmState {
    /// Replays other workers' decisions into this VM's index, reading at most `max_slots`
    /// records of the shared log (see [`DecisionLog::poll_at_most`]).
    pub(crate) fn catch_up(&mut self, max_slots: usize) {
        let VmState {
            router,
            log,
            metrics,
            ..
        } = self;
        let applied = log.poll_at_most(&HostStore, max_slots, |endpoint, keys| {
            router.apply_remote(endpoint, keys)
        });
        if applied > 0 {
            Metrics::add(metrics.remote_applied, applied as u64);
        }
    }
}

struct PrefixAffinityRoot {
    context_id: u32,
    state: SharedState,
}

impl Context for PrefixAffinityRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            let limit = vm
                .live
                .as_ref()
                .map_or(0, |l| l.snapshot.settings().max_snapshot_bytes);
            let (status, body) = kvoy_filter_common::call_response(num_headers, body_size, limit);
            live::on_poll_response(vm, token_id, status, &body);
        }
    }
}

impl RootContext for PrefixAffinityRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(raw) = self.get_plugin_configuration() else {
            error!("kvoy_prefix_affinity: no plugin configuration; an endpoint list is required");
            return false;
        };
        let config = match PluginConfig::from_json(&raw) {
            Ok(c) => c,
            Err(e) => {
                error!("kvoy_prefix_affinity: bad configuration: {e}");
                return false;
            }
        };
        // Shared-data keys are namespaced by the configuration, so that a new configuration
        // (new endpoint order) never reads the previous one's counters.
        let namespace = replica::namespace("kvoy.pa", &raw);
        let seed = kvoy_filter_common::vm_seed(self.context_id);
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
            .map(|a| live::LivePool::new(a, &namespace, seed));
        // Every VM ticks: each replays the other workers' decisions, follows the board of a
        // live pool, and the lease holder polls the aggregator.
        let tick = live
            .as_ref()
            .map_or(CATCH_UP_TICK, |l| l.snapshot.tick_period());
        if hostcalls::set_tick_period(tick).is_err() {
            error!("kvoy_prefix_affinity: cannot set the tick period; idle workers catch up on requests only, and an aggregator is not polled");
        }
        if let Some(l) = &live {
            info!(
                "kvoy_prefix_affinity: live pool from the aggregator cluster {:?} every {} ms",
                l.snapshot.settings().cluster,
                l.snapshot.settings().poll_interval_ms
            );
        }
        let mut log = DecisionLog::new(&namespace, config.decision_log_slots, seed);
        log.start_at_head(&HostStore);
        info!(
            "kvoy_prefix_affinity: configured {endpoints} endpoints, block size {}, namespace {namespace}",
            config.block_size
        );
        *self.state.borrow_mut() = Some(VmState {
            router: Router::new(config, seed),
            outstanding: OutstandingTable::new(&namespace),
            log,
            metrics,
            counts: Vec::with_capacity(endpoints),
            live,
            scored: 0,
            logged: LogOnce::new(256),
        });
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            if vm.live.is_some() {
                live::on_tick(vm);
            }
            vm.catch_up(usize::MAX);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(RequestStream::new(self.state.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
