//! The chaos run (issue 16, item 8): a real Envoy (`envoy/kvoy.yaml`, `--concurrency 2`) with
//! all three kvoy filters, three in-process kvoy-sim simulators (KV events and replay) and an
//! in-process kvoy-aggregator that both routing filters follow, all on 127.0.0.1. 10,000
//! requests in 20 bursts of 500 from 32 client threads, while things break:
//!
//! - **client resets**: some clients drop the connection half way through the request body,
//!   others after the first bytes of the answer; some HTTP/2 clients reset their stream half
//!   way through the body, others cancel it once the response headers are in (RST_STREAM);
//! - **a simulator killed** mid-burst (its in-flight requests die with it) and restarted on the
//!   same ports two bursts later;
//! - **the aggregator killed twice** mid-burst and restarted on the same port at the next burst;
//! - **a canary outside the pool**: every trick a client has to name an upstream names one of
//!   two canary listeners on 127.0.0.1, outside `allowed_destinations` (which lists only the
//!   simulators' ports, since a 127.0.0.0/8 block would cover the canaries too):
//!   `x-gateway-destination-endpoint`, the internal pin header `x-kvoy-session-endpoint`, and a
//!   forged `x-session-token`; and for three bursts the aggregator's own endpoint list names the
//!   decoy canary, which answers the aggregator's `/metrics` scrapes as an idle vLLM would (so
//!   it is the most attractive endpoint of the snapshot, and only the allowlist keeps it out).
//!
//! Admission is tight (4 in flight per endpoint, small bands, a 250 ms TTL, a sheddable
//! objective), so bursts are held, shed and expired. The checks, none of them on timing:
//! every request has an outcome; each one not reset by its client is answered 200 by a pool
//! member (streams complete with `[DONE]`), or 429/503 with `x-kvoy-dropped-reason`; the only
//! other answers allowed are Envoy's upstream failures for requests that were in flight while
//! the simulator was down (a 503 with reason `upstream-unavailable`, or an answer cut off;
//! counted and reported); the hidden canary accepts no connection and
//! the decoy only the aggregator's `GET /metrics`; the Envoy log has no wasm panic or trap; and
//! the kvoy in-flight and queue gauges (`/stats/prometheus`) return to 0. A summary table is
//! printed (`cargo test -p kvoy-e2e --test chaos -- --nocapture`).
//!
//! Needs `envoy` on PATH and the release wasm filters (`make test` provides both).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::ops::ControlFlow;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Incoming};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;

use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::http::server::{self, Server};
use kvoy_testkit::{
    free_port,
    http::{self, HttpError, Part},
    wait_for, PoolEndpoint, Stack, StackConfig, SERVED_BY_HEADER, SERVED_HEADER,
};

const NAME: &str = "chaos";
const MODEL: &str = "kvoy-demo";
const REQUESTS: usize = 10_000;
const BURST: usize = 500;
const CLIENTS: usize = 32;
const SEED: u64 = 0x6b76_6f79_6368_616f;
const TIMEOUT: Duration = Duration::from_secs(30);
const REASON: &str = "x-kvoy-dropped-reason";
/// The reason on Envoy's own 503 when the chosen server cannot be reached (envoy/kvoy.yaml).
const UPSTREAM_REASON: &str = "upstream-unavailable";
const AGGREGATOR_SETTINGS: &str = "scrape_interval_ms: 50\nstale_after_ms: 1000\n";
/// Bursts where things happen (see the module doc).
const DECOY_LISTED: std::ops::Range<usize> = 4..7;
const SIM_KILLED_IN: usize = 6;
const SIM_RESTARTED_AT: usize = 8;
const AGGREGATOR_KILLED_IN: [usize; 2] = [10, 15];
/// After the victim is back, requests still in flight from its downtime may end badly; ones
/// that start later than this must not.
const SIM_GRACE: Duration = Duration::from_secs(3);

fn splitmix(x: u64) -> u64 {
    kvoy_shared::Rng::new(x).next_u64()
}

/// What a client does with request `i` (decided by the seed alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// HTTP/1.1, the whole answer read.
    Plain,
    /// HTTP/1.1, `stream: true`, read to `[DONE]`.
    Stream,
    /// HTTP/2 (h2c), streaming or not, the whole answer read.
    H2 { stream: bool },
    /// HTTP/1.1, the connection dropped half way through the request body.
    ResetInBody,
    /// HTTP/1.1 streaming, the connection dropped after the first bytes of the answer.
    ResetInAnswer,
    /// HTTP/2 streaming, the stream cancelled (answer dropped) after the response headers.
    H2Cancel,
    /// HTTP/2, the stream reset half way through the request body.
    H2ResetInBody,
    /// HTTP/1.1 naming the canary every way a client can.
    Attack,
}

#[derive(Clone, Debug)]
struct Plan {
    kind: Kind,
    objective: Option<&'static str>,
    session: Option<String>,
    cookie: Option<String>,
    max_tokens: u32,
}

