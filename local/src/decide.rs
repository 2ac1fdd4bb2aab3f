//! `kvoy-local decide`: runs requests through the filter chain under the harness and reports,
//! for each, what the chain decided (the endpoint, or the local reply), every scorer's score per
//! endpoint (see [`crate::mirror`]) and the time each filter took.
//!
//! Requests run one after the other on the chain (worker `i % workers` for request `i`), each
//! answered by a simulated upstream `200` (so that response callbacks run: the served-endpoint
//! header, session bindings) and then ended (`proxy_on_log`: in-flight counts released), so a
//! list of requests shows how the filters' state evolves. With a snapshot (the body of
//! kvoy-aggregator's `GET /v1/snapshot`), the filters' polls of the aggregator are answered with
//! it before the first request, so they route over that pool.

use std::time::{Duration, Instant};

use kvoy_harness::{ChainState, FilterChain, HeaderMap, HttpResponse};
use kvoy_shared::session::PIN_HEADER;
use kvoy_shared::snapshot::Snapshot;

use crate::chain::{self, Callouts, StartError};
use crate::config::Config;
use crate::mirror::{Mirror, ScoreTable};
use crate::request::Request;

/// The filter whose scores are shown.
pub const PREFIX_AFFINITY: &str = "kvoy_prefix_affinity";
/// The combined filter: its `prefix_affinity` section's scores are shown.
pub const COMBINED: &str = "kvoy";
/// The header the chain's routing decision is read from.
pub use kvoy_shared::protocol::DESTINATION_HEADER;
/// The filter-state object that can carry the destination instead (Envoy's original-dst).
pub const ORIGINAL_DST_STATE: &str = "envoy.network.transport_socket.original_dst_address";

/// Longest (virtual) time a held request is waited for.
const MAX_HOLD: Duration = Duration::from_secs(120);
/// Virtual time step while priming the snapshot or waiting for a held request.
const STEP: Duration = Duration::from_millis(10);

/// Options of `decide`.
#[derive(Debug, Clone, Default)]
pub struct DecideOptions {
    /// The aggregator's snapshot (binary), answered to the filters' polls.
    pub snapshot: Option<Vec<u8>>,
    /// Do not simulate the upstream response (response callbacks do not run).
    pub no_response: bool,
}

/// What became of a request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The chain let it go to `endpoint`.
    Routed { endpoint: String },
    /// The chain let it go without a destination (Envoy's router would answer 503).
    NoDestination,
    /// Filter `filter` answered it.
    LocalReply {
        filter: String,
        status: u32,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// Filter `filter` still held it after two minutes (virtual).
    Held { filter: String },
    /// Filter `filter` reset the stream.
    Reset { filter: String },
}

/// The report on one request.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RequestReport {
    pub index: usize,
    pub method: String,
    pub path: String,
    pub worker: usize,
    #[serde(flatten)]
    pub outcome: Outcome,
    /// How long (virtual time) a filter held the request before letting it go.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_ms: Option<u64>,
    /// Headers the filters added to (or changed in) the request on its way upstream.
    pub upstream_headers: Vec<(String, String)>,
    /// Headers the filters added to (or changed in) the simulated upstream response.
    pub response_headers: Vec<(String, String)>,
    /// Scores of the prefix-affinity filter (or the combined filter's stage), when it is in the
    /// chain and saw the request. The combined filter's session pin is not visible outside it:
    /// its requests are scored unpinned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scores: Option<ScoreTable>,
    /// Time in each filter (wall clock, µs) until the decision, in chain order.
    pub filter_us: Vec<FilterTime>,
    /// Time of the whole request phase through the chain (µs).
    pub total_us: f64,
    /// Each filter's crossings over the whole request (response and end of stream included),
    /// in chain order.
    pub filter_calls: Vec<FilterCalls>,
}

/// One filter's host calls, shared-data operations and VM entries for one request, summed
/// over its VMs (ticks and queue deliveries the request caused included).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FilterCalls {
    pub filter: String,
    pub host_calls: u64,
    pub shared_data: u64,
    pub vm_entries: u64,
    /// The host calls by import name (WASI stubs left out: see
    /// [`kvoy_harness::HostCallNames`]).
    pub by_name: std::collections::BTreeMap<&'static str, u64>,
}

/// Time spent in one filter's callbacks.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FilterTime {
    pub filter: String,
    pub us: f64,
}

/// Microseconds, to 0.1.
fn micros(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e7).round() / 10.0
}

/// Why `decide` could not run.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("the snapshot is not a kvoy-aggregator snapshot: {0}")]
    Snapshot(String),
    #[error("the `{PREFIX_AFFINITY}` configuration: {0}")]
    PrefixConfig(String),
    #[error("request {index}: {source}")]
    Request {
        index: usize,
        source: kvoy_harness::Error,
    },
    #[error("priming the snapshot: {0}")]
    Prime(kvoy_harness::Error),
}

