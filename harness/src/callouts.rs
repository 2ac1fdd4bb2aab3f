//! Records of what a filter asked the outside world for: HTTP callouts, foreign functions, local
//! replies; and the responses a test feeds back.

use std::fmt;
use std::time::Duration;

use crate::headers::HeaderMap;
use crate::types::Status;

/// An HTTP callout a filter made with `proxy_http_call`, waiting for the test to answer it with
/// [`crate::Plugin::respond_http_call`] or [`crate::Plugin::fail_http_call`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// The VM that made the call; the response goes back to it.
    pub vm: usize,
    /// The context (root or stream) that made the call.
    pub context_id: u32,
    /// The token `proxy_http_call` returned.
    pub token: u32,
    /// The upstream cluster name.
    pub upstream: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
    pub timeout: Duration,
}

impl HttpCall {
    /// The `:path` header.
    pub fn path(&self) -> Option<&str> {
        self.headers.get(":path")
    }

    /// The `:method` header.
    pub fn method(&self) -> Option<&str> {
        self.headers.get(":method")
    }
}

/// A response the test delivers to an [`HttpCall`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpResponse {
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
}

impl HttpResponse {
    /// A response with just a `:status` header.
    pub fn new(status: u16) -> HttpResponse {
        HttpResponse {
            headers: HeaderMap::from_pairs([(":status", status.to_string())]),
            ..HttpResponse::default()
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> HttpResponse {
        self.headers.add(name, value);
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> HttpResponse {
        self.body = body.into();
        self
    }

    /// Adds a trailer.
    pub fn trailer(mut self, name: &str, value: &str) -> HttpResponse {
        self.trailers.add(name, value);
        self
    }
}

/// A call to `proxy_call_foreign_function`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignCall {
    pub vm: usize,
    pub context_id: u32,
    pub name: String,
    pub arguments: Vec<u8>,
}

/// A test-provided implementation of a foreign function: arguments in, result bytes or a status
/// out. It runs inside the guest's host call, while the calling VM is locked: it must not drive
/// that plugin's VMs or streams (reading logs, metrics or shared data is fine).
pub type ForeignFunction = Box<dyn FnMut(&[u8]) -> Result<Vec<u8>, Status> + Send>;

/// A local reply a filter sent with `proxy_send_local_response`.
#[derive(Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    /// The response code details (Envoy's `%RESPONSE_CODE_DETAILS%`).
    pub details: String,
    pub body: Vec<u8>,
    /// The headers the filter asked to add (lower-cased). The full response, as it left the
    /// filter chain, is the stream's `response_headers()`.
    pub headers: HeaderMap,
    /// The gRPC status, or `None` for the SDK's -1 ("not gRPC").
    pub grpc_status: Option<u32>,
}

impl LocalReply {
    /// The body as text (lossy).
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl fmt::Debug for LocalReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalReply")
            .field("status", &self.status)
            .field("details", &self.details)
            .field("body", &String::from_utf8_lossy(&self.body))
            .field("headers", &self.headers)
            .field("grpc_status", &self.grpc_status)
            .finish()
    }
}
