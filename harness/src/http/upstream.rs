//! HTTP callouts to real addresses ([`crate::PluginBuilder::upstream`]): a cluster name maps to
//! an `ip:port`, and `proxy_http_call` to that cluster sends a real HTTP/1.1 request from a
//! thread of its own. The answer waits in a channel until the owner of the plugin delivers it
//! ([`crate::Plugin::deliver_http_responses`]), on the thread that drives the VMs.
//!
//! Failures look the way Envoy's async client reports them to a filter: a connection that
//! cannot be opened or that closes before the response headers is a local `503` ("upstream
//! connect error or disconnect/reset before headers..."), a call past its timeout a local `504`
//! ("upstream request timeout"); only a connection lost after the headers is a failed call
//! (no headers; `proxy_get_status` says `BrokenConnection` / "reset").

use std::net::SocketAddr;
use std::sync::mpsc::Sender;
use std::time::Duration;

use kvoy_testkit::http::{aio, block_on, HttpError, Request};

use crate::http::callouts::{HttpCall, HttpResponse};
use crate::http::headers::HeaderMap;

/// Connect timeout when the call has none (Envoy: the cluster's `connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The bound on a call without a timeout of its own (Envoy would wait on; a test should not).
const NO_TIMEOUT: Duration = Duration::from_secs(600);

/// A finished real callout: the call and its response (`None`: reset).
pub(crate) type Finished = (HttpCall, Option<HttpResponse>);

/// Sends `call` to `addr` on a new thread; the result goes to `done`.
pub(crate) fn spawn(call: HttpCall, addr: SocketAddr, done: Sender<Finished>) {
    let name = format!("kvoy-harness-callout-{}", call.token);
    let spawned = std::thread::Builder::new().name(name).spawn({
        let call = call.clone();
        let done = done.clone();
        move || {
            let response = send(&call, addr);
            let _ = done.send((call, response));
        }
    });
    if spawned.is_err() {
        // No thread: the call fails as on a reset.
        let _ = done.send((call, None));
    }
}

/// One request/response exchange on the test kit's client, mapped to what the filter sees.
pub(crate) fn send(call: &HttpCall, addr: SocketAddr) -> Option<HttpResponse> {
    let total = if call.timeout.is_zero() {
        NO_TIMEOUT
    } else {
        call.timeout
    };
    let request = request(call).timeout(total);
    let exchange = async {
        let stream = aio::connect(addr, total.min(CONNECT_TIMEOUT)).await?;
        aio::Connection::handshake(stream)
            .await?
            .request(&request)
            .await
    };
    let outcome = block_on(async { tokio::time::timeout(total, exchange).await });
    let reply = match outcome {
        Ok(Ok(reply)) => reply,
        Ok(Err(_elapsed)) => return Some(local_reply(504, "upstream request timeout")),
        // No runtime for the call: as if the connection could not be made.
        Err(e) => Err(e),
    };
    match reply {
        Ok(reply) => {
            let mut headers = HeaderMap::new();
            headers.add(":status", &reply.status.to_string());
            for (name, value) in &reply.headers.0 {
                headers.add(name, value);
            }
            Some(HttpResponse {
                headers,
                body: reply.body,
                trailers: HeaderMap::new(),
            })
        }
        Err(HttpError::Timeout { .. }) => Some(local_reply(504, "upstream request timeout")),
        Err(e) if e.after_head() => None,
        Err(e) => Some(local_reply(
            503,
            &format!(
                "upstream connect error or disconnect/reset before headers. reset reason: {}",
                reset_reason(&e)
            ),
        )),
    }
}

/// Envoy's words for a failure before the response headers.
fn reset_reason(error: &HttpError) -> &'static str {
    match error {
        HttpError::Connect { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused =>
        {
            "remote connection failure, transport failure reason: delayed connect error: Connection refused"
        }
        HttpError::Request(e) if e.is_parse() => "protocol error",
        HttpError::Invalid(_) => "protocol error",
        _ => "connection termination",
    }
}

/// A response as Envoy's router makes one up.
fn local_reply(status: u16, body: &str) -> HttpResponse {
    HttpResponse::new(status)
        .header("content-length", &body.len().to_string())
        .header("content-type", "text/plain")
        .body(body.as_bytes())
}

/// The call's pseudo-headers as the request line and `host`; its other headers as they are,
/// but for the framing ones the client sets itself.
fn request(call: &HttpCall) -> Request {
    let headers = &call.headers;
    let mut request = Request::new(
        headers.get(":method").unwrap_or("GET"),
        headers.get(":path").unwrap_or("/"),
    )
    .host(headers.get(":authority").unwrap_or_default())
    .body(call.body.clone());
    for (name, value) in headers.iter() {
        if name.starts_with(':')
            || ["host", "content-length", "connection", "transfer-encoding"].contains(&name)
        {
            continue;
        }
        request = request.header(name, value);
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use std::net::TcpListener;
    use std::thread::JoinHandle;
    use std::time::Instant;

    fn call(timeout_ms: u64) -> HttpCall {
        HttpCall {
            vm: 0,
            context_id: 1,
            token: 1,
            upstream: "c".into(),
            headers: HeaderMap::from_pairs([
                (":method", "GET"),
                (":path", "/v1/snapshot"),
                (":authority", "agg"),
                ("x-a", "1"),
            ]),
            body: Vec::new(),
            trailers: HeaderMap::new(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn serve_once(reply: &'static [u8]) -> (SocketAddr, JoinHandle<io::Result<String>>) {
        crate::testing::serve_once(reply).expect("serve")
    }

    #[test]
    fn content_length_and_chunked_bodies() {
        let (addr, h) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-B: 2\r\n\r\nhello");
        let r = send(&call(1000), addr).expect("response");
        assert_eq!(r.headers.get(":status"), Some("200"));
        assert_eq!(r.headers.get("x-b"), Some("2"));
        assert_eq!(r.body, b"hello");
        let request = h.join().expect("server").expect("read");
        assert!(request.starts_with("GET /v1/snapshot HTTP/1.1\r\nhost: agg\r\n"));
        assert!(request.contains("x-a: 1\r\n"));

        let (addr, _h) = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        );
        assert_eq!(send(&call(1000), addr).expect("response").body, b"abcde");
    }

    #[test]
    fn failures_look_like_envoys() {
        // Nothing listens: 503 from the proxy itself.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port");
        let r = send(&call(500), port).expect("a local reply");
        assert_eq!(r.headers.get(":status"), Some("503"));
        assert!(String::from_utf8_lossy(&r.body).contains("upstream connect error"));

        // A server that never answers: 504 after the timeout.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let start = Instant::now();
        let r = send(&call(150), addr).expect("a local reply");
        assert_eq!(r.headers.get(":status"), Some("504"));
        assert!(start.elapsed() < Duration::from_secs(3));
        drop(listener);

        // Headers, then the connection drops inside the body: a reset.
        let (addr, _h) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort");
        assert_eq!(send(&call(1000), addr), None);
    }
}
