//! Every scorer's score per endpoint, for `decide`.
//!
//! The `kvoy_prefix_affinity` filter does not report its scores (it only sets the destination),
//! and `kvoy-local` does not change the filters. So the scores are recomputed natively with the
//! filter's own core, [`kvoy_shared::prefix_affinity::Router`], from the filter's own state: the plugin
//! configuration bytes it was given, the pool it routes over (the aggregator's snapshot from its
//! shared-data board, per [`kvoy_shared::snapshot_board::choose`], or the static endpoints), the prefix
//! index rebuilt from the cross-worker decision log it keeps in shared data, and the in-flight
//! counts from its shared in-flight table. The state is read (never written) just before the
//! request enters the chain, and the request is then scored against it. The wasm filter's
//! choice is the truth; the table says whether it was among the best scores (ties are broken at
//! random by the filter).

use kvoy_harness::Plugin;
use kvoy_shared::prefix_affinity::{
    DecisionKind, PluginConfig, RouteError, Router, Scorer, Weights,
};
use kvoy_shared::request::Api;
use kvoy_shared::shared_data::{
    self, DecisionLog, Logged, OutstandingTable, SharedStore, StoreError,
};
use kvoy_shared::snapshot_board::{self, PoolChoice, SnapshotBoard};
use kvoy_shared::{EndpointId, Outstanding};

/// Read-only shared data of a plugin.
struct PluginStore<'a>(&'a Plugin);

impl SharedStore for PluginStore<'_> {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.0.shared_data(key)
    }

    fn set(&self, _key: &str, _value: &[u8], _cas: u32) -> Result<(), StoreError> {
        Err(StoreError::Unavailable(
            "the score mirror only reads".to_owned(),
        ))
    }
}

/// The prefix-affinity filter's configuration, for scoring.
pub struct Mirror {
    config: PluginConfig,
    namespace: String,
}

/// The filter's state just before a request.
pub struct Prepared {
    router: Router,
    counts: Vec<Outstanding>,
    pool_live: bool,
    /// The plugin's clock (the filter's: the outstanding table's entries are on it).
    now: std::time::Duration,
}

/// One endpoint's scores.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScoreRow {
    pub endpoint: String,
    /// Leading request blocks the endpoint is believed to hold.
    pub matched_blocks: u32,
    /// This proxy's requests in flight to it.
    pub inflight: u32,
    /// Known queue (from the aggregator or the static configuration).
    pub waiting: Option<u32>,
    pub kv_cache_usage: Option<f64>,
    /// Raw scores (0-1), before weights.
    pub prefix: f64,
    pub inflight_score: f64,
    pub queue: f64,
    pub kv_cache: f64,
    /// The session pin's weight when the request is pinned here, else 0.
    pub session: f64,
    /// The weighted sum.
    pub total: f64,
    /// The hot-spot guard removed the prefix score.
    pub hot: bool,
    /// The cost model's terms (see `kvoy_shared::prefix_affinity::cost`): prompt tokens the endpoint would
    /// compute, prefill tokens queued there, sequences decoding, seconds.
    pub uncached_tokens: f64,
    pub queued_tokens: f64,
    pub running: u32,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub cost_s: f64,
    /// Among the best (the endpoint chosen, or tied with it).
    pub best: bool,
}

/// The scores of one request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScoreTable {
    /// `scored`, `passthrough` (not an inference request: least-loaded), `fallback` (bad body,
    /// least-loaded), or `error` (the filter answers with an error).
    pub kind: &'static str,
    /// `cost` (the default) or `weighted`.
    pub scorer: &'static str,
    pub request_blocks: u32,
    pub weights: WeightsOut,
    /// Whether the pool was the aggregator's.
    pub pool_live: bool,
    pub rows: Vec<ScoreRow>,
    /// The error the router gives, for `error`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The weights, for output.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct WeightsOut {
    pub prefix: f64,
    pub inflight: f64,
    pub queue: f64,
    pub kv_cache: f64,
    pub session: f64,
}

impl From<&Weights> for WeightsOut {
    fn from(w: &Weights) -> Self {
        WeightsOut {
            prefix: w.prefix,
            inflight: w.inflight,
            queue: w.queue,
            kv_cache: w.kv_cache,
            session: w.session,
        }
    }
}

impl Mirror {
    /// From the plugin configuration bytes the filter was given.
    pub fn new(raw: &[u8]) -> Result<Mirror, kvoy_shared::prefix_affinity::ConfigError> {
        let config = PluginConfig::from_json(raw)?;
        Ok(Mirror {
            namespace: shared_data::pool_namespace("kvoy.pa", &config),
            config,
        })
    }

