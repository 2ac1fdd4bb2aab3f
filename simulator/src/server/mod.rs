//! The HTTP side of a simulator: an OpenAI-compatible API over hyper (`/v1/chat/completions`,
//! `/v1/completions`, and `/v1/responses` with its stored conversations), `/metrics`,
//! `/health`, vLLM's `/version` and `/reset_prefix_cache` and its tokenizer endpoints (`/tokenize`,
//! `/v1/chat/completions/render`), in front of one engine thread. Prompts become token ids in
//! `prompt` (with the [`Tokenizer`] of [`HttpOptions`]), the same way for every endpoint.

pub mod api;
mod chat_input;
pub mod disagg;
mod generation;
mod ids;
pub mod metrics;
mod prompt;
pub mod response_store;
pub mod responses;
pub mod runtime;
mod tokenize;

use kvoy_shared::protocol::{CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, MODELS_PATH, RESPONSES_PATH};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use kvoy_shared::request::Api;
use kvoy_shared::Rng;

use crate::engine::SubmitError;
use crate::tokenizer::Tokenizer;
use api::{ApiError, ClassicWriter};
use generation::{Generation, Prepared};
use metrics::Recorder;
use response_store::ResponseStore;
use runtime::EngineHandle;

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
    /// Responses API: at most this many stored responses (least recently used dropped first).
    pub max_stored_responses: usize,
    /// Responses API: at most this many bytes of stored conversation context.
    pub max_stored_response_bytes: usize,
    /// How prompts become token ids and what answers are made of (`--tokenizer`).
    pub tokenizer: Tokenizer,
    /// Its part in prefill/decode disaggregation (`--role`): a decode (or both) server runs the
    /// decode-side sidecar for requests that name a prefiller ([`disagg`]).
    pub role: kvoy_shared::Role,
    /// KV transfer rate from a prefill server, prompt tokens per second of model time.
    pub kv_transfer_tokens_per_s: f64,
}

impl Default for HttpOptions {
    /// `kvoy-sim`'s defaults, serving model `kvoy-sim`.
    fn default() -> Self {
        HttpOptions {
            models: vec!["kvoy-sim".to_owned()],
            speedup: 1.0,
            default_max_tokens: 16,
            max_body_bytes: 32 << 20,
            error_rate: 0.0,
            added_latency: Duration::ZERO,
            seed: 1,
            max_stored_responses: 10_000,
            max_stored_response_bytes: 256 << 20,
            tokenizer: Tokenizer::StandIn,
            role: kvoy_shared::Role::Decode,
            kv_transfer_tokens_per_s: 200_000.0,
        }
    }
}

/// Everything the handlers share.
pub struct Simulator {
    pub engine: EngineHandle,
    /// Reported on every response as `x-served-by`, so tests and demos see who answered.
    pub served_by: String,
    pub options: HttpOptions,
    pub recorder: Recorder,
    /// The Responses API's stored conversations.
    pub responses: Arc<ResponseStore>,
    faults: Mutex<Rng>,
}

