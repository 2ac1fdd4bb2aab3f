//! The HTTP API: the snapshot for the filters, a JSON view for people, Prometheus metrics and
//! health. Every handler reads the latest [`PoolView`]; none waits on the pool actor.
//!
//! - Until the endpoint source has been read once ([`PoolView::loaded`]), `/v1/snapshot`
//!   answers 503 with [`STATUS_HEADER`]`: not-loaded` instead of an empty pool, and `/readyz`
//!   answers 503: a restarted aggregator never tells the filters that the pool is empty. Then,
//!   until every KV follower has replayed what its server buffered, 503 `catching-up`: a
//!   replica that just started does not serve a pool that has forgotten the servers' caches.
//! - With a token configured, `/v1/snapshot`, `/v1/endpoints`, `/v1/pool` and `/v1/decisions` require
//!   `Authorization: Bearer <token>` (compared in constant time; 401 otherwise, counted).
//!   `/metrics`, `/healthz`, `/readyz` and the pool view's page stay open.
//! - Bounds ([`Limits`]): at most `http_max_connections` open connections (more are closed at
//!   once), request headers within `http_header_read_timeout`, and a failing `accept` backs
//!   off instead of spinning. Every refusal is counted by reason ([`crate::reject`]).

use kvoy_shared::protocol::{ENDPOINTS_PATH, POOL_PATH, REMOVALS_PATH, SNAPSHOT_PATH};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use kvoy_shared::relay::{
    self, DecisionBatch, DecisionRelay, RelayedDecision, RelayedRemoval, Removals,
};
use kvoy_shared::snapshot::{SnapshotFormat, CONTENT_TYPE};

use crate::config::{ApiToken, Limits};
use crate::follow::KvCounters;
use crate::http_client;
use crate::kv_link::{LinkCounters, LinkSettings, Linker};
use crate::page::{self, PoolPage};
use crate::pool::{EndpointView, PoolView};
use crate::prefill::PrefillReport;
use crate::reject::{Reason, Rejections};

mod metrics;

pub use kvoy_shared::protocol::AGGREGATOR_STATUS_HEADER as STATUS_HEADER;
pub use metrics::render_metrics;
/// Its value while the endpoint source has not been read successfully yet.
pub const NOT_LOADED: &str = "not-loaded";
/// The status header's value while a loaded aggregator replays the servers' KV events.
pub const CATCHING_UP: &str = "catching-up";

/// Counters of the API itself.
#[derive(Debug, Default)]
pub struct ApiCounters {
    pub snapshots_full: AtomicU64,
    pub snapshots_incremental: AtomicU64,
    /// Snapshot polls answered 503 "not loaded yet".
    pub snapshots_not_loaded: AtomicU64,
    pub snapshot_bytes: AtomicU64,
    /// Relayed routing decisions: received from proxies, refused (an address outside the
    /// pool), sent on to the other proxies; and the bytes both ways.
    pub decisions_received: AtomicU64,
    pub decisions_refused: AtomicU64,
    pub decisions_sent: AtomicU64,
    /// Removal records sent to proxies (pieces of at most a wire record's keys).
    pub removals_sent: AtomicU64,
    /// Decisions not linked: their proxy keys prompts with another schedule than the linker.
    pub link_schedule_mismatches: AtomicU64,
    pub decision_bytes_in: AtomicU64,
    pub decision_bytes_out: AtomicU64,
    /// Connections open now.
    pub connections: AtomicU64,
}

#[derive(Clone)]
pub struct Api {
    pub views: watch::Receiver<Arc<PoolView>>,
    pub counters: Arc<ApiCounters>,
    /// What the API refused, by reason.
    pub rejections: Arc<Rejections>,
    token: Option<ApiToken>,
    limits: Limits,
    /// The routing decisions the proxies relay to each other (`POST /v1/decisions`).
    relay: Arc<Mutex<DecisionRelay>>,
    /// Bumped on every push of decisions into `relay`: a waiting exchange (`wait_ms`) wakes.
    relay_pushed: Arc<watch::Sender<u64>>,
    /// The decisions of the replicas named in `peers:` are in (or could not be had): until
    /// then the snapshot answers 503 `catching-up`, as while the KV followers replay.
    pub peers_read: Arc<std::sync::atomic::AtomicBool>,
    /// The pool view's history and relayed decisions per endpoint (`GET /`, `/v1/pool`).
    pub page: Arc<PoolPage>,
    /// Relayed decisions linked to the servers' blocks (fed here and by the KV followers).
    pub links: Arc<Mutex<Linker>>,
}

