//! The live pool from kvoy-aggregator, as the filters use it.
//!
//! One VM per proxy polls the aggregator: whoever holds the shared-data lease
//! ([`SnapshotBoard::try_lease`]). It applies the answer (full, or the changes since its
//! version) to the snapshot it has and publishes the result on the board: the encoded snapshot
//! under one key and a 24-byte [`BoardMeta`] (epoch, version, time of last contact) under
//! another. Every VM reads the meta key (small) per request and the snapshot only when the
//! version changed, then routes with [`live_pool`] or falls back per [`choose`]. Nothing on
//! the request path ever waits for the aggregator.

use crate::endpoint::{Endpoint, EndpointId, EndpointLoad, Health, Pool};
use crate::prefix_affinity::config::AggregatorSettings;
use crate::prefix_affinity::config::MAX_ENDPOINTS;
use crate::shared_data::{SharedStore, StoreError};
use crate::snapshot::{Snapshot, SnapshotDelta, SnapshotError, SnapshotFormat};
use std::net::SocketAddr;

/// What the board says about the published snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoardMeta {
    pub epoch: u64,
    pub version: u64,
    /// When the poller last heard from the aggregator (ms, host clock).
    pub contacted_ms: u64,
}

impl BoardMeta {
    fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0..8].copy_from_slice(&self.epoch.to_le_bytes());
        b[8..16].copy_from_slice(&self.version.to_le_bytes());
        b[16..24].copy_from_slice(&self.contacted_ms.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
        };
        Some(BoardMeta {
            epoch: word(0)?,
            version: word(8)?,
            contacted_ms: word(16)?,
        })
    }
}

/// The shared-data keys of the live pool, for one filter configuration.
#[derive(Clone, Debug)]
pub struct SnapshotBoard {
    lease_key: String,
    meta_key: String,
    snapshot_key: String,
    owner: u64,
    scratch: Vec<u8>,
}

impl SnapshotBoard {
    /// `owner` identifies this VM (any value distinct per VM).
    pub fn new(namespace: &str, owner: u64) -> Self {
        SnapshotBoard {
            lease_key: format!("{namespace}.agg.lease"),
            meta_key: format!("{namespace}.agg.meta"),
            snapshot_key: format!("{namespace}.agg.snapshot"),
            owner,
            scratch: Vec::new(),
        }
    }

    /// Takes or renews the poller lease until `now_ms + ttl_ms`. True when this VM is the
    /// poller. Two VMs that both find no lease may both poll once; the CAS settles it next time.
    pub fn try_lease(&self, store: &impl SharedStore, now_ms: u64, ttl_ms: u64) -> bool {
        let mut value = [0u8; 16];
        value[0..8].copy_from_slice(&self.owner.to_le_bytes());
        value[8..16].copy_from_slice(&now_ms.saturating_add(ttl_ms).to_le_bytes());
        let cas = match store.get(&self.lease_key) {
            Some((b, cas)) => {
                let held = |i: usize| -> Option<u64> {
                    Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
                };
                let mine = held(0) == Some(self.owner);
                let expired = held(8).is_none_or(|until| now_ms >= until);
                if !(mine || expired) {
                    return false;
                }
                cas
            }
            None => 0,
        };
        store.set(&self.lease_key, &value, cas).is_ok()
    }

    /// Publishes `snapshot` (contacted at `contacted_ms`): the snapshot first, then the meta,
    /// so a reader that sees the new meta finds the new snapshot.
    pub fn publish(
        &mut self,
        store: &impl SharedStore,
        snapshot: &Snapshot,
        contacted_ms: u64,
    ) -> Result<(), StoreError> {
        self.scratch.clear();
        snapshot.encode(&mut self.scratch);
        store.set(&self.snapshot_key, &self.scratch, 0)?;
        self.touch(store, snapshot, contacted_ms)
    }

