//! An OpenAI-shaped echo backend: answers every inference call with a reply that names the
//! address that served it, so tests can see where a proxy routed each request.
//!
//! On the test kit's hyper server: keep-alive, `Content-Length` and chunked bodies, a bounded
//! number of connections.

use kvoy_shared::protocol::{CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, MODELS_PATH, RESPONSES_PATH};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::http::server::{self, read_body, Body, BodyError, Options, Server};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue};
use serde_json::{json, Value};

mod openai;

pub use openai::error_body;
use openai::{completion_body, models_body, stream_events, Api};

/// The header a routing proxy sets to choose the endpoint; echoed back in the reply.
pub use kvoy_shared::protocol::DESTINATION_HEADER;
/// kvoy's internal session-pin header, echoed back in the reply (`pin_header`) so that tests
/// can check that it never reaches a model server.
pub use kvoy_shared::session::PIN_HEADER;
/// Response header naming the address that served the request.
pub const SERVED_BY_HEADER: &str = "x-served-by";
/// Request header asking for a delay before the reply, in milliseconds.
pub const DELAY_HEADER: &str = "x-echo-delay-ms";
/// Upper bound of any delay, header or configured.
pub const MAX_DELAY: Duration = Duration::from_secs(10);
/// Largest request body accepted (a multi-MB prompt fits).
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Most connections served at once; more are refused with 503.
pub const MAX_CONNECTIONS: usize = 512;
/// A connection idle this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How to run one echo backend.
#[derive(Clone, Debug)]
pub struct EchoConfig {
    /// Where to listen; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Models listed by `/v1/models` and accepted in request bodies.
    pub models: Vec<String>,
    /// A delay added to every inference reply (capped at [`MAX_DELAY`]).
    pub delay: Duration,
}

impl EchoConfig {
    /// A backend on `listen` serving `models`, without delay.
    pub fn new(listen: SocketAddr, models: &[&str]) -> Self {
        EchoConfig {
            listen,
            models: models.iter().map(|m| m.to_string()).collect(),
            delay: Duration::ZERO,
        }
    }
}

#[derive(Debug, Default)]
struct Stats {
    requests: AtomicU64,
    inference: AtomicU64,
}

struct Shared {
    served_by: String,
    models: Vec<String>,
    delay: Duration,
    stats: Stats,
}

/// A running echo backend; stops when dropped.
pub struct EchoServer {
    server: Server,
    shared: Arc<Shared>,
}

impl EchoServer {
    /// `count` backends on free ports of 127.0.0.1 serving `models`, without delay.
    pub fn loopback(count: usize, models: &[&str]) -> io::Result<Vec<EchoServer>> {
        (0..count)
            .map(|_| {
                EchoServer::start(EchoConfig::new(
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    models,
                ))
            })
            .collect()
    }