/// Keys of relayed decisions the aggregator holds at most (8 bytes each, plus the entry): a
/// few seconds of decisions at the rates a pool's proxies route.
const RELAY_MAX_KEYS: usize = 1 << 20;
/// Removal records `/v1/pool` lists (newest), and one page of `/v1/removals` at most.
const LINK_REMOVALS_SHOWN: usize = 16;
const REMOVALS_PAGE: usize = 64;
/// Removal records one proxy exchange carries at most (each is written to the proxy's shared
/// decision log on its tick; the rest wait for the next exchange).
const REMOVALS_PER_EXCHANGE: usize = 64;
/// Keys one page of `GET /v1/decisions` carries at most (2 MiB of keys).
const PAGE_MAX_KEYS: usize = 1 << 18;
/// The longest an exchange may wait for other proxies' decisions (`wait_ms`).
/// Where kvoy-async workers report their lanes (`POST`), for the pool view.
pub const ASYNC_PATH: &str = "/v1/async";
const MAX_DECISION_WAIT: Duration = Duration::from_secs(30);

impl Api {
    pub fn new(
        views: watch::Receiver<Arc<PoolView>>,
        token: Option<ApiToken>,
        limits: Limits,
        links: LinkSettings,
    ) -> Self {
        let first_decision = DecisionRelay::first_number(views.borrow().history.epoch());
        Api {
            links: Arc::new(Mutex::new(Linker::new(links))),
            views,
            counters: Arc::default(),
            rejections: Arc::new(Rejections::new("kvoy-aggregator API")),
            token,
            limits,
            relay: Arc::new(Mutex::new(DecisionRelay::numbered_from(
                RELAY_MAX_KEYS,
                first_decision,
            ))),
            relay_pushed: Arc::new(watch::channel(0).0),
            peers_read: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            page: Arc::default(),
        }
    }
}

impl Api {
    /// Decisions another replica relayed (read as this one starts), as if a proxy had sent
    /// them: every proxy is handed them.
    pub fn seed_decisions(&self, decisions: Vec<RelayedDecision>) {
        if decisions.is_empty() {
            return;
        }
        if let Ok(mut relay) = self.relay.lock() {
            relay.push(0, decisions);
            self.relay_pushed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Caught up: loaded, the KV followers replayed, the peers' decisions read.
    fn caught_up(&self, view: &PoolView) -> bool {
        view.caught_up && self.peers_read.load(Ordering::Relaxed)
    }
}

/// Waits after a failed `accept`: 10 ms, doubling to 1 s, back to 10 ms after a success.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    failures: u32,
}

impl AcceptBackoff {
    /// The pause after one more failure.
    pub fn failed(&mut self) -> Duration {
        let d = Duration::from_millis(10).saturating_mul(1 << self.failures.min(7));
        self.failures = self.failures.saturating_add(1);
        d.min(Duration::from_secs(1))
    }

    pub fn succeeded(&mut self) {
        self.failures = 0;
    }
}

/// Serves connections until `shutdown` turns true.
pub async fn serve(listener: TcpListener, api: Api, mut shutdown: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(api.limits.http_max_connections));
    let mut backoff = AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff.succeeded();
                stream
            }
            Err(e) => {
                // E.g. EMFILE: the error repeats at once; wait instead of spinning.
                let pause = backoff.failed();
                api.rejections.reject(
                    Reason::AcceptError,
                    format_args!("accept failed: {e}; retrying in {pause:?}"),
                );
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = shutdown.changed() => break,
                }
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            api.rejections.reject(
                Reason::ConnectionCap,
                format_args!(
                    "a connection over limits.http_max_connections ({}), closed",
                    api.limits.http_max_connections
                ),
            );
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let api = api.clone();
        tokio::spawn(async move {
            api.counters.connections.fetch_add(1, Ordering::Relaxed);
            let handler = api.clone();
            let service = hyper::service::service_fn(move |req| {
                let api = handler.clone();
                async move {
                    if req.uri().path() == relay::PATH {
                        return Ok::<_, Infallible>(api.decisions(req).await);
                    }
                    if req.uri().path() == ASYNC_PATH {
                        return Ok::<_, Infallible>(api.async_report(req).await);
                    }
                    Ok::<_, Infallible>(api.handle(&req))
                }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(api.limits.http_header_read_timeout)
                .max_buf_size(64 * 1024)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                if e.is_timeout() || e.is_parse() || e.is_parse_too_large() {
                    api.rejections.reject(
                        Reason::BadRequest,
                        format_args!(
                            "{e} (request headers are due within limits.http_header_read_timeout_ms = {} ms)",
                            api.limits.http_header_read_timeout.as_millis()
                        ),
                    );
                } else {
                    log::debug!("kvoy-aggregator: connection ended: {e}");
                }
            }
            api.counters.connections.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
}

/// Equal bytes, in time that depends only on `expected`'s length.
fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != expected.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= given.get(i).copied().unwrap_or(0) ^ e;
    }
    std::hint::black_box(diff) == 0
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    reply(status, "text/plain; charset=utf-8", body)
}