/// Runs `requests` through a fresh chain built from `config`.
pub fn decide(
    config: &Config,
    requests: &[Request],
    options: &DecideOptions,
) -> Result<Vec<RequestReport>, DecideError> {
    if let Some(bytes) = &options.snapshot {
        Snapshot::decode(bytes).map_err(|e| DecideError::Snapshot(e.to_string()))?;
    }
    let chain = chain::start(config, Callouts::Recorded, None)?;
    let prefix = match config.filter(PREFIX_AFFINITY) {
        Some((index, f)) => Some((index, f.configuration.as_slice())),
        None => match config.filter(COMBINED) {
            Some((index, f)) => Some((index, prefix_section(&f.configuration)?)),
            None => None,
        },
    };
    let mirror = match prefix {
        Some((index, raw)) => Some((
            index,
            Mirror::new(raw).map_err(|e| DecideError::PrefixConfig(e.to_string()))?,
        )),
        None => None,
    };
    if let Some(snapshot) = &options.snapshot {
        prime(&chain, snapshot).map_err(DecideError::Prime)?;
    }
    let mut reports = Vec::with_capacity(requests.len());
    for (index, request) in requests.iter().enumerate() {
        let report = run_one(&chain, config, mirror.as_ref(), index, request, options)
            .map_err(|source| DecideError::Request { index, source })?;
        reports.push(report);
    }
    Ok(reports)
}

/// The `prefix_affinity` section of the combined filter's configuration, byte for byte (its
/// shared-data namespace is derived from these bytes).
fn prefix_section(raw: &[u8]) -> Result<&[u8], DecideError> {
    #[derive(serde::Deserialize)]
    struct Sections<'a> {
        #[serde(borrow)]
        prefix_affinity: Option<&'a serde_json::value::RawValue>,
    }
    let sections: Sections<'_> = serde_json::from_slice(raw)
        .map_err(|e| DecideError::PrefixConfig(format!("`{COMBINED}`: {e}")))?;
    sections
        .prefix_affinity
        .map(|r| r.get().as_bytes())
        .ok_or_else(|| DecideError::PrefixConfig(format!("`{COMBINED}` has no `prefix_affinity`")))
}

/// Ticks the chain until the filters have polled the aggregator and got the snapshot.
fn prime(chain: &FilterChain, snapshot: &[u8]) -> Result<(), kvoy_harness::Error> {
    let mut answered = 0usize;
    for _ in 0..300 {
        chain.advance(STEP)?;
        let mut pending = 0;
        for i in 0..chain.len() {
            let Some(plugin) = chain.plugin(i) else {
                continue;
            };
            for call in plugin.http_calls() {
                pending += 1;
                let response = HttpResponse::new(200)
                    .header("content-type", "application/x-kvoy-snapshot")
                    .header("content-length", &snapshot.len().to_string())
                    .body(snapshot);
                plugin.respond_http_call(&call, response)?;
                answered += 1;
            }
        }
        if answered > 0 && pending == 0 {
            break;
        }
    }
    Ok(())
}