    /// Records a contact that changed nothing.
    pub fn touch(
        &self,
        store: &impl SharedStore,
        snapshot: &Snapshot,
        contacted_ms: u64,
    ) -> Result<(), StoreError> {
        let meta = BoardMeta {
            epoch: snapshot.epoch,
            version: snapshot.version,
            contacted_ms,
        };
        store.set(&self.meta_key, &meta.encode(), 0)
    }

    pub fn read_meta(&self, store: &impl SharedStore) -> Option<BoardMeta> {
        store
            .get(&self.meta_key)
            .and_then(|(b, _)| BoardMeta::decode(&b))
    }

    /// The published snapshot; `None` when there is none or it does not decode.
    pub fn read_snapshot(&self, store: &impl SharedStore) -> Option<Snapshot> {
        store
            .get(&self.snapshot_key)
            .and_then(|(b, _)| Snapshot::decode(&b).ok())
    }
}

/// What a VM routes with at a given moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolChoice {
    /// The configured `endpoints`.
    Static,
    /// The aggregator's endpoints; their queue and KV figures only when `with_loads`.
    Live { with_loads: bool },
}

/// Chooses between the live and the static pool, given the board's meta at `now_ms`: live
/// while the aggregator was heard from within `snapshot_max_age_ms` (or always, when there is
/// no static pool), its load figures only within `load_max_age_ms`.
pub fn choose(
    meta: Option<BoardMeta>,
    have_snapshot: bool,
    now_ms: u64,
    settings: &AggregatorSettings,
    static_pool_empty: bool,
) -> PoolChoice {
    let Some(meta) = meta.filter(|_| have_snapshot) else {
        return PoolChoice::Static;
    };
    let age = now_ms.saturating_sub(meta.contacted_ms);
    if age > settings.snapshot_max_age_ms && !static_pool_empty {
        return PoolChoice::Static;
    }
    PoolChoice::Live {
        with_loads: age <= settings.load_max_age_ms,
    }
}

/// The pool a snapshot describes: ids are the aggregator's slots. Not-ready endpoints are
/// kept (with [`Health::NotReady`]) so that the pool still routes if nothing is ready. The
/// load figures (queue, KV use, prefill rate) only `with_loads`, of ready, fresh endpoints.
pub fn live_pool(snapshot: &Snapshot, with_loads: bool) -> Pool {
    Pool::with_ids(snapshot.endpoints.iter().map(|s| {
        let health = if !s.ready {
            Health::NotReady
        } else if s.stale {
            Health::Stale
        } else {
            Health::Ready
        };
        let load = if with_loads && s.ready && !s.stale {
            EndpointLoad {
                waiting: Some(s.waiting),
                running: Some(s.running),
                kv_cache_usage: Some(f64::from(s.kv_cache_usage)),
                prefill_tokens_per_s: s.prefill_tokens_per_s.map(f64::from),
                kv_capacity_tokens: None,
            }
        } else {
            EndpointLoad::default()
        };
        // The cache's size is geometry, not load: known whatever the freshness.
        let capacity = s.capacity_blocks.saturating_mul(s.block_size);
        // Offloaded blocks still serve their prefix, so every tier counts. No block at all is
        // what an endpoint whose events nobody follows reports too: then nothing is known.
        let cached_blocks: u64 = s.cached_blocks.iter().map(|&b| u64::from(b)).sum();
        let cached_tokens = cached_blocks.saturating_mul(u64::from(s.block_size));
        let load = EndpointLoad {
            kv_capacity_tokens: (capacity > 0).then_some(capacity),
            ..load
        };
        (
            EndpointId(s.slot),
            Endpoint {
                load,
                health,
                cache_generation: s.cache_generation,
                cached_tokens: (cached_tokens > 0).then_some(cached_tokens),
                role: s.role,
                ..Endpoint::new(s.address, s.models.clone())
            },
        )
    }))
}