fn plan(i: usize) -> Plan {
    let r = splitmix(SEED ^ i as u64);
    let kind = match r % 100 {
        0..=49 => Kind::Plain,
        50..=64 => Kind::Stream,
        65..=74 => Kind::H2 {
            stream: (r >> 8).is_multiple_of(2),
        },
        75..=79 => Kind::ResetInBody,
        80..=84 => Kind::ResetInAnswer,
        85..=88 => Kind::H2Cancel,
        89..=91 => Kind::H2ResetInBody,
        _ => Kind::Attack,
    };
    let objective = match (r >> 16) % 10 {
        0..=1 => Some("interactive"),
        2 => Some("scavenger"),
        3..=5 => Some("batch"),
        _ => None,
    };
    let session = (r >> 24)
        .is_multiple_of(10)
        .then(|| format!("session-{}", (r >> 32) % 40));
    let cookie = (r >> 28)
        .is_multiple_of(10)
        .then(|| format!("kvoy-session=cookie-{}", (r >> 36) % 40));
    // A few long generations keep the slots busy, so held requests also expire.
    let max_tokens = if (r >> 40).is_multiple_of(25) {
        160
    } else {
        4 + ((r >> 44) % 12) as u32
    };
    Plan {
        kind,
        objective,
        session,
        cookie,
        max_tokens,
    }
}

