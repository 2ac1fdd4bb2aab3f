//! The live pool from kvoy-aggregator (see [`kvoy_shared::live`]): every VM follows the
//! snapshot on the shared-data board; the VM holding the lease polls the aggregator from its
//! root context's tick.

use std::time::Duration;

use log::{debug, warn};
use proxy_wasm::hostcalls;

use kvoy_shared::live::{self, PollError, PoolChoice, SnapshotBoard};
use kvoy_shared::snapshot::Snapshot;
use kvoy_shared::AggregatorSettings;

use crate::metrics::Metrics;
use crate::VmState;
use kvoy_filter_common::{now_ms, HostStore};

/// Per-VM state of the live pool.
pub(crate) struct LivePool {
    pub settings: AggregatorSettings,
    board: SnapshotBoard,
    /// The latest snapshot this VM knows (epoch 0: none yet).
    snapshot: Snapshot,
    /// What the router's pool was last built from.
    applied: Option<(PoolChoice, u64, u64)>,
    /// The poll in flight, with when it started.
    poll: Option<(u32, u64)>,
    want_full: bool,
    failures_logged: u64,
}

impl LivePool {
    pub fn new(settings: AggregatorSettings, namespace: &str, owner: u64) -> Self {
        LivePool {
            settings,
            board: SnapshotBoard::new(namespace, owner),
            snapshot: Snapshot::default(),
            applied: None,
            poll: None,
            want_full: false,
            failures_logged: 0,
        }
    }

    pub fn tick_period(&self) -> Duration {
        Duration::from_millis(self.settings.poll_interval_ms)
    }
}

/// Brings the router's pool in line with the board: a small read per call, a snapshot read
/// and a pool rebuild only when the version or the choice changed.
pub(crate) fn refresh(vm: &mut VmState, now_ms: u64) {
    let Some(live) = vm.live.as_mut() else {
        return;
    };
    let meta = live.board.read_meta(&HostStore);
    if let Some(m) = meta {
        if (m.epoch, m.version) != (live.snapshot.epoch, live.snapshot.version) {
            if let Some(s) = live.board.read_snapshot(&HostStore) {
                live.snapshot = s;
            }
        }
    }
    let choice = live::choose(
        meta,
        live.snapshot.epoch != 0,
        now_ms,
        &live.settings,
        vm.router.config().pool.is_empty(),
    );
    let key = (choice, live.snapshot.epoch, live.snapshot.version);
    if live.applied == Some(key) {
        return;
    }
    let pool = match choice {
        PoolChoice::Static => vm.router.config().pool.clone(),
        PoolChoice::Live { with_loads } => live::live_pool(&live.snapshot, with_loads),
    };
    debug!(
        "kvoy_prefix_affinity: pool {choice:?} epoch {} version {}: {} endpoints",
        live.snapshot.epoch,
        live.snapshot.version,
        pool.len()
    );
    Metrics::set(vm.metrics.pool_endpoints, pool.len() as u64);
    Metrics::set(
        vm.metrics.pool_live,
        u64::from(matches!(choice, PoolChoice::Live { .. })),
    );
    Metrics::add(vm.metrics.pool_updates, 1);
    vm.router.set_pool(pool);
    vm.inflight.set_endpoints(vm.router.pool().id_bound());
    live.applied = Some(key);
}

/// On a tick: refresh, then poll if this VM holds the lease and no poll is in flight.
pub(crate) fn on_tick(vm: &mut VmState) {
    let now = now_ms();
    refresh(vm, now);
    let Some(live) = vm.live.as_mut() else {
        return;
    };
    if let Some((_, started)) = live.poll {
        // A lost callback must not stop polling forever.
        if now.saturating_sub(started) <= live.settings.timeout_ms.saturating_mul(2) {
            return;
        }
        live.poll = None;
    }
    let ttl = live
        .settings
        .poll_interval_ms
        .saturating_mul(3)
        .max(live.settings.timeout_ms);
    if !live.board.try_lease(&HostStore, now, ttl) {
        return;
    }
    let path = live::poll_path(&live.settings, &live.snapshot, live.want_full);
    let authority = live
        .settings
        .authority
        .clone()
        .unwrap_or_else(|| live.settings.cluster.clone());
    match hostcalls::dispatch_http_call(
        &live.settings.cluster,
        vec![
            (":method", "GET"),
            (":path", &path),
            (":authority", &authority),
        ],
        None,
        vec![],
        Duration::from_millis(live.settings.timeout_ms),
    ) {
        Ok(token) => live.poll = Some((token, now)),
        Err(status) => {
            Metrics::add(vm.metrics.snapshot_poll_failures, 1);
            if live.failures_logged < 3 {
                live.failures_logged += 1;
                warn!(
                    "kvoy_prefix_affinity: cannot call the aggregator cluster {:?}: {status:?}",
                    live.settings.cluster
                );
            }
        }
    }
}

/// The answer to a poll: apply it, publish it, use it.
pub(crate) fn on_poll_response(vm: &mut VmState, token: u32, status: Option<u32>, body: &[u8]) {
    let now = now_ms();
    let Some(live) = vm.live.as_mut() else {
        return;
    };
    if live.poll.map(|(t, _)| t) != Some(token) {
        return;
    }
    live.poll = None;
    let mut next = live.snapshot.clone();
    match live::apply_poll(&mut next, status, body) {
        Ok(changed) => {
            live.want_full = false;
            Metrics::add(vm.metrics.snapshot_polls, 1);
            let published = if changed {
                live.board.publish(&HostStore, &next, now)
            } else {
                live.board.touch(&HostStore, &next, now)
            };
            if published.is_err() {
                Metrics::add(vm.metrics.shared_state_errors, 1);
            }
            live.snapshot = next;
        }
        Err(e) => {
            Metrics::add(vm.metrics.snapshot_poll_failures, 1);
            if matches!(e, PollError::Mismatch(_)) {
                live.want_full = true;
            }
            debug!("kvoy_prefix_affinity: snapshot poll: {e}");
        }
    }
    refresh(vm, now);
}
