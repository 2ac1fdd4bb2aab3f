//! The Prometheus text of `GET /metrics`: the API's counters, the decision links', the pool's
//! gauges, and per endpoint its status, its scrapes and its KV-event follower.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use super::ApiCounters;
use crate::follow::KvCounters;
use crate::kv_link::LinkCounters;
use crate::pool::PoolView;
use crate::reject::{Reason, Rejections};

/// Escapes a label value (`\`, `"`, newline).
pub(super) fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Family<'a> {
    out: &'a mut String,
}

impl Family<'_> {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// A family of one sample without labels.
    fn single(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.head(name, kind, help);
        self.sample(name, &[], value);
    }

    /// A family of one sample per value of `label`.
    fn by<'v>(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        label: &str,
        samples: impl IntoIterator<Item = (&'v str, f64)>,
    ) {
        self.head(name, kind, help);
        for (value, n) in samples {
            self.sample(name, &[(label, value)], n);
        }
    }
}

fn load(c: &AtomicU64) -> f64 {
    c.load(Ordering::Relaxed) as f64
}

type KvGetter = fn(&KvCounters) -> &AtomicU64;

/// Every KV-event follower counter ([`KvCounters`]): its key in `/v1/endpoints`' `kv_events`,
/// its metric (per endpoint) and the metric's help.
pub(super) const KV_COUNTERS: [(&str, &str, &str, KvGetter); 15] = [
    (
        "batches",
        "kvoy_aggregator_kv_event_batches_total",
        "KV-event batches applied.",
        |c| &c.batches,
    ),
    (
        "blocks_stored",
        "kvoy_aggregator_kv_blocks_stored_total",
        "Blocks stored by BlockStored events.",
        |c| &c.blocks_stored,
    ),
    (
        "blocks_removed",
        "kvoy_aggregator_kv_blocks_removed_total",
        "Blocks removed by BlockRemoved events.",
        |c| &c.blocks_removed,
    ),
    (
        "cleared",
        "kvoy_aggregator_kv_cleared_total",
        "AllBlocksCleared events.",
        |c| &c.cleared,
    ),
    (
        "unknown_events",
        "kvoy_aggregator_kv_unknown_events_total",
        "Events of an unknown type, counted and skipped.",
        |c| &c.unknown_events,
    ),
    (
        "orphan_blocks",
        "kvoy_aggregator_kv_orphan_blocks_total",
        "Blocks stored under a parent the aggregator does not hold.",
        |c| &c.orphan_blocks,
    ),
    (
        "unknown_removals",
        "kvoy_aggregator_kv_unknown_removals_total",
        "Removals of blocks the aggregator does not hold.",
        |c| &c.unknown_removals,
    ),
    (
        "malformed_events",
        "kvoy_aggregator_kv_malformed_events_total",
        "Events with inconsistent fields, skipped.",
        |c| &c.malformed_events,
    ),
    (
        "decode_errors",
        "kvoy_aggregator_kv_decode_errors_total",
        "Messages or payloads that did not decode.",
        |c| &c.decode_errors,
    ),
    (
        "seq_gaps",
        "kvoy_aggregator_kv_seq_gaps_total",
        "Sequence gaps seen on the live stream.",
        |c| &c.seq_gaps,
    ),
    (
        "publisher_restarts",
        "kvoy_aggregator_kv_publisher_restarts_total",
        "Publisher restarts (sequence went back).",
        |c| &c.publisher_restarts,
    ),
    (
        "server_restarts",
        "kvoy_aggregator_server_restarts_total",
        "Server restarts seen in its metrics (counters went back); its cache is dropped.",
        |c| &c.server_restarts,
    ),
    (
        "replayed_batches",
        "kvoy_aggregator_kv_replayed_batches_total",
        "Missed batches recovered through the replay socket.",
        |c| &c.replayed_batches,
    ),
    (
        "replay_failures",
        "kvoy_aggregator_kv_replay_failures_total",
        "Replay requests that failed.",
        |c| &c.replay_failures,
    ),
    (
        "batches_lost",
        "kvoy_aggregator_kv_batches_lost_total",
        "Missed batches that could not be recovered.",
        |c| &c.batches_lost,
    ),
];

