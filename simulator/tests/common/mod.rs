//! Shared by the black-box server tests: simulators on 127.0.0.1 and the test kit's HTTP/1.1
//! client, noting when each SSE event arrived.

#![allow(dead_code)] // each test binary uses its part

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ops::ControlFlow;

use kvoy_testkit::http::{aio, Part, Request, Response};
use tokio::net::{TcpListener, TcpStream};

use kvoy_sim::engine::Profile;
use kvoy_sim::server::runtime::EngineHandle;
use kvoy_sim::server::{self, HttpOptions, Simulator};

/// The options the tests start from: model `m`, 16 MiB bodies.
pub fn options(speedup: f64) -> HttpOptions {
    HttpOptions {
        models: vec!["m".into()],
        speedup,
        max_body_bytes: 1 << 24,
        ..HttpOptions::default()
    }
}

pub async fn start(profile: Profile, speedup: f64) -> (SocketAddr, Arc<Simulator>) {
    start_with(profile, options(speedup)).await
}

pub async fn start_with(profile: Profile, options: HttpOptions) -> (SocketAddr, Arc<Simulator>) {
    let engine = EngineHandle::start(profile, options.speedup, Box::new(|_| {})).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sim = Simulator::new(engine, options, addr.to_string());
    tokio::spawn(server::serve(listener, sim.clone()));
    (addr, sim)
}

/// A response and the arrival time of each SSE `data:` event (relative to the send).
pub struct Reply {
    pub status: u16,
    /// The status line and headers, lower case.
    pub head: String,
    /// The body, its chunked framing removed.
    pub body: String,
    pub events: Vec<Duration>,
}

pub async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    let s = TcpStream::connect(addr).await.unwrap();
    request_on(s, method, path, body).await
}

/// A request on `path` for a model the server does not serve (`other`) is refused with 404
/// `model_not_found`; `body` is the rest of the JSON object.
pub async fn assert_unknown_model(addr: SocketAddr, path: &str, body: &str) {
    let r = request(
        addr,
        "POST",
        path,
        &format!(r#"{{"model":"other",{body}}}"#),
    )
    .await;
    assert_eq!(r.status, 404);
    assert!(r.body.contains("model_not_found"));
}

/// Sends a request on an open connection (so that a test can connect many clients first).
pub async fn request_on(s: TcpStream, method: &str, path: &str, body: &str) -> Reply {
    request_on_with(s, method, path, body, &[]).await
}

/// [`request`] with `headers` besides the usual ones.
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let s = TcpStream::connect(addr).await.unwrap();
    request_on_with(s, method, path, body, headers).await
}

async fn request_on_with(
    s: TcpStream,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Reply {
    s.set_nodelay(true).unwrap();
    let mut request = Request::new(method, path)
        .host("sim")
        .header("content-type", "application/json")
        .header("content-length", &body.len().to_string());
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let request = request
        .body(body.to_owned())
        .timeout(Duration::from_secs(60));
    let mut conn = aio::Connection::handshake(s).await.unwrap();
    let sent = Instant::now();
    let mut raw = Vec::new();
    let mut events = Vec::new();
    let head = conn
        .stream(&request, |part| {
            if let Part::Data(data) = part {
                let at = sent.elapsed();
                let new = String::from_utf8_lossy(data);
                events.extend(std::iter::repeat_n(at, new.matches("data: ").count()));
                raw.extend_from_slice(data);
            }
            ControlFlow::Continue(())
        })
        .await
        .unwrap();
    let response = Response {
        status: head.status,
        headers: head.headers,
        body: raw,
    };
    Reply {
        status: response.status,
        head: response.head_text().to_lowercase(),
        body: response.text(),
        events,
    }
}
