//! The HTTP side of a simulator: an OpenAI-compatible API over hyper, `/metrics`, `/health`
//! and vLLM's `/reset_prefix_cache`, in front of one engine thread.

pub mod api;
pub mod metrics;
pub mod runtime;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use kvoy_shared::request::Api;
use kvoy_shared::Rng;

use crate::engine::tokenizer::tokenize_bytes;
use api::{ApiError, Completion};
use metrics::Recorder;
use runtime::{EngineHandle, Progress};

pub type HttpBody = BoxBody<Bytes, Infallible>;

/// Request-handling options of one simulator.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    pub models: Vec<String>,
    /// Divides every simulated duration (also the injected latency).
    pub speedup: f64,
    pub default_max_tokens: u32,
    pub max_body_bytes: usize,
    /// Fraction of completions answered 500, for fault-injection tests.
    pub error_rate: f64,
    /// Simulated latency added before a completion reaches the engine.
    pub added_latency: Duration,
    pub seed: u64,
}

/// Everything the handlers share.
pub struct Simulator {
    pub engine: EngineHandle,
    /// Reported on every response as `x-served-by`, so tests and demos see who answered.
    pub served_by: String,
    pub options: HttpOptions,
    pub recorder: Recorder,
    faults: Mutex<Rng>,
    next_id: AtomicU64,
}

impl Simulator {
    pub fn new(engine: EngineHandle, options: HttpOptions, served_by: String) -> Arc<Simulator> {
        Arc::new(Simulator {
            engine,
            served_by,
            faults: Mutex::new(Rng::new(options.seed)),
            options,
            recorder: Recorder::default(),
            next_id: AtomicU64::new(1),
        })
    }

    fn inject_error(&self) -> bool {
        if self.options.error_rate <= 0.0 {
            return false;
        }
        let draw = match self.faults.lock() {
            Ok(mut r) => r.next_u64(),
            Err(poisoned) => poisoned.into_inner().next_u64(),
        };
        (draw >> 11) as f64 / (1u64 << 53) as f64 <= self.options.error_rate
    }

    /// Real time converted to simulated time.
    fn simulated(&self, real: Duration) -> Duration {
        real.mul_f64(self.options.speedup.max(f64::MIN_POSITIVE))
    }
}

/// Accepts connections until the listener fails; each connection is served on its own task.
pub async fn serve(listener: TcpListener, sim: Arc<Simulator>) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let sim = sim.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let sim = sim.clone();
                async move {
                    let mut response = handle(sim.clone(), req).await;
                    if let Ok(v) = sim.served_by.parse() {
                        response.headers_mut().insert("x-served-by", v);
                    }
                    Ok::<_, Infallible>(response)
                }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                log::debug!("connection ended: {e}");
            }
        });
    }
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<HttpBody> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn json(status: StatusCode, v: &serde_json::Value) -> Response<HttpBody> {
    full(
        status,
        "application/json",
        serde_json::to_vec(v).unwrap_or_default(),
    )
}

fn error(e: &ApiError) -> Response<HttpBody> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    full(status, "application/json", e.body())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn handle(sim: Arc<Simulator>, req: Request<Incoming>) -> Response<HttpBody> {
    let arrived = Instant::now();
    let path = req.uri().path().to_owned();
    let api = match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => return full(StatusCode::OK, "text/plain", ""),
        (&Method::GET, "/v1/models") => {
            return json(
                StatusCode::OK,
                &api::models_body(&sim.options.models, unix_now()),
            )
        }
        (&Method::GET, "/metrics") => {
            let model = sim.options.models.first().map_or("", String::as_str);
            let text = sim.recorder.render(model, &sim.engine.stats());
            return full(StatusCode::OK, "text/plain; version=0.0.4", text);
        }
        (&Method::POST, "/reset_prefix_cache") => {
            return if sim.engine.reset_cache().await {
                full(StatusCode::OK, "text/plain", "")
            } else {
                error(&ApiError {
                    status: 409,
                    kind: "invalid_request_error",
                    code: "requests_running",
                    message: "the prefix cache can only be reset while no request runs".into(),
                })
            };
        }
        (&Method::POST, "/v1/chat/completions") => Api::ChatCompletions,
        (&Method::POST, "/v1/completions") => Api::Completions,
        _ => {
            return error(&ApiError {
                status: 404,
                kind: "NotFoundError",
                code: "not_found",
                message: format!("no route for {} {path}", req.method()),
            })
        }
    };
    let limit = sim.options.max_body_bytes;
    let body = match Limited::new(req.into_body(), limit).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(&ApiError {
                status: 413,
                kind: "invalid_request_error",
                code: "request_too_large",
                message: format!("request body rejected: {e}"),
            })
        }
    };
    let completion = match api::parse_completion(
        api,
        &body,
        &sim.options.models,
        sim.options.default_max_tokens,
        limit,
    ) {
        Ok(c) => c,
        Err(e) => return error(&e),
    };
    let delay = sim
        .options
        .added_latency
        .div_f64(sim.options.speedup.max(f64::MIN_POSITIVE));
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if sim.inject_error() {
        sim.recorder.finished(false);
        return error(&ApiError {
            status: 500,
            kind: "InternalServerError",
            code: "injected_fault",
            message: "injected fault (--error-rate)".into(),
        });
    }
    // TTFT counts from arrival (as vLLM's does); the engine starts the request's simulated
    // life at arrival plus the injected latency.
    let started = arrived;
    let progress = sim.engine.submit(
        tokenize_bytes(&completion.prompt),
        completion.max_tokens,
        arrived + delay,
    );
    let id = format!(
        "cmpl-kvoy-sim-{}",
        sim.next_id.fetch_add(1, Ordering::Relaxed)
    );
    if completion.stream {
        stream(sim, completion, id, progress, started)
    } else {
        whole(sim, completion, id, progress, started).await
    }
}

