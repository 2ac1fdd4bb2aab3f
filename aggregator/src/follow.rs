//! Following one model server's KV events: a thread that owns the endpoint's
//! [`EndpointCache`], decodes each batch at the edge, detects sequence gaps and publisher
//! restarts, recovers missed batches through the replay socket, and publishes a small
//! [`KvSummary`] for the pool.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use tokio::sync::watch;

use kvoy_kvevents::{
    decode_batch, ReplayClient, ReplayLimits, SeqStatus, SeqTracker, Subscriber, TransportError,
    ZmqContext,
};

use crate::config::{KvEventsSource, Limits};
use crate::kv_index::{ApplyStats, EndpointCache, Tier};
use crate::kv_link::Linker;
use crate::reject::{Reason, Rejections};

/// How long one receive waits before the stop flag is checked again.
const POLL: Duration = Duration::from_millis(100);
/// Live batches at most this far behind the catch-up's last one are taken as already applied.
const CATCH_UP_OVERLAP: u64 = 4096;
/// Connection drops are looked for at least every this many messages (and on every idle poll).
const DISCONNECT_CHECK_EVERY: u32 = 256;

/// What the pool needs from an endpoint's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvSummary {
    /// Blocks cached per tier: GPU, CPU, STORAGE.
    pub cached: [u32; 3],
    /// Bumped on `AllBlocksCleared` and on a publisher restart.
    pub generation: u32,
    /// Whether any batch arrived yet.
    pub receiving: bool,
    /// The follower asked the server's replay socket for what it buffered before the follower
    /// joined (done, failed or without a replay socket): a restarted replica serves its
    /// snapshot only once every follower is (see [`crate::pool::PoolView::caught_up`]).
    pub caught_up: bool,
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
    /// The server's capacity in blocks, from its metrics (0: unknown), for the block cap.
    capacity: Arc<AtomicU64>,
    summary: watch::Receiver<KvSummary>,
    counters: Arc<KvCounters>,
    rejections: Arc<Rejections>,
    thread: Option<JoinHandle<()>>,
}

impl Follower {
    /// Starts following `source` within `limits`; `name` labels the logs. Every batch also
    /// goes to `links`, as `address`'s events.
    pub fn spawn(
        ctx: &ZmqContext,
        source: &KvEventsSource,
        name: &str,
        limits: Limits,
        links: Option<(Arc<Mutex<Linker>>, SocketAddr)>,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(KvCounters::default());
        let rejections = Arc::new(Rejections::new(format!("kvoy-aggregator {name} KV events")));
        let (tx, summary) = watch::channel(KvSummary::default());
        let capacity = Arc::new(AtomicU64::new(0));
        let mut cache = EndpointCache::new();
        cache.set_block_cap(limits.block_cap(0));
        let mut state = FollowState {
            ctx: ctx.clone(),
            source: source.clone(),
            name: name.to_owned(),
            limits,
            cache,
            counters: counters.clone(),
            rejections: rejections.clone(),
            summary: tx,
            receiving: false,
            caught_up: false,
            links,
        };
        let flag = stop.clone();
        let restarts = Arc::new(AtomicU64::new(0));
        let seen = restarts.clone();
        let capacity_seen = capacity.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvoy-kv-{name}"))
            .spawn(move || state.run(&flag, &seen, &capacity_seen))?;
        Ok(Follower {
            stop,
            restarts,
            capacity,
            summary,
            counters,
            rejections,
            thread: Some(thread),
        })
    }

    /// Tells the thread the server's capacity in blocks (its `num_gpu_blocks`; 0: unknown),
    /// from which its block cap follows ([`Limits::block_cap`]).
    pub fn set_capacity(&self, blocks: u32) {
        self.capacity.store(u64::from(blocks), Ordering::Relaxed);
    }