/// The decision links' counters ([`crate::kv_link`]).
fn link_metrics(f: &mut Family<'_>, c: &LinkCounters) {
    f.by(
        "kvoy_aggregator_decision_links_total",
        "counter",
        "Relayed decisions linked to the server blocks their prefill stored, known already (every key linked), or repeating one pending.",
        "what",
        [
            ("linked", c.decisions_linked as f64),
            ("known", c.decisions_known as f64),
            ("repeated", c.decisions_repeated as f64),
        ],
    );
    f.by(
        "kvoy_aggregator_decisions_unlinked_total",
        "counter",
        "Relayed decisions left unlinked, by reason.",
        "reason",
        [
            ("no_chain", c.unlinked_no_chain as f64),
            ("ambiguous", c.unlinked_ambiguous as f64),
            ("capacity", c.unlinked_capacity as f64),
        ],
    );
    let totals: [(&str, &str, u64); 6] = [
        (
            "kvoy_aggregator_linked_keys_total",
            "Text block keys linked to server blocks.",
            c.keys_linked,
        ),
        (
            "kvoy_aggregator_exact_removals_total",
            "Server block removals that removed linked text keys (GET /v1/removals).",
            c.exact_removals,
        ),
        (
            "kvoy_aggregator_removed_keys_total",
            "Linked text keys removed by the servers' block removals.",
            c.keys_removed,
        ),
        (
            "kvoy_aggregator_offloads_total",
            "Server block removals from the GPU that moved linked text keys to a slower tier, where the server still holds them (GET /v1/removals, offloaded_to).",
            c.offloads,
        ),
        (
            "kvoy_aggregator_offloaded_keys_total",
            "Linked text keys moved off the GPU to a slower tier.",
            c.keys_offloaded,
        ),
        (
            "kvoy_aggregator_unclaimed_chains_total",
            "Stored block chains no relayed decision claimed within the window.",
            c.chains_expired,
        ),
    ];
    for (name, help, n) in totals {
        f.single(name, "counter", help, n as f64);
    }
}

