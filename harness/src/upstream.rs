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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use crate::callouts::{HttpCall, HttpResponse};
use crate::headers::HeaderMap;

/// Largest response head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// Largest response body buffered (Envoy's async client also buffers the whole body).
const MAX_BODY: usize = 64 << 20;
/// Connect timeout when the call has none (Envoy: the cluster's `connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

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

/// Why a call stopped.
enum Failure {
    /// Before the response headers: Envoy answers 503 itself.
    BeforeHeaders(String),
    /// The timeout ran out: Envoy answers 504.
    Timeout,
    /// After the headers: a reset.
    Reset,
}

/// One request/response exchange, mapped to what the filter sees.
pub(crate) fn send(call: &HttpCall, addr: SocketAddr) -> Option<HttpResponse> {
    let deadline = (!call.timeout.is_zero()).then(|| Instant::now() + call.timeout);
    match exchange(call, addr, deadline) {
        Ok(response) => Some(response),
        Err(Failure::Reset) => None,
        Err(Failure::Timeout) => Some(local_reply(504, "upstream request timeout")),
        Err(Failure::BeforeHeaders(reason)) => Some(local_reply(
            503,
            &format!(
                "upstream connect error or disconnect/reset before headers. reset reason: {reason}"
            ),
        )),
    }
}

/// A response as Envoy's router makes one up.
fn local_reply(status: u16, body: &str) -> HttpResponse {
    HttpResponse::new(status)
        .header("content-length", &body.len().to_string())
        .header("content-type", "text/plain")
        .body(body.as_bytes())
}

fn remaining(deadline: Option<Instant>) -> Result<Option<Duration>, Failure> {
    match deadline {
        None => Ok(None),
        Some(d) => match d.checked_duration_since(Instant::now()) {
            Some(left) if !left.is_zero() => Ok(Some(left)),
            _ => Err(Failure::Timeout),
        },
    }
}

fn io_failure(error: &std::io::Error, before_headers: bool) -> Failure {
    use std::io::ErrorKind::{TimedOut, WouldBlock};
    if matches!(error.kind(), TimedOut | WouldBlock) {
        return Failure::Timeout;
    }
    if before_headers {
        Failure::BeforeHeaders(match error.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                "remote connection failure, transport failure reason: delayed connect error: Connection refused".to_owned()
            }
            _ => "connection termination".to_owned(),
        })
    } else {
        Failure::Reset
    }
}

fn request_bytes(call: &HttpCall) -> Vec<u8> {
    let headers = &call.headers;
    let method = headers.get(":method").unwrap_or("GET");
    let path = headers.get(":path").unwrap_or("/");
    let authority = headers.get(":authority").unwrap_or_default();
    let mut out = format!("{method} {path} HTTP/1.1\r\nhost: {authority}\r\n");
    for (name, value) in headers.iter() {
        if name.starts_with(':')
            || ["host", "content-length", "connection", "transfer-encoding"].contains(&name)
        {
            continue;
        }
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    if !call.body.is_empty() || method.eq_ignore_ascii_case("POST") {
        out.push_str(&format!("content-length: {}\r\n", call.body.len()));
    }
    out.push_str("connection: close\r\n\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&call.body);
    bytes
}

fn exchange(
    call: &HttpCall,
    addr: SocketAddr,
    deadline: Option<Instant>,
) -> Result<HttpResponse, Failure> {
    let connect = remaining(deadline)?.map_or(CONNECT_TIMEOUT, |d| d.min(CONNECT_TIMEOUT));
    let stream = TcpStream::connect_timeout(&addr, connect).map_err(|e| io_failure(&e, true))?;
    let _ = stream.set_nodelay(true);
    stream
        .set_write_timeout(remaining(deadline)?)
        .map_err(|e| io_failure(&e, true))?;
    (&stream)
        .write_all(&request_bytes(call))
        .map_err(|e| io_failure(&e, true))?;
    let mut reader = BufReader::new(&stream);
    let set_timeout = |stream: &TcpStream| -> Result<(), Failure> {
        stream
            .set_read_timeout(remaining(deadline)?)
            .map_err(|e| io_failure(&e, true))
    };
    set_timeout(&stream)?;
    let mut budget = MAX_HEAD;
    let status_line = read_line(&mut reader, &mut budget).map_err(|e| io_failure(&e, true))?;
    let status = parse_status(&status_line)
        .ok_or_else(|| Failure::BeforeHeaders("protocol error".to_owned()))?;
    let mut headers = HeaderMap::new();
    headers.add(":status", &status.to_string());
    loop {
        set_timeout(&stream)?;
        let line = read_line(&mut reader, &mut budget).map_err(|e| io_failure(&e, true))?;
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(Failure::BeforeHeaders("protocol error".to_owned()));
        };
        headers.add(name.trim(), value.trim());
    }
    let body = read_body(&stream, &mut reader, &headers, status, deadline)?;
    Ok(HttpResponse {
        headers,
        body,
        trailers: HeaderMap::new(),
    })
}

fn parse_status(line: &str) -> Option<u16> {
    let mut parts = line.split_whitespace();
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") {
        return None;
    }
    parts
        .next()?
        .parse()
        .ok()
        .filter(|s| (100..1000).contains(s))
}

