//! One HTTP request through the prefix-affinity filter: the stage, with the session pin read
//! from (and stripped out of) the internal request header.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use kvoy_filter_common::{HeaderCache, Headers};
use kvoy_filter_stages::prefix_affinity::{
    request_body, BodyVerdict, HeadersVerdict, PrefixStage, DESTINATION_HEADER, PREFILLER_HEADER,
};
use kvoy_shared::request::Api;
use kvoy_shared::session::PIN_HEADER;

use crate::SharedState;

pub(crate) struct RequestStream {
    state: SharedState,
    stage: PrefixStage,
    /// The session pin `kvoy_session` handed over (validated against the pool when routing).
    pin: Option<String>,
}

impl RequestStream {
    pub fn new(state: SharedState) -> Self {
        RequestStream {
            state,
            stage: PrefixStage::new(),
            pin: None,
        }
    }

    /// Reads the buffered body (`size` bytes) and routes it.
    fn route(&mut self, api: Api, size: usize) -> Action {
        let body = if size > 0 {
            request_body(size)
        } else {
            Vec::new()
        };
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        let Some(vm) = guard.as_mut() else {
            return Action::Continue;
        };
        if self.stage.route_body(vm, api, &body, self.pin.as_deref()) {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn release(&mut self) {
        if !self.stage.holds_outstanding() {
            return;
        }
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            self.stage.release(vm);
        }
    }
}

impl Context for RequestStream {
    fn on_done(&mut self) -> bool {
        // Whichever comes first of done and log releases (a reset, a local reply, an upstream
        // failure all end here); the other finds nothing left.
        self.release();
        true
    }
}

impl HttpContext for RequestStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Whatever happens next, the client never chooses the upstream, and the session pin
        // (an internal header) never leaves the proxy. The request headers come in one host
        // call (the stage reads its pseudo-headers from them, never the destination), which
        // also says whether there is a destination to remove.
        let headers = HeaderCache::new(MapType::HttpRequestHeaders);
        if headers.may_contain(DESTINATION_HEADER) {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, DESTINATION_HEADER, None);
        }
        // The prefill endpoint a sidecar would pull KV from is the router's to name too.
        if headers.may_contain(PREFILLER_HEADER) {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, PREFILLER_HEADER, None);
        }
        self.pin = headers.get(PIN_HEADER);
        if self.pin.is_some() {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, PIN_HEADER, None);
        }
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        let Some(vm) = guard.as_mut() else {
            // Not configured: Envoy refuses such a plugin, so this is unreachable in practice.
            return Action::Continue;
        };
        match self.stage.on_request_headers(vm, &headers, end_of_stream) {
            HeadersVerdict::Routed => Action::Continue,
            HeadersVerdict::Replied => Action::Pause,
            HeadersVerdict::ReadBody(api) if end_of_stream => {
                drop(guard);
                self.route(api, 0)
            }
            HeadersVerdict::ReadBody(_) => Action::Pause,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let verdict = {
            let mut guard = self.state.borrow_mut();
            match guard.as_mut() {
                Some(vm) => self.stage.on_request_body(vm, body_size, end_of_stream),
                None => BodyVerdict::NotReading,
            }
        };
        match verdict {
            BodyVerdict::NotReading => Action::Continue,
            BodyVerdict::More | BodyVerdict::Replied => Action::Pause,
            BodyVerdict::Complete(api) => self.route(api, body_size),
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // An HTTP/2 (or chunked HTTP/1.1) request that ends with trailers: the body callbacks
        // never saw the end of the stream, so the body is complete now. Routed like any other;
        // without this, the SDK's default would let it go on with no destination set.
        match self.stage.on_request_trailers() {
            Some((api, size)) => self.route(api, size),
            None => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Some(vm) = self.state.borrow().as_ref() {
            self.stage.on_response_headers(vm);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let chunk = if self.stage.reads_response_body() && body_size > 0 {
            hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
                .ok()
                .flatten()
        } else {
            None
        };
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            self.stage
                .on_response_body(vm, chunk.as_deref(), end_of_stream);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release();
    }
}