/// The Prometheus text of `GET /metrics`.
pub fn render_metrics(
    view: &PoolView,
    api: &ApiCounters,
    rejected: &Rejections,
    links: &LinkCounters,
) -> String {
    let mut out = String::with_capacity(4096);
    let mut f = Family { out: &mut out };
    link_metrics(&mut f, links);
    f.single(
        "kvoy_aggregator_loaded",
        "gauge",
        "1 once the endpoint source has been read successfully (before that /v1/snapshot answers 503 not-loaded).",
        f64::from(u8::from(view.loaded)),
    );
    f.single(
        "kvoy_aggregator_http_connections",
        "gauge",
        "HTTP connections open.",
        load(&api.connections),
    );
    f.by(
        "kvoy_aggregator_http_rejected_total",
        "counter",
        "HTTP connections and requests refused, by reason (the first of each reason is logged).",
        "reason",
        Reason::HTTP
            .iter()
            .map(|r| (r.label(), rejected.count(*r) as f64)),
    );
    let g = &view.gauges;
    let pool: [(&str, &str, f64); 7] = [
        (
            "kvoy_aggregator_pool_endpoints",
            "Endpoints in the pool.",
            g.endpoints as f64,
        ),
        (
            "kvoy_aggregator_pool_ready_endpoints",
            "Endpoints whose scrapes succeed.",
            g.ready as f64,
        ),
        (
            "kvoy_aggregator_pool_stale_endpoints",
            "Endpoints whose metrics are older than the staleness threshold.",
            g.stale as f64,
        ),
        (
            "kvoy_aggregator_pool_queue_depth",
            "Requests waiting in the servers' queues, over ready endpoints.",
            g.waiting as f64,
        ),
        (
            "kvoy_aggregator_pool_running_requests",
            "Requests running on ready endpoints.",
            g.running as f64,
        ),
        (
            "kvoy_aggregator_pool_kv_cache_usage",
            "Mean KV-cache use (0-1) of ready, fresh endpoints.",
            g.kv_cache_usage,
        ),
        (
            "kvoy_aggregator_pool_saturation",
            "Mean over endpoints of max(waiting/5, kv/0.8); stale or not-ready endpoints count 1.",
            g.saturation,
        ),
    ];
    for (name, help, value) in pool {
        f.single(name, "gauge", help, value);
    }
    f.single(
        "kvoy_aggregator_snapshot_version",
        "gauge",
        "Current snapshot version.",
        view.history.version() as f64,
    );
    f.by(
        "kvoy_aggregator_snapshot_requests_total",
        "counter",
        "Snapshot requests served, by kind.",
        "kind",
        [
            ("full", load(&api.snapshots_full)),
            ("incremental", load(&api.snapshots_incremental)),
            ("not_loaded", load(&api.snapshots_not_loaded)),
        ],
    );
    f.single(
        "kvoy_aggregator_snapshot_bytes_total",
        "counter",
        "Bytes of snapshots served.",
        load(&api.snapshot_bytes),
    );
    f.by(
        "kvoy_aggregator_decisions_total",
        "counter",
        "Routing decisions relayed between proxies (POST /v1/decisions), by what became of them.",
        "what",
        [
            ("received", load(&api.decisions_received)),
            ("refused", load(&api.decisions_refused)),
            ("sent", load(&api.decisions_sent)),
        ],
    );
    f.single(
        "kvoy_aggregator_decisions_unlinked_schedule_total",
        "counter",
        "Relayed decisions not linked to the servers' blocks: their proxy keys prompts with another block schedule than links: in pool.yaml.",
        load(&api.link_schedule_mismatches),
    );
    f.single(
        "kvoy_aggregator_removals_sent_total",
        "counter",
        "Confirmed removals (keys whose server blocks were evicted) sent to proxies in their decision exchange.",
        load(&api.removals_sent),
    );
    f.by(
        "kvoy_aggregator_decision_bytes_total",
        "counter",
        "Bytes of decision batches, received from and sent to proxies.",
        "direction",
        [
            ("in", load(&api.decision_bytes_in)),
            ("out", load(&api.decision_bytes_out)),
        ],
    );
    f.single(
        "kvoy_aggregator_source_reloads_total",
        "counter",
        "Endpoint lists loaded from the source.",
        view.source_reloads as f64,
    );
    f.single(
        "kvoy_aggregator_source_errors_total",
        "counter",
        "Endpoint source reads that failed (the previous list was kept).",
        view.source_errors as f64,
    );

    type Getter = fn(&crate::pool::EndpointView) -> Option<f64>;
    let per_endpoint: [(&str, &str, &str, Getter); 10] = [
        (
            "kvoy_aggregator_endpoint_ready",
            "gauge",
            "1 when the endpoint's scrapes succeed.",
            |e| Some(f64::from(u8::from(e.status.ready))),
        ),
        (
            "kvoy_aggregator_endpoint_stale",
            "gauge",
            "1 when the endpoint's metrics are stale.",
            |e| Some(f64::from(u8::from(e.status.stale))),
        ),
        (
            "kvoy_aggregator_endpoint_waiting_requests",
            "gauge",
            "Requests waiting, as last scraped.",
            |e| Some(f64::from(e.status.waiting)),
        ),
        (
            "kvoy_aggregator_endpoint_running_requests",
            "gauge",
            "Requests running, as last scraped.",
            |e| Some(f64::from(e.status.running)),
        ),
        (
            "kvoy_aggregator_endpoint_kv_cache_usage",
            "gauge",
            "KV-cache use (0-1), as last scraped.",
            |e| Some(f64::from(e.status.kv_cache_usage)),
        ),
        (
            "kvoy_aggregator_endpoint_prefill_tokens_per_second",
            "gauge",
            "Prefill rate estimated from the server's metrics (prompt tokens computed per second), once known.",
            |e| e.status.prefill_tokens_per_s.map(f64::from),
        ),
        (
            "kvoy_aggregator_endpoint_cache_generation",
            "gauge",
            "Times the endpoint's cache was cleared or its publisher restarted.",
            |e| Some(f64::from(e.status.cache_generation)),
        ),
        (
            "kvoy_aggregator_endpoint_metrics_age_seconds",
            "gauge",
            "Age of the last successful scrape.",
            |e| e.metrics_age_ms.map(|ms| ms as f64 / 1000.0),
        ),
        (
            "kvoy_aggregator_scrapes_total",
            "counter",
            "Scrapes attempted.",
            |e| Some(load(&e.scrape_counters.scrapes)),
        ),
        (
            "kvoy_aggregator_scrape_failures_total",
            "counter",
            "Scrapes that failed.",
            |e| Some(load(&e.scrape_counters.failures)),
        ),
    ];
    let addresses: Vec<String> = view
        .endpoints
        .iter()
        .map(|e| e.status.address.to_string())
        .collect();
    for (name, kind, help, get) in per_endpoint {
        f.head(name, kind, help);
        for (e, addr) in view.endpoints.iter().zip(&addresses) {
            if let Some(v) = get(e) {
                f.sample(name, &[("endpoint", addr)], v);
            }
        }
    }
    f.head(
        "kvoy_aggregator_cached_blocks",
        "gauge",
        "Blocks known cached from KV events, by medium.",
    );
    for (e, addr) in view.endpoints.iter().zip(&addresses) {
        if e.kv.is_some() {
            for (tier, n) in kvoy_shared::Tier::ALL.iter().zip(e.status.cached_blocks) {
                f.sample(
                    "kvoy_aggregator_cached_blocks",
                    &[("endpoint", addr), ("medium", tier.name())],
                    f64::from(n),
                );
            }
        }
    }
    f.head(
        "kvoy_aggregator_kv_rejected_total",
        "counter",
        "KV-event input refused or skipped, by reason (the first of each reason per endpoint is logged; /v1/endpoints shows the last).",
    );
    for (e, addr) in view.endpoints.iter().zip(&addresses) {
        if let Some(r) = &e.kv_rejections {
            for reason in Reason::KV {
                f.sample(
                    "kvoy_aggregator_kv_rejected_total",
                    &[("endpoint", addr), ("reason", reason.label())],
                    r.count(*reason) as f64,
                );
            }
        }
    }
    for (_, name, help, get) in KV_COUNTERS {
        f.head(name, "counter", help);
        for (e, addr) in view.endpoints.iter().zip(&addresses) {
            if let Some((_, counters)) = &e.kv {
                f.sample(name, &[("endpoint", addr)], load(get(counters)));
            }
        }
    }
    out
}
