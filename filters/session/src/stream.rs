//! One HTTP request through the session filter: the session stage, with the pin handed over in
//! an internal request header and the served endpoint read from the response's header.

use std::net::SocketAddr;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use kvoy_filter_common::{HeaderCache, Headers, HostHeaders};
use kvoy_filter_stages::session::{SessionStage, SessionVm};
use kvoy_shared::request::{self, Api};
use kvoy_shared::session::PIN_HEADER;

use crate::SharedState;

/// The endpoint that served the request, as the prefix-affinity filter reports it (it only
/// ever names a pool member).
use kvoy_shared::protocol::SERVED_HEADER;

pub(crate) struct SessionStream {
    state: SharedState,
    stage: SessionStage,
    /// Waiting for the whole body of a Responses API request, to read its keys.
    reading_body: bool,
    /// Bytes buffered so far, for a body that ends with trailers.
    body_size: usize,
}

impl SessionStream {
    pub fn new(state: SharedState) -> Self {
        SessionStream {
            state,
            stage: SessionStage::new(),
            reading_body: false,
            body_size: 0,
        }
    }

    /// Resolves the keys and hands the pin over in the internal header.
    fn pin(
        &mut self,
        vm: &SessionVm,
        previous_response_id: Option<&str>,
        conversation: Option<&str>,
    ) {
        if let Some(endpoint) = self.stage.pin(vm, previous_response_id, conversation) {
            let _ = hostcalls::set_map_value(
                MapType::HttpRequestHeaders,
                PIN_HEADER,
                Some(&endpoint.to_string()),
            );
        }
    }

    /// The whole Responses API body is buffered (`body_size` bytes): read its keys and pin.
    fn read_body(&mut self, body_size: usize) -> Action {
        self.reading_body = false;
        let state = self.state.clone();
        let guard = state.borrow();
        let Some(vm) = guard.as_ref() else {
            return Action::Continue;
        };
        let body = if SessionStage::reads_body_of(vm, body_size) {
            hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        // A body that does not parse just has no body keys; the prefix-affinity filter
        // answers it.
        match request::parse(Api::Responses, &body, vm.config.max_body_bytes) {
            Ok(req) => {
                let (prev, conv) = (req.previous_response_id.clone(), req.conversation.clone());
                self.pin(vm, prev.as_deref(), conv.as_deref());
            }
            Err(_) => self.pin(vm, None, None),
        }
        Action::Continue
    }
}

impl Context for SessionStream {}

impl HttpContext for SessionStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // The request headers in one host call; the stage reads only its own keys from them.
        let headers = HeaderCache::new(MapType::HttpRequestHeaders);
        // Only this filter sets the pin; a client's value is dropped (a request without one
        // costs no host call for it).
        if headers.may_contain(PIN_HEADER) {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, PIN_HEADER, None);
        }
        let state = self.state.clone();
        let guard = state.borrow();
        let Some(vm) = guard.as_ref() else {
            return Action::Continue;
        };
        if self.stage.on_request_headers(vm, &headers, end_of_stream) {
            self.reading_body = true;
            return Action::Pause;
        }
        self.pin(vm, None, None);
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.reading_body {
            return Action::Continue;
        }
        if !end_of_stream {
            self.body_size = body_size;
            return Action::Pause;
        }
        self.read_body(body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A Responses API request that ends with trailers: its body is complete now (the body
        // callbacks never saw the end of the stream). Without this it would go on unpinned.
        if !self.reading_body {
            return Action::Continue;
        }
        self.read_body(self.body_size)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let response = HostHeaders(MapType::HttpResponseHeaders);
        let served = response
            .get(SERVED_HEADER)
            .and_then(|s| s.trim().parse::<SocketAddr>().ok());
        let Some(served) = served else {
            return Action::Continue;
        };
        let state = self.state.clone();
        let guard = state.borrow();
        let Some(vm) = guard.as_ref() else {
            return Action::Continue;
        };
        self.stage.on_served(vm, served, || {
            response.get(":status").is_some_and(|s| s.trim() == "200")
        });
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if !self.stage.reads_response_body() {
            return Action::Continue;
        }
        let chunk = if body_size > 0 {
            hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let state = self.state.clone();
        let guard = state.borrow();
        if let Some(vm) = guard.as_ref() {
            self.stage.on_response_chunk(vm, &chunk);
        }
        Action::Continue
    }
}