    /// Binds and starts serving in background threads.
    pub fn start(config: EchoConfig) -> io::Result<EchoServer> {
        // The address to name is only known once bound; the handler reads it from here.
        let served_by = Arc::new(std::sync::OnceLock::<Arc<Shared>>::new());
        let options = Options {
            max_connections: MAX_CONNECTIONS,
            idle_timeout: IDLE_TIMEOUT,
            // Two threads, as the machines running the e2e tests have two cores.
            workers: 2,
            refuse: Arc::new({
                let served_by = Arc::clone(&served_by);
                move || {
                    let name = served_by.get().map_or("", |s| s.served_by.as_str());
                    let body = error_body("too many connections", "server_error", "overloaded");
                    json_reply(503, name, body)
                }
            }),
        };
        let server = Server::start(config.listen, options, {
            let served_by = Arc::clone(&served_by);
            move |request| {
                let shared = served_by.get().cloned();
                async move {
                    match shared {
                        Some(shared) => handle(&shared, request).await,
                        None => {
                            json_reply(503, "", error_body("starting", "server_error", "starting"))
                        }
                    }
                }
            }
        })?;
        let shared = Arc::new(Shared {
            served_by: server.addr().to_string(),
            models: config.models,
            delay: config.delay.min(MAX_DELAY),
            stats: Stats::default(),
        });
        let _ = served_by.set(Arc::clone(&shared));
        Ok(EchoServer { server, shared })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// Requests answered so far (any path, including errors).
    pub fn requests(&self) -> u64 {
        self.shared.stats.requests.load(Ordering::Relaxed)
    }

    /// Inference requests (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`) answered.
    pub fn inference_requests(&self) -> u64 {
        self.shared.stats.inference.load(Ordering::Relaxed)
    }

    /// Blocks until the server stops (it runs until the server is dropped elsewhere or the
    /// process exits).
    pub fn wait(self) {
        self.server.wait();
    }
}

async fn handle(shared: &Shared, request: hyper::Request<Incoming>) -> hyper::Response<Body> {
    let (parts, body) = request.into_parts();
    let body = match read_body(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(e) => {
            let status = if matches!(e, BodyError::TooLarge(_)) {
                413
            } else {
                400
            };
            let body = error_body(&e.to_string(), "invalid_request_error", "bad_request");
            return json_reply(status, &shared.served_by, body);
        }
    };
    shared.stats.requests.fetch_add(1, Ordering::Relaxed);
    respond(
        shared,
        parts.method.as_str(),
        parts.uri.path(),
        &parts.headers,
        &body,
    )
    .await
}

async fn respond(
    shared: &Shared,
    method: &str,
    path: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> hyper::Response<Body> {
    let served_by = shared.served_by.as_str();
    let api = match (method, path) {
        ("GET", "/health") => return json_reply(200, served_by, b"{\"status\":\"ok\"}".to_vec()),
        ("GET", MODELS_PATH) => {
            return json_reply(200, served_by, models_body(served_by, &shared.models))
        }
        ("POST", CHAT_COMPLETIONS_PATH) => Api::Chat,
        ("POST", COMPLETIONS_PATH) => Api::Completions,
        ("POST", RESPONSES_PATH) => Api::Responses,
        (
            _,
            "/health" | MODELS_PATH | CHAT_COMPLETIONS_PATH | COMPLETIONS_PATH | RESPONSES_PATH,
        ) => {
            let body = error_body(
                "method not allowed",
                "invalid_request_error",
                "method_not_allowed",
            );
            return json_reply(405, served_by, body);
        }
        _ => {
            let body = error_body(
                &format!("no route for {path}"),
                "invalid_request_error",
                "not_found",
            );
            return json_reply(404, served_by, body);
        }
    };
    let request: Value = match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Value::Object(map),
        Ok(_) => return bad_request(served_by, "request body must be a JSON object"),
        Err(e) => return bad_request(served_by, &format!("request body is not JSON: {e}")),
    };
    let model = match request.get("model") {
        Some(Value::String(m)) => m.clone(),
        _ => return bad_request(served_by, "field `model` (string) is required"),
    };
    if !shared.models.contains(&model) {
        let body = error_body(
            &format!("The model `{model}` does not exist."),
            "invalid_request_error",
            "model_not_found",
        );
        return json_reply(404, served_by, body);
    }
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let delay = requested_delay(header(DELAY_HEADER))
        .unwrap_or(shared.delay)
        .min(MAX_DELAY);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    shared.stats.inference.fetch_add(1, Ordering::Relaxed);
    let echo = json!({
        "served_by": served_by,
        "path": path,
        "destination_header": header(DESTINATION_HEADER),
        "pin_header": header(PIN_HEADER),
    });
    let stream = matches!(request.get("stream"), Some(Value::Bool(true)));
    let text = format!("Hello from kvoy echo backend {served_by}.");
    if stream {
        stream_reply(served_by, api, &model, &text, echo)
    } else {
        let body = completion_body(api, &model, &text, echo);
        json_reply(
            200,
            served_by,
            serde_json::to_vec(&body).unwrap_or_default(),
        )
    }
}

fn requested_delay(value: Option<&str>) -> Option<Duration> {
    let ms = value?.trim().parse::<u64>().ok()?;
    Some(Duration::from_millis(ms).min(MAX_DELAY))
}

fn bad_request(served_by: &str, message: &str) -> hyper::Response<Body> {
    let body = error_body(message, "invalid_request_error", "bad_request");
    json_reply(400, served_by, body)
}

/// A JSON reply with the `x-served-by` header.
fn json_reply(status: u16, served_by: &str, body: Vec<u8>) -> hyper::Response<Body> {
    let mut reply = server::response(status, "application/json", body);
    name_server(reply.headers_mut(), served_by);
    reply
}

fn name_server(headers: &mut HeaderMap, served_by: &str) {
    if let Ok(value) = HeaderValue::from_str(served_by) {
        headers.insert(SERVED_BY_HEADER, value);
    }
}

/// An SSE reply, one chunk per event, ending in `data: [DONE]`.
fn stream_reply(
    served_by: &str,
    api: Api,
    model: &str,
    text: &str,
    echo: Value,
) -> hyper::Response<Body> {
    let mut frames: Vec<Bytes> = stream_events(api, model, text, echo)
        .into_iter()
        .map(|event| {
            let mut frame = b"data: ".to_vec();
            frame.extend(serde_json::to_vec(&event).unwrap_or_default());
            frame.extend_from_slice(b"\n\n");
            Bytes::from(frame)
        })
        .collect();
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let mut reply = hyper::Response::new(Body::chunks(frames));
    let headers = reply.headers_mut();
    headers.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        hyper::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache"),
    );
    name_server(headers, served_by);
    reply
}

#[cfg(test)]
mod tests;
