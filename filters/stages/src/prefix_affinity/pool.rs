//! The live pool from kvoy-aggregator: the router's pool follows the snapshot
//! ([`LiveSnapshot`]) or the static endpoints, per [`kvoy_shared::snapshot_board::choose`].

use log::{debug, warn};

use kvoy_filter_common::{now_ms, CallBody, LiveSnapshot, PollStart};
use kvoy_shared::snapshot_board::{self, PoolChoice};
use kvoy_shared::AggregatorSettings;

use super::Metrics;
use super::PrefixVm as VmState;

/// Per-VM state of the live pool.
pub struct LivePool {
    pub snapshot: LiveSnapshot,
    /// What the router's pool was last built from.
    applied: Option<(PoolChoice, u64, u64)>,
}

impl LivePool {
    pub fn new(settings: AggregatorSettings, namespace: &str, owner: u64) -> Self {
        LivePool {
            snapshot: LiveSnapshot::new(settings, namespace, owner),
            applied: None,
        }
    }
}

/// Brings the router's pool in line with the board: a small read per call, a snapshot read
/// and a pool rebuild only when the version or the choice changed.
pub fn refresh(vm: &mut VmState, now_ms: u64) {
    let Some(live) = vm.live.as_mut() else {
        return;
    };
    live.snapshot.refresh();
    let choice = live
        .snapshot
        .choose(now_ms, vm.router.config().pool.is_empty());
    let snap = live.snapshot.snapshot();
    let key = (choice, snap.epoch, snap.version);
    if live.applied == Some(key) {
        return;
    }
    let pool = match choice {
        PoolChoice::Static => vm.router.config().pool.clone(),
        PoolChoice::Live { with_loads } => snapshot_board::live_pool(snap, with_loads),
    };
    debug!(
        "kvoy_prefix_affinity: pool {choice:?} epoch {} version {}: {} endpoints",
        snap.epoch,
        snap.version,
        pool.len()
    );
    live.applied = Some(key);
    let refused = vm.router.set_pool(pool);
    // No address the aggregator names leaves `allowed_destinations` (nor the index budget).
    for r in refused {
        if vm.logged.first(&("refused", r.address, r.reason)) {
            warn!(
                "kvoy_prefix_affinity: aggregator endpoint {} refused: {} (logged once, counted in kvoy_prefix_affinity_endpoints_refused_total)",
                r.address, r.reason
            );
        }
    }
    Metrics::add(vm.metrics.endpoints_refused, refused.len() as u64);
    Metrics::set(vm.metrics.pool_endpoints_refused, refused.len() as u64);
    Metrics::set(vm.metrics.pool_endpoints, vm.router.pool().len() as u64);
    Metrics::set(
        vm.metrics.pool_live,
        u64::from(matches!(choice, PoolChoice::Live { .. })),
    );
    Metrics::add(vm.metrics.pool_updates, 1);
}

/// On a tick: refresh, then poll if this VM holds the lease (reporting `held`, see
/// [`super::PrefixVm::on_tick_with`]).
pub fn on_tick(vm: &mut VmState, held: impl FnOnce() -> Option<u64>) {
    let now = now_ms();
    refresh(vm, now);
    let Some(live) = vm.live.as_mut() else {
        return;
    };
    match live.snapshot.poll_reporting(now, held) {
        PollStart::Failed => Metrics::add(vm.metrics.snapshot_poll_failures, 1),
        // The lease holder relays decisions on the ticks it polls.
        PollStart::Started => {
            if let Some(relay) = vm.relay.as_mut() {
                let settings = live.snapshot.settings();
                if let Some(sent) =
                    relay.exchange(&vm.router, settings, live.snapshot.authorization(), now)
                {
                    Metrics::add(vm.metrics.relay_sent, sent as u64);
                }
            }
        }
        PollStart::Skipped => {}
    }
}

/// The answer to a decision exchange: the other proxies' decisions into the log.
pub fn on_relay_response(vm: &mut VmState, num_headers: usize, body_size: usize) {
    let Some(relay) = vm.relay.as_mut() else {
        return;
    };
    let (status, body) =
        kvoy_filter_common::call_response(num_headers, body_size, super::relay::MAX_ANSWER_BYTES);
    match relay.on_response(status, &body, &vm.router) {
        Ok(done) => {
            Metrics::add(vm.metrics.relay_received, done.received as u64);
            Metrics::add(vm.metrics.relay_refused, done.refused as u64);
            Metrics::add(vm.metrics.relay_removals, done.removals as u64);
        }
        Err(e) => {
            debug!("decision relay: {e}");
            Metrics::add(vm.metrics.relay_failures, 1);
        }
    }
}

/// The answer to a poll: apply it, publish it, use it.
pub fn on_poll_response(vm: &mut VmState, token: u32, status: Option<u32>, body: &CallBody) {
    let now = now_ms();
    let Some(live) = vm.live.as_mut() else {
        return;
    };
    match live.snapshot.on_response(token, status, body, now) {
        None => return,
        Some(Ok(())) => Metrics::add(vm.metrics.snapshot_polls, 1),
        Some(Err(e)) => {
            Metrics::add(vm.metrics.snapshot_poll_failures, 1);
            if e.is_rejected_input() {
                Metrics::add(vm.metrics.snapshot_rejected, 1);
            }
        }
    }
    refresh(vm, now);
}
