//! The gRPC server: `envoy.service.ext_proc.v3.ExternalProcessor/Process`, a bidirectional
//! stream over HTTP/2 (hyper), on 127.0.0.1, in a thread with its own tokio runtime.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderMap, HeaderValue};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::{mpsc, oneshot};

use super::grpc::{self, Code, Deframer, Status};
use super::picker::{Picker, StreamState};

/// The one method served.
pub const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// Runtime threads: as many as the Envoy under test has workers on this 2-core machine.
const WORKERS: usize = 2;

/// A running picker server; stopped when dropped.
pub struct ExtProcServer {
    addr: SocketAddr,
    picker: Arc<Mutex<Picker>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn lock(p: &Mutex<Picker>) -> MutexGuard<'_, Picker> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl ExtProcServer {
    /// Serves `picker` on an ephemeral port of 127.0.0.1.
    pub fn start(picker: Picker) -> std::io::Result<ExtProcServer> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKERS)
            .thread_name("kvoy-ext-proc")
            .enable_all()
            .build()?;
        let std_listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let picker = Arc::new(Mutex::new(picker));
        let (stop, stopped) = oneshot::channel();
        let shared = picker.clone();
        let thread = std::thread::Builder::new()
            .name("kvoy-ext-proc-accept".into())
            .spawn(move || runtime.block_on(accept_loop(std_listener, shared, stopped)))?;
        Ok(ExtProcServer {
            addr,
            picker,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests routed to each pool member so far.
    pub fn routed(&self) -> Vec<(SocketAddr, u64)> {
        lock(&self.picker).routed()
    }

    /// Requests the picker counts outstanding now.
    pub fn outstanding_requests(&self) -> u64 {
        lock(&self.picker).outstanding_requests()
    }
}

impl Drop for ExtProcServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    listener: std::net::TcpListener,
    picker: Arc<Mutex<Picker>>,
    mut stopped: oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            log::error!("ext_proc picker: cannot listen: {e}");
            return;
        }
    };
    loop {
        let (socket, _) = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    log::warn!("ext_proc picker: accept: {e}");
                    continue;
                }
            },
        };
        let _ = socket.set_nodelay(true);
        let picker = picker.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| serve(req, picker.clone()));
            // Large windows and frames: a 400 KB body should cross in one round trip, the
            // best case for ext_proc.
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .initial_stream_window_size(4 << 20)
                .initial_connection_window_size(16 << 20)
                .max_frame_size(1 << 20)
                .max_concurrent_streams(4096)
                .serve_connection(TokioIo::new(socket), service);
            if let Err(e) = conn.await {
                log::debug!("ext_proc picker: connection ended: {e}");
            }
        });
    }
}

/// The response body: frames as the stream's task produces them.
struct ChannelBody {
    rx: mpsc::Receiver<Frame<Bytes>>,
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.get_mut().rx.poll_recv(cx).map(|f| f.map(Ok))
    }
}

async fn serve(
    req: Request<Incoming>,
    picker: Arc<Mutex<Picker>>,
) -> Result<Response<ChannelBody>, Infallible> {
    let (tx, rx) = mpsc::channel(8);
    if req.uri().path() == PROCESS_PATH {
        tokio::spawn(process(req.into_body(), tx, picker));
    } else {
        let status = Status::new(
            Code::Unimplemented,
            "only ExternalProcessor/Process is served",
        );
        tokio::spawn(async move {
            let _ = tx.send(Frame::trailers(trailers(&status))).await;
        });
    }
    let mut response = Response::new(ChannelBody { rx });
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    Ok(response)
}

fn trailers(status: &Status) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from(status.code as u32));
    if !status.message.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&status.header_message()) {
            t.insert("grpc-message", v);
        }
    }
    t
}

/// One ext_proc stream: every message answered in order; a bad one ends the call with its
/// status (the server goes on).
async fn process(mut body: Incoming, tx: mpsc::Sender<Frame<Bytes>>, picker: Arc<Mutex<Picker>>) {
    let mut deframer = Deframer::default();
    let mut stream = StreamState::default();
    let status = 'stream: loop {
        let data = match body.frame().await {
            None => {
                break deframer
                    .finish()
                    .map_or_else(|e| e.status(), |()| Status::ok())
            }
            // Envoy reset the stream: nobody to answer.
            Some(Err(_)) => {
                lock(&picker).end(&mut stream);
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue, // request trailers carry nothing for us
            },
        };
        deframer.push(&data);
        loop {
            let message = match deframer.next_message() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => break 'stream e.status(),
            };
            let answer = lock(&picker).handle(&mut stream, message);
            match answer {
                Ok(response) => {
                    if tx.send(Frame::data(grpc::frame(&response))).await.is_err() {
                        lock(&picker).end(&mut stream);
                        return;
                    }
                }
                Err(status) => break 'stream status,
            }
        }
    };
    lock(&picker).end(&mut stream);
    if status.code != Code::Ok {
        log::warn!("ext_proc picker: stream ended with {status:?}");
    }
    let _ = tx.send(Frame::trailers(trailers(&status))).await;
}
