//! Shared by the black-box server tests: simulators on 127.0.0.1 and a minimal HTTP/1.1
//! client that also notes when each SSE event arrived.

#![allow(dead_code)] // each test binary uses its part

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    pub head: String,
    pub body: String,
    pub events: Vec<Duration>,
}

pub async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    let s = TcpStream::connect(addr).await.unwrap();
    request_on(s, method, path, body).await
}

/// Sends a request on an open connection (so that a test can connect many clients first).
pub async fn request_on(mut s: TcpStream, method: &str, path: &str, body: &str) -> Reply {
    s.set_nodelay(true).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let sent = Instant::now();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    let mut events = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        if n == 0 {
            break;
        }
        let at = sent.elapsed();
        let new = String::from_utf8_lossy(&buf[..n]);
        events.extend(std::iter::repeat_n(at, new.matches("data: ").count()));
        raw.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Reply {
        status,
        head: head.to_lowercase(),
        body: body.to_owned(),
        events,
    }
}

/// The payload of a body sent with `transfer-encoding: chunked` (how streams arrive).
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].strip_prefix("\r\n").unwrap();
    }
    out
}
