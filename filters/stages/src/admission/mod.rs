//! The admission stage ([`kvoy_shared::admission`]): admits requests at once while the pool has
//! room and otherwise holds them in priority bands with fair share between flows.
//!
//! At the request headers it classifies the request (objective -> priority, fairness id ->
//! flow), measures saturation (this proxy's in-flight requests, a shared-data counter, against
//! the per-endpoint limit) and asks the VM's [`FlowQueue`]: admit, hold, or reject (429 with
//! `x-kvoy-dropped-reason`). Held requests are released by the VM that holds them, in the
//! queue's order, when one of its requests completes and on every tick; those past the queue
//! TTL get 429 `ttl-expired`; a client that leaves while held is removed.
//!
//! Configuration: the JSON of [`kvoy_shared::admission::AdmissionFilterConfig`].

mod metrics;
mod stage;

use std::collections::HashSet;
use std::time::Duration;

use log::{info, warn};
use proxy_wasm::hostcalls;

use kvoy_filter_common::{now_ms, HostStore, LiveSnapshot, PollStart};
use kvoy_shared::admission::{
    AdmissionFilterConfig, AdmissionPolicy, HeldBoard, PoolState, Release, Room, RoomScratch,
    UnseenInflight, EXPIRED_REASON,
};
use kvoy_shared::shared_data::{self, InflightTable};
use kvoy_shared::snapshot_board::PoolChoice;
use kvoy_shared::EndpointId;

pub use metrics::Metrics;
pub use stage::{reject, reject_no_endpoint, AdmissionStage, Verdict, DROPPED_REASON_HEADER};

/// The slot of the in-flight table that counts every request of the proxy.
const ALL: EndpointId = EndpointId(0);
/// The slot of the in-flight table that counts the workers with an entry on the held board: a
/// worker that reads none but itself there (with the in-flight count it reads anyway) need not
/// read the board. A worker is counted before its entry appears and uncounted only once its
/// entry is gone, so a count of none means an empty board at the moment it was read.
const HOLDERS: EndpointId = EndpointId(1);

/// What one VM keeps between requests.
pub struct AdmissionVm {
    pub config: AdmissionFilterConfig,
    /// The decisions: this worker's held requests, what to admit, release and answer.
    pub policy: AdmissionPolicy,
    /// This proxy's requests in flight (admitted, not finished), across workers: one count
    /// (slot 0) of a shared in-flight table, the filter running before the endpoint is known;
    /// slot 1 counts the workers on the held board ([`HOLDERS`]).
    pub inflight: InflightTable,
    /// The table as the last [`AdmissionVm::room`] read it.
    counts: Vec<u32>,
    /// This worker is counted in [`HOLDERS`].
    holder: bool,
    /// Requests of this VM counted in flight (admitted or released), by context id.
    pub acquired: HashSet<u32>,
    pub metrics: Metrics,
    /// The highest priority each worker holds: strict priority across workers.
    pub held: HeldBoard,
    /// The aggregator's snapshot, when configured.
    pub live: Option<LiveSnapshot>,
    tick: Duration,
    room_scratch: RoomScratch,
    /// The snapshot's endpoints inside `allowed_destinations`, and the snapshot they are of.
    allowed: Vec<kvoy_shared::snapshot::EndpointStatus>,
    allowed_of: Option<(u64, u64)>,
    /// This proxy's requests in flight that the snapshot's queues do not show yet.
    unseen: UnseenInflight,
    release: Release,
}