/// Keeps the proxy's endpoint ids and cache generations steady across aggregator replicas.
/// Each replica numbers its slots and counts each server's cache generations itself (from when
/// it started), so the same pool read from another replica would otherwise look like new
/// endpoints with cleared caches, and the proxy's index would forget them. The lease holder
/// turns each replica's snapshot into the proxy's own numbering before it publishes it: an
/// address keeps the slot the board gave it, a new one takes its replica's slot when that is
/// free (the lowest free one otherwise); a generation moves on only when the same replica, in
/// the same epoch, reports a new one. A server the replica has no prefill rate for keeps the
/// one the board had.
#[derive(Debug, Default)]
pub struct Renumber {
    /// The replica and epoch the generations below come from.
    source: Option<(usize, u64)>,
    /// Each address's generation as that replica last reported it.
    upstream: Vec<(SocketAddr, u32)>,
}

impl Renumber {
    /// `upstream` (replica `replica`'s numbering) in the numbering of `board` (what the proxy
    /// routes on now): same epoch and version as `upstream`, slots and generations the proxy's.
    pub fn local(&mut self, replica: usize, upstream: &Snapshot, board: &Snapshot) -> Snapshot {
        let same_source = self.source == Some((replica, upstream.epoch));
        let before = |address: SocketAddr| board.endpoints.iter().find(|e| e.address == address);
        let mut taken = vec![false; MAX_ENDPOINTS];
        for e in &upstream.endpoints {
            if let Some(b) = before(e.address) {
                if let Some(t) = taken.get_mut(usize::from(b.slot)) {
                    *t = true;
                }
            }
        }
        let mut endpoints = Vec::with_capacity(upstream.endpoints.len());
        for e in &upstream.endpoints {
            let mut local = e.clone();
            match before(e.address) {
                Some(b) => {
                    local.slot = b.slot;
                    // A replica that (re)started has no prefill rate for a server until it
                    // has seen enough of its work; the server is as fast as it was, and the
                    // rate the proxy knew keeps its costs where they were meanwhile (a move to
                    // the configured default shifted them: turns left their servers).
                    if local.prefill_tokens_per_s.is_none() {
                        local.prefill_tokens_per_s = b.prefill_tokens_per_s;
                    }
                    let reported = self
                        .upstream
                        .iter()
                        .find(|(a, _)| *a == e.address)
                        .map(|&(_, g)| g);
                    let moved = same_source && reported.is_some_and(|g| g != e.cache_generation);
                    local.cache_generation = if moved {
                        b.cache_generation.wrapping_add(1)
                    } else {
                        b.cache_generation
                    };
                }
                None => {
                    let own = usize::from(e.slot);
                    let slot = if taken.get(own) == Some(&false) {
                        own
                    } else {
                        taken.iter().position(|t| !t).unwrap_or(own)
                    };
                    if let Some(t) = taken.get_mut(slot) {
                        *t = true;
                    }
                    local.slot = u16::try_from(slot).unwrap_or(e.slot);
                }
            }
            endpoints.push(local);
        }
        endpoints.sort_by_key(|e| e.slot);
        self.source = Some((replica, upstream.epoch));
        self.upstream = upstream
            .endpoints
            .iter()
            .map(|e| (e.address, e.cache_generation))
            .collect();
        Snapshot {
            epoch: upstream.epoch,
            version: upstream.version,
            endpoints,
        }
    }
}

/// Why a poll gave nothing.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PollError {
    #[error("the aggregator answered status {0}")]
    Status(u32),
    #[error("no answer (timeout or connection failure)")]
    NoAnswer,
    #[error("bad snapshot: {0}")]
    Decode(SnapshotError),
    #[error("the changes do not apply to our version: {0}")]
    Mismatch(SnapshotError),
    #[error("the answer is {size} bytes, over aggregator.max_snapshot_bytes ({limit}); not read")]
    TooLarge { size: usize, limit: usize },
    /// A replica that lost its pool (restarted, not caught up) while another has one.
    #[error("an empty pool, while the proxy routes on {had} endpoints: another replica is asked")]
    Empty { had: usize },
}