/// What a snapshot poll asks for.
#[derive(Debug, PartialEq)]
struct SnapshotQuery {
    epoch: Option<u64>,
    since: Option<u64>,
    /// The newest format the poller reads (absent: format 1).
    format: Option<u64>,
}

/// The `limit` of a decisions request: at most [`relay::MAX_DECISIONS`], which is also the
/// default.
fn decisions_limit(query: &str) -> usize {
    query_u64(query, "limit").map_or(relay::MAX_DECISIONS, |l| {
        usize::try_from(l)
            .unwrap_or(usize::MAX)
            .min(relay::MAX_DECISIONS)
    })
}

/// The value of `name` in a query string as a number (the last `name` counts); absent or
/// unparsable is `None`.
/// The value of the last `name` in a query string (`""` for a bare `name`).
fn query_value<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
        .rfind(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

fn query_u64(query: &str, name: &str) -> Option<u64> {
    query_value(query, name).and_then(|v| v.parse().ok())
}

/// A poll's admission report, `proxy=<16 hex digits>&held=N` (the filters'
/// `kvoy_shared::snapshot_board::PollReport`); `None` unless both parse. The held count is bounded by
/// what one proxy could hold (a garbage figure must not swamp the sum).
fn admission_report(query: &str) -> Option<(u64, u64)> {
    let proxy = query_value(query, "proxy").and_then(|v| {
        (v.len() == 16)
            .then(|| u64::from_str_radix(v, 16).ok())
            .flatten()
    })?;
    let held = query_u64(query, "held")?;
    (held <= MAX_REPORTED_HELD).then_some((proxy, held))
}

/// Requests one proxy's report may say it holds, at most (far above any admission queue's
/// bound: `max_queue` is a u32 per worker).
const MAX_REPORTED_HELD: u64 = 1 << 40;

/// `epoch`, `since` and `format` from a query string; anything unparsable counts as absent
/// (a full snapshot, always a correct answer; format 1, which every filter reads).
fn snapshot_query(query: &str) -> SnapshotQuery {
    SnapshotQuery {
        epoch: query_u64(query, "epoch"),
        since: query_u64(query, "since"),
        format: query_u64(query, "format"),
    }
}

/// 401 with the bearer challenge.
fn unauthorized() -> Response<Full<Bytes>> {
    let mut r = text(StatusCode::UNAUTHORIZED, "a bearer token is required\n");
    r.headers_mut().insert(
        hyper::header::WWW_AUTHENTICATE,
        hyper::header::HeaderValue::from_static("Bearer realm=\"kvoy-aggregator\""),
    );
    r
}

impl Api {
    /// Whether `req` may read the pool (always, without a token configured).
    fn authorized<B>(&self, req: &Request<B>) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let given = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or(b"");
        if constant_time_eq(given, token.expose()) {
            return true;
        }
        let what = if given.is_empty() {
            "no bearer token"
        } else {
            "a wrong bearer token"
        };
        self.rejections.reject(
            Reason::Unauthorized,
            format_args!("{} {} with {what}", req.method(), req.uri().path()),
        );
        false
    }

    fn handle<B>(&self, req: &Request<B>) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
        }
        let path = req.uri().path();
        // The page itself is static and open; the pool it shows (`/v1/pool`) is not.
        if let Some((content_type, body)) = page::asset(path) {
            let mut r = reply(StatusCode::OK, content_type, body);
            r.headers_mut().insert(
                hyper::header::CONTENT_SECURITY_POLICY,
                hyper::header::HeaderValue::from_static(
                    // 'wasm-unsafe-eval': the explain panel compiles its WebAssembly module
                    // (served from here too); nothing else is evaluated.
                    "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; img-src 'self' data:; frame-ancestors 'none'",
                ),
            );
            return r;
        }
        if matches!(
            path,
            SNAPSHOT_PATH | ENDPOINTS_PATH | POOL_PATH | REMOVALS_PATH
        ) && !self.authorized(req)
        {
            return unauthorized();
        }
        let view = self.views.borrow().clone();
        match path {
            SNAPSHOT_PATH => {
                let query = req.uri().query().unwrap_or("");
                if let Some((proxy, held)) = admission_report(query) {
                    self.page.report_admission(proxy, held, std::time::Instant::now());
                }
                self.snapshot(&view, query)
            }
            ENDPOINTS_PATH => reply(
                StatusCode::OK,
                "application/json",
                serde_json::to_vec_pretty(&endpoints_json(&view)).unwrap_or_default(),
            ),
            POOL_PATH => {
                let mut json = self.page.json(&view, std::time::Instant::now());
                if let Some(o) = json.as_object_mut() {
                    o.insert("links".into(), self.links_json(&view));
                }
                reply(
                    StatusCode::OK,
                    "application/json",
                    serde_json::to_vec(&json).unwrap_or_default(),
                )
            }
            REMOVALS_PATH => self.removals(req.uri().query().unwrap_or("")),
            "/metrics" => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                render_metrics(&view, &self.counters, &self.rejections, &self.link_counters()),
            ),
            "/healthz" => text(StatusCode::OK, "ok\n"),
            // Ready once the endpoints are known, even if none of them is ready: the filters
            // must keep hearing from the aggregator to learn which servers are down.
            "/readyz" => {
                if !view.loaded {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "endpoints not loaded yet\n",
                    )
                } else if !self.caught_up(&view) {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "catching up: replaying the servers' buffered KV events\n",
                    )
                } else {
                    text(
                        StatusCode::OK,
                        format!(
                            "ready: {} endpoints, {} ready\n",
                            view.gauges.endpoints, view.gauges.ready
                        ),
                    )
                }
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "not found; try /, /v1/pool, /v1/async (POST), /v1/snapshot, /v1/endpoints, /v1/removals, /metrics, /healthz, /readyz\n",
            ),
        }
    }

    fn link_counters(&self) -> LinkCounters {
        self.links.lock().map(|l| l.counters()).unwrap_or_default()
    }

    /// The decision links for `/v1/pool`: counters, per endpoint what is linked and pending,
    /// and the last removals (without their keys: `GET /v1/removals` has them).
    fn links_json(&self, view: &PoolView) -> serde_json::Value {
        use serde_json::json;
        let Ok(l) = self.links.lock() else {
            return serde_json::Value::Null;
        };
        let c = l.counters();
        let endpoints: serde_json::Map<String, serde_json::Value> = view
            .endpoints
            .iter()
            .map(|e| {
                let s = l.endpoint(e.status.address);
                (
                    e.status.address.to_string(),
                    json!({
                        "linked_keys": s.linked_keys,
                        "linked_blocks": s.linked_blocks,
                        "pending_decisions": s.pending_decisions,
                        "pending_chains": s.pending_chains,
                    }),
                )
            })
            .collect();
        let removals: Vec<_> = l
            .recent_removals(LINK_REMOVALS_SHOWN)
            .iter()
            .map(|r| {
                json!({"seq": r.seq, "endpoint": r.endpoint.to_string(), "keys": r.count, "cleared": r.cleared})
            })
            .collect();
        json!({
            "decisions_linked": c.decisions_linked,
            "decisions_known": c.decisions_known,
            "decisions_repeated": c.decisions_repeated,
            "unlinked": {
                "no_chain": c.unlinked_no_chain,
                "ambiguous": c.unlinked_ambiguous,
                "capacity": c.unlinked_capacity,
            },
            "keys_linked": c.keys_linked,
            "exact_removals": c.exact_removals,
            "keys_removed": c.keys_removed,
            "offloads": c.offloads,
            "keys_offloaded": c.keys_offloaded,
            "unclaimed_chains": c.chains_expired,
            "endpoints": endpoints,
            "removals": removals,
        })
    }

    /// `GET /v1/removals?after=S[&limit=N]`: the linked keys the servers removed, records
    /// numbered after `S`, oldest first (JSON; keys as 16-digit hex).
    fn removals(&self, query: &str) -> Response<Full<Bytes>> {
        let after = query_u64(query, "after").unwrap_or(0);
        let limit = query_u64(query, "limit").map_or(REMOVALS_PAGE, |l| {
            usize::try_from(l).unwrap_or(usize::MAX).min(REMOVALS_PAGE)
        });
        let Ok(l) = self.links.lock() else {
            return text(StatusCode::INTERNAL_SERVER_ERROR, "links unavailable\n");
        };
        let page = l.removals_after(after, limit);
        drop(l);
        let next = page.last().map_or(after, |r| r.seq);
        let removals: Vec<_> = page
            .iter()
            .map(|r| {
                serde_json::json!({
                    "seq": r.seq,
                    "endpoint": r.endpoint.to_string(),
                    "count": r.count,
                    "cleared": r.cleared,
                    "event_ts": r.event_ts,
                    // Offloaded to this tier (its medium), rather than removed.
                    "offloaded_to": r.offloaded_to.map(kvoy_shared::Tier::name),
                    "keys": r.keys.iter().map(|k| format!("{:016x}", k.0)).collect::<Vec<_>>(),
                })
            })
            .collect();
        reply(
            StatusCode::OK,
            "application/json",
            serde_json::to_vec(&serde_json::json!({"next": next, "removals": removals}))
                .unwrap_or_default(),
        )
    }

    /// `POST /v1/async?worker=NAME`: a kvoy-async worker's lanes, for the pool view.
    async fn async_report(&self, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::POST {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "only POST (a kvoy-async report)\n",
            );
        }
        if !self.authorized(&req) {
            return unauthorized();
        }
        let worker = query_value(req.uri().query().unwrap_or(""), "worker")
            .filter(|w| {
                !w.is_empty()
                    && w.len() <= page::MAX_ASYNC_WORKER_NAME
                    && w.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
            })
            .map(str::to_owned);
        let Some(worker) = worker else {
            self.rejections.reject(
                Reason::BadRequest,
                format_args!("POST {ASYNC_PATH}: no valid worker= (1-128 of [A-Za-z0-9-_.:])"),
            );
            return text(
                StatusCode::BAD_REQUEST,
                "worker= is missing or not a plain name\n",
            );
        };
        let body = match http_client::read_body(req.into_body(), page::MAX_ASYNC_REPORT_BYTES).await
        {
            Ok(b) => b,
            Err(e) => {
                self.rejections.reject(
                    Reason::BadRequest,
                    format_args!(
                        "POST {ASYNC_PATH}: body unreadable or over {} bytes: {e}",
                        page::MAX_ASYNC_REPORT_BYTES
                    ),
                );
                return text(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "report too large or unreadable\n",
                );
            }
        };
        let report: page::AsyncReport = match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                self.rejections.reject(
                    Reason::BadRequest,
                    format_args!("POST {ASYNC_PATH}: not a kvoy-async report: {e}"),
                );
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("not a kvoy-async report: {e}\n"),
                );
            }
        };
        if self
            .page
            .report_async(&worker, report, std::time::Instant::now())
        {
            text(StatusCode::NO_CONTENT, "")
        } else {
            text(
                StatusCode::TOO_MANY_REQUESTS,
                "too many kvoy-async workers reporting\n",
            )
        }
    }

    /// `POST /v1/decisions?since=C[&limit=N]`: stores the proxy's decisions (only those naming a pool
    /// member) and answers with the other proxies' decisions after cursor `C`.
    async fn decisions(&self, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        if req.method() == Method::GET {
            return self.decisions_page(&req);
        }
        if req.method() != Method::POST {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "only POST (a proxy's exchange) or GET (a reader's page)\n",
            );
        }
        if !self.authorized(&req) {
            return unauthorized();
        }
        let query = req.uri().query().unwrap_or("");
        let cursor = query_u64(query, "since").unwrap_or(0);
        // The poller bounds what it takes per exchange (each costs it shared-data writes).
        let limit = decisions_limit(query);
        // A proxy that asks for removals gets them (format 2); one that does not, format 1.
        let removals_since = query_u64(query, "removals_since");
        // One that says `tiers=1` gets the offloads too (format 3 when there are some).
        let tiers = query_value(query, relay::TIERS_PARAM) == Some("1");
        // The proxy's key schedule, when it names one (older filters do not).
        let schedule = query_value(query, relay::SCHEDULE_PARAM).map(relay::parse_schedule);
        let wait = query_u64(query, relay::WAIT_PARAM)
            .map_or(Duration::ZERO, Duration::from_millis)
            .min(MAX_DECISION_WAIT);
        let body = match http_client::read_body(req.into_body(), relay::MAX_BATCH_BYTES).await {
            Ok(b) => b,
            Err(e) => {
                self.rejections.reject(
                    Reason::BadRequest,
                    format_args!(
                        "POST {}: body unreadable or over {} bytes: {e}",
                        relay::PATH,
                        relay::MAX_BATCH_BYTES
                    ),
                );
                return text(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "decision batch too large or unreadable\n",
                );
            }
        };
        let batch = match DecisionBatch::decode(&body) {
            Ok(b) => b,
            Err(e) => {
                self.rejections.reject(
                    Reason::BadRequest,
                    format_args!("POST {}: {e}", relay::PATH),
                );
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("bad decision batch: {e}\n"),
                );
            }
        };
        self.counters
            .decision_bytes_in
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        let view = self.views.borrow().clone();
        let received = batch.decisions.len();
        // Only the pool's members travel on: an address the aggregator does not serve is
        // never handed to another proxy.
        let kept: Vec<_> = batch
            .decisions
            .into_iter()
            .filter(|d| {
                view.endpoints
                    .iter()
                    .any(|e| e.status.address == d.endpoint)
            })
            .collect();
        let c = &self.counters;
        c.decisions_received
            .fetch_add(received as u64, Ordering::Relaxed);
        c.decisions_refused
            .fetch_add((received - kept.len()) as u64, Ordering::Relaxed);
        self.page.count_routed(kept.iter().map(|d| d.endpoint));
        if let Ok(mut l) = self.links.lock() {
            // Keys made with another schedule than the linker's would link to the wrong blocks
            // (and their removals forget the wrong prefixes): such a proxy's are not linked.
            let expected = l.settings().schedule;
            match schedule {
                Some(named) if named != Some(expected) => {
                    let before = c
                        .link_schedule_mismatches
                        .fetch_add(kept.len() as u64, Ordering::Relaxed);
                    if before == 0 {
                        log::warn!(
                            "POST {}: a proxy keys prompts with schedule {}, the linker expects {} (links: in pool.yaml must have the filters' block_size, max_blocks, dense_blocks, blocks_per_doubling): its decisions are relayed, not linked (counted in kvoy_aggregator_decisions_unlinked_schedule_total)",
                            relay::PATH,
                            named.map_or_else(|| "(unreadable)".to_owned(), |s| relay::schedule_param(&s)),
                            relay::schedule_param(&expected)
                        );
                    }
                }
                _ => l.decisions(&kept, std::time::Instant::now()),
            }
        }
        // Subscribed before the push and the first read, so that no push between them is missed.
        let mut pushed = self.relay_pushed.subscribe();
        let (mut decisions, mut next) = {
            let Ok(mut relay) = self.relay.lock() else {
                return text(StatusCode::INTERNAL_SERVER_ERROR, "relay unavailable\n");
            };
            if !kept.is_empty() {
                relay.push(batch.proxy, kept);
                self.relay_pushed.send_modify(|n| *n = n.wrapping_add(1));
            }
            pushed.borrow_and_update();
            relay.since(cursor, batch.proxy, limit)
        };
        // A long poll (`wait_ms`): with nothing for this proxy yet, the answer waits until
        // another proxy's decisions arrive (or the wait ends), so that a decision reaches the
        // other proxies one round trip after it was sent, not a poll interval later.
        if decisions.is_empty() && limit > 0 && !wait.is_zero() {
            let deadline = tokio::time::Instant::now() + wait;
            while decisions.is_empty() {
                match tokio::time::timeout_at(deadline, pushed.changed()).await {
                    Ok(Ok(())) => {}
                    _ => break,
                }
                pushed.borrow_and_update();
                let Ok(relay) = self.relay.lock() else {
                    return text(StatusCode::INTERNAL_SERVER_ERROR, "relay unavailable\n");
                };
                (decisions, next) = relay.since(cursor, batch.proxy, limit);
            }
        }
        c.decisions_sent
            .fetch_add(decisions.len() as u64, Ordering::Relaxed);
        let removals = removals_since.map(|since| {
            let (records, cursor) = match self.links.lock() {
                Ok(l) => l.removals_for_proxy(since, REMOVALS_PER_EXCHANGE),
                Err(_) => (Vec::new(), since),
            };
            // A record's keys travel in pieces of at most a wire record's worth.
            let removals: Vec<RelayedRemoval> = records
                .iter()
                .filter(|r| tiers || r.offloaded_to.is_none())
                .flat_map(|r| {
                    r.keys
                        .chunks(relay::MAX_KEYS_PER_DECISION)
                        .map(|keys| RelayedRemoval {
                            endpoint: r.endpoint,
                            keys: keys.to_vec(),
                            offloaded_to: r.offloaded_to,
                        })
                })
                .collect();
            c.removals_sent
                .fetch_add(removals.len() as u64, Ordering::Relaxed);
            Removals { cursor, removals }
        });
        let mut out = Vec::new();
        DecisionBatch {
            proxy: 0,
            cursor: next,
            decisions,
            removals,
        }
        .encode(&mut out);
        c.decision_bytes_out
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        reply(StatusCode::OK, relay::CONTENT_TYPE, out)
    }

    /// `GET /v1/decisions?after=C[&limit=N]`: the relayed decisions numbered after `C`, every
    /// proxy's, oldest first, as one [`DecisionBatch`] whose cursor is the last number in it
    /// (at most [`relay::MAX_DECISIONS`] decisions and [`PAGE_MAX_KEYS`] keys). Read only: the
    /// pool view's explain panel pages through it to rebuild the proxies' prefix index.
    fn decisions_page<B>(&self, req: &Request<B>) -> Response<Full<Bytes>> {
        if !self.authorized(req) {
            return unauthorized();
        }
        let query = req.uri().query().unwrap_or("");
        let cursor = query_u64(query, "after").unwrap_or(0);
        let limit = decisions_limit(query);
        let (decisions, next) = match self.relay.lock() {
            Ok(relay) => relay.after(cursor, limit, PAGE_MAX_KEYS),
            Err(_) => return text(StatusCode::INTERNAL_SERVER_ERROR, "relay unavailable\n"),
        };
        let mut out = Vec::new();
        DecisionBatch {
            proxy: 0,
            cursor: next,
            decisions,
            removals: None,
        }
        .encode(&mut out);
        reply(StatusCode::OK, relay::CONTENT_TYPE, out)
    }

    fn snapshot(&self, view: &PoolView, query: &str) -> Response<Full<Bytes>> {
        if !view.loaded || !self.caught_up(view) {
            // Not an empty pool: the filters keep what they have (their last snapshot, another
            // replica's, or their static endpoints) until the first discovery succeeds and the
            // servers' buffered KV events are replayed.
            self.counters
                .snapshots_not_loaded
                .fetch_add(1, Ordering::Relaxed);
            let (why, status) = if view.loaded {
                (
                    "catching up: replaying the servers' buffered KV events\n",
                    CATCHING_UP,
                )
            } else {
                (
                    "endpoints not loaded yet: the endpoint source has not been read successfully since the aggregator started\n",
                    NOT_LOADED,
                )
            };
            let mut r = text(StatusCode::SERVICE_UNAVAILABLE, why);
            r.headers_mut().insert(
                STATUS_HEADER,
                hyper::header::HeaderValue::from_static(status),
            );
            r.headers_mut().insert(
                hyper::header::RETRY_AFTER,
                hyper::header::HeaderValue::from_static("1"),
            );
            return r;
        }
        let q = snapshot_query(query);
        let delta = view.history.delta_since(q.epoch, q.since);
        let mut body = Vec::with_capacity(256);
        delta.encode_format(SnapshotFormat::negotiate(q.format), &mut body);
        let kind = if delta.is_full() {
            &self.counters.snapshots_full
        } else {
            &self.counters.snapshots_incremental
        };
        kind.fetch_add(1, Ordering::Relaxed);
        self.counters
            .snapshot_bytes
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        reply(StatusCode::OK, CONTENT_TYPE, body)
    }
}