impl AdmissionVm {
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
        let mut pool = PoolState::Static;
        if let Some(live) = self.live.as_mut() {
            live.refresh();
            if let PoolChoice::Live { with_loads } = live.choose(now_ms(), true) {
                // Only what the prefix-affinity filter may route to is capacity.
                let snapshot = live.snapshot();
                let endpoints = self.config.allowed_endpoints(
                    snapshot,
                    &mut self.allowed,
                    &mut self.allowed_of,
                );
                pool = PoolState::Live {
                    endpoints,
                    with_loads,
                    unseen: self.unseen.measure(snapshot.epoch, endpoints, total),
                };
            }
        }
        Room::measure(&self.config, pool, total, &mut self.room_scratch)
    }

    /// Releases what the capacity allows and expires what waited too long. Resuming a held
    /// request switches the effective context, which only its own VM may do: this runs on the
    /// VM's root context (tick) or at the end of one of its streams.
    pub fn release_held(&mut self) {
        self.release_held_with(&mut |_| true);
    }

    /// [`AdmissionVm::release_held`], calling `on_release(context)` for each request it
    /// releases, with that request's context made effective, before resuming it: the request is
    /// resumed only when `on_release` returns `true` (the combined filter routes it first, and
    /// lets its body callback continue it when the body is still arriving).
    pub fn release_held_with(&mut self, on_release: &mut dyn FnMut(u32) -> bool) {
        if self.policy.is_empty() {
            return;
        }
        let now = now_ms();
        let room = self.room();
        let mut release = std::mem::take(&mut self.release);
        // Counts read by `room` tell whether the held board need be read at all.
        let holders = self.holders_besides_me();
        let board = &mut self.held;
        self.policy.release(
            now,
            room,
            |top| holders && board.outranked(&HostStore, top, now),
            &mut release,
        );
        for context in release.no_endpoint.iter().filter_map(|&id| context_of(id)) {
            if hostcalls::set_effective_context(context).is_ok() {
                reject_no_endpoint(&self.metrics);
            }
        }
        for &(id, waited) in &release.resume {
            let Some(context) = context_of(id) else {
                continue;
            };
            self.acquire(context);
            if let Some(waited) = waited {
                kvoy_filter_common::record(self.metrics.wait_ms, waited);
            }
            kvoy_filter_common::add(self.metrics.released, 1);
            if hostcalls::set_effective_context(context).is_ok() && on_release(context) {
                if let Err(e) = hostcalls::resume_http_request() {
                    warn!("kvoy_admission: cannot resume request {context}: {e:?}");
                }
            }
        }
        for context in release.expired.iter().filter_map(|&id| context_of(id)) {
            if hostcalls::set_effective_context(context).is_ok() {
                reject(&self.metrics, EXPIRED_REASON);
            }
        }
        self.release = release;
        self.queue_changed();
    }

    /// Whether, as of the last [`AdmissionVm::room`], a worker other than this one is on the
    /// held board.
    pub(crate) fn holders_besides_me(&self) -> bool {
        let holders = self.counts.get(HOLDERS.index()).copied().unwrap_or(0);
        holders > u32::from(self.holder)
    }

    /// Publishes this worker's highest held band for the others (when it changed, and as a
    /// refresh while it holds requests).
    pub fn publish_held(&mut self, now: u64) {
        // The highest band, and every request this worker holds (the proxy's queue depth is
        // the board's sum).
        let queue = self.policy.queue();
        let held = u32::try_from(queue.len()).unwrap_or(u32::MAX);
        let top = queue.bands().next().map(|b| (b.priority, held));
        // Counted among the holders before the entry appears, uncounted once it is gone (see
        // HOLDERS); a count that cannot be changed leaves the others reading the board.
        if top.is_some() && !self.holder {
            match self.inflight.add(&HostStore, HOLDERS, 1) {
                Ok(()) => self.holder = true,
                Err(_) => kvoy_filter_common::add(self.metrics.shared_state_errors, 1),
            }
        }
        if self.held.publish(&HostStore, top, now).is_err() {
            kvoy_filter_common::add(self.metrics.shared_state_errors, 1);
            return;
        }
        if top.is_none() && self.holder {
            match self.inflight.add(&HostStore, HOLDERS, -1) {
                Ok(()) => self.holder = false,
                Err(_) => kvoy_filter_common::add(self.metrics.shared_state_errors, 1),
            }
        }
    }

    /// After every change to the queue: gauges, and the band published to the other workers.
    pub fn queue_changed(&mut self) {
        self.publish_held(now_ms());
        self.update_gauges();
    }

    pub fn update_gauges(&self) {
        let queue = self.policy.queue();
        self.metrics.queue_depth.set(queue.len() as u64);
        self.metrics.queue_bytes.set(queue.bytes());
        self.metrics.set_bands(queue.bands());
    }
}

