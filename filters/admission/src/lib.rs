//! `kvoy_admission`: a proxy-wasm HTTP filter, between `kvoy_session` and
//! `kvoy_prefix_affinity`, that admits requests at once while the pool has room and otherwise
//! holds them in priority bands with fair share between flows ([`kvoy_shared::flow`]).
//!
//! At the request headers it classifies the request (objective -> priority, fairness id ->
//! flow), measures saturation (this proxy's in-flight requests, a shared-data counter, against
//! the per-endpoint limit) and asks the VM's [`FlowQueue`]: admit (continue), queue (pause, also
//! at the body callbacks), or reject (429 with `x-kvoy-dropped-reason`). Held requests are
//! released by the VM that holds them, in the queue's order, when one of its requests
//! completes and on every tick; those past the queue TTL get 429 `ttl-expired`; a client that
//! leaves while held is removed.
//!
//! Plugin configuration: the JSON of [`kvoy_shared::flow::AdmissionFilterConfig`].

mod metrics;
mod stream;

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;
use std::time::Duration;

use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use kvoy_filter_common::{now_ms, HostStore, LiveSnapshot, PollStart};
use kvoy_shared::flow::{
    saturation, saturation_from_inflight, AdmissionFilterConfig, FlowQueue, HeldBoard,
    EXPIRED_REASON,
};
use kvoy_shared::live::PoolChoice;
use kvoy_shared::replica::{self, InflightTable};
use kvoy_shared::EndpointId;

/// The slot of the in-flight table that counts every request of the proxy.
const ALL: EndpointId = EndpointId(0);

use crate::metrics::Metrics;
use crate::stream::{reject, reject_no_endpoint, AdmissionStream};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(AdmissionRoot { context_id, state: Rc::new(RefCell::new(None)) })
    });
}}

/// What one VM keeps between requests.
pub(crate) struct VmState {
    pub config: AdmissionFilterConfig,
    pub queue: FlowQueue,
    /// This proxy's requests in flight (admitted, not finished), across workers: one count
    /// (slot 0) of a shared in-flight table, the filter running before the endpoint is known.
    pub inflight: InflightTable,
    counts: Vec<u32>,
    /// Requests of this VM counted in flight (admitted or released), by context id.
    pub acquired: HashSet<u32>,
    /// When each held request was queued, for the wait histogram.
    pub queued_at: std::collections::HashMap<u32, u64>,
    pub metrics: Metrics,
    /// The highest priority each worker holds: strict priority across workers.
    pub held: HeldBoard,
    /// The aggregator's snapshot, when configured.
    pub live: Option<LiveSnapshot>,
    scratch: Vec<u32>,
    slots: Vec<u16>,
    /// The snapshot's endpoints inside `allowed_destinations`, and the snapshot they are of.
    allowed: Vec<kvoy_shared::snapshot::EndpointStatus>,
    allowed_of: Option<(u64, u64)>,
    released: Vec<u64>,
    expired: Vec<u64>,
}

/// What the pool has room for, at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Room {
    /// The pool's saturation and how many held requests may be released into it.
    Pool { saturated: bool, capacity: u32 },
    /// The aggregator's pool is empty: answer 503.
    NoEndpoint,
}

pub(crate) type SharedState = Rc<RefCell<Option<VmState>>>;

impl VmState {
    /// Counts `context` in flight.
    pub fn acquire(&mut self, context: u32) {
        if !self.acquired.insert(context) {
            return;
        }
        self.metrics.inflight.add(1);
        if self.inflight.add(&HostStore, ALL, 1).is_err() {
            kvoy_filter_common::add(self.metrics.shared_state_errors, 1);
        }
    }

    /// Releases `context`'s in-flight count, if it had one.
    pub fn release_inflight(&mut self, context: u32) {
        if !self.acquired.remove(&context) {
            return;
        }
        self.metrics.inflight.add(-1);
        if self.inflight.add(&HostStore, ALL, -1).is_err() {
            kvoy_filter_common::add(self.metrics.shared_state_errors, 1);
        }
    }

