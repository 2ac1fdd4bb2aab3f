//! `kvoy-local serve`: a small HTTP/1.1 proxy that runs the filter chain under wasmtime and
//! forwards each request to the endpoint the chain chose, streaming the response back through
//! the filters' response callbacks, so that kvoy can be tried against real model servers with
//! no Envoy at all.
//!
//! Like Envoy: each client connection is served by one worker (round robin), i.e. VM `w` of
//! every filter; the request goes through the chain (held requests wait, local replies are
//! answered), then to the address in `x-gateway-destination-endpoint` (an `ORIGINAL_DST`
//! cluster; without one: 503 `no healthy upstream`); the response goes back through the
//! response callbacks with `upstream.address` set; when the response is done (or the client
//! leaves) the filters' `proxy_on_log` runs. `dispatch_http_call`s go to the `clusters` of the
//! configuration. An optional admin listener answers `GET /stats` (Envoy's format, the filters'
//! metrics as `wasmcustom.*`) and `GET /ready`.
//!
//! Differences from Envoy: the request body is read whole before the chain sees it (the filters
//! buffer it anyway; over 64 MiB is answered 413 without the chain), one upstream connection
//! per request, no request trailers, HTTP/1.1 only, no TLS.

mod engine;
mod upstream;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use kvoy_harness::{HeaderMap, Metric, MetricType};

use crate::chain::{self, Callouts, StartError};
use crate::config::Config;
use engine::{Command, Event};

/// Largest request body read.
pub const MAX_REQUEST_BODY: usize = 64 << 20;

/// Connection-specific headers, never forwarded.
pub(crate) const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
];

/// Where to listen.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// The admin listener (`/stats`, `/ready`), if any.
    pub admin: Option<SocketAddr>,
}

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
    #[error("the filter engine stopped")]
    EngineGone,
}

/// A running proxy; stops when dropped.
pub struct Server {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    commands: Sender<Command>,
    shutdown: tokio::sync::watch::Sender<bool>,
    runtime: Option<tokio::runtime::Runtime>,
    engine: Option<std::thread::JoinHandle<()>>,
}

/// Shared by every connection.
struct Shared {
    commands: Mutex<Sender<Command>>,
    next_id: AtomicU64,
    next_worker: AtomicUsize,
    workers: usize,
}

impl Shared {
    fn send(&self, command: Command) -> bool {
        self.commands
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(command)
            .is_ok()
    }