impl AdmissionVm {
    /// Checks the stage's JSON configuration and sets the VM up (`context_id`: the root
    /// context's, for this VM's random seed); the error says what is wrong. The VM should tick
    /// every [`AdmissionVm::tick_period`].
    pub fn configure(raw: &[u8], context_id: u32) -> Result<AdmissionVm, String> {
        let config = AdmissionFilterConfig::from_json(raw).map_err(|e| e.to_string())?;
        let namespace = shared_data::namespace("kvoy.adm", raw);
        let live = config
            .aggregator
            .clone()
            .map(|a| LiveSnapshot::new(a, &namespace, kvoy_filter_common::vm_seed(context_id)));
        // Ticks release held requests (and poll the aggregator, at its own pace).
        let tick = live.as_ref().map_or(config.tick_ms, |l| {
            config.tick_ms.min(l.settings().poll_interval_ms)
        });
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
            kvoy_filter_common::vm_seed(context_id),
            (tick * 10).max(250),
        );
        Ok(AdmissionVm {
            policy: AdmissionPolicy::new(&config.flow),
            config,
            inflight: InflightTable::new(&namespace, 2),
            counts: Vec::with_capacity(2),
            holder: false,
            acquired: HashSet::new(),
            metrics,
            live,
            held,
            tick: Duration::from_millis(tick),
            room_scratch: RoomScratch::default(),
            allowed: Vec::new(),
            allowed_of: None,
            unseen: UnseenInflight::default(),
            release: Release::default(),
        })
    }

    /// How often the VM should tick (release held requests, poll the aggregator).
    pub fn tick_period(&self) -> Duration {
        self.tick
    }

    /// The tick: polls the aggregator (at its pace), releases what it can (see
    /// [`AdmissionVm::release_held_with`]) and refreshes the band published to other workers.
    pub fn on_tick(&mut self, on_release: &mut dyn FnMut(u32) -> bool) {
        if let Some(live) = self.live.as_mut() {
            let board = &mut self.held;
            let report = || Some(board.held_in_proxy(&HostStore, now_ms()));
            if live.poll_reporting(now_ms(), report) == PollStart::Failed {
                kvoy_filter_common::add(self.metrics.snapshot_poll_failures, 1);
            }
        }
        self.release_held_with(on_release);
        self.publish_held(now_ms());
    }

    /// Whether this stage polls the aggregator itself (its configuration has an `aggregator`
    /// section); its polls then report the admission queue.
    pub fn polls_aggregator(&self) -> bool {
        self.live.is_some()
    }

    /// The requests every worker of this proxy holds (the held board's sum; one shared-data
    /// read), for the aggregator's view of the admission queue.
    pub fn held_in_proxy(&mut self) -> u64 {
        self.held.held_in_proxy(&HostStore, now_ms())
    }

    /// Whether the HTTP call `token` is this stage's aggregator poll.
    pub fn owns_call(&self, token: u32) -> bool {
        self.live.as_ref().is_some_and(|l| l.owns(token))
    }

    /// The answer to an HTTP call (the aggregator's snapshot, if `token` is this stage's poll).
    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        if !live.owns(token) {
            return;
        }
        let limit = live.settings().max_snapshot_bytes;
        let (status, body) = kvoy_filter_common::call_response(num_headers, body_size, limit);
        match live.on_response(token, status, &body, now_ms()) {
            Some(Ok(())) => kvoy_filter_common::add(self.metrics.snapshot_polls, 1),
            Some(Err(e)) => {
                kvoy_filter_common::add(self.metrics.snapshot_poll_failures, 1);
                if e.is_rejected_input() {
                    kvoy_filter_common::add(self.metrics.snapshot_rejected, 1);
                }
            }
            None => {}
        }
    }
}

/// The context id a policy id stands for (the policy's ids are the contexts').
fn context_of(id: u64) -> Option<u32> {
    u32::try_from(id).ok()
}

/// The separate filter's answer to a release: every released request is resumed at once (the
/// filters after it route it).
pub fn resume_at_once(_context: u32) -> bool {
    true
}

impl crate::root::StageVm for AdmissionVm {
    const FILTER: &'static str = "kvoy_admission";
    const REQUIRED: Option<&'static str> = Some("`endpoints` is required");

    fn configure(raw: &[u8], context_id: u32) -> Result<AdmissionVm, String> {
        AdmissionVm::configure(raw, context_id)
    }

    fn tick_period(&self) -> Option<Duration> {
        Some(AdmissionVm::tick_period(self))
    }

    fn on_tick(&mut self) {
        AdmissionVm::on_tick(self, &mut resume_at_once);
    }

    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        AdmissionVm::on_http_call_response(self, token, num_headers, body_size);
    }
}