impl PollError {
    /// The kind of failure, for metrics and for logging each kind once.
    pub fn label(&self) -> &'static str {
        match self {
            PollError::Status(_) => "status",
            PollError::NoAnswer => "no_answer",
            PollError::Decode(_) => "decode",
            PollError::Mismatch(_) => "mismatch",
            PollError::TooLarge { .. } => "too_large",
            PollError::Empty { .. } => "empty",
        }
    }

    /// Whether the aggregator's answer itself was refused (too large or undecodable), as
    /// opposed to no usable answer at all.
    pub fn is_rejected_input(&self) -> bool {
        matches!(
            self,
            PollError::Decode(_) | PollError::TooLarge { .. } | PollError::Empty { .. }
        )
    }
}

/// What a proxy tells the aggregator in its poll: its id (one for all its workers) and the
/// requests its admission stage holds. The aggregator shows the pool's admission queue from
/// these; it routes nothing by them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollReport {
    pub proxy: u64,
    pub held: u64,
}

/// The path of the next poll: incremental from `have` unless a full snapshot is wanted, and
/// naming the newest snapshot format this build reads (an aggregator that knows no `format`
/// ignores it and answers format 1, which this build reads too), then the proxy's `report`
/// (`&proxy=<16 hex digits>&held=N`; an aggregator that knows neither ignores them).
pub fn poll_path(
    settings: &AggregatorSettings,
    have: &Snapshot,
    want_full: bool,
    report: Option<PollReport>,
) -> String {
    let mut path = snapshot_path(settings, have, want_full);
    if let Some(r) = report {
        path.push_str(&format!("&proxy={:016x}&held={}", r.proxy, r.held));
    }
    path
}

fn snapshot_path(settings: &AggregatorSettings, have: &Snapshot, want_full: bool) -> String {
    let sep = if settings.path.contains('?') {
        '&'
    } else {
        '?'
    };
    let format = SnapshotFormat::LATEST as u8;
    if want_full || have.epoch == 0 {
        format!("{}{sep}format={format}", settings.path)
    } else {
        format!(
            "{}{sep}epoch={}&since={}&format={format}",
            settings.path, have.epoch, have.version
        )
    }
}

