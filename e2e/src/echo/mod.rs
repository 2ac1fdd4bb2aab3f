//! An OpenAI-shaped echo backend: answers every inference call with a reply that names the
//! address that served it, so tests can see where a proxy routed each request.
//!
//! Thread per connection (bounded), HTTP/1.1 keep-alive, `Content-Length` and chunked bodies.

use kvoy_shared::protocol::{CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, MODELS_PATH, RESPONSES_PATH};
use std::io::{self, BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use serde_json::{json, Value};

use crate::http::{self, Headers, HttpError, Unframed};

mod openai;

pub use openai::error_body;
use openai::{completion_body, models_body, stream_events, Api};

/// The header a routing proxy sets to choose the endpoint; echoed back in the reply.
pub use kvoy_shared::protocol::DESTINATION_HEADER;
/// kvoy's internal session-pin header, echoed back in the reply (`pin_header`) so that tests
/// can check that it never reaches a model server.
pub use kvoy_shared::session::PIN_HEADER;
/// Response header naming the address that served the request.
pub const SERVED_BY_HEADER: &str = "x-served-by";
/// Request header asking for a delay before the reply, in milliseconds.
pub const DELAY_HEADER: &str = "x-echo-delay-ms";
/// Upper bound of any delay, header or configured.
pub const MAX_DELAY: Duration = Duration::from_secs(10);
/// Largest request body accepted (a multi-MB prompt fits).
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Most connections served at once; more are refused with 503.
pub const MAX_CONNECTIONS: usize = 512;
/// Most requests on one keep-alive connection.
const MAX_REQUESTS_PER_CONNECTION: usize = 100_000;
/// A connection idle this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How to run one echo backend.
#[derive(Clone, Debug)]
pub struct EchoConfig {
    /// Where to listen; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Models listed by `/v1/models` and accepted in request bodies.
    pub models: Vec<String>,
    /// A delay added to every inference reply (capped at [`MAX_DELAY`]).
    pub delay: Duration,
}

impl EchoConfig {
    /// A backend on `listen` serving `models`, without delay.
    pub fn new(listen: SocketAddr, models: &[&str]) -> Self {
        EchoConfig {
            listen,
            models: models.iter().map(|m| m.to_string()).collect(),
            delay: Duration::ZERO,
        }
    }
}

#[derive(Debug, Default)]
struct Stats {
    requests: AtomicU64,
    inference: AtomicU64,
    connections: AtomicUsize,
}

struct Shared {
    served_by: String,
    models: Vec<String>,
    delay: Duration,
    stats: Stats,
    stop: AtomicBool,
}

/// A running echo backend; stops accepting when dropped.
pub struct EchoServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl EchoServer {
    /// Binds and starts serving in background threads.
    pub fn start(config: EchoConfig) -> io::Result<EchoServer> {
        let listener = TcpListener::bind(config.listen)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            served_by: addr.to_string(),
            models: config.models,
            delay: config.delay.min(MAX_DELAY),
            stats: Stats::default(),
            stop: AtomicBool::new(false),
        });
        let for_thread = Arc::clone(&shared);
        let acceptor = thread::Builder::new()
            .name(format!("echo-accept-{addr}"))
            .spawn(move || accept_loop(listener, for_thread))?;
        Ok(EchoServer {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests answered so far (any path, including errors).
    pub fn requests(&self) -> u64 {
        self.shared.stats.requests.load(Ordering::Relaxed)
    }

    /// Inference requests (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`) answered.
    pub fn inference_requests(&self) -> u64 {
        self.shared.stats.inference.load(Ordering::Relaxed)
    }

    /// Blocks until the acceptor stops (it runs until the server is dropped elsewhere or the
    /// process exits).
    pub fn wait(mut self) {
        if let Some(handle) = self.acceptor.take() {
            let _ = handle.join();
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept so the thread sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(handle) = self.acceptor.take() {
            let _ = handle.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else {
            // Transient accept errors (EMFILE and the like): back off briefly.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        let active = shared.stats.connections.fetch_add(1, Ordering::SeqCst);
        if active >= MAX_CONNECTIONS {
            shared.stats.connections.fetch_sub(1, Ordering::SeqCst);
            let _ = refuse(stream, &shared);
            continue;
        }
        let conn_shared = Arc::clone(&shared);
        let spawned = thread::Builder::new()
            .name("echo-conn".into())
            .spawn(move || {
                if let Err(e) = serve_connection(&stream, &conn_shared) {
                    log::debug!("echo {}: connection ended: {e}", conn_shared.served_by);
                }
                let _ = stream.shutdown(Shutdown::Both);
                conn_shared.stats.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            shared.stats.connections.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn refuse(mut stream: TcpStream, shared: &Shared) -> io::Result<()> {
    let body = error_body("too many connections", "server_error", "overloaded");
    write_response(&mut stream, 503, &served_by(shared), &body, false)
}

fn serve_connection(stream: &TcpStream, shared: &Shared) -> Result<(), HttpError> {
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    stream.set_write_timeout(Some(IDLE_TIMEOUT))?;
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream);
    for _ in 0..MAX_REQUESTS_PER_CONNECTION {
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let head = match http::read_head(&mut reader) {
            Ok(Some(head)) => head,
            Ok(None) => return Ok(()),
            Err(HttpError::Io(e)) => return Err(HttpError::Io(e)),
            Err(e) => {
                let mut w = BufWriter::new(stream);
                let body = error_body(&e.to_string(), "invalid_request_error", "bad_request");
                write_response(&mut w, 400, &served_by(shared), &body, false)?;
                return Ok(());
            }
        };
        let keep_alive = wants_keep_alive(&head.start_line, &head.headers);
        let body =
            match http::read_body(&mut reader, &head.headers, MAX_BODY_BYTES, Unframed::Empty) {
                Ok(body) => body,
                Err(HttpError::Io(e)) => return Err(HttpError::Io(e)),
                Err(e) => {
                    let status = if matches!(e, HttpError::TooLarge { .. }) {
                        413
                    } else {
                        400
                    };
                    let mut w = BufWriter::new(stream);
                    let body = error_body(&e.to_string(), "invalid_request_error", "bad_request");
                    write_response(&mut w, status, &served_by(shared), &body, false)?;
                    return Ok(());
                }
            };
        shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        let mut w = BufWriter::new(stream);
        handle(
            &mut w,
            shared,
            &head.start_line,
            &head.headers,
            &body,
            keep_alive,
        )?;
        w.flush()?;
        if !keep_alive {
            return Ok(());
        }
    }
    Ok(())
}

fn wants_keep_alive(start_line: &str, headers: &Headers) -> bool {
    let connection = headers.get("connection").map(|v| v.to_ascii_lowercase());
    if start_line.ends_with("HTTP/1.0") {
        connection.as_deref() == Some("keep-alive")
    } else {
        connection.as_deref() != Some("close")
    }
}

fn handle<W: Write>(
    w: &mut W,
    shared: &Shared,
    start_line: &str,
    headers: &Headers,
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let mut parts = start_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return bad_request(w, shared, "malformed request line", keep_alive);
    };
    if !version.starts_with("HTTP/1.") {
        return bad_request(w, shared, "unsupported HTTP version", keep_alive);
    }
    let path = target.split('?').next().unwrap_or(target);
    let api = match (method, path) {
        ("GET", "/health") => {
            return write_response(
                w,
                200,
                &served_by(shared),
                b"{\"status\":\"ok\"}",
                keep_alive,
            )
        }
        ("GET", MODELS_PATH) => {
            let body = models_body(&shared.served_by, &shared.models);
            return write_response(w, 200, &served_by(shared), &body, keep_alive);
        }
        ("POST", CHAT_COMPLETIONS_PATH) => Api::Chat,
        ("POST", COMPLETIONS_PATH) => Api::Completions,
        ("POST", RESPONSES_PATH) => Api::Responses,
        (
            _,
            "/health" | MODELS_PATH | CHAT_COMPLETIONS_PATH | COMPLETIONS_PATH | RESPONSES_PATH,
        ) => {
            let body = error_body(
                "method not allowed",
                "invalid_request_error",
                "method_not_allowed",
            );
            return write_response(w, 405, &served_by(shared), &body, keep_alive);
        }
        _ => {
            let body = error_body(
                &format!("no route for {path}"),
                "invalid_request_error",
                "not_found",
            );
            return write_response(w, 404, &served_by(shared), &body, keep_alive);
        }
    };
    let request: Value = match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Value::Object(map),
        Ok(_) => return bad_request(w, shared, "request body must be a JSON object", keep_alive),
        Err(e) => {
            return bad_request(
                w,
                shared,
                &format!("request body is not JSON: {e}"),
                keep_alive,
            )
        }
    };
    let model = match request.get("model") {
        Some(Value::String(m)) => m.clone(),
        _ => return bad_request(w, shared, "field `model` (string) is required", keep_alive),
    };
    if !shared.models.contains(&model) {
        let body = error_body(
            &format!("The model `{model}` does not exist."),
            "invalid_request_error",
            "model_not_found",
        );
        return write_response(w, 404, &served_by(shared), &body, keep_alive);
    }
    let delay = requested_delay(headers)
        .unwrap_or(shared.delay)
        .min(MAX_DELAY);
    if !delay.is_zero() {
        thread::sleep(delay);
    }
    shared.stats.inference.fetch_add(1, Ordering::Relaxed);
    let echo = json!({
        "served_by": shared.served_by,
        "path": path,
        "destination_header": headers.get(DESTINATION_HEADER),
        "pin_header": headers.get(PIN_HEADER),
    });
    let stream = matches!(request.get("stream"), Some(Value::Bool(true)));
    let text = format!("Hello from kvoy echo backend {}.", shared.served_by);
    if stream {
        write_stream(w, shared, api, &model, &text, echo, keep_alive)
    } else {
        let body = completion_body(api, &model, &text, echo);
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        write_response(w, 200, &served_by(shared), &bytes, keep_alive)
    }
}

fn requested_delay(headers: &Headers) -> Option<Duration> {
    let ms = headers.get(DELAY_HEADER)?.trim().parse::<u64>().ok()?;
    Some(Duration::from_millis(ms).min(MAX_DELAY))
}

fn served_by(shared: &Shared) -> [(&'static str, &str); 1] {
    [(SERVED_BY_HEADER, shared.served_by.as_str())]
}

fn bad_request<W: Write>(
    w: &mut W,
    shared: &Shared,
    message: &str,
    keep_alive: bool,
) -> io::Result<()> {
    let body = error_body(message, "invalid_request_error", "bad_request");
    write_response(w, 400, &served_by(shared), &body, keep_alive)
}

fn write_stream<W: Write>(
    w: &mut W,
    shared: &Shared,
    api: Api,
    model: &str,
    text: &str,
    echo: Value,
    keep_alive: bool,
) -> io::Result<()> {
    write!(
        w,
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
         {SERVED_BY_HEADER}: {}\r\ntransfer-encoding: chunked\r\nconnection: {}\r\n\r\n",
        shared.served_by,
        if keep_alive { "keep-alive" } else { "close" },
    )?;
    for event in stream_events(api, model, text, echo) {
        let mut frame = b"data: ".to_vec();
        frame.extend(serde_json::to_vec(&event).unwrap_or_default());
        frame.extend_from_slice(b"\n\n");
        http::write_chunk(w, &frame)?;
        w.flush()?;
    }
    http::write_chunk(w, b"data: [DONE]\n\n")?;
    http::write_last_chunk(w)?;
    w.flush()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

fn write_response<W: Write>(
    w: &mut W,
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    write!(
        w,
        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: {}\r\n",
        reason(status),
        body.len(),
        if keep_alive { "keep-alive" } else { "close" },
    )?;
    for (name, value) in headers {
        write!(w, "{name}: {value}\r\n")?;
    }
    w.write_all(b"\r\n")?;
    w.write_all(body)?;
    w.flush()
}

#[cfg(test)]
mod tests;
