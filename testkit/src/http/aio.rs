//! The async client under the blocking one; tokio tests call it directly. One
//! [`Connection`] is one HTTP/1.1 connection (`hyper::client::conn::http1`), its driver a task
//! on the caller's runtime that ends when the connection is dropped.

use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::header::{CONNECTION, CONTENT_LENGTH, HOST};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use super::types::{Head, Headers, HttpError, Part, Request, Response, MAX_CLIENT_BODY};

/// Opens a TCP connection to `addr` within `timeout`, with Nagle off (requests and streamed
/// replies are small writes).
pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, HttpError> {
    let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Err(_) => {
            return Err(HttpError::Timeout {
                what: "the connection",
                after: timeout,
            })
        }
        Ok(Err(source)) => return Err(HttpError::Connect { addr, source }),
        Ok(Ok(stream)) => stream,
    };
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// One request on a fresh connection; the whole response.
pub async fn request(addr: SocketAddr, request: &Request) -> Result<Response, HttpError> {
    Connection::open(addr, request.timeout)
        .await?
        .request(request)
        .await
}

/// One request on a fresh connection, its response handed to `on` as it arrives (see
/// [`super::stream`]).
pub async fn stream(
    addr: SocketAddr,
    request: &Request,
    on: impl FnMut(Part<'_>) -> ControlFlow<()>,
) -> Result<Head, HttpError> {
    Connection::open(addr, request.timeout)
        .await?
        .stream(request, on)
        .await
}

/// Aborts the connection's driver task when the connection is dropped, closing the socket.
struct Driver(JoinHandle<()>);

impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One HTTP/1.1 connection; requests on it go one after the other (keep-alive).
pub struct Connection {
    sender: http1::SendRequest<Full<Bytes>>,
    host: String,
    _driver: Driver,
}

impl Connection {
    /// Connects to `addr` within `timeout`.
    pub async fn open(addr: SocketAddr, timeout: Duration) -> Result<Connection, HttpError> {
        Connection::handshake(connect(addr, timeout).await?).await
    }

    /// Speaks HTTP/1.1 on a connection the caller opened (a test that connects many clients
    /// before sending anything, say). Must be called inside a tokio runtime.
    pub async fn handshake(stream: TcpStream) -> Result<Connection, HttpError> {
        let host = stream.peer_addr()?.to_string();
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(HttpError::Request)?;
        let driver = tokio::spawn(async move {
            // Its error reaches the request that was in flight; nothing more to do here.
            let _ = connection.await;
        });
        Ok(Connection {
            sender,
            host,
            _driver: Driver(driver),
        })
    }

    /// Whether the peer or an error closed the connection.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// One request; the whole response (bodies up to [`MAX_CLIENT_BODY`]).
    pub async fn request(&mut self, request: &Request) -> Result<Response, HttpError> {
        let mut body = Vec::new();
        let head = self
            .stream(request, |part| {
                if let Part::Data(data) = part {
                    body.extend_from_slice(data);
                }
                ControlFlow::Continue(())
            })
            .await?;
        Ok(Response {
            status: head.status,
            headers: head.headers,
            body,
        })
    }

    /// One request, its response handed to `on` as it arrives: the head, then each piece of
    /// the body. `Break` stops reading (the connection is then no use for another request).
    pub async fn stream(
        &mut self,
        request: &Request,
        mut on: impl FnMut(Part<'_>) -> ControlFlow<()>,
    ) -> Result<Head, HttpError> {
        let timeout = request.timeout;
        let outgoing = build(request, &self.host)?;
        let response = tokio::time::timeout(timeout, async {
            self.sender.ready().await?;
            self.sender.send_request(outgoing).await
        })
        .await
        .map_err(|_| HttpError::Timeout {
            what: "the response head",
            after: timeout,
        })?
        .map_err(HttpError::Request)?;
        let (parts, mut body) = response.into_parts();
        let head = Head {
            status: parts.status.as_u16(),
            headers: Headers::from_map(&parts.headers),
        };
        if on(Part::Head(&head)).is_break() {
            return Ok(head);
        }
        let mut total = 0usize;
        // Every data frame holds at least one byte, so the body limit bounds the frames too;
        // the slack is for trailers and empty frames.
        for _ in 0..MAX_CLIENT_BODY.saturating_add(64) {
            let frame = match tokio::time::timeout(timeout, body.frame()).await {
                Err(_) => {
                    return Err(HttpError::Timeout {
                        what: "the response body",
                        after: timeout,
                    })
                }
                Ok(None) => return Ok(head),
                Ok(Some(frame)) => frame.map_err(HttpError::Body)?,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            total = total.saturating_add(data.len());
            if total > MAX_CLIENT_BODY {
                return Err(HttpError::TooLarge {
                    what: "the response body",
                    limit: MAX_CLIENT_BODY,
                });
            }
            if on(Part::Data(&data)).is_break() {
                return Ok(head);
            }
        }
        Err(HttpError::TooLarge {
            what: "the response body's frame count",
            limit: MAX_CLIENT_BODY,
        })
    }
}

/// The hyper request for `request`: `host` (unless the caller set one), `connection: close`
/// when asked, the caller's headers in order, and a `content-length` when there is a body or
/// the method is POST or PUT (as servers expect from a client that sends one).
fn build(request: &Request, host: &str) -> Result<hyper::Request<Full<Bytes>>, HttpError> {
    let has = |name: &str| {
        request
            .headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case(name))
    };
    let mut builder = hyper::Request::builder()
        .method(request.method.as_str())
        .uri(request.path.as_str());
    if !has("host") {
        builder = builder.header(HOST, request.host.as_deref().unwrap_or(host));
    }
    if request.close && !has("connection") {
        builder = builder.header(CONNECTION, "close");
    }
    for (name, value) in &request.headers {
        builder = builder.header(name.as_str(), value.as_str());
    }
    let method = request.method.as_str();
    if !has("content-length")
        && !has("transfer-encoding")
        && (!request.body.is_empty() || method == "POST" || method == "PUT")
    {
        builder = builder.header(CONTENT_LENGTH, request.body.len());
    }
    builder
        .body(Full::new(request.body.clone()))
        .map_err(|e| HttpError::Invalid(e.to_string()))
}