/// Applies a poll's answer to `snapshot`. `Ok(true)` when it changed. On
/// [`PollError::Mismatch`] the next poll should ask for a full snapshot.
pub fn apply_poll(
    snapshot: &mut Snapshot,
    status: Option<u32>,
    body: &[u8],
) -> Result<bool, PollError> {
    match status {
        Some(200) => {}
        Some(s) => return Err(PollError::Status(s)),
        None => return Err(PollError::NoAnswer),
    }
    let delta = SnapshotDelta::decode(body).map_err(PollError::Decode)?;
    let before = (snapshot.epoch, snapshot.version);
    let full = delta.is_full();
    snapshot.apply(delta).map_err(PollError::Mismatch)?;
    Ok(full || before != (snapshot.epoch, snapshot.version))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_data::MemoryStore;
    use crate::snapshot::{EndpointStatus, SnapshotHistory};

    fn settings() -> AggregatorSettings {
        crate::prefix_affinity::PluginConfig::from_json(
            br#"{"aggregator":{"cluster":"agg"},"allowed_destinations":[{"cidr":"10.0.0.0/8"}]}"#,
        )
        .unwrap()
        .aggregator
        .unwrap()
    }

    fn status(slot: u16, port: u16, ready: bool, stale: bool) -> EndpointStatus {
        EndpointStatus {
            ready,
            stale,
            waiting: 3,
            running: 1,
            kv_cache_usage: 0.5,
            block_size: 16,
            capacity_blocks: 100,
            cached_blocks: [1, 0, 0],
            cache_generation: 2,
            prefill_tokens_per_s: Some(12_000.0),
            ..EndpointStatus::ready(slot, ([10, 0, 0, 1], port).into(), &["m"])
        }
    }

    fn snap(epoch: u64, version: u64, endpoints: &[(u16, u16, u32)]) -> Snapshot {
        Snapshot {
            epoch,
            version,
            endpoints: endpoints
                .iter()
                .map(|&(slot, port, generation)| EndpointStatus {
                    cache_generation: generation,
                    ..status(slot, port, true, false)
                })
                .collect(),
        }
    }

    /// (address port, slot, generation) of each endpoint, by port.
    fn numbering(s: &Snapshot) -> Vec<(u16, u16, u32)> {
        let mut v: Vec<_> = s
            .endpoints
            .iter()
            .map(|e| (e.address.port(), e.slot, e.cache_generation))
            .collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn another_replicas_pool_keeps_the_proxys_slots_and_generations() {
        let mut r = Renumber::default();
        // Replica 0: slots 0..3, generations as it counted them.
        let a = snap(7, 3, &[(0, 8001, 4), (1, 8002, 0), (2, 8003, 1)]);
        let board = r.local(0, &a, &Snapshot::default());
        assert_eq!(board.endpoints.len(), 3);
        assert_eq!(
            numbering(&board),
            vec![(8001, 0, 4), (8002, 1, 0), (8003, 2, 1)],
            "the first snapshot is taken as it is"
        );
        // Replica 1 numbers the same servers otherwise, counts generations from its own start,
        // and knows one more server: the proxy's ids and generations stay, the new server
        // takes a free slot.
        let b = snap(
            9,
            1,
            &[(0, 8003, 0), (1, 8002, 0), (2, 8001, 0), (3, 8004, 0)],
        );
        let board = r.local(1, &b, &board);
        assert_eq!((board.epoch, board.version), (9, 1));
        assert_eq!(
            numbering(&board),
            vec![(8001, 0, 4), (8002, 1, 0), (8003, 2, 1), (8004, 3, 0)]
        );
        assert!(board.endpoints.windows(2).all(|w| w[0].slot < w[1].slot));
        // Replica 1 then sees 8002's cache cleared: the proxy's generation moves on.
        let b2 = snap(
            9,
            2,
            &[(0, 8003, 0), (1, 8002, 1), (2, 8001, 0), (3, 8004, 0)],
        );
        let board = r.local(1, &b2, &board);
        assert_eq!(
            numbering(&board),
            vec![(8001, 0, 4), (8002, 1, 1), (8003, 2, 1), (8004, 3, 0)]
        );
        // A new server whose replica slot the proxy gives to another takes the lowest free one.
        let b3 = snap(
            9,
            3,
            &[(0, 8003, 0), (2, 8001, 0), (3, 8004, 0), (1, 8005, 0)],
        );
        let board = r.local(1, &b3, &board);
        assert_eq!(
            numbering(&board),
            vec![(8001, 0, 4), (8003, 2, 1), (8004, 3, 0), (8005, 1, 0)]
        );
        // Back to replica 0 after a restart (a new epoch): nothing looks cleared.
        let a2 = snap(
            8,
            1,
            &[(0, 8001, 0), (1, 8003, 0), (2, 8004, 0), (3, 8005, 0)],
        );
        let board = r.local(0, &a2, &board);
        assert_eq!(
            numbering(&board),
            vec![(8001, 0, 4), (8003, 2, 1), (8004, 3, 0), (8005, 1, 0)]
        );
    }

    #[test]
    fn a_replica_without_a_prefill_rate_keeps_the_boards() {
        let mut r = Renumber::default();
        let mut a = snap(7, 3, &[(0, 8001, 0), (1, 8002, 0)]);
        a.endpoints[0].prefill_tokens_per_s = Some(61_000.0);
        a.endpoints[1].prefill_tokens_per_s = Some(47_000.0);
        let board = r.local(0, &a, &Snapshot::default());
        // Replica 1 just started: no rate for 8001, its own for 8002, and a new server.
        let mut b = snap(9, 1, &[(0, 8001, 0), (1, 8002, 0), (2, 8003, 0)]);
        for e in &mut b.endpoints {
            e.prefill_tokens_per_s = None;
        }
        b.endpoints[1].prefill_tokens_per_s = Some(52_000.0);
        let board = r.local(1, &b, &board);
        let rates: Vec<_> = board
            .endpoints
            .iter()
            .map(|e| (e.address.port(), e.prefill_tokens_per_s))
            .collect();
        assert_eq!(
            rates,
            [(8001, Some(61_000.0)), (8002, Some(52_000.0)), (8003, None)]
        );
    }

    #[test]
    fn one_poller_at_a_time() {
        let store = MemoryStore::default();
        let a = SnapshotBoard::new("ns", 1);
        let b = SnapshotBoard::new("ns", 2);
        assert!(a.try_lease(&store, 1000, 300));
        assert!(!b.try_lease(&store, 1100, 300), "held by a");
        assert!(a.try_lease(&store, 1200, 300), "renewed");
        assert!(!b.try_lease(&store, 1499, 300));
        assert!(b.try_lease(&store, 1500, 300), "expired: taken over");
        assert!(!a.try_lease(&store, 1600, 300));
    }

    #[test]
    fn publish_then_read_and_choose() {
        let store = MemoryStore::default();
        let mut board = SnapshotBoard::new("ns", 1);
        let reader = SnapshotBoard::new("ns", 2);
        assert_eq!(reader.read_meta(&store), None);
        let mut history = SnapshotHistory::new(7);
        history.update(vec![status(0, 1, true, false), status(2, 3, false, false)]);
        let snap = history.snapshot();
        board.publish(&store, &snap, 5_000).unwrap();
        let meta = reader.read_meta(&store).unwrap();
        assert_eq!(
            (meta.epoch, meta.version, meta.contacted_ms),
            (7, snap.version, 5_000)
        );
        assert_eq!(reader.read_snapshot(&store).unwrap(), snap);

        let s = settings();
        assert_eq!(choose(None, false, 5_000, &s, false), PoolChoice::Static);
        let loads_stale = 5_000 + s.load_max_age_ms + 1;
        let snapshot_stale = 5_000 + s.snapshot_max_age_ms + 1;
        // (now, static pool empty, choice); with no static pool the last snapshot is kept
        for (now_ms, static_pool_empty, want) in [
            (6_000, false, PoolChoice::Live { with_loads: true }),
            (loads_stale, false, PoolChoice::Live { with_loads: false }),
            (snapshot_stale, false, PoolChoice::Static),
            (snapshot_stale, true, PoolChoice::Live { with_loads: false }),
        ] {
            assert_eq!(
                choose(Some(meta), true, now_ms, &s, static_pool_empty),
                want,
                "at {now_ms} ms, static pool empty: {static_pool_empty}"
            );
        }
    }

    #[test]
    fn live_pool_maps_slots_health_and_loads() {
        let mut history = SnapshotHistory::new(7);
        history.update(vec![
            status(0, 1, true, false),
            status(2, 3, false, false),
            status(5, 6, true, true),
        ]);
        let pool = live_pool(&history.snapshot(), true);
        assert_eq!((pool.len(), pool.id_bound()), (3, 6));
        let e0 = pool.get(EndpointId(0)).unwrap();
        assert_eq!(
            (e0.health, e0.load.waiting, e0.cache_generation),
            (Health::Ready, Some(3), 2)
        );
        assert_eq!(e0.load.prefill_tokens_per_s, Some(12_000.0));
        assert_eq!(pool.get(EndpointId(2)).unwrap().health, Health::NotReady);
        let e5 = pool.get(EndpointId(5)).unwrap();
        assert_eq!(
            (e5.health, e5.load.waiting, e5.load.prefill_tokens_per_s),
            (Health::Stale, None, None),
            "stale loads are not used"
        );
        let mut ids = Vec::new();
        pool.serving("m", &mut ids);
        assert_eq!(ids, [EndpointId(0)]);
        assert_eq!(e0.load.kv_capacity_tokens, Some(100 * 16));
        assert_eq!(e0.cached_tokens, Some(16), "one GPU block of 16 tokens");
        let mut counted = status(0, 1, true, false);
        counted.cached_blocks = [2, 3, 1];
        let mut nothing = status(1, 2, true, false);
        nothing.cached_blocks = [0; 3];
        history.update(vec![counted, nothing]);
        let pool = live_pool(&history.snapshot(), true);
        let cached = |id| pool.get(EndpointId(id)).unwrap().cached_tokens;
        assert_eq!(cached(0), Some(6 * 16), "every tier counts");
        assert_eq!(cached(1), None, "no block reported: nothing known");
        let pool = live_pool(&history.snapshot(), false);
        // Without loads only the cache's size is known (geometry, not load).
        assert_eq!(
            pool.get(EndpointId(0)).unwrap().load,
            EndpointLoad {
                kv_capacity_tokens: Some(100 * 16),
                ..EndpointLoad::default()
            }
        );
    }

    #[test]
    fn polls_apply_incrementally_and_recover_from_mismatch() {
        let s = settings();
        let mut history = SnapshotHistory::new(9);
        history.update(vec![status(0, 1, true, false)]);
        let mut mine = Snapshot::default();
        assert_eq!(poll_path(&s, &mine, false, None), "/v1/snapshot?format=3");
        assert_eq!(
            poll_path(
                &s,
                &mine,
                false,
                Some(PollReport {
                    proxy: 0xab,
                    held: 7
                })
            ),
            "/v1/snapshot?format=3&proxy=00000000000000ab&held=7"
        );
        let mut body = Vec::new();
        history.delta_since(None, None).encode(&mut body);
        assert_eq!(apply_poll(&mut mine, Some(200), &body), Ok(true));
        assert_eq!(
            poll_path(&s, &mine, false, None),
            format!("/v1/snapshot?epoch=9&since={}&format=3", mine.version)
        );
        assert_eq!(poll_path(&s, &mine, true, None), "/v1/snapshot?format=3");
        let mut tagged = s.clone();
        tagged.path = "/v1/snapshot?pool=a".into();
        assert_eq!(
            poll_path(&tagged, &Snapshot::default(), false, None),
            "/v1/snapshot?pool=a&format=3"
        );

        history.update(vec![status(0, 1, true, false), status(1, 2, true, false)]);
        body.clear();
        history
            .delta_since(Some(mine.epoch), Some(mine.version))
            .encode(&mut body);
        assert_eq!(apply_poll(&mut mine, Some(200), &body), Ok(true));
        assert_eq!(mine, history.snapshot());
        // nothing new: an empty delta changes nothing
        body.clear();
        history
            .delta_since(Some(mine.epoch), Some(mine.version))
            .encode(&mut body);
        assert_eq!(apply_poll(&mut mine, Some(200), &body), Ok(false));

        let mut behind = Snapshot::default();
        assert!(matches!(
            apply_poll(&mut behind, Some(200), &body),
            Err(PollError::Mismatch(_))
        ));
        assert_eq!(
            apply_poll(&mut mine, Some(503), b""),
            Err(PollError::Status(503))
        );
        assert_eq!(apply_poll(&mut mine, None, b""), Err(PollError::NoAnswer));
        assert!(matches!(
            apply_poll(&mut mine, Some(200), b"garbage"),
            Err(PollError::Decode(_))
        ));
        assert_eq!(mine, history.snapshot(), "failed polls change nothing");
    }
}
