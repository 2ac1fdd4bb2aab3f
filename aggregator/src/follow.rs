//! Following one model server's KV events: a thread that owns the endpoint's
//! [`EndpointCache`], decodes each batch at the edge, detects sequence gaps and publisher
//! restarts, recovers missed batches through the replay socket, and publishes a small
//! [`KvSummary`] for the pool.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use log::{debug, info, warn};
use tokio::sync::watch;

use kvoy_kvevents::{
    decode_batch, ReplayClient, SeqStatus, SeqTracker, Subscriber, TransportError, ZmqContext,
};

use crate::config::KvEventsSource;
use crate::kv_index::{ApplyStats, EndpointCache, Tier};

/// How long one receive waits before the stop flag is checked again.
const POLL: Duration = Duration::from_millis(100);
/// Bounds of one replay request.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(1);
const REPLAY_MAX_BATCHES: u64 = 100_000;

/// What the pool needs from an endpoint's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvSummary {
    /// Blocks cached per tier: GPU, CPU, STORAGE.
    pub cached: [u32; 3],
    /// Bumped on `AllBlocksCleared` and on a publisher restart.
    pub generation: u32,
    /// Whether any batch arrived yet.
    pub receiving: bool,
}

/// Counters of one follower, read by `/metrics`.
#[derive(Debug, Default)]
pub struct KvCounters {
    pub batches: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_removed: AtomicU64,
    pub cleared: AtomicU64,
    pub unknown_events: AtomicU64,
    pub orphan_blocks: AtomicU64,
    pub unknown_removals: AtomicU64,
    pub malformed_events: AtomicU64,
    /// Payloads that did not decode, and messages without the three frames.
    pub decode_errors: AtomicU64,
    pub seq_gaps: AtomicU64,
    pub publisher_restarts: AtomicU64,
    /// Restarts seen in the server's metrics (counters went back), whatever the sequence said.
    pub server_restarts: AtomicU64,
    pub replayed_batches: AtomicU64,
    pub replay_failures: AtomicU64,
    /// Batches neither received nor recovered.
    pub batches_lost: AtomicU64,
}