fn run_one(
    chain: &FilterChain,
    config: &Config,
    mirror: Option<&(usize, Mirror)>,
    index: usize,
    request: &Request,
    options: &DecideOptions,
) -> Result<RequestReport, kvoy_harness::Error> {
    let worker = index % config.workers.max(1);
    let prepared = match mirror {
        Some((i, m)) => chain.plugin(*i).map(|p| m.prepare(p)),
        None => None,
    };
    let calls_before = chain.call_counts();
    let names_before = chain.host_call_names();
    let mut stream = chain.stream(worker)?;
    let port = 40_000 + (index % 20_000) as u16;
    stream.set_property(&["source", "address"], format!("127.0.0.1:{port}"))?;
    stream.set_property(&["destination", "address"], "127.0.0.1:10000")?;
    stream.set_property(&["request", "protocol"], "HTTP/1.1")?;
    let headers = request.header_map("kvoy-local", &format!("kvoy-local-{index}"));
    let started = Instant::now();
    stream.send_request(headers.clone(), &request.body)?;
    let mut total = started.elapsed();
    let filter_us = |stream: &kvoy_harness::ChainStream| -> Vec<FilterTime> {
        chain
            .names()
            .zip(stream.filter_time())
            .map(|(n, t)| FilterTime {
                filter: n.to_owned(),
                us: micros(*t),
            })
            .collect()
    };
    let mut timing = filter_us(&stream);

    // A held request: let virtual time pass (ticks release or expire it).
    let mut held_ms = None;
    if let ChainState::Held { .. } = stream.state() {
        let mut waited = Duration::ZERO;
        while matches!(stream.state(), ChainState::Held { .. }) && waited < MAX_HOLD {
            chain.advance(STEP)?;
            waited += STEP;
            stream.pump()?;
        }
        held_ms = Some(u64::try_from(waited.as_millis()).unwrap_or(u64::MAX));
        timing = filter_us(&stream);
        total = Duration::from_secs_f64(timing.iter().map(|t| t.us).sum::<f64>() / 1e6);
    }
    let name = |i: usize| chain.names().nth(i).unwrap_or("?").to_owned();
    let mut upstream_headers = Vec::new();
    let mut response_headers = Vec::new();
    let outcome = match stream.state() {
        ChainState::Upstream => {
            let up = stream.take_upstream_request();
            let up_headers = up.map(|u| u.headers).unwrap_or_default();
            upstream_headers = changed(&headers, &up_headers);
            let destination = destination(&stream, chain.len(), &up_headers);
            match destination {
                Some(endpoint) => {
                    if !options.no_response {
                        response_headers = simulate_response(&mut stream, &endpoint)?;
                    }
                    Outcome::Routed { endpoint }
                }
                None => Outcome::NoDestination,
            }
        }
        ChainState::LocalReply { from } => {
            let (status, headers, body) = match stream.local_reply() {
                Some((_, reply)) => {
                    let down = stream.take_downstream();
                    let headers = down.headers.map(|h| h.to_vec()).unwrap_or_default();
                    (
                        reply.status,
                        headers,
                        String::from_utf8_lossy(&down.body).into_owned(),
                    )
                }
                None => (0, Vec::new(), String::new()),
            };
            Outcome::LocalReply {
                filter: name(from),
                status,
                headers,
                body,
            }
        }
        ChainState::Held { at } => Outcome::Held { filter: name(at) },
        ChainState::Reset { by } => Outcome::Reset { filter: name(by) },
    };
    let scores = match (prepared, mirror) {
        (Some(prepared), Some((i, _))) => stream.request_headers_into(*i).map(|into| {
            let pin = into.get(PIN_HEADER).map(str::to_owned);
            prepared.score(
                &request.method,
                &request.path,
                &request.body,
                pin.as_deref(),
            )
        }),
        _ => None,
    };
    stream.finish()?;
    let filter_calls = chain
        .names()
        .zip(chain.call_counts().into_iter().zip(calls_before))
        .zip(chain.host_call_names().into_iter().zip(names_before))
        .map(|((filter, (after, before)), (names, names_before))| {
            let c = after - before;
            FilterCalls {
                filter: filter.to_owned(),
                host_calls: c.host_calls,
                shared_data: c.shared_data,
                vm_entries: c.vm_entries,
                by_name: names.since(&names_before).0,
            }
        })
        .collect();
    Ok(RequestReport {
        index,
        method: request.method.clone(),
        path: request.path.clone(),
        worker,
        outcome,
        held_ms,
        upstream_headers,
        response_headers,
        scores,
        filter_us: timing,
        total_us: micros(total),
        filter_calls,
    })
}

/// Where the router would send the request: the destination header, else Envoy's
/// original-destination filter state.
pub fn destination(
    stream: &kvoy_harness::ChainStream,
    filters: usize,
    headers: &HeaderMap,
) -> Option<String> {
    if let Some(d) = headers.get(DESTINATION_HEADER) {
        return Some(d.trim().to_owned());
    }
    (0..filters)
        .filter_map(|i| stream.filter_stream(i))
        .find_map(|s| s.filter_state(ORIGINAL_DST_STATE))
        .map(|v| String::from_utf8_lossy(&v).into_owned())
}

/// A `200` from the endpoint, through the response callbacks; returns what the filters added.
fn simulate_response(
    stream: &mut kvoy_harness::ChainStream,
    endpoint: &str,
) -> Result<Vec<(String, String)>, kvoy_harness::Error> {
    stream.set_property(&["upstream", "address"], endpoint.to_owned())?;
    let body = br#"{"object":"kvoy-local.simulated"}"#;
    let headers = HeaderMap::from_pairs([
        (":status", "200"),
        ("content-type", "application/json"),
        ("content-length", &body.len().to_string()),
    ]);
    stream.send_response_headers(headers.clone(), false)?;
    stream.send_response_body(body, true)?;
    let down = stream.take_downstream();
    Ok(down
        .headers
        .map(|h| changed(&headers, &h))
        .unwrap_or_default())
}

/// Pairs of `after` that `before` does not have.
fn changed(before: &HeaderMap, after: &HeaderMap) -> Vec<(String, String)> {
    after
        .iter()
        .filter(|(n, v)| !before.get_all(n).any(|b| b == *v))
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect()
}