fn kv_json(c: &KvCounters) -> serde_json::Value {
    let counters: serde_json::Map<_, _> = metrics::KV_COUNTERS
        .iter()
        .map(|(key, _, _, get)| ((*key).to_owned(), KvCounters::get(get(c)).into()))
        .collect();
    counters.into()
}

fn prefill_json(p: &PrefillReport) -> serde_json::Value {
    json!({
        "tokens_per_s": p.estimate.map(|e| e.tokens_per_s),
        "fixed_cost_ms": p.estimate.and_then(|e| e.fixed_s).map(|s| (s * 1e4).round() / 10.0),
        "evidence_tokens": p.evidence_tokens.round(),
        "evidence_requests": p.evidence_requests.round(),
        "concurrency": (p.concurrency * 100.0).round() / 100.0,
        "source": if p.from_histogram {
            "vllm:request_prefill_kv_computed_tokens"
        } else {
            "vllm:prompt_tokens - vllm:prefix_cache_hits"
        },
        "resets": p.resets,
    })
}

/// What `GET /v1/endpoints` and the pool view (`GET /v1/pool`) both say of an endpoint, with
/// `extra`'s fields.
pub(crate) fn endpoint_json(e: &EndpointView, extra: serde_json::Value) -> serde_json::Value {
    let s = &e.status;
    let mut v = json!({
        "address": s.address.to_string(),
        "models": s.models,
        "ready": s.ready,
        "stale": s.stale,
        "waiting": s.waiting,
        "running": s.running,
        "kv_cache_usage": s.kv_cache_usage,
        "capacity_blocks": s.capacity_blocks,
        "cached_blocks": {"gpu": s.cached_blocks[0], "cpu": s.cached_blocks[1], "storage": s.cached_blocks[2]},
        "prefix_hit_rate": s.prefix_hit_rate,
        "metrics_age_ms": e.metrics_age_ms,
        "last_error": e.last_error,
    });
    if let (Some(v), serde_json::Value::Object(extra)) = (v.as_object_mut(), extra) {
        v.extend(extra);
    }
    v
}

