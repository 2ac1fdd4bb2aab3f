//! HTTP/1.1 on hyper for tests, benches and tools: a blocking client (this module), its async
//! core ([`aio`]) and a small server ([`server`]).
//!
//! The blocking calls run their future on a current-thread tokio runtime of their own; called
//! from inside a tokio runtime, they move to a scoped thread first (blocking the caller, as a
//! `std::net` client would). Everything read is bounded: bodies by [`MAX_CLIENT_BODY`], each wait
//! for the head or a piece of the body by the request's timeout.

pub mod aio;
pub mod server;
mod types;

use std::future::Future;
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::time::Duration;

use bytes::Bytes;

pub use types::{Head, Headers, HttpError, Part, Request, Response, MAX_CLIENT_BODY};

/// Runs `fut` to completion on a current-thread runtime of its own (on a scoped thread when the
/// caller is itself inside a tokio runtime, where blocking on another one would panic).
pub fn block_on<F>(fut: F) -> Result<F::Output, HttpError>
where
    F: Future + Send,
    F::Output: Send,
{
    fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }
    if tokio::runtime::Handle::try_current().is_err() {
        return Ok(runtime()?.block_on(fut));
    }
    std::thread::scope(|scope| {
        scope
            .spawn(|| runtime().map(|rt| rt.block_on(fut)))
            .join()
            .map_err(|_| HttpError::Io(std::io::Error::other("the client thread panicked")))?
            .map_err(HttpError::Io)
    })
}

/// One request on a fresh connection (`connection: close`); the whole response.
pub fn request(addr: SocketAddr, request: &Request) -> Result<Response, HttpError> {
    block_on(aio::request(addr, request))?
}

/// One request with `method`, `path`, extra `headers` and `body` (a `content-length` is sent
/// when `body` is non-empty or the method is POST or PUT); `timeout` bounds connecting and each
/// read.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    request(
        addr,
        &Request::new(method, path)
            .headers(headers)
            .body(Bytes::copy_from_slice(body))
            .timeout(timeout),
    )
}

/// [`send`] for a GET without a body.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Response, HttpError> {
    request(addr, &Request::get(path).timeout(timeout))
}

/// [`send`] for a POST of a JSON body (`content-type: application/json` first).
pub fn post_json(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let headers = [&[("content-type", "application/json")], headers].concat();
    send(addr, "POST", path, &headers, body, timeout)
}

/// The `data:` payloads of a server-sent-events body, in order.
pub fn sse_data(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .collect()
}

/// One request on a fresh connection, its response handed to `on` as it arrives: the head,
/// then each piece of the body. `on` returning `Break` drops the connection at once (unread data
/// left makes that a reset). Returns the head.
pub fn stream(
    addr: SocketAddr,
    request: &Request,
    on: impl FnMut(Part<'_>) -> ControlFlow<()> + Send,
) -> Result<Head, HttpError> {
    block_on(aio::stream(addr, request, on))?
}

/// A kept-alive HTTP/1.1 connection for a blocking caller: requests go one after the other on
/// the same socket (load generators time the proxy, not connection setup). Not for use inside a
/// tokio runtime: use [`aio::Connection`] there.
pub struct Connection {
    runtime: tokio::runtime::Runtime,
    inner: aio::Connection,
}

impl Connection {
    /// Connects to `addr` within `timeout`.
    pub fn open(addr: SocketAddr, timeout: Duration) -> Result<Connection, HttpError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(HttpError::Io(std::io::Error::other(
                "a blocking connection cannot be used inside a tokio runtime",
            )));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let inner = runtime.block_on(aio::Connection::open(addr, timeout))?;
        Ok(Connection { runtime, inner })
    }

    /// One request on this connection; the whole response.
    pub fn request(&mut self, request: &Request) -> Result<Response, HttpError> {
        self.runtime.block_on(self.inner.request(request))
    }

    /// Whether the peer or an error closed the connection (no more requests can go on it).
    pub fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }
}

#[cfg(test)]
mod tests;
