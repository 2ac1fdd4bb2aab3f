//! Sending a request the chain let go to the endpoint it chose, and streaming the response back
//! into the chain (Envoy's router, for an `ORIGINAL_DST` cluster).

use std::net::SocketAddr;
use std::sync::mpsc::Sender;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use kvoy_harness::HeaderMap;

use super::engine::Command;
use super::HOP_BY_HOP;

/// The pool cluster's `connect_timeout` in `envoy/kvoy.yaml`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Forwards request `id` to `address` and feeds the response to the engine. Failures before
/// the response headers become Envoy's router replies (503 through the chain's response
/// callbacks); a failure after them resets the stream.
pub async fn forward(
    id: u64,
    address: SocketAddr,
    headers: HeaderMap,
    body: Vec<u8>,
    engine: Sender<Command>,
) {
    let send = |command: Command| {
        let _ = engine.send(command);
    };
    let reply = |reason: &str| {
        let body = format!(
            "upstream connect error or disconnect/reset before headers. reset reason: {reason}"
        );
        let headers = HeaderMap::from_pairs([
            (":status", "503"),
            ("content-length", &body.len().to_string()),
            ("content-type", "text/plain"),
        ]);
        send(Command::ResponseHeaders {
            id,
            headers,
            end: false,
            upstream: Some(address),
        });
        send(Command::ResponseBody {
            id,
            chunk: Bytes::from(body),
            end: true,
        });
    };
    let connected =
        tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(address)).await;
    let tcp = match connected {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return reply("remote connection failure, transport failure reason: delayed connect error: Connection refused");
        }
        Ok(Err(_)) => return reply("remote connection failure"),
        Err(_) => return reply("connection timeout"),
    };
    let _ = tcp.set_nodelay(true);
    let Ok((mut sender, connection)) =
        hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await
    else {
        return reply("connection termination");
    };
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let Some(request) = build_request(&headers, body) else {
        return reply("protocol error");
    };
    let response = match sender.send_request(request).await {
        Ok(r) => r,
        Err(_) => return reply("connection termination"),
    };
    let (parts, mut incoming) = response.into_parts();
    let mut out = HeaderMap::new();
    out.add(":status", parts.status.as_str());
    for (name, value) in &parts.headers {
        if HOP_BY_HOP.contains(&name.as_str()) {
            continue;
        }
        out.add(name.as_str(), &String::from_utf8_lossy(value.as_bytes()));
    }
    let end = hyper::body::Body::is_end_stream(&incoming);
    send(Command::ResponseHeaders {
        id,
        headers: out,
        end,
        upstream: Some(address),
    });
    if end {
        return;
    }
    loop {
        match incoming.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if !data.is_empty() {
                        send(Command::ResponseBody {
                            id,
                            chunk: data,
                            end: false,
                        });
                    }
                }
            }
            Some(Err(_)) => {
                send(Command::UpstreamReset { id });
                return;
            }
            None => {
                send(Command::ResponseBody {
                    id,
                    chunk: Bytes::new(),
                    end: true,
                });
                return;
            }
        }
    }
}

/// The HTTP/1.1 request for the upstream: pseudo-headers become the request line and `host`,
/// connection-specific headers are dropped, `content-length` is the body's.
fn build_request(headers: &HeaderMap, body: Vec<u8>) -> Option<hyper::Request<Full<Bytes>>> {
    let method = headers.get(":method").unwrap_or("GET");
    let path = headers.get(":path").unwrap_or("/");
    let mut builder = hyper::Request::builder().method(method).uri(path);
    if let Some(authority) = headers.get(":authority") {
        builder = builder.header("host", authority);
    }
    for (name, value) in headers.iter() {
        if name.starts_with(':') || name == "host" || name == "content-length" {
            continue;
        }
        if HOP_BY_HOP.contains(&name) {
            continue;
        }
        builder = builder.header(name, value);
    }
    if !body.is_empty() || method.eq_ignore_ascii_case("POST") {
        builder = builder.header("content-length", body.len());
    }
    builder.body(Full::new(Bytes::from(body))).ok()
}