    /// Reads the filter's state (the pool, the index, the in-flight counts) from `plugin`.
    pub fn prepare(&self, plugin: &Plugin) -> Prepared {
        let store = PluginStore(plugin);
        let now = plugin
            .now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mut router = Router::new(self.config.clone(), 1);
        let mut pool_live = false;
        if let Some(settings) = &self.config.aggregator {
            // The filter's owner id is random; any other id reads the same board.
            let board = SnapshotBoard::new(&self.namespace, 0);
            let meta = board.read_meta(&store);
            let snapshot = board.read_snapshot(&store);
            let now_ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
            let choice = snapshot_board::choose(
                meta,
                snapshot.is_some(),
                now_ms,
                settings,
                self.config.pool.is_empty(),
            );
            if let (PoolChoice::Live { with_loads }, Some(snapshot)) = (choice, snapshot) {
                router.set_pool(snapshot_board::live_pool(&snapshot, with_loads));
                pool_live = true;
            }
        }
        // Everything the workers logged: each worker's index holds all of it before it routes
        // (a worker replays at most 32 records per request and the rest on its tick; `decide`
        // alternates the workers, so neither is ever that far behind).
        let mut log = DecisionLog::new(
            &self.namespace,
            self.config.decision_log_slots,
            0x6b76_6f79_6c6f_6361,
        );
        log.poll_at_most_with(&store, usize::MAX, |logged| {
            if let Logged::Routed(endpoint, keys, _) = logged {
                router.apply_remote(endpoint, keys);
            }
            true
        });
        let mut counts = Vec::new();
        OutstandingTable::new(&self.namespace).read(&store, router.pool(), &mut counts);
        Prepared {
            router,
            counts,
            pool_live,
            now,
        }
    }
}

impl Prepared {
    /// Scores a request as the filter would, given the session pin it received (if any).
    pub fn score(mut self, method: &str, path: &str, body: &[u8], pin: Option<&str>) -> ScoreTable {
        let api = Api::from_path(path).filter(|_| method.eq_ignore_ascii_case("POST"));
        let result = match api {
            Some(api) => self
                .router
                .route_pinned(api, body, &self.counts, pin, self.now),
            None => self.router.route_passthrough(&self.counts),
        };
        let weights = self.router.config().weights;
        let (kind, request_blocks, error) = match &result {
            Ok(d) => (
                match d.kind {
                    DecisionKind::Scored => "scored",
                    DecisionKind::Passthrough => "passthrough",
                    DecisionKind::Fallback => "fallback",
                },
                d.request_blocks,
                None,
            ),
            Err(e) => ("error", 0, Some(describe(e))),
        };
        let scores = self.router.last_scores();
        let costs = self.router.last_costs();
        // The filter breaks ties with its own randomness: every row that ties with this
        // router's choice is marked (the filter's pick is one of them).
        let chosen = result.as_ref().ok().and_then(|d| {
            self.router
                .last_candidates()
                .iter()
                .position(|c| c.id == d.endpoint)
        });
        let weighted = self.router.config().scorer == Scorer::Weighted;
        let ties = |i: usize| -> bool {
            let Some(k) = chosen else {
                return false;
            };
            if weighted && !scores.is_empty() {
                let (a, b) = (scores.get(i), scores.get(k));
                return a
                    .zip(b)
                    .is_some_and(|(a, b)| (a.total - b.total).abs() < 1e-9);
            }
            match (costs.get(i), costs.get(k)) {
                (Some(a), Some(b)) => (a.total_s - b.total_s).abs() < 1e-9,
                _ => i == k,
            }
        };
        let rows = self
            .router
            .last_candidates()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let s = scores.get(i).copied().unwrap_or_default();
                let t = costs.get(i).copied().unwrap_or_default();
                ScoreRow {
                    endpoint: self.address(c.id),
                    matched_blocks: c.matched,
                    inflight: c.inflight,
                    waiting: c.load.waiting,
                    kv_cache_usage: c.load.kv_cache_usage,
                    prefix: s.prefix,
                    inflight_score: s.inflight,
                    queue: s.queue,
                    kv_cache: s.kv_cache,
                    session: if c.pinned { weights.session } else { 0.0 },
                    total: s.total,
                    hot: s.hot,
                    uncached_tokens: t.uncached_tokens,
                    queued_tokens: t.queued_tokens,
                    running: t.running,
                    prefill_s: t.prefill_s,
                    decode_s: t.decode_s,
                    cost_s: t.total_s,
                    best: ties(i),
                }
            })
            .collect();
        ScoreTable {
            kind,
            scorer: match self.router.config().scorer {
                Scorer::Cost => "cost",
                Scorer::Weighted => "weighted",
            },
            request_blocks,
            weights: WeightsOut::from(&weights),
            pool_live: self.pool_live,
            rows,
            error,
        }
    }

    fn address(&self, id: EndpointId) -> String {
        self.router
            .pool()
            .get(id)
            .map_or_else(|| format!("#{}", id.0), |e| e.address_text.clone())
    }
}

fn describe(e: &RouteError) -> String {
    format!("{} {}", e.status(), e)
}