impl KvCounters {
    fn add_stats(&self, s: &ApplyStats) {
        let pairs = [
            (&self.blocks_stored, s.stored),
            (&self.blocks_removed, s.removed),
            (&self.cleared, s.cleared),
            (&self.unknown_events, s.unknown_events),
            (&self.orphan_blocks, s.orphan_blocks),
            (&self.unknown_removals, s.unknown_removals),
            (&self.malformed_events, s.malformed),
        ];
        for (counter, n) in pairs {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A running follower; dropping it stops the thread (within [`POLL`]).
pub struct Follower {
    stop: Arc<AtomicBool>,
    /// Server restarts noticed elsewhere (the scrapes), for the thread to act on.
    restarts: Arc<AtomicU64>,
    summary: watch::Receiver<KvSummary>,
    counters: Arc<KvCounters>,
    thread: Option<JoinHandle<()>>,
}

impl Follower {
    /// Starts following `source`; `name` labels the logs.
    pub fn spawn(ctx: &ZmqContext, source: &KvEventsSource, name: &str) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(KvCounters::default());
        let (tx, summary) = watch::channel(KvSummary::default());
        let mut state = FollowState {
            ctx: ctx.clone(),
            source: source.clone(),
            name: name.to_owned(),
            cache: EndpointCache::new(),
            counters: counters.clone(),
            summary: tx,
            receiving: false,
        };
        let flag = stop.clone();
        let restarts = Arc::new(AtomicU64::new(0));
        let seen = restarts.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvoy-kv-{name}"))
            .spawn(move || state.run(&flag, &seen))?;
        Ok(Follower {
            stop,
            restarts,
            summary,
            counters,
            thread: Some(thread),
        })
    }

    /// Tells the thread how many times the server has restarted (from its metrics): on a new
    /// restart it drops the cache and follows the publisher's numbering from 0 again. A
    /// restarted publisher may reach the sequence number we expected before we reconnect, so
    /// the sequence alone cannot always tell.
    pub fn server_restarted(&self, count: u64) {
        self.restarts.fetch_max(count, Ordering::Relaxed);
    }

    pub fn summary(&self) -> KvSummary {
        *self.summary.borrow()
    }

    pub fn counters(&self) -> Arc<KvCounters> {
        self.counters.clone()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Not joined: the thread notices the flag within one poll and exits on its own, and a
        // drop on an async task must not block.
        drop(self.thread.take());
    }
}

struct FollowState {
    ctx: ZmqContext,
    source: KvEventsSource,
    name: String,
    cache: EndpointCache,
    counters: Arc<KvCounters>,
    summary: watch::Sender<KvSummary>,
    receiving: bool,
}

impl FollowState {
    fn run(&mut self, stop: &AtomicBool, restarts: &AtomicU64) {
        let sub = loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match Subscriber::connect(
                &self.ctx,
                &self.source.endpoint,
                self.source.topic.as_bytes(),
            ) {
                Ok(s) => break s,
                Err(e) => {
                    warn!("kvoy-aggregator {}: KV events: {e}; retrying", self.name);
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        };
        let mut replay = self.source.replay_endpoint.as_deref().and_then(|ep| {
            ReplayClient::connect(&self.ctx, ep)
                .map_err(|e| warn!("kvoy-aggregator {}: replay socket: {e}", self.name))
                .ok()
        });
        // With a replay socket, a first message later than seq 0 is a gap: the buffered
        // history tells what the server cached before we joined.
        let fresh_tracker = |replay: &Option<ReplayClient>| {
            if replay.is_some() {
                SeqTracker::from_start()
            } else {
                SeqTracker::new()
            }
        };
        let mut tracker = fresh_tracker(&replay);
        let mut restarts_seen = 0u64;
        info!(
            "kvoy-aggregator {}: following KV events on {}",
            self.name, self.source.endpoint
        );
        while !stop.load(Ordering::Relaxed) {
            let restarted = restarts.load(Ordering::Relaxed);
            if restarted > restarts_seen {
                restarts_seen = restarted;
                info!(
                    "kvoy-aggregator {}: the server restarted; dropping its cache",
                    self.name
                );
                self.counters
                    .server_restarts
                    .fetch_add(1, Ordering::Relaxed);
                self.cache.clear();
                tracker = fresh_tracker(&replay);
                self.publish();
            }
            let msg = match sub.recv(POLL) {
                Ok(Some(msg)) => msg,
                Ok(None) => continue,
                Err(TransportError::Malformed { reason, .. }) => {
                    self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                    debug!("kvoy-aggregator {}: malformed message: {reason}", self.name);
                    continue;
                }
                Err(e) => {
                    warn!("kvoy-aggregator {}: KV events: {e}", self.name);
                    std::thread::sleep(POLL);
                    continue;
                }
            };
            match tracker.observe(msg.seq) {
                SeqStatus::InOrder => {}
                SeqStatus::Gap { missing } => {
                    self.counters.seq_gaps.fetch_add(1, Ordering::Relaxed);
                    self.recover(replay.as_mut(), missing);
                }
                SeqStatus::Restart { missing } => {
                    info!(
                        "kvoy-aggregator {}: the KV-event publisher restarted (seq {}); dropping its cache",
                        self.name, msg.seq
                    );
                    self.counters
                        .publisher_restarts
                        .fetch_add(1, Ordering::Relaxed);
                    self.cache.clear();
                    self.recover(replay.as_mut(), missing);
                }
            }
            self.apply(&msg.payload);
            self.publish();
        }
    }

    fn apply(&mut self, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => {
                let stats = self.cache.apply_batch(&batch);
                self.counters.add_stats(&stats);
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
                self.receiving = true;
            }
            Err(e) => {
                self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                debug!("kvoy-aggregator {}: undecodable batch: {e}", self.name);
            }
        }
    }

    /// Fetches the batches in `missing` from the replay socket and applies them in order.
    fn recover(&mut self, replay: Option<&mut ReplayClient>, missing: Range<u64>) {
        let wanted = missing.end.saturating_sub(missing.start);
        if wanted == 0 {
            return;
        }
        let Some(client) = replay else {
            self.counters
                .batches_lost
                .fetch_add(wanted, Ordering::Relaxed);
            return;
        };
        let max = usize::try_from(wanted.min(REPLAY_MAX_BATCHES)).unwrap_or(usize::MAX);
        let mut applied = 0u64;
        match client.replay(missing.start, max, REPLAY_TIMEOUT) {
            Ok(outcome) => {
                for (seq, payload) in &outcome.batches {
                    if missing.contains(seq) {
                        self.apply(payload);
                        applied += 1;
                    }
                }
                self.counters
                    .replayed_batches
                    .fetch_add(applied, Ordering::Relaxed);
            }
            Err(e) => {
                self.counters
                    .replay_failures
                    .fetch_add(1, Ordering::Relaxed);
                warn!("kvoy-aggregator {}: replay failed: {e}", self.name);
            }
        }
        let lost = wanted.saturating_sub(applied);
        if lost > 0 {
            self.counters
                .batches_lost
                .fetch_add(lost, Ordering::Relaxed);
            debug!(
                "kvoy-aggregator {}: {lost} of {wanted} missed batches could not be recovered",
                self.name
            );
        }
    }

    fn publish(&self) {
        let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let summary = KvSummary {
            cached: [
                clamp(self.cache.blocks(Tier::Gpu)),
                clamp(self.cache.blocks(Tier::Cpu)),
                clamp(self.cache.blocks(Tier::Storage)),
            ],
            generation: self.cache.generation(),
            receiving: self.receiving,
        };
        self.summary.send_if_modified(|old| {
            let changed = *old != summary;
            *old = summary;
            changed
        });
    }
}