    /// What this follower refused, by reason.
    pub fn rejections(&self) -> Arc<Rejections> {
        self.rejections.clone()
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
    limits: Limits,
    cache: EndpointCache,
    counters: Arc<KvCounters>,
    rejections: Arc<Rejections>,
    summary: watch::Sender<KvSummary>,
    receiving: bool,
    caught_up: bool,
    /// The pool's decision linker and this endpoint's address in it.
    links: Option<(Arc<Mutex<Linker>>, SocketAddr)>,
}

impl FollowState {
    fn run(&mut self, stop: &AtomicBool, restarts: &AtomicU64, capacity: &AtomicU64) {
        let max_message = Some(self.limits.kv_events_max_message_bytes);
        let mut sub = loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match Subscriber::connect_limited(
                &self.ctx,
                &self.source.endpoint,
                self.source.topic.as_bytes(),
                max_message,
            ) {
                Ok(s) => break s,
                Err(e) => {
                    warn!("kvoy-aggregator {}: KV events: {e}; retrying", self.name);
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        };
        let mut replay = self.source.replay_endpoint.as_deref().and_then(|ep| {
            ReplayClient::connect_limited(&self.ctx, ep, max_message)
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
        // Catch up at once, not at the first live batch: a restarted replica must know what
        // the server cached before it serves a snapshot, even in a quiet pool.
        let mut replayed_through = None;
        if let Some(client) = replay.as_mut() {
            replayed_through = self.catch_up(client);
            if let Some(last) = replayed_through {
                tracker = SeqTracker::expecting(last.saturating_add(1));
            }
        }
        self.caught_up = true;
        self.publish();
        let mut restarts_seen = 0u64;
        let mut since_check = 0u32;
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
                self.clear_links();
                tracker = fresh_tracker(&replay);
                self.publish();
            }
            let cap = self
                .limits
                .block_cap(u32::try_from(capacity.load(Ordering::Relaxed)).unwrap_or(u32::MAX));
            if cap != self.cache.block_cap() {
                self.cache.set_block_cap(cap);
            }
            let received = sub.recv(POLL);
            since_check += 1;
            if since_check >= DISCONNECT_CHECK_EVERY || matches!(received, Ok(None)) {
                since_check = 0;
                let drops = sub.take_disconnects();
                self.rejections.reject_n(
                    Reason::PublisherDisconnect,
                    drops,
                    format_args!(
                        "the connection to {} dropped: a frame over limits.kv_events_max_message_bytes ({} bytes), or the publisher went away; ZMQ reconnects",
                        self.source.endpoint, self.limits.kv_events_max_message_bytes
                    ),
                );
            }
            let msg = match received {
                Ok(Some(msg)) => msg,
                Ok(None) => continue,
                Err(TransportError::Malformed { reason, .. }) => {
                    self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                    self.rejections.reject(Reason::MalformedMessage, reason);
                    continue;
                }
                Err(e) => {
                    warn!("kvoy-aggregator {}: KV events: {e}", self.name);
                    std::thread::sleep(POLL);
                    continue;
                }
            };
            // Live batches queued while the catch-up ran that it already applied. (A window,
            // so that a publisher that restarted meanwhile, numbering from 0 again, is seen.)
            if let Some(last) = replayed_through {
                if msg.seq > last {
                    replayed_through = None;
                } else if last - msg.seq < CATCH_UP_OVERLAP {
                    continue;
                }
            }
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
                    self.clear_links();
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
                if let Some((links, address)) = &self.links {
                    // A poisoned lock only costs links; the cache above is what routing reads.
                    if let Ok(mut l) = links.lock() {
                        l.events(*address, &batch, Instant::now());
                    }
                }
                self.counters.add_stats(&stats);
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
                self.receiving = true;
                self.note_rejections(&stats);
            }
            Err(e) => {
                self.counters.decode_errors.fetch_add(1, Ordering::Relaxed);
                self.rejections.reject(
                    Reason::UndecodableBatch,
                    format_args!("a {}-byte payload: {e}", payload.len()),
                );
            }
        }
    }

    /// The engine hashes may mean something else now: every link of the endpoint goes.
    fn clear_links(&self) {
        if let Some((links, address)) = &self.links {
            if let Ok(mut l) = links.lock() {
                l.clear(*address);
            }
        }
    }

    /// Counts what a batch's events had wrong, with the first of each kind described.
    fn note_rejections(&self, stats: &ApplyStats) {
        if let Some(m) = stats.first_malformed {
            self.rejections
                .reject_n(Reason::MalformedEvent, stats.malformed, m);
        }
        if let Some(t) = stats.first_unknown {
            self.rejections.reject_n(
                Reason::UnknownEvent,
                stats.unknown_events,
                format_args!("an event of type {:?} (skipped)", t.as_str()),
            );
        }
        if stats.over_cap > 0 {
            self.rejections.reject_n(
                Reason::BlockCap,
                stats.over_cap,
                format_args!(
                    "{} new blocks not stored: the endpoint holds its cap of {} blocks (limits.blocks_per_capacity_block x its num_gpu_blocks, or limits.blocks_without_capacity)",
                    stats.over_cap,
                    self.cache.block_cap()
                ),
            );
        }
    }

    /// Asks the replay socket for everything the server buffered and applies it in order; the
    /// last sequence number applied, if any.
    fn catch_up(&mut self, client: &mut ReplayClient) -> Option<u64> {
        let limits = ReplayLimits {
            max_batches: self.limits.replay_max_batches,
            max_bytes: self.limits.replay_max_bytes,
            timeout: self.limits.replay_timeout,
        };
        match client.replay_bounded(0, limits) {
            Ok(outcome) => {
                let mut last = None;
                for (seq, payload) in &outcome.batches {
                    if last.is_some_and(|l| *seq <= l) {
                        continue;
                    }
                    self.apply(payload);
                    last = Some(*seq);
                }
                self.counters
                    .replayed_batches
                    .fetch_add(outcome.batches.len() as u64, Ordering::Relaxed);
                info!(
                    "kvoy-aggregator {}: caught up: {} batches replayed{}",
                    self.name,
                    outcome.batches.len(),
                    if outcome.complete {
                        ""
                    } else {
                        " (the replay limits cut it short)"
                    }
                );
                last
            }
            Err(e) => {
                self.counters
                    .replay_failures
                    .fetch_add(1, Ordering::Relaxed);
                warn!("kvoy-aggregator {}: catch-up replay failed: {e}", self.name);
                None
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
        let limits = ReplayLimits {
            max_batches: usize::try_from(wanted)
                .unwrap_or(usize::MAX)
                .min(self.limits.replay_max_batches),
            max_bytes: self.limits.replay_max_bytes,
            timeout: self.limits.replay_timeout,
        };
        let mut applied = 0u64;
        match client.replay_bounded(missing.start, limits) {
            Ok(outcome) => {
                let got = outcome.batches.len() as u64;
                if !outcome.complete && got < wanted {
                    self.rejections.reject(
                        Reason::ReplayBudget,
                        format_args!(
                            "a replay of {wanted} batches from seq {} stopped after {got} batches, {} bytes (limits.replay_max_batches {}, replay_max_bytes {}, replay_timeout_ms {})",
                            missing.start,
                            outcome.bytes,
                            self.limits.replay_max_batches,
                            self.limits.replay_max_bytes,
                            self.limits.replay_timeout.as_millis()
                        ),
                    );
                }
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
            caught_up: self.caught_up,
        };
        self.summary.send_if_modified(|old| {
            let changed = *old != summary;
            *old = summary;
            changed
        });
    }
}
