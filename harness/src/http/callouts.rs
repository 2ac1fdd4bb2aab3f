//! HTTP callouts (`proxy_http_call`): the records a test answers, the responses it feeds back,
//! and their delivery to the guest (`proxy_on_http_call_response`).

use std::time::Duration;

use crate::http::headers::HeaderMap;

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