impl Simulator {
    pub fn new(engine: EngineHandle, options: HttpOptions, served_by: String) -> Arc<Simulator> {
        Arc::new(Simulator {
            served_by,
            faults: Mutex::new(Rng::new(options.seed)),
            responses: Arc::new(ResponseStore::new(
                options.max_stored_responses,
                options.max_stored_response_bytes,
            )),
            recorder: Recorder::new(engine.max_model_len()),
            engine,
            options,
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
}

/// Accepts connections until the listener fails; each connection is served on its own task.
pub async fn serve(listener: TcpListener, sim: Arc<Simulator>) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        // Streamed answers are many small writes: without TCP_NODELAY each one waits for the
        // ACK of the previous, which a client on a reused connection (a proxy's pool) delays
        // by up to 40 ms. vLLM and SGLang (asyncio, uvicorn) set it on every connection.
        if let Err(e) = stream.set_nodelay(true) {
            log::debug!("TCP_NODELAY: {e}");
        }
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
    // The decode-side sidecar's part: only a server that decodes follows the header.
    let prefiller: Option<SocketAddr> = req
        .headers()
        .get(kvoy_shared::protocol::PREFILLER_HEADER)
        .filter(|_| sim.options.role.decodes())
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.trim().trim_start_matches("http://").parse().ok());
    enum Route {
        Generate(Api),
        Tokenize,
        RenderChat,
    }
    let route = match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => return full(StatusCode::OK, "text/plain", ""),
        // vLLM's `GET /version`. SGLang's model gateway (smg 1.13) reads it to tell a vLLM
        // server from a generic OpenAI one; only then does it poll `/metrics` for the loads its
        // load-aware policies need. The version is kvoy-sim's own: nothing else is claimed.
        (&Method::GET, "/version") => {
            return json(
                StatusCode::OK,
                &serde_json::json!({"version": env!("CARGO_PKG_VERSION")}),
            )
        }
        (&Method::GET, MODELS_PATH) => {
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
                    param: None,
                    message: "the prefix cache can only be reset while no request runs".into(),
                })
            };
        }
        (&Method::POST, CHAT_COMPLETIONS_PATH) => Route::Generate(Api::ChatCompletions),
        (&Method::POST, COMPLETIONS_PATH) => Route::Generate(Api::Completions),
        (&Method::POST, RESPONSES_PATH) => Route::Generate(Api::Responses),
        (&Method::POST, "/tokenize") => Route::Tokenize,
        (&Method::POST, "/v1/chat/completions/render") => Route::RenderChat,
        _ => {
            return error(&ApiError {
                status: 404,
                kind: "NotFoundError",
                code: "not_found",
                param: None,
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
                param: None,
                message: format!("request body rejected: {e}"),
            })
        }
    };
    let api = match route {
        Route::Generate(api) => api,
        Route::Tokenize => {
            let max_model_len = sim.engine.max_model_len();
            return match tokenize::tokenize(&body, &sim.options, max_model_len) {
                Ok(v) => json(StatusCode::OK, &v),
                Err(e) => error(&e),
            };
        }
        Route::RenderChat => {
            return match tokenize::render_chat(&body, &sim.options) {
                Ok(v) => json(StatusCode::OK, &v),
                Err(e) => error(&e),
            };
        }
    };
    let mut prepared = match prepare(&sim, api, &body) {
        Ok(p) => p,
        Err(e) => return error(&e),
    };
    if sim.options.role.prefills() && disagg::asks_remote_decode(&body) {
        sim.recorder.prefilled_for_remote();
        prepared.writer = Box::new(disagg::TransferWriter {
            inner: prepared.writer,
            served_by: sim.served_by.clone(),
            block_size: sim.engine.stats().block_size as usize,
        });
    }
    // Like vLLM, a prompt over the context is refused before anything streams.
    let prompt_tokens = prepared.tokens.len() as u64;
    let requested = prompt_tokens + u64::from(prepared.max_tokens);
    if requested > sim.engine.max_model_len() {
        let e = SubmitError::TooLong {
            requested,
            prompt_tokens,
            max_model_len: sim.engine.max_model_len(),
        };
        return error(&ApiError::bad_request(e.to_string()));
    }
    let delay = sim
        .options
        .added_latency
        .div_f64(sim.options.speedup.max(f64::MIN_POSITIVE));
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if sim.inject_error() {
        sim.recorder.failed();
        return error(&ApiError {
            status: 500,
            kind: "InternalServerError",
            code: "injected_fault",
            param: None,
            message: "injected fault (--error-rate)".into(),
        });
    }
    let transferred = match prefiller {
        Some(target) => pull_from(&sim, target, api, &path, &body, prepared.tokens.len()).await,
        None => false,
    };
    // TTFT counts from arrival (as vLLM's does); the engine starts the request's simulated
    // life at arrival plus the injected latency (a transferred request's, once its KV is here).
    let progress = if transferred {
        sim.engine.submit_transferred(
            prepared.tokens,
            prepared.max_tokens,
            prepared.output,
            Instant::now(),
        )
    } else {
        sim.engine.submit_with_output(
            prepared.tokens,
            prepared.max_tokens,
            prepared.output,
            arrived + delay,
        )
    };
    let generation = Generation::new(sim, progress, arrived);
    generation::answer(generation, prepared.writer, prepared.stream).await
}

/// The decode side of a disaggregated request: has `target` prefill it and waits for its KV
/// (`tokens` prompt tokens at the transfer rate); false when the prefill failed and the request
/// is prefilled here instead.
async fn pull_from(
    sim: &Simulator,
    target: SocketAddr,
    api: Api,
    path: &str,
    body: &[u8],
    tokens: usize,
) -> bool {
    let Some(prefill) = disagg::prefill_body(api, body) else {
        return false;
    };
    match disagg::remote_prefill(target, path, prefill).await {
        Ok(_) => {
            let o = &sim.options;
            tokio::time::sleep(disagg::transfer_wait(
                tokens,
                o.kv_transfer_tokens_per_s,
                o.speedup,
            ))
            .await;
            sim.recorder.remote_prefill(true);
            true
        }
        Err(why) => {
            log::info!("prefill at {target} failed ({why}): prefilling here");
            sim.recorder.remote_prefill(false);
            false
        }
    }
}

/// Decodes a completion request for `api`.
fn prepare(sim: &Simulator, api: Api, body: &[u8]) -> Result<Prepared, ApiError> {
    if api == Api::Responses {
        return responses::prepare(sim, body);
    }
    let o = &sim.options;
    let c = api::parse_completion(api, body, &o.models, o.default_max_tokens, o.max_body_bytes)?;
    let prefix = match api {
        Api::ChatCompletions => "chatcmpl-",
        _ => "cmpl-",
    };
    Ok(Prepared {
        tokens: prompt::prompt_tokens(&o.tokenizer, api, body, &c, unix_now())?,
        output: o.tokenizer.output(),
        max_tokens: c.max_tokens,
        stream: c.stream,
        writer: Box::new(ClassicWriter::new(c, ids::next(prefix), unix_now())),
    })
}