fn body(i: usize, p: &Plan, stream: bool) -> Vec<u8> {
    // Prompts share a prefix by group, so prefix affinity has something to keep together.
    let group = i % 37;
    let prompt = format!(
        "{} question {i}: what changed?",
        format!("conversation {group} context. ").repeat(12)
    );
    serde_json::to_vec(
        &json!({"model": MODEL, "max_tokens": p.max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": prompt}]}),
    )
    .unwrap()
}

/// How request `i` ended.
#[derive(Clone, Debug)]
enum Outcome {
    /// 200 from a pool member (`x-served-by`), streams complete.
    Ok { served: String },
    /// 429 or 503 with the reason header.
    Dropped { status: u16, reason: String },
    /// The client reset it on purpose (no answer expected).
    ClientReset,
    /// The HTTP/2 client cancelled its stream on purpose.
    Cancelled,
    /// The answer Envoy gives when the upstream fails (a 503 with its `upstream connect error`
    /// text, or an answer cut off): allowed only for requests in flight while the simulator
    /// was down.
    Upstream { what: String },
    /// Anything else: the test fails.
    Bad { what: String },
}

#[derive(Clone, Debug)]
struct Record {
    started: Duration,
    ended: Duration,
    kind: Kind,
    h2: bool,
    outcome: Outcome,
}

/// Classifies a complete HTTP answer.
fn classify(
    status: u16,
    reason: Option<&str>,
    served_by: Option<&str>,
    served_header: Option<&str>,
    body: &[u8],
    stream: bool,
    pool: &[String],
) -> Outcome {
    match status {
        200 => {
            let served = served_by.unwrap_or("").to_owned();
            if !pool.contains(&served) {
                return Outcome::Bad {
                    what: format!("200 served by {served:?}, not a pool member"),
                };
            }
            if served_header != Some(served.as_str()) {
                return Outcome::Bad {
                    what: format!("200 from {served} but {SERVED_HEADER} is {served_header:?}"),
                };
            }
            let text = String::from_utf8_lossy(body);
            let complete = if stream {
                text.contains("data: [DONE]")
            } else {
                serde_json::from_slice::<serde_json::Value>(body)
                    .is_ok_and(|v| v["choices"].is_array())
            };
            if complete {
                Outcome::Ok { served }
            } else {
                Outcome::Upstream {
                    what: format!(
                        "200 from {served} with an incomplete body ({} bytes)",
                        body.len()
                    ),
                }
            }
        }
        // Envoy's local reply when the chosen server cannot be reached (envoy/kvoy.yaml's
        // `local_reply_config`).
        503 if reason == Some(UPSTREAM_REASON) => Outcome::Upstream {
            what: format!("503 {UPSTREAM_REASON}"),
        },
        429 | 503 if reason.is_some_and(|r| !r.is_empty()) => Outcome::Dropped {
            status,
            reason: reason.unwrap_or_default().to_owned(),
        },
        _ => Outcome::Bad {
            what: format!(
                "{status} (reason {reason:?}): {}",
                String::from_utf8_lossy(&body[..body.len().min(160)])
            ),
        },
    }
}

/// The headers of a plan's HTTP/1.1 request, after `host` and `connection: close`.
fn h1_headers(p: &Plan, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    if let Some(o) = p.objective {
        headers.push(("x-gateway-inference-objective".into(), o.into()));
    }
    let tenant = if p.objective == Some("interactive") {
        "a"
    } else {
        "b"
    };
    headers.push((
        "x-gateway-inference-fairness-id".into(),
        format!("tenant-{tenant}"),
    ));
    if let Some(s) = &p.session {
        headers.push(("x-session-id".into(), s.clone()));
    }
    if let Some(c) = &p.cookie {
        headers.push(("cookie".into(), c.clone()));
    }
    headers.extend_from_slice(extra);
    headers
}

/// The head as raw bytes, for the client that goes away half way through its body.
fn h1_head(path: &str, p: &Plan, len: usize, extra: &[(String, String)]) -> String {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: gw\r\nconnection: close\r\ncontent-length: {len}\r\n"
    );
    for (k, v) in h1_headers(p, extra) {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head
}

struct Target {
    envoy: SocketAddr,
    pool: Vec<String>,
    canary: SocketAddr,
    decoy: SocketAddr,
}

fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    s.set_read_timeout(Some(TIMEOUT))?;
    s.set_write_timeout(Some(TIMEOUT))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// One HTTP/1.1 request, read to the end (or reset as planned).
fn h1(t: &Target, i: usize, p: &Plan) -> Outcome {
    let stream = matches!(p.kind, Kind::Stream | Kind::ResetInAnswer);
    let body = body(i, p, stream);
    let mut extra = Vec::new();
    if p.kind == Kind::Attack {
        // Every way a client has to name an upstream names a canary.
        let target = if i.is_multiple_of(2) {
            t.canary
        } else {
            t.decoy
        };
        extra.push(("x-gateway-destination-endpoint".into(), target.to_string()));
        extra.push(("x-kvoy-session-endpoint".into(), target.to_string()));
        extra.push((
            "x-session-token".into(),
            kvoy_shared::session::encode_token(target),
        ));
    }
    if p.kind == Kind::ResetInBody {
        // Raw bytes on purpose: a client that leaves half way through its body.
        let head = h1_head("/v1/chat/completions", p, body.len(), &extra);
        let mut s = match connect(t.envoy) {
            Ok(s) => s,
            Err(e) => {
                return Outcome::Bad {
                    what: format!("connect: {e}"),
                }
            }
        };
        let _ = s.write_all(head.as_bytes());
        let _ = s.write_all(&body[..body.len() / 2]);
        // A pause, so the proxy has the headers and half the body when the client goes.
        std::thread::sleep(Duration::from_millis(2));
        let _ = s.shutdown(Shutdown::Both);
        return Outcome::ClientReset;
    }
    let mut request = http::Request::post("/v1/chat/completions")
        .host("gw")
        .body(body)
        .timeout(TIMEOUT);
    request.headers = h1_headers(p, &extra);
    let mut reset = false;
    let mut answer = Vec::new();
    let head = http::stream(t.envoy, &request, |part| match part {
        // The first bytes of the stream, then gone (unread data left: the close is a reset).
        Part::Head(head) if p.kind == Kind::ResetInAnswer && head.status == 200 => {
            reset = true;
            ControlFlow::Continue(())
        }
        Part::Head(_) => ControlFlow::Continue(()),
        Part::Data(_) if reset => ControlFlow::Break(()),
        Part::Data(data) => {
            answer.extend_from_slice(data);
            ControlFlow::Continue(())
        }
    });
    let head = match head {
        Ok(head) => head,
        Err(e @ (HttpError::Connect { .. } | HttpError::Invalid(_) | HttpError::Io(_))) => {
            return Outcome::Bad {
                what: format!("connect: {e}"),
            }
        }
        Err(e) if e.after_head() => {
            return Outcome::Upstream {
                what: format!("answer cut off: {e}"),
            }
        }
        Err(e) => {
            return Outcome::Upstream {
                what: format!("reading the answer: {e}"),
            }
        }
    };
    if reset {
        return Outcome::ClientReset;
    }
    classify(
        head.status,
        head.headers.get(REASON),
        head.headers.get(SERVED_BY_HEADER),
        head.headers.get(SERVED_HEADER),
        &answer,
        stream,
        &t.pool,
    )
}

async fn read_all(mut body: Incoming) -> Result<Vec<u8>, hyper::Error> {
    use std::future::poll_fn;
    let mut out = Vec::new();
    while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(data) = frame?.into_data() {
            out.extend_from_slice(&data);
        }
    }
    Ok(out)
}

/// One HTTP/2 request on a connection of its own (h2c, prior knowledge).
async fn h2(t: &Target, i: usize, p: &Plan) -> Outcome {
    let stream = matches!(p.kind, Kind::H2 { stream: true } | Kind::H2Cancel);
    let body = body(i, p, stream);
    let tcp = match tokio::net::TcpStream::connect(t.envoy).await {
        Ok(s) => s,
        Err(e) => {
            return Outcome::Bad {
                what: format!("h2 connect: {e}"),
            }
        }
    };
    let (mut sender, conn) = match hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    {
        Ok(x) => x,
        Err(e) => {
            return Outcome::Bad {
                what: format!("h2 handshake: {e}"),
            }
        }
    };
    let conn = tokio::spawn(conn);
    let mut request = Request::post(format!("http://{}/v1/chat/completions", t.envoy))
        .header("content-type", "application/json")
        .header("x-gateway-inference-fairness-id", "tenant-h2");
    if let Some(o) = p.objective {
        request = request.header("x-gateway-inference-objective", o);
    }
    if let Some(s) = &p.session {
        request = request.header("x-session-id", s.as_str());
    }
    if p.kind == Kind::H2ResetInBody {
        // Half the body, then the stream stalls; dropping the request resets the stream
        // (RST_STREAM CANCEL). Admission may answer first (a 429 at the headers).
        let half = Bytes::copy_from_slice(&body[..body.len() / 2]);
        let request = request
            .body(server::Body::chunks([half]).stalled())
            .unwrap();
        let answered =
            tokio::time::timeout(Duration::from_millis(20), sender.send_request(request)).await;
        let outcome = match answered {
            Err(_) => Outcome::ClientReset,
            Ok(Err(e)) => Outcome::Upstream {
                what: format!("h2 request: {e}"),
            },
            Ok(Ok(r)) => {
                let header = |n: &str| {
                    r.headers()
                        .get(n)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                };
                let (status, reason) = (r.status().as_u16(), header(REASON));
                let body = read_all(r.into_body()).await.unwrap_or_default();
                classify(status, reason.as_deref(), None, None, &body, false, &t.pool)
            }
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(sender);
        conn.abort();
        return outcome;
    }
    let request = request
        .body(server::Body::chunks([Bytes::from(body)]))
        .unwrap();
    let response = match sender.send_request(request).await {
        Ok(r) => r,
        Err(e) => {
            return Outcome::Upstream {
                what: format!("h2 request: {e}"),
            }
        }
    };
    let status = response.status().as_u16();
    let header = |n: &str| {
        response
            .headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (reason, by, served) = (
        header(REASON),
        header(SERVED_BY_HEADER),
        header(SERVED_HEADER),
    );
    if p.kind == Kind::H2Cancel && status == 200 {
        // Dropping the unfinished answer resets the stream (RST_STREAM CANCEL); give the
        // connection task a moment to send it before the connection goes too.
        drop(response);
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(sender);
        conn.abort();
        return Outcome::Cancelled;
    }
    let body = match read_all(response.into_body()).await {
        Ok(b) => b,
        Err(e) => {
            return Outcome::Upstream {
                what: format!("h2 {status} answer cut off: {e}"),
            }
        }
    };
    drop(sender);
    conn.abort();
    classify(
        status,
        reason.as_deref(),
        by.as_deref(),
        served.as_deref(),
        &body,
        stream,
        &t.pool,
    )
}

fn run_one(t: &Target, rt: &tokio::runtime::Runtime, i: usize, p: &Plan) -> Outcome {
    match p.kind {
        Kind::H2 { .. } | Kind::H2Cancel | Kind::H2ResetInBody => rt.block_on(async {
            match tokio::time::timeout(TIMEOUT, h2(t, i, p)).await {
                Ok(o) => o,
                Err(_) => Outcome::Bad {
                    what: "h2 timed out".into(),
                },
            }
        }),
        _ => h1(t, i, p),
    }
}

/// A listener that counts what reaches it. The hidden canary must see nothing at all; the
/// decoy answers `GET /metrics` (only the aggregator sends that: Envoy answers 404 for any
/// path but the API, so no proxied request has it) and records anything else as a breach.
struct Canary {
    addr: SocketAddr,
    server: Server,
    scrapes: Arc<AtomicUsize>,
    breaches: Arc<Mutex<Vec<String>>>,
}

const DECOY_METRICS: &str = "# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{model_name=\"kvoy-demo\"} 0\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{model_name=\"kvoy-demo\"} 0\n\
# TYPE vllm:kv_cache_usage_perc gauge\n\
vllm:kv_cache_usage_perc{model_name=\"kvoy-demo\"} 0\n";

fn canary(answers_metrics: bool) -> Canary {
    let scrapes = Arc::new(AtomicUsize::new(0));
    let breaches = Arc::new(Mutex::new(Vec::new()));
    let (sc, b) = (scrapes.clone(), breaches.clone());
    // Keep-alive: the aggregator scrapes over one connection.
    let server = Server::start(
        "127.0.0.1:0".parse().unwrap(),
        server::Options::default(),
        move |request| {
            let (sc, b) = (sc.clone(), b.clone());
            async move {
                if answers_metrics
                    && request.method() == hyper::Method::GET
                    && request.uri().path() == "/metrics"
                {
                    sc.fetch_add(1, Ordering::SeqCst);
                    return server::response(200, "text/plain", DECOY_METRICS);
                }
                b.lock().unwrap().push(format!(
                    "{} {} {:?}",
                    request.method(),
                    request.uri(),
                    request.version()
                ));
                server::response(500, "text/plain", "a breach")
            }
        },
    )
    .unwrap();
    Canary {
        addr: server.addr(),
        server,
        scrapes,
        breaches,
    }
}

struct Sim {
    fleet: Option<SimFleet>,
    addr: SocketAddr,
    kv: String,
    replay: String,
}

fn sim_args<'a>(kv: &'a str, replay: &'a str) -> Vec<&'a str> {
    vec![
        "--model",
        MODEL,
        "--speedup",
        "10",
        "--kv-events-endpoint",
        kv,
        "--kv-events-replay-endpoint",
        replay,
    ]
}

fn start_sim() -> Sim {
    for attempt in 1.. {
        let kv = format!("tcp://127.0.0.1:{}", free_port().unwrap());
        let replay = format!("tcp://127.0.0.1:{}", free_port().unwrap());
        match SimFleet::start(&["127.0.0.1:0".parse().unwrap()], &sim_args(&kv, &replay)) {
            Ok(fleet) => {
                fleet.wait_healthy(Duration::from_secs(10)).unwrap();
                let addr = fleet.addrs()[0];
                return Sim {
                    fleet: Some(fleet),
                    addr,
                    kv,
                    replay,
                };
            }
            Err(e) if attempt < 4 => eprintln!("[{NAME}] simulator ports taken, again: {e:#}"),
            Err(e) => panic!("[{NAME}] cannot start a simulator: {e:#}"),
        }
    }
    unreachable!()
}

/// Restarts a killed simulator on its own ports (they may take a moment to be free).
fn restart_sim(sim: &mut Sim) {
    let mut last = String::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        match SimFleet::start(&[sim.addr], &sim_args(&sim.kv, &sim.replay)) {
            Ok(fleet) => {
                fleet.wait_healthy(Duration::from_secs(10)).unwrap();
                sim.fleet = Some(fleet);
                return;
            }
            Err(e) => last = format!("{e:#}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "[{NAME}] cannot restart the simulator on {}: {last}",
        sim.addr
    );
}

fn restart_aggregator(config: &Path, yaml: &str, addr: SocketAddr) -> LocalAggregator {
    let mut restarted = None;
    wait_for(
        "the aggregator port free again",
        Duration::from_secs(15),
        || {
            restarted = LocalAggregator::start(config, yaml, addr).ok();
            restarted.is_some()
        },
    );
    restarted.unwrap()
}

fn endpoints(sims: &[Sim], decoy: Option<SocketAddr>) -> Vec<AggregatedEndpoint> {
    let mut out: Vec<AggregatedEndpoint> = sims
        .iter()
        .map(|s| AggregatedEndpoint {
            address: s.addr,
            models: vec![MODEL.into()],
            kv_events: Some((s.kv.clone(), Some(s.replay.clone()))),
        })
        .collect();
    if let Some(address) = decoy {
        out.push(AggregatedEndpoint {
            address,
            models: vec![MODEL.into()],
            kv_events: None,
        });
    }
    out
}

fn aggregator_ready(agg: SocketAddr) -> u64 {
    http::get(agg, "/v1/endpoints", Duration::from_secs(5))
        .ok()
        .and_then(|r| r.json().ok())
        .and_then(|v| v["pool"]["ready"].as_u64())
        .unwrap_or(0)
}

/// `/stats/prometheus` once the filters have ticked (they give Envoy their metrics on the
/// tick, every 20 ms here): see [`prometheus_kvoy`].
fn prometheus_kvoy_settled(admin: SocketAddr) -> BTreeMap<String, f64> {
    std::thread::sleep(Duration::from_millis(100));
    prometheus_kvoy(admin)
}

/// `/stats/prometheus`: every kvoy sample, by series (labels included), histograms skipped.
fn prometheus_kvoy(admin: SocketAddr) -> BTreeMap<String, f64> {
    let r = http::get(admin, "/stats/prometheus", Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200);
    r.text()
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("kvoy_"))
        .filter(|l| !l.contains("_bucket") && !l.contains("_sum") && !l.contains("_count"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The in-flight and queue gauges, by short name.
fn gauges(admin: SocketAddr) -> BTreeMap<String, f64> {
    prometheus_kvoy(admin)
        .into_iter()
        .filter(|(k, _)| {
            k.contains("kvoy_admission_queue_")
                || k.contains("kvoy_admission_inflight")
                || k.contains("kvoy_prefix_affinity_inflight")
        })
        .map(|(k, v)| {
            let short = k[k.find("kvoy_").unwrap_or(0)..].to_owned();
            (short, v)
        })
        .collect()
}

fn counter(stats: &BTreeMap<String, f64>, name: &str) -> u64 {
    stats
        .iter()
        .filter(|(k, _)| k.contains(name))
        .map(|(_, v)| *v as u64)
        .sum()
}

/// Runs requests `range` on `CLIENTS` threads; `event` runs on this thread once `at` of them
/// have started. Returns when all are done.
fn burst(
    t: &Arc<Target>,
    start: Instant,
    range: std::ops::Range<usize>,
    records: &Arc<Mutex<Vec<Option<Record>>>>,
    event: Option<(usize, &mut dyn FnMut())>,
) {
    let next = Arc::new(AtomicUsize::new(range.start));
    let end = range.end;
    let workers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (t, next, records) = (t.clone(), next.clone(), records.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= end {
                        break;
                    }
                    let p = plan(i);
                    let started = start.elapsed();
                    let outcome = run_one(&t, &rt, i, &p);
                    let record = Record {
                        started,
                        ended: start.elapsed(),
                        kind: p.kind,
                        h2: matches!(
                            p.kind,
                            Kind::H2 { .. } | Kind::H2Cancel | Kind::H2ResetInBody
                        ),
                        outcome,
                    };
                    records.lock().unwrap()[i] = Some(record);
                }
            })
        })
        .collect();
    if let Some((at, event)) = event {
        let deadline = Instant::now() + Duration::from_secs(120);
        while next.load(Ordering::SeqCst) < range.start + at && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        event();
    }
    for w in workers {
        w.join().unwrap();
    }
}

#[test]
fn ten_thousand_requests_through_resets_kills_and_restarts() {
    let run_start = Instant::now();
    let hidden = canary(false);
    let decoy = canary(true);
    let mut sims: Vec<Sim> = (0..3).map(|_| start_sim()).collect();
    let pool: Vec<String> = sims.iter().map(|s| s.addr.to_string()).collect();
    let dir = common::run_dir(NAME);
    let agg_config = dir.join("aggregator.yaml");
    let yaml = aggregator_yaml(AGGREGATOR_SETTINGS, &endpoints(&sims, None));
    let yaml_with_decoy = aggregator_yaml(AGGREGATOR_SETTINGS, &endpoints(&sims, Some(decoy.addr)));
    let mut agg =
        LocalAggregator::start(&agg_config, &yaml, "127.0.0.1:0".parse().unwrap()).unwrap();
    let agg_addr = agg.addr();

    // The allowlist: the simulators' ports on 127.0.0.1, nothing else (127.0.0.0/8 would
    // cover the canaries, Envoy's own listener and admin port).
    let ports: Vec<u16> = sims.iter().map(|s| s.addr.port()).collect();
    let allowed = json!([{"cidr": "127.0.0.1/32", "ports": ports}]);
    let aggregator = json!({"cluster": kvoy_testkit::AGGREGATOR_CLUSTER});
    let static_pool = sims
        .iter()
        .map(|s| PoolEndpoint::new(s.addr, &[MODEL]))
        .collect();
    let mut config = StackConfig::new(static_pool, dir.clone());
    config.aggregator = Some(agg_addr);
    config.extra_config = Some(json!({"aggregator": aggregator, "allowed_destinations": allowed}));
    config.session_config = json!({"cookie": "kvoy-session"}).to_string();
    config.admission_config = Some(
        json!({"endpoints": 3, "tick_ms": 20, "aggregator": aggregator,
            "allowed_destinations": allowed,
            "flow": {"objectives": {"interactive": 10, "batch": 0, "scavenger": -1},
                     "saturation": {"max_inflight_per_endpoint": 4},
                     "queue_ttl_ms": 250, "band_max_requests": 8, "max_requests": 16}})
        .to_string(),
    );
    let stack = Stack::start(&config).unwrap_or_else(|e| panic!("[{NAME}] {e:#}"));
    let guard = LogTail(&stack);
    eprintln!(
        "[{NAME}] envoy {} (admin {}), aggregator {agg_addr}, simulators {pool:?}, canary {}, decoy {}",
        stack.listen, stack.admin, hidden.addr, decoy.addr
    );
    wait_for("three simulators ready", Duration::from_secs(15), || {
        aggregator_ready(agg_addr) == 3
    });

    let target = Arc::new(Target {
        envoy: stack.listen,
        pool: pool.clone(),
        canary: hidden.addr,
        decoy: decoy.addr,
    });
    let records: Arc<Mutex<Vec<Option<Record>>>> = Arc::new(Mutex::new(vec![None; REQUESTS]));
    let start = Instant::now();
    // The gauges during the run: the highest value each reached (sampled every 100 ms).
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    // Set while the aggregator lists the decoy: those peaks are kept apart.
    let decoy_phase = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (sampling, admin) = (sampling.clone(), stack.admin);
        let decoy_phase = decoy_phase.clone();
        std::thread::spawn(move || {
            let mut peaks: BTreeMap<String, f64> = BTreeMap::new();
            let deadline = Instant::now() + Duration::from_secs(300);
            while sampling.load(Ordering::SeqCst) && Instant::now() < deadline {
                let listed = decoy_phase.load(Ordering::SeqCst);
                for (k, v) in gauges(admin) {
                    let k = if listed {
                        format!("{k} (decoy listed)")
                    } else {
                        k
                    };
                    let peak = peaks.entry(k).or_default();
                    *peak = peak.max(v);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            peaks
        })
    };
    let mut sim_down: Option<(Duration, Duration)> = None;
    let mut killed_at = Duration::ZERO;
    let mut aggregator_restarts = 0;
    let mut decoy_refused = 0;
    for b in 0..REQUESTS / BURST {
        let range = b * BURST..(b + 1) * BURST;
        if b == DECOY_LISTED.start {
            std::fs::write(&agg_config, &yaml_with_decoy).unwrap();
            wait_for(
                "the decoy ready in the aggregator",
                Duration::from_secs(10),
                || aggregator_ready(agg_addr) == 4,
            );
            decoy_phase.store(true, Ordering::SeqCst);
        }
        if b == DECOY_LISTED.end {
            let stats = prometheus_kvoy_settled(stack.admin);
            decoy_refused = counter(&stats, "kvoy_prefix_affinity_endpoints_refused_total");
            std::fs::write(&agg_config, &yaml).unwrap();
            wait_for(
                "the decoy gone from the aggregator",
                Duration::from_secs(10),
                || aggregator_ready(agg_addr) == 3,
            );
            decoy_phase.store(false, Ordering::SeqCst);
        }
        if b == SIM_RESTARTED_AT {
            restart_sim(&mut sims[2]);
            sim_down = Some((killed_at, start.elapsed()));
            eprintln!(
                "[{NAME}] simulator {} back at {:?}",
                sims[2].addr,
                start.elapsed()
            );
        }
        let mut kill_sim = || {
            // The time the kill began: requests it cut end while the runtime shuts down.
            killed_at = start.elapsed();
            drop(sims[2].fleet.take());
            eprintln!("[{NAME}] simulator {} killed at {killed_at:?}", pool[2]);
        };
        let mut kill_agg = || {
            agg.kill();
            eprintln!("[{NAME}] aggregator killed at {:?}", start.elapsed());
        };
        let event: Option<(usize, &mut dyn FnMut())> = if b == SIM_KILLED_IN {
            Some((BURST / 2, &mut kill_sim))
        } else if AGGREGATOR_KILLED_IN.contains(&b) {
            Some((BURST / 2, &mut kill_agg))
        } else {
            None
        };
        let agg_killed = AGGREGATOR_KILLED_IN.contains(&b);
        burst(&target, start, range, &records, event);
        if agg_killed {
            let current = std::fs::read_to_string(&agg_config).unwrap();
            agg = restart_aggregator(&agg_config, &current, agg_addr);
            aggregator_restarts += 1;
            eprintln!("[{NAME}] aggregator restarted at {:?}", start.elapsed());
        }
    }
    let duration = start.elapsed();
    sampling.store(false, Ordering::SeqCst);
    let peaks: BTreeMap<String, f64> = sampler
        .join()
        .unwrap()
        .into_iter()
        .filter(|(k, _)| !k.contains("_priority_"))
        .collect();

    // The gauges return to 0 (every request ended; held ones left or were answered).
    let deadline = Instant::now() + Duration::from_secs(10);
    let last = loop {
        let g = gauges(stack.admin);
        if g.values().all(|v| *v == 0.0) || Instant::now() > deadline {
            break g;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let settled = last.values().all(|v| *v == 0.0);
    for name in [
        "kvoy_admission_inflight",
        "kvoy_admission_queue_depth",
        "kvoy_admission_queue_bytes",
        "kvoy_prefix_affinity_inflight",
    ] {
        assert!(
            last.keys().any(|k| k.starts_with(name)),
            "[{NAME}] no gauge {name} in /stats/prometheus: {last:?}"
        );
    }
    let stats = prometheus_kvoy_settled(stack.admin);

    // Nothing leaked in the shared in-flight counts either: on the idle proxy, requests one
    // at a time are admitted at once (none is held), and answered by the pool.
    let queued_before = counter(&stats, "kvoy_admission_queued_total");
    for i in 0..6 {
        let p = Plan {
            kind: Kind::Plain,
            objective: Some("batch"),
            session: None,
            cookie: None,
            max_tokens: 4,
        };
        let o = h1(&target, REQUESTS + i, &p);
        assert!(
            matches!(o, Outcome::Ok { .. }),
            "[{NAME}] after the run: {o:?}"
        );
    }
    assert_eq!(
        counter(
            &prometheus_kvoy_settled(stack.admin),
            "kvoy_admission_queued_total"
        ),
        queued_before,
        "[{NAME}] the idle proxy held a request: its in-flight count leaked"
    );

    // Tally.
    let records: Vec<Record> = records
        .lock()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            r.clone()
                .unwrap_or_else(|| panic!("[{NAME}] request {i} has no outcome"))
        })
        .collect();
    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    let mut served: BTreeMap<String, usize> = BTreeMap::new();
    let (mut resets, mut cancels, mut h2, mut upstream_failures) = (0, 0, 0, 0);
    let mut last_upstream_failure = Duration::ZERO;
    let mut bad = Vec::new();
    let (down_from, back_at) = sim_down.expect("the simulator was restarted");
    for (i, r) in records.iter().enumerate() {
        if r.h2 {
            h2 += 1;
        }
        match &r.outcome {
            Outcome::Ok { served: s } => {
                *by_status.entry("200".into()).or_default() += 1;
                *served.entry(s.clone()).or_default() += 1;
            }
            Outcome::Dropped { status, reason } => {
                *by_status.entry(format!("{status} {reason}")).or_default() += 1;
            }
            Outcome::ClientReset => resets += 1,
            Outcome::Cancelled => cancels += 1,
            Outcome::Bad { what } => bad.push(format!(
                "request {i} ({:?}, {:?}..{:?}): {what}",
                r.kind, r.started, r.ended
            )),
            Outcome::Upstream { what } => {
                // In flight while the simulator was down (or just after it came back).
                if r.ended >= down_from && r.started <= back_at + SIM_GRACE {
                    upstream_failures += 1;
                    last_upstream_failure = last_upstream_failure.max(r.started);
                    *by_status
                        .entry("503 / cut off by Envoy: upstream failure, simulator down".into())
                        .or_default() += 1;
                } else {
                    bad.push(format!(
                        "request {i} ({:?}, {:?}..{:?}): {what}",
                        r.kind, r.started, r.ended
                    ));
                }
            }
        }
    }
    let answered: usize = by_status.values().sum();
    let hidden_connections = hidden.server.accepted();
    let decoy_breaches = decoy.breaches.lock().unwrap().clone();
    let c = |n: &str| counter(&stats, n);
    let attacks = records.iter().filter(|r| r.kind == Kind::Attack).count();

    eprintln!("[{NAME}] ---- chaos run summary ----");
    eprintln!("| what | count |\n|---|---|");
    eprintln!(
        "| requests | {} ({} over HTTP/2, {attacks} naming a canary) |",
        records.len(),
        h2
    );
    for (k, v) in &by_status {
        eprintln!("| answered {k} | {v} |");
    }
    eprintln!(
        "| upstream failures while the simulator was down: {upstream_failures}, the last one started {:?} after the kill |",
        last_upstream_failure.saturating_sub(down_from)
    );
    eprintln!("| client resets (mid-body, mid-answer; HTTP/1.1 and HTTP/2) | {resets} |");
    eprintln!("| HTTP/2 cancellations | {cancels} |");
    eprintln!("| answered total | {answered} |");
    eprintln!("| served per simulator | {served:?} |");
    eprintln!(
        "| admission: admitted / queued / released / removed | {} / {} / {} / {} |",
        c("kvoy_admission_admitted_total"),
        c("kvoy_admission_queued_total"),
        c("kvoy_admission_released_total"),
        c("kvoy_admission_removed_total")
    );
    eprintln!("| admission rejected: saturated / queue-full / ttl-expired / no-endpoint | {} / {} / {} / {} |",
        c("kvoy_admission_rejected_saturated_total"), c("kvoy_admission_rejected_queue_full_total"),
        c("kvoy_admission_rejected_ttl_expired_total"), c("kvoy_admission_rejected_no_endpoint_total"));
    eprintln!("| restarts: simulator / aggregator | 1 (down {down_from:?}..{back_at:?}) / {aggregator_restarts} |");
    eprintln!("| decoy in the snapshot: endpoints refused by the allowlist | {decoy_refused} |");
    eprintln!("| canary connections (hidden) | {hidden_connections} |");
    eprintln!(
        "| decoy: aggregator scrapes / proxied requests | {} / {} |",
        decoy.scrapes.load(Ordering::SeqCst),
        decoy_breaches.len()
    );
    eprintln!("| gauges, highest seen during the run | {peaks:?} |");
    eprintln!("| gauges at the end | {last:?} |");
    eprintln!(
        "| duration (requests) / whole test | {duration:.1?} / {:.1?} |",
        run_start.elapsed()
    );
    eprintln!("[{NAME}] ---------------------------");

    assert!(
        bad.is_empty(),
        "[{NAME}] {} requests answered wrongly, first: {:#?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
    assert_eq!(answered + resets + cancels, REQUESTS);
    assert_eq!(
        hidden_connections, 0,
        "[{NAME}] the hidden canary was reached"
    );
    assert!(
        decoy_breaches.is_empty(),
        "[{NAME}] the decoy got proxied requests: {decoy_breaches:?}"
    );
    assert!(
        decoy.scrapes.load(Ordering::SeqCst) > 0,
        "the aggregator never saw the decoy"
    );
    assert!(
        decoy_refused > 0,
        "the allowlist never refused the decoy's snapshot entry"
    );
    assert!(settled, "[{NAME}] gauges not back to 0: {last:?}");
    assert!(
        c("kvoy_admission_queued_total") > 0,
        "admission never held a request"
    );
    assert!(
        by_status.keys().any(|k| k.starts_with("429")),
        "admission never shed a request: {by_status:?}"
    );
    // The pool kept serving through it all. How many of the 10,000 are answered rather than
    // shed is a race between the clients and the in-process (debug build) simulators behind the
    // tight admission, not a property of the filters: on one machine, same code, 52-58% in one
    // hour and 43-47% the next (the same share with the filters of the session before), and
    // "more than half" failed fresh-clone runs. A third still fails a proxy that sheds or
    // loses most of what it could serve.
    let answered = by_status.get("200").copied().unwrap_or(0);
    assert!(
        answered > REQUESTS / 3,
        "[{NAME}] only {answered} of {REQUESTS} answered 200: {by_status:?}"
    );
    assert_eq!(served.len(), 3, "every simulator served: {served:?}");
    stack.assert_no_wasm_failures(NAME);
    drop(guard);
    drop(stack);
    drop(agg);
    drop(sims);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Prints Envoy's log tail when the test fails.
struct LogTail<'a>(&'a Stack);

impl Drop for LogTail<'_> {
    fn drop(&mut self) {
        self.0.print_log_tail_if_panicking(NAME);
    }
}