    /// Whether the pool is saturated now, and how many held requests may go: from the
    /// aggregator's snapshot (servers' queues and KV use, stale = saturated) when it is fresh,
    /// with this proxy's in-flight count against the per-endpoint limit; from the in-flight
    /// count alone otherwise. A live pool with no endpoint at all is [`Room::NoEndpoint`].
    pub fn room(&mut self) -> Room {
        self.inflight.read(&HostStore, &mut self.counts);
        let total = self.counts.first().copied().unwrap_or(0);
        if let Some(live) = self.live.as_mut() {
            live.refresh();
            if let PoolChoice::Live { with_loads } = live.choose(now_ms(), true) {
                // Only what the prefix-affinity filter may route to is capacity.
                let endpoints = self.config.allowed_endpoints(
                    live.snapshot(),
                    &mut self.allowed,
                    &mut self.allowed_of,
                );
                if endpoints.is_empty() {
                    return Room::NoEndpoint;
                }
                if with_loads {
                    self.slots.clear();
                    self.slots.extend(endpoints.iter().map(|e| e.slot));
                    AdmissionFilterConfig::spread_by_slot(total, &self.slots, &mut self.scratch);
                    let sat = saturation(&self.config.flow, endpoints, &self.scratch, None);
                    return Room::Pool {
                        saturated: sat.saturated,
                        capacity: sat.release_capacity(),
                    };
                }
            }
        }
        self.config.spread(total, &mut self.scratch);
        let sat = saturation_from_inflight(&self.config.flow, &self.scratch, None);
        Room::Pool {
            saturated: sat.saturated,
            capacity: sat.release_capacity(),
        }
    }

    /// Releases what the capacity allows and expires what waited too long. Resuming a held
    /// request switches the effective context, which only its own VM may do: this runs on the
    /// VM's root context (tick) or at the end of one of its streams.
    pub fn release_held(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        let now = now_ms();
        let room = self.room();
        // No endpoint: every held request is answered 503 (it would only wait for its TTL).
        let capacity = match room {
            // Another worker holds a higher band: it releases first, at its next tick.
            Room::Pool { .. } if self.outranked_by_others(now) => 0,
            Room::Pool { capacity, .. } => capacity,
            Room::NoEndpoint => u32::MAX,
        };
        let mut released = std::mem::take(&mut self.released);
        let mut expired = std::mem::take(&mut self.expired);
        released.clear();
        expired.clear();
        self.queue
            .release(now, capacity, &mut released, &mut expired);
        for &id in &released {
            let Ok(context) = u32::try_from(id) else {
                continue;
            };
            if room == Room::NoEndpoint {
                self.queued_at.remove(&context);
                if hostcalls::set_effective_context(context).is_ok() {
                    reject_no_endpoint(&self.metrics);
                }
                continue;
            }
            self.acquire(context);
            if let Some(at) = self.queued_at.remove(&context) {
                kvoy_filter_common::record(self.metrics.wait_ms, now.saturating_sub(at));
            }
            kvoy_filter_common::add(self.metrics.released, 1);
            if hostcalls::set_effective_context(context).is_ok() {
                if let Err(e) = hostcalls::resume_http_request() {
                    warn!("kvoy_admission: cannot resume request {context}: {e:?}");
                }
            }
        }
        for &id in &expired {
            let Ok(context) = u32::try_from(id) else {
                continue;
            };
            self.queued_at.remove(&context);
            if hostcalls::set_effective_context(context).is_ok() {
                reject(&self.metrics, EXPIRED_REASON);
            }
        }
        self.released = released;
        self.expired = expired;
        self.queue_changed();
    }

    /// Whether another worker holds a request of a higher band than this one's highest.
    fn outranked_by_others(&mut self, now: u64) -> bool {
        match self.queue.highest_waiting_priority() {
            Some(top) => self.held.outranked(&HostStore, top, now),
            None => false,
        }
    }