    fn sender(&self) -> Sender<Command> {
        self.commands
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Server {
    /// Starts the filters (failing like Envoy does on a bad configuration), the engine thread,
    /// and the listeners.
    pub fn start(config: &Config, options: &ServeOptions) -> Result<Server, ServeError> {
        let chain = chain::start(config, Callouts::Real, Some(SystemTime::now()))?;
        let (commands, receiver) = std::sync::mpsc::channel();
        let engine = std::thread::Builder::new()
            .name("kvoy-local-filters".to_owned())
            .spawn(move || engine::run(chain, receiver))
            .map_err(ServeError::Runtime)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvoy-local-http")
            .enable_all()
            .build()
            .map_err(ServeError::Runtime)?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(options.listen))
            .map_err(|source| ServeError::Listen {
                addr: options.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| ServeError::Listen {
            addr: options.listen,
            source,
        })?;
        let admin_listener = match options.admin {
            Some(a) => Some(
                runtime
                    .block_on(tokio::net::TcpListener::bind(a))
                    .map_err(|source| ServeError::Listen { addr: a, source })?,
            ),
            None => None,
        };
        let admin = match &admin_listener {
            Some(l) => Some(
                l.local_addr()
                    .map_err(|source| ServeError::Listen { addr, source })?,
            ),
            None => None,
        };
        let shared = Arc::new(Shared {
            commands: Mutex::new(commands.clone()),
            next_id: AtomicU64::new(1),
            next_worker: AtomicUsize::new(0),
            workers: config.workers,
        });
        let (shutdown, stop) = tokio::sync::watch::channel(false);
        runtime.spawn(accept(listener, shared.clone(), stop.clone()));
        if let Some(l) = admin_listener {
            runtime.spawn(admin_accept(l, shared, stop));
        }
        Ok(Server {
            addr,
            admin,
            commands,
            shutdown,
            runtime: Some(runtime),
            engine: Some(engine),
        })
    }

    /// The proxy listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// Every filter's metrics, as (filter, metric).
    pub fn metrics(&self) -> Result<Vec<(String, Metric)>, ServeError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.commands
            .send(Command::Metrics { reply })
            .map_err(|_| ServeError::EngineGone)?;
        answer.blocking_recv().map_err(|_| ServeError::EngineGone)
    }

    /// Blocks until Ctrl-C or SIGTERM.
    pub fn wait_for_signal(&self) {
        if let Some(runtime) = &self.runtime {
            runtime.block_on(async {
                #[cfg(unix)]
                {
                    use tokio::signal::unix::{signal, SignalKind};
                    match signal(SignalKind::terminate()) {
                        Ok(mut term) => {
                            tokio::select! {
                                _ = tokio::signal::ctrl_c() => {}
                                _ = term.recv() => {}
                            }
                        }
                        Err(_) => {
                            let _ = tokio::signal::ctrl_c().await;
                        }
                    }
                }
                #[cfg(not(unix))]
                {
                    let _ = tokio::signal::ctrl_c().await;
                }
            });
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
        // The engine stops once the last command sender is gone.
        let (dead, _) = std::sync::mpsc::channel();
        self.commands = dead;
        if let Some(engine) = self.engine.take() {
            let _ = engine.join();
        }
    }
}

/// Envoy's stats text: `wasmcustom.<name>: <value>` per counter and gauge, sorted.
pub fn stats_text(metrics: &[(String, Metric)]) -> String {
    let mut lines: Vec<String> = metrics
        .iter()
        .filter(|(_, m)| m.kind != MetricType::Histogram)
        .map(|(_, m)| format!("wasmcustom.{}: {}", m.name, m.value))
        .collect();
    lines.sort();
    lines.dedup();
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

/// The next connection on `listener`, or `None` once `stop` changes. A failed accept (out of
/// file descriptors, say) is retried after a pause rather than spun on.
async fn next_connection(
    listener: &tokio::net::TcpListener,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Option<(tokio::net::TcpStream, std::net::SocketAddr)> {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(connection) => return Some(connection),
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            _ = stop.changed() => return None,
        }
    }
}

async fn accept(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    while let Some((tcp, peer)) = next_connection(&listener, &mut stop).await {
        let _ = tcp.set_nodelay(true);
        let local = tcp.local_addr().unwrap_or(peer);
        let worker = shared.next_worker.fetch_add(1, Ordering::Relaxed) % shared.workers.max(1);
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                handle(req, shared.clone(), worker, peer, local)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

/// Sends `Finish` for a request when dropped: after the response, or when the client leaves.
struct FinishGuard {
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for FinishGuard {
    fn drop(&mut self) {
        self.shared.send(Command::Finish { id: self.id });
    }
}

/// A response body fed by the engine's events.
pub struct ChannelBody {
    rx: tokio::sync::mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>,
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

type ProxyBody = http_body_util::Either<Full<Bytes>, ChannelBody>;

fn plain(status: StatusCode, text: &str) -> Response<ProxyBody> {
    let mut response = Response::new(http_body_util::Either::Left(Full::new(Bytes::from(
        text.to_owned(),
    ))));
    *response.status_mut() = status;
    if !text.is_empty() {
        response.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/plain"),
        );
    }
    response
}

/// The request headers Envoy's connection manager hands the first filter.
fn request_headers(parts: &hyper::http::request::Parts, id: u64) -> HeaderMap {
    let mut map = HeaderMap::new();
    map.add(":method", parts.method.as_str());
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    map.add(":path", &path);
    let authority = parts
        .headers
        .get(hyper::header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| parts.uri.authority().map(|a| a.to_string()))
        .unwrap_or_default();
    map.add(":authority", &authority);
    map.add(":scheme", "http");
    for (name, value) in &parts.headers {
        let name = name.as_str();
        if name == "host" || HOP_BY_HOP.contains(&name) {
            continue;
        }
        map.add(name, &String::from_utf8_lossy(value.as_bytes()));
    }
    map.replace("x-forwarded-proto", "http");
    if !map.contains("x-request-id") {
        map.add(
            "x-request-id",
            &format!("kvoy-local-{:016x}", request_id(id)),
        );
    }
    map
}

/// A request id that differs across runs (Envoy's is a UUID).
fn request_id(id: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos ^ id.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

async fn handle(
    req: Request<Incoming>,
    shared: Arc<Shared>,
    worker: usize,
    peer: SocketAddr,
    local: SocketAddr,
) -> Result<Response<ProxyBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, MAX_REQUEST_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return Ok(plain(StatusCode::PAYLOAD_TOO_LARGE, "Payload Too Large")),
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let headers = request_headers(&parts, id);
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let sent = shared.send(Command::Request {
        id,
        worker,
        headers,
        body: body.to_vec(),
        peer,
        local,
        events: events_tx,
    });
    if !sent {
        return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, ""));
    }
    let guard = FinishGuard {
        id,
        shared: shared.clone(),
    };
    loop {
        let Some(event) = events.recv().await else {
            return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, ""));
        };
        match event {
            Event::Upstream {
                address,
                headers,
                body,
            } => {
                tokio::spawn(upstream::forward(
                    id,
                    address,
                    headers,
                    body,
                    shared.sender(),
                ));
            }
            Event::Headers(headers) => return Ok(respond(headers, events, guard)),
            Event::Body(..) => {}
            Event::Reset => {
                return Err(std::io::Error::other("the stream was reset"));
            }
            // Envoy fails the stream closed: 503, no body.
            Event::Failed(message) => {
                log::warn!("kvoy-local: request {id} failed in the filter chain: {message}");
                return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, ""));
            }
        }
    }
}

