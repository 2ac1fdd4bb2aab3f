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
    /// When the next whole tick is due (board, poll, lease, catch-up: once per poll interval);
    /// the ticks between them only relay.
    next_whole_ms: u64,
    /// This VM held the lease at its last whole tick: it relays, and ticks every flush.
    pub relaying: bool,
}

impl LivePool {
    pub fn new(settings: AggregatorSettings, namespace: &str, owner: u64) -> Self {
        LivePool {
            snapshot: LiveSnapshot::new(settings, namespace, owner),
            applied: None,
            next_whole_ms: 0,
            relaying: false,
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

/// On a tick: once per poll interval a whole tick (refresh, then poll if this VM holds the
/// lease, reporting `held`, see [`super::PrefixVm::on_tick_with`]); on every tick of the lease
/// holder, the relay. True when it was a whole tick.
pub fn on_tick(vm: &mut VmState, held: impl FnOnce() -> Option<u64>) -> bool {
    let now = now_ms();
    let whole = vm.live.as_ref().is_some_and(|l| now >= l.next_whole_ms);
    if whole {
        refresh(vm, now);
    }
    let Some(live) = vm.live.as_mut() else {
        return whole;
    };
    if whole {
        let interval = live.snapshot.settings().poll_interval_ms;
        // A tenth of slack: a tick a little early must not skip a whole interval.
        live.next_whole_ms = now.saturating_add(interval - interval / 10);
        match live.snapshot.poll_reporting(now, held) {
            PollStart::Failed => Metrics::add(vm.metrics.snapshot_poll_failures, 1),
            PollStart::Started | PollStart::Skipped => {}
        }
        live.relaying = vm.relay.is_some() && live.snapshot.holds_lease(now);
    }
    // The lease holder relays on every tick (every `relay_flush_ms`): a small read of the
    // decision log's head when there is nothing to send. The lease it renews on whole ticks
    // outlives three poll intervals.
    if live.relaying {
        if let Some(relay) = vm.relay.as_mut() {
            let settings = live.snapshot.settings();
            let auth = live.snapshot.authorization();
            let primary = live.snapshot.primary();
            if let Some(sent) = relay.tick(&vm.router, settings, auth, primary, now) {
                Metrics::add(vm.metrics.relay_sent, sent as u64);
            }
        }
    }
    whole
}

/// The answer to a decision exchange: the other proxies' decisions into the log.
pub fn on_relay_response(vm: &mut VmState, token: u32, num_headers: usize, body_size: usize) {
    let Some(relay) = vm.relay.as_mut() else {
        return;
    };
    let (status, body) =
        kvoy_filter_common::call_response(num_headers, body_size, super::relay::MAX_ANSWER_BYTES);
    match relay.on_response(token, status, &body, &vm.router) {
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
    // A replica that stopped answering the relay's long poll is left for the next at once,
    // not at the next failed snapshot poll: the other proxies' decisions keep arriving.
    if let (Some(failed), Some(live)) = (relay.take_failed(), vm.live.as_mut()) {
        live.snapshot.fail_over_from(failed);
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