    /// Publishes this worker's highest held band for the others (when it changed, and as a
    /// refresh while it holds requests).
    pub fn publish_held(&mut self, now: u64) {
        let top = self
            .queue
            .bands()
            .next()
            .map(|b| (b.priority, u32::try_from(b.requests).unwrap_or(u32::MAX)));
        if self.held.publish(&HostStore, top, now).is_err() {
            kvoy_filter_common::add(self.metrics.shared_state_errors, 1);
        }
    }

    /// After every change to the queue: gauges, and the band published to the other workers.
    pub fn queue_changed(&mut self) {
        self.publish_held(now_ms());
        self.update_gauges();
    }

    pub fn update_gauges(&self) {
        self.metrics.queue_depth.set(self.queue.len() as u64);
        self.metrics.queue_bytes.set(self.queue.bytes());
        self.metrics.set_bands(self.queue.bands());
    }
}

struct AdmissionRoot {
    context_id: u32,
    state: SharedState,
}

impl Context for AdmissionRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            if let Some(live) = vm.live.as_mut() {
                let limit = live.settings().max_snapshot_bytes;
                let (status, body) =
                    kvoy_filter_common::call_response(num_headers, body_size, limit);
                match live.on_response(token_id, status, &body, now_ms()) {
                    Some(Ok(())) => kvoy_filter_common::add(vm.metrics.snapshot_polls, 1),
                    Some(Err(e)) => {
                        kvoy_filter_common::add(vm.metrics.snapshot_poll_failures, 1);
                        if e.is_rejected_input() {
                            kvoy_filter_common::add(vm.metrics.snapshot_rejected, 1);
                        }
                    }
                    None => {}
                }
            }
        }
    }
}

impl RootContext for AdmissionRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(raw) = self.get_plugin_configuration() else {
            error!("kvoy_admission: no plugin configuration; `endpoints` is required");
            return false;
        };
        let config = match AdmissionFilterConfig::from_json(&raw) {
            Ok(c) => c,
            Err(e) => {
                error!("kvoy_admission: bad configuration: {e}");
                return false;
            }
        };
        let namespace = replica::namespace("kvoy.adm", &raw);
        let live = config.aggregator.clone().map(|a| {
            LiveSnapshot::new(a, &namespace, kvoy_filter_common::vm_seed(self.context_id))
        });
        // Ticks release held requests (and poll the aggregator, at its own pace).
        let tick = live.as_ref().map_or(config.tick_ms, |l| {
            config.tick_ms.min(l.settings().poll_interval_ms)
        });
        if hostcalls::set_tick_period(Duration::from_millis(tick)).is_err() {
            error!("kvoy_admission: cannot set the tick period");
        }
        info!(
            "kvoy_admission: {} endpoints, limit {:?} per endpoint, TTL {} ms",
            config.endpoints,
            config.flow.saturation.max_inflight_per_endpoint,
            config.flow.queue_ttl_ms
        );
        let metrics = Metrics::define(&config.flow);
        // A worker that stopped refreshing its entry (it refreshes every tick while it holds
        // requests) blocks no one for long.
        let held = HeldBoard::new(
            &namespace,
            kvoy_filter_common::vm_seed(self.context_id),
            (tick * 10).max(250),
        );
        *self.state.borrow_mut() = Some(VmState {
            queue: FlowQueue::new(&config.flow),
            config,
            inflight: InflightTable::new(&namespace, 1),
            counts: Vec::with_capacity(1),
            acquired: HashSet::new(),
            queued_at: std::collections::HashMap::new(),
            metrics,
            live,
            held,
            scratch: Vec::new(),
            slots: Vec::new(),
            allowed: Vec::new(),
            allowed_of: None,
            released: Vec::new(),
            expired: Vec::new(),
        });
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            if let Some(live) = vm.live.as_mut() {
                if live.poll(now_ms()) == PollStart::Failed {
                    kvoy_filter_common::add(vm.metrics.snapshot_poll_failures, 1);
                }
            }
            vm.release_held();
            vm.publish_held(now_ms());
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(AdmissionStream::new(
            self.state.clone(),
            context_id,
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
