//! Host-side state of one HTTP stream context: header maps, body buffers and what went upstream
//! or downstream, with Envoy's rules for when the guest may touch each of them.

use std::collections::HashMap;
use std::fmt;

use crate::http::headers::HeaderMap;
use crate::types::StreamType;

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

/// Something a filter did to its stream, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// `proxy_continue_stream` (the SDK's `resume_http_request` / `resume_http_response`).
    Continued(StreamType),
    /// `proxy_close_stream` (the SDK's `reset_http_request` / `reset_http_response`).
    Closed(StreamType),
    /// `proxy_send_local_response`, with the status.
    LocalReply(u32),
}

/// One direction (request or response) of a stream.
#[derive(Debug, Clone, Default)]
pub(crate) struct Direction {
    pub headers: HeaderMap,
    /// Envoy keeps a pointer to the headers from the headers callback until the filter lets
    /// them go (`Continue` from that callback, or `proxy_continue_stream`); the guest can read
    /// and change them only while it is set.
    pub headers_live: bool,
    pub trailers: HeaderMap,
    pub trailers_live: bool,
    /// The chunk being delivered, or everything buffered while the filter returns `Pause`.
    pub body: Vec<u8>,
    pub buffering: bool,
    /// The headers as they were when they went on (upstream for requests, downstream for
    /// responses); `None` while the filter holds them.
    pub forwarded_headers: Option<HeaderMap>,
    /// Body bytes that went on.
    pub forwarded_body: Vec<u8>,
    /// No more callbacks for this direction (local reply or reset).
    pub closed: bool,
}

impl Direction {
    /// Lets held headers and buffered body go on, as when the filter continues.
    pub fn pass_on(&mut self) {
        if self.forwarded_headers.is_none() {
            self.forwarded_headers = Some(self.headers.clone());
        }
        self.forwarded_body.append(&mut self.body);
        self.buffering = false;
    }

    /// The body the filter holds (buffered while it returns `Pause`).
    pub fn held_body(&self) -> Vec<u8> {
        if self.buffering {
            self.body.clone()
        } else {
            Vec::new()
        }
    }

    /// Starts a body callback: a new chunk replaces a passed-on one or joins the buffered ones.
    pub fn take_chunk(&mut self, chunk: &[u8]) {
        if !self.buffering {
            self.body.clear();
        }
        self.body.extend_from_slice(chunk);
    }
}

/// Host-side state of one HTTP context.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamState {
    pub request: Direction,
    pub response: Direction,
    /// Per-stream properties, keyed by the \0-joined path.
    pub properties: HashMap<Vec<u8>, Vec<u8>>,
    /// Envoy filter state objects set through the `set_envoy_filter_state` foreign function.
    pub filter_state: HashMap<String, Vec<u8>>,
    /// When the context was created (virtual clock, ns since the epoch): `request.time`.
    pub started_at: u64,
    pub local_reply: Option<LocalReply>,
    /// A local reply sent during the current guest call, applied after it returns.
    pub pending_reply: Option<LocalReply>,
    pub events: Vec<StreamEvent>,
    /// Inside `proxy_on_log`: Envoy lets the guest read the request and response headers then.
    pub in_log: bool,
    pub finished: bool,
}

impl StreamState {
    /// The direction a stream type names, for `proxy_continue_stream` and friends.
    pub fn direction_mut(&mut self, stream: StreamType) -> Option<&mut Direction> {
        match stream {
            StreamType::HttpRequest => Some(&mut self.request),
            StreamType::HttpResponse => Some(&mut self.response),
            StreamType::Downstream | StreamType::Upstream => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_accumulate_only_while_buffering() {
        let mut dir = Direction::default();
        dir.take_chunk(b"ab");
        dir.buffering = true; // filter returned Pause
        dir.take_chunk(b"cd");
        assert_eq!(dir.body, b"abcd");
        dir.pass_on(); // filter returned Continue
        assert_eq!(dir.forwarded_body, b"abcd");
        assert!(dir.body.is_empty());
        dir.take_chunk(b"ef");
        assert_eq!(dir.body, b"ef");
        dir.pass_on();
        assert_eq!(dir.forwarded_body, b"abcdef");
    }

    #[test]
    fn forwarded_headers_are_a_snapshot() {
        let mut dir = Direction {
            headers: HeaderMap::from_pairs([("a", "1")]),
            ..Direction::default()
        };
        dir.pass_on();
        dir.headers.add("b", "2");
        dir.pass_on();
        assert_eq!(dir.forwarded_headers.map(|h| h.len()), Some(1));
    }
}
