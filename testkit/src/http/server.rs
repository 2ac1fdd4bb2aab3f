//! A small HTTP/1.1 server on hyper for fake upstreams and test backends: an async handler per
//! request, keep-alive, a connection limit, on a runtime and thread of its own so that blocking
//! tests can start one. Binding is the caller's: tests bind 127.0.0.1.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::oneshot;

/// Most connections a server accepts over its life (a bound on the accept loop, far above any
/// test's needs).
const MAX_ACCEPTS: u64 = 1 << 40;

/// A body for hyper, a server's response or a client's request: whole (sent with a
/// `content-length`) or a list of pieces (sent chunked on HTTP/1.1, one chunk or DATA frame
/// each, as a streamed reply is), optionally ended by trailers, or never ended (a stalled
/// upload: it stays pending after its pieces).
#[derive(Debug, Default)]
pub struct Body {
    pieces: VecDeque<Bytes>,
    whole: bool,
    trailers: Option<hyper::HeaderMap>,
    stall: bool,
}

impl Body {
    pub fn empty() -> Body {
        Body::full(Bytes::new())
    }

    pub fn full(bytes: impl Into<Bytes>) -> Body {
        let bytes = bytes.into();
        Body {
            pieces: if bytes.is_empty() {
                VecDeque::new()
            } else {
                VecDeque::from([bytes])
            },
            whole: true,
            ..Body::default()
        }
    }

    /// A chunked body, one chunk per piece (empty pieces are skipped: they would end it).
    pub fn chunks(pieces: impl IntoIterator<Item = Bytes>) -> Body {
        Body {
            pieces: pieces.into_iter().filter(|p| !p.is_empty()).collect(),
            ..Body::default()
        }
    }

    /// This body, its pieces followed by `trailers` (which end it).
    pub fn with_trailers(self, trailers: hyper::HeaderMap) -> Body {
        Body {
            trailers: Some(trailers),
            ..self
        }
    }

    /// This body, never ending after its pieces: a client that stops sending mid-upload.
    pub fn stalled(self) -> Body {
        Body {
            stall: true,
            ..self
        }
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(piece) = self.pieces.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        if let Some(trailers) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        if self.stall {
            // Nothing will wake it: the stream stays open until the other side gives up.
            return Poll::Pending;
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.pieces.is_empty() && self.trailers.is_none() && !self.stall
    }

    fn size_hint(&self) -> SizeHint {
        if self.whole {
            let len = self.pieces.iter().map(Bytes::len).sum::<usize>();
            SizeHint::with_exact(u64::try_from(len).unwrap_or(u64::MAX))
        } else {
            SizeHint::default()
        }
    }
}

/// A response with `status`, a `content-type` and a whole body.
pub fn response(status: u16, content_type: &str, body: impl Into<Bytes>) -> hyper::Response<Body> {
    let mut response = hyper::Response::new(Body::full(body));
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("request body exceeds the limit of {0} bytes")]
    TooLarge(usize),
    #[error("request body: {0}")]
    Http(#[from] hyper::Error),
}

/// Reads a request body whole, at most `limit` bytes.
pub async fn read_body(mut body: Incoming, limit: usize) -> Result<Bytes, BodyError> {
    let mut out = Vec::new();
    // Data frames hold at least a byte each, so the limit bounds the frames too.
    for _ in 0..limit.saturating_add(64) {
        let Some(frame) = body.frame().await else {
            return Ok(Bytes::from(out));
        };
        if let Ok(data) = frame?.into_data() {
            if out.len().saturating_add(data.len()) > limit {
                return Err(BodyError::TooLarge(limit));
            }
            out.extend_from_slice(&data);
        }
    }
    Err(BodyError::TooLarge(limit))
}

/// The answer for a connection past [`Options::max_connections`].
pub type Refusal = Arc<dyn Fn() -> hyper::Response<Body> + Send + Sync>;

/// How a server runs.
#[derive(Clone)]
pub struct Options {
    /// Connections served at once; one more gets [`Options::refuse`]'s answer and is closed.
    pub max_connections: usize,
    /// A connection whose next request head takes longer than this is closed.
    pub idle_timeout: Duration,
    /// Threads of the server's runtime.
    pub workers: usize,
    /// The answer to a connection over the limit (default: a bare 503).
    pub refuse: Refusal,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            max_connections: 512,
            idle_timeout: Duration::from_secs(60),
            workers: 1,
            refuse: Arc::new(|| response(503, "text/plain", "too many connections")),
        }
    }
}

#[derive(Debug, Default)]
struct Stats {
    accepted: AtomicU64,
    active: AtomicUsize,
}

/// Takes a connection off the active count when its task ends, however it ends.
struct Active(Arc<Stats>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running server; stops when dropped.
pub struct Server {
    addr: SocketAddr,
    stats: Arc<Stats>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `listen` and serves each request with `handler` on a thread of the server's own.
    pub fn start<H, F>(listen: SocketAddr, options: Options, handler: H) -> io::Result<Server>
    where
        H: Fn(hyper::Request<Incoming>) -> F + Send + Sync + 'static,
        F: Future<Output = hyper::Response<Body>> + Send + 'static,
    {
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.workers.max(1))
            .thread_name("kvoy-testkit-server")
            .enable_all()
            .build()?;
        let stats = Arc::new(Stats::default());
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name(format!("kvoy-testkit-server-{addr}"))
            .spawn({
                let stats = Arc::clone(&stats);
                move || {
                    runtime.block_on(accept_loop(
                        listener,
                        options,
                        Arc::new(handler),
                        stats,
                        stopped,
                    ));
                }
            })?;
        Ok(Server {
            addr,
            stats,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far (refused ones included).
    pub fn accepted(&self) -> u64 {
        self.stats.accepted.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn active(&self) -> usize {
        self.stats.active.load(Ordering::SeqCst)
    }

    /// Blocks until the server stops (it runs until the process exits, unless its accept loop
    /// fails to start).
    pub fn wait(mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop<H, F>(
    listener: std::net::TcpListener,
    options: Options,
    handler: Arc<H>,
    stats: Arc<Stats>,
    mut stopped: oneshot::Receiver<()>,
) where
    H: Fn(hyper::Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    for _ in 0..MAX_ACCEPTS {
        let accepted = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else {
            // Transient accept errors (EMFILE and the like): back off briefly.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        stats.accepted.fetch_add(1, Ordering::SeqCst);
        let over = stats.active.fetch_add(1, Ordering::SeqCst) >= options.max_connections;
        let active = Active(Arc::clone(&stats));
        let handler = Arc::clone(&handler);
        let refuse = Arc::clone(&options.refuse);
        let idle = options.idle_timeout;
        tokio::spawn(async move {
            let _active = active;
            let service = hyper::service::service_fn(move |request| {
                let reply = (!over).then(|| handler(request));
                let refuse = Arc::clone(&refuse);
                async move {
                    Ok::<_, Infallible>(match reply {
                        Some(reply) => reply.await,
                        None => refuse(),
                    })
                }
            });
            // A failed connection concerns only its client.
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(idle)
                .keep_alive(!over)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