/// The JSON of `GET /v1/endpoints`.
pub fn endpoints_json(view: &PoolView) -> serde_json::Value {
    let endpoints: Vec<_> = view
        .endpoints
        .iter()
        .map(|e| {
            let s = &e.status;
            endpoint_json(e, json!({
                "slot": s.slot,
                "block_size": s.block_size,
                "cache_generation": s.cache_generation,
                "prefill_tokens_per_s": s.prefill_tokens_per_s,
                "prefill_estimate": prefill_json(&e.prefill),
                "scrapes": e.scrape_counters.scrapes.load(Ordering::Relaxed),
                "scrape_failures": e.scrape_counters.failures.load(Ordering::Relaxed),
                "kv_events": e.kv.as_ref().map(|(summary, counters)| {
                    let mut v = kv_json(counters);
                    if let Some(o) = v.as_object_mut() {
                        o.insert("endpoint".into(), json!(e.spec.kv_events.as_ref().map(|k| k.endpoint.clone())));
                        o.insert("receiving".into(), json!(summary.receiving));
                        if let Some(r) = &e.kv_rejections {
                            o.insert("rejected".into(), r.json(Reason::KV));
                        }
                    }
                    v
                }),
            }))
        })
        .collect();
    json!({
        "epoch": view.history.epoch(),
        "version": view.history.version(),
        "loaded": view.loaded,
        "pool": pool_gauges_json(view),
        "endpoints": endpoints,
    })
}