/// Tracks token timings for the histograms.
struct Timing {
    started: Instant,
    last: Option<Instant>,
}

impl Timing {
    fn token(&mut self, sim: &Simulator, now: Instant) {
        match self.last {
            None => sim.recorder.ttft(sim.simulated(now - self.started)),
            Some(prev) => sim.recorder.inter_token(sim.simulated(now - prev)),
        }
        self.last = Some(now);
    }
}

async fn whole(
    sim: Arc<Simulator>,
    c: Completion,
    id: String,
    mut progress: mpsc::UnboundedReceiver<Progress>,
    started: Instant,
) -> Response<HttpBody> {
    let mut timing = Timing {
        started,
        last: None,
    };
    let mut text = String::new();
    while let Some(p) = progress.recv().await {
        match p {
            Progress::First { word, at, .. } | Progress::Token { word, at } => {
                timing.token(&sim, at);
                text.push_str(word);
            }
            Progress::Done(usage) => {
                sim.recorder.finished(true);
                return json(
                    StatusCode::OK,
                    &api::response_body(&c, &id, unix_now(), &text, &usage),
                );
            }
            Progress::Failed(message) => {
                sim.recorder.finished(false);
                return error(&ApiError::bad_request(message));
            }
        }
    }
    sim.recorder.finished(false);
    error(&ApiError {
        status: 500,
        kind: "InternalServerError",
        code: "engine_stopped",
        message: "the engine stopped".into(),
    })
}

/// A response body fed by a channel of SSE frames.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

fn sse(v: &serde_json::Value) -> Bytes {
    let mut out = b"data: ".to_vec();
    out.extend(serde_json::to_vec(v).unwrap_or_default());
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

fn stream(
    sim: Arc<Simulator>,
    c: Completion,
    id: String,
    mut progress: mpsc::UnboundedReceiver<Progress>,
    started: Instant,
) -> Response<HttpBody> {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let created = unix_now();
        let mut timing = Timing {
            started,
            last: None,
        };
        let mut n = 0u32;
        while let Some(p) = progress.recv().await {
            let frame = match p {
                Progress::First { word, at, .. } | Progress::Token { word, at } => {
                    timing.token(&sim, at);
                    let f = sse(&api::chunk(&c, &id, created, word, None, n == 0));
                    n += 1;
                    f
                }
                Progress::Done(usage) => {
                    sim.recorder.finished(true);
                    let finish = api::finish_reason(&usage, c.max_tokens);
                    let mut tail =
                        sse(&api::chunk(&c, &id, created, "", Some(finish), n == 0)).to_vec();
                    if c.include_usage {
                        tail.extend_from_slice(&sse(&api::usage_chunk(&c, &id, created, &usage)));
                    }
                    tail.extend_from_slice(b"data: [DONE]\n\n");
                    let _ = tx.send(Bytes::from(tail)).await;
                    return;
                }
                Progress::Failed(message) => {
                    sim.recorder.finished(false);
                    let e = ApiError::bad_request(message);
                    let v: serde_json::Value =
                        serde_json::from_slice(&e.body()).unwrap_or_default();
                    let mut tail = sse(&v).to_vec();
                    tail.extend_from_slice(b"data: [DONE]\n\n");
                    let _ = tx.send(Bytes::from(tail)).await;
                    return;
                }
            };
            if tx.send(frame).await.is_err() {
                // The client left: dropping `progress` makes the engine abort the request.
                sim.recorder.finished(false);
                return;
            }
        }
    });
    let mut r = Response::new(ChannelBody(rx).boxed());
    if let Ok(v) = "text/event-stream".parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}