/// The client's response: the headers now, the body as the engine sends it.
fn respond(
    headers: HeaderMap,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    guard: FinishGuard,
) -> Response<ProxyBody> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let _guard = guard;
        while let Some(event) = events.recv().await {
            match event {
                Event::Body(chunk, end) => {
                    if !chunk.is_empty() && tx.send(Ok(chunk)).is_err() {
                        return;
                    }
                    if end {
                        return;
                    }
                }
                Event::Reset | Event::Failed(_) => {
                    let _ = tx.send(Err(std::io::Error::other("the stream was reset")));
                    return;
                }
                Event::Headers(_) | Event::Upstream { .. } => {}
            }
        }
    });
    let status = headers
        .get(":status")
        .and_then(|s| s.trim().parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::BAD_GATEWAY);
    let mut response = Response::new(http_body_util::Either::Right(ChannelBody { rx }));
    *response.status_mut() = status;
    for (name, value) in headers.iter() {
        if name.starts_with(':') || HOP_BY_HOP.contains(&name) {
            continue;
        }
        let (Ok(name), Ok(value)) = (
            hyper::header::HeaderName::from_bytes(name.as_bytes()),
            hyper::header::HeaderValue::from_str(value),
        ) else {
            continue;
        };
        response.headers_mut().append(name, value);
    }
    response
}

async fn admin_accept(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    while let Some((tcp, _)) = next_connection(&listener, &mut stop).await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(admin(req, &shared).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

async fn admin(req: Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    match req.uri().path() {
        "/ready" => text(StatusCode::OK, "LIVE\n".to_owned()),
        "/stats" => {
            let (reply, answer) = tokio::sync::oneshot::channel();
            if !shared.send(Command::Metrics { reply }) {
                return text(StatusCode::SERVICE_UNAVAILABLE, String::new());
            }
            match answer.await {
                Ok(metrics) => {
                    let filter = req
                        .uri()
                        .query()
                        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("filter=")))
                        .unwrap_or("");
                    let body: String = stats_text(&metrics)
                        .lines()
                        .filter(|l| l.contains(filter))
                        .map(|l| format!("{l}\n"))
                        .collect();
                    text(StatusCode::OK, body)
                }
                Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, String::new()),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "GET /stats or /ready\n".to_owned()),
    }
}