/// A CRLF- or LF-terminated line without its terminator; EOF before the end is an error.
fn read_line(reader: &mut impl BufRead, budget: &mut usize) -> std::io::Result<String> {
    let mut buf = Vec::new();
    let limit = u64::try_from(*budget).unwrap_or(u64::MAX).saturating_add(1);
    let n = reader.by_ref().take(limit).read_until(b'\n', &mut buf)?;
    if n > *budget {
        return Err(std::io::Error::other("response head too large"));
    }
    *budget -= n;
    if buf.last() != Some(&b'\n') {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

fn read_body(
    stream: &TcpStream,
    reader: &mut BufReader<&TcpStream>,
    headers: &HeaderMap,
    status: u16,
    deadline: Option<Instant>,
) -> Result<Vec<u8>, Failure> {
    let mut body = Vec::new();
    if status == 204 || status == 304 || (100..200).contains(&status) {
        return Ok(body);
    }
    let chunked = headers
        .get("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let length = headers
        .get("content-length")
        .and_then(|v| v.trim().parse::<usize>().ok());
    let refresh = || -> Result<(), Failure> {
        stream
            .set_read_timeout(remaining(deadline)?)
            .map_err(|e| io_failure(&e, false))
    };
    if chunked {
        loop {
            refresh()?;
            let mut budget = MAX_HEAD;
            let size_line = read_line(reader, &mut budget).map_err(|e| io_failure(&e, false))?;
            let size_text = size_line.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size_text, 16).map_err(|_| Failure::Reset)?;
            if size == 0 {
                // Trailers (ignored) up to the empty line.
                loop {
                    let line = read_line(reader, &mut budget).map_err(|e| io_failure(&e, false))?;
                    if line.is_empty() {
                        return Ok(body);
                    }
                }
            }
            if body.len().saturating_add(size) > MAX_BODY {
                return Err(Failure::Reset);
            }
            let start = body.len();
            body.resize(start + size, 0);
            reader
                .read_exact(&mut body[start..])
                .map_err(|e| io_failure(&e, false))?;
            let mut crlf = [0u8; 2];
            reader
                .read_exact(&mut crlf)
                .map_err(|e| io_failure(&e, false))?;
        }
    }
    match length {
        Some(n) if n > MAX_BODY => Err(Failure::Reset),
        Some(n) => {
            refresh()?;
            body.resize(n, 0);
            reader
                .read_exact(&mut body)
                .map_err(|e| io_failure(&e, false))?;
            Ok(body)
        }
        None => {
            let mut chunk = [0u8; 16 * 1024];
            loop {
                refresh()?;
                let n = reader.read(&mut chunk).map_err(|e| io_failure(&e, false))?;
                if n == 0 {
                    return Ok(body);
                }
                if body.len() + n > MAX_BODY {
                    return Err(Failure::Reset);
                }
                body.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

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

    fn serve_once(reply: &'static [u8]) -> (SocketAddr, std::thread::JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let handle = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut seen = Vec::new();
            let mut buf = [0u8; 1024];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).expect("read");
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
            }
            s.write_all(reply).expect("write");
            String::from_utf8_lossy(&seen).into_owned()
        });
        (addr, handle)
    }

    #[test]
    fn content_length_and_chunked_bodies() {
        let (addr, h) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-B: 2\r\n\r\nhello");
        let r = send(&call(1000), addr).expect("response");
        assert_eq!(r.headers.get(":status"), Some("200"));
        assert_eq!(r.headers.get("x-b"), Some("2"));
        assert_eq!(r.body, b"hello");
        let request = h.join().expect("server");
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