/// The pool's gauges as `GET /v1/endpoints` and the pool view (`GET /v1/pool`) give them.
pub fn pool_gauges_json(view: &PoolView) -> serde_json::Value {
    let g = &view.gauges;
    json!({
        "endpoints": g.endpoints,
        "ready": g.ready,
        "stale": g.stale,
        "waiting": g.waiting,
        "running": g.running,
        "kv_cache_usage": g.kv_cache_usage,
        "saturation": g.saturation,
    })
}

#[cfg(test)]
mod tests {
    use super::metrics::label;
    use super::*;

    #[test]
    fn query_parsing_is_lenient() {
        let q = |epoch, since, format| SnapshotQuery {
            epoch,
            since,
            format,
        };
        assert_eq!(snapshot_query("epoch=5&since=7"), q(Some(5), Some(7), None));
        assert_eq!(
            snapshot_query("since=x&epoch=&format=2"),
            q(None, None, Some(2))
        );
        assert_eq!(snapshot_query("format=v2&x"), q(None, None, None));
        assert_eq!(snapshot_query(""), q(None, None, None));
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn a_polls_admission_report_needs_both_fields() {
        assert_eq!(
            admission_report("format=2&proxy=00000000000000ab&held=7"),
            Some((0xab, 7))
        );
        assert_eq!(admission_report("format=2&held=7"), None);
        assert_eq!(admission_report("proxy=ab&held=7"), None, "16 digits");
        assert_eq!(admission_report("proxy=zz000000000000ab&held=7"), None);
        assert_eq!(admission_report("proxy=00000000000000ab"), None);
        assert_eq!(
            admission_report("proxy=00000000000000ab&held=99999999999999999"),
            None,
            "beyond any queue"
        );
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!constant_time_eq(b"0123456789abcdeg", b"0123456789abcdef"));
        assert!(!constant_time_eq(b"0123456789abcde", b"0123456789abcdef"));
        assert!(!constant_time_eq(b"0123456789abcdef0", b"0123456789abcdef"));
        assert!(!constant_time_eq(b"", b"0123456789abcdef"));
    }

    #[test]
    fn accept_backoff_grows_and_resets() {
        let mut b = AcceptBackoff::default();
        let waits: Vec<u128> = (0..10).map(|_| b.failed().as_millis()).collect();
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        b.succeeded();
        assert_eq!(b.failed(), Duration::from_millis(10));
    }
}
