//! The client's request, response and error types.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;

/// Largest response body the client reads.
pub const MAX_CLIENT_BODY: usize = 64 * 1024 * 1024;

/// How long a request waits for each thing it reads when the caller does not say.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A failure to exchange a request and its response.
#[derive(Debug, Error)]
pub enum HttpError {
    /// The TCP connection could not be opened.
    #[error("connect to {addr}: {source}")]
    Connect { addr: SocketAddr, source: io::Error },
    /// The request could not be sent or no response head came back (refused, reset, malformed).
    #[error("request: {0}")]
    Request(hyper::Error),
    /// The response head came, then reading its body failed.
    #[error("response body: {0}")]
    Body(hyper::Error),
    /// Nothing arrived within the timeout.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: &'static str, after: Duration },
    #[error("{what} exceeds the limit of {limit} bytes")]
    TooLarge { what: &'static str, limit: usize },
    /// The request itself is not valid HTTP (a bad method, path or header).
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl HttpError {
    /// Whether the error came after the response head (a reset stream, to a proxy).
    pub fn after_head(&self) -> bool {
        matches!(
            self,
            HttpError::Body(_)
                | HttpError::TooLarge { .. }
                | HttpError::Timeout {
                    what: "the response body",
                    ..
                }
        )
    }
}

/// Header lines in arrival order (names in lower case, as hyper gives them); lookups ignore
/// case.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(pub Vec<(String, String)>);

impl Headers {
    /// The first value of `name` (case-insensitive).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `name` (case-insensitive), in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn from_map(map: &hyper::HeaderMap) -> Headers {
        Headers(
            map.iter()
                .map(|(n, v)| {
                    (
                        n.as_str().to_owned(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
        )
    }
}

/// A response's status and headers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Head {
    pub status: u16,
    pub headers: Headers,
}

/// What [`super::stream`] hands its callback: the head first, then the body piece by piece.
#[derive(Debug)]
pub enum Part<'a> {
    Head(&'a Head),
    Data(&'a [u8]),
}

/// A response as the client saw it.
#[derive(Clone, Debug, Default)]
pub struct Response {
    pub status: u16,
    pub headers: Headers,
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// The status line and headers as text (`HTTP/1.1 200` and `name: value` lines, CRLF
    /// separated), for messages and for tests that look for a header line.
    pub fn head_text(&self) -> String {
        let mut out = format!("HTTP/1.1 {}", self.status);
        for (name, value) in &self.headers.0 {
            out.push_str(&format!("\r\n{name}: {value}"));
        }
        out
    }
}

/// A request to send: method, path (with its query), headers in order, body and timeout.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// The `host` header; the address connected to when `None`.
    pub host: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    /// Bounds connecting, the wait for the response head and each wait for a piece of its body.
    pub timeout: Duration,
    /// Sends `connection: close` (one-shot calls do; requests on a kept-alive
    /// [`super::Connection`] do not).
    pub close: bool,
}

impl Request {
    pub fn new(method: &str, path: &str) -> Request {
        Request {
            method: method.to_owned(),
            path: path.to_owned(),
            host: None,
            headers: Vec::new(),
            body: Bytes::new(),
            timeout: DEFAULT_TIMEOUT,
            close: true,
        }
    }

    pub fn get(path: &str) -> Request {
        Request::new("GET", path)
    }

    pub fn post(path: &str) -> Request {
        Request::new("POST", path)
    }

    /// A POST of a JSON body.
    pub fn post_json(path: &str, body: impl Into<Bytes>) -> Request {
        Request::post(path)
            .header("content-type", "application/json")
            .body(body)
    }

    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn headers(mut self, headers: &[(&str, &str)]) -> Request {
        self.headers
            .extend(headers.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        self
    }

    /// Headers written as text, one `name: value` line each (CRLF or LF ended), as tests that
    /// spell their headers out do; lines without a colon are skipped.
    pub fn header_lines(mut self, lines: &str) -> Request {
        for line in lines.lines() {
            if let Some((name, value)) = line.split_once(':') {
                self.headers
                    .push((name.trim().to_owned(), value.trim().to_owned()));
            }
        }
        self
    }

    pub fn host(mut self, host: &str) -> Request {
        self.host = Some(host.to_owned());
        self
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Request {
        self.body = body.into();
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Request {
        self.timeout = timeout;
        self
    }

    /// Whether to send `connection: close`.
    pub fn close(mut self, close: bool) -> Request {
        self.close = close;
        self
    }
}
