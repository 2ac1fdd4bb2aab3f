//! One HTTP request through the session filter.

use std::net::SocketAddr;

use log::debug;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use kvoy_shared::request::{self, Api};
use kvoy_shared::session::{
    binding_key, cookie_value, encode_token, resolve, KeySource, RequestKeys, ResponseIdScanner,
    PIN_HEADER,
};

use crate::metrics::Metrics;
use crate::{SharedState, VmState};
use kvoy_filter_common::{now_ms, HostStore};

/// The endpoint that served the request, as the prefix-affinity filter reports it (it only
/// ever names a pool member).
const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";

pub(crate) struct SessionStream {
    state: SharedState,
    /// Waiting for the whole body of a Responses API request, to read its keys.
    reading_body: bool,
    /// Bytes buffered so far, for a body that ends with trailers.
    body_size: usize,
    /// Header-borne keys, kept until the body is read.
    header: Option<String>,
    cookie: Option<String>,
    token: Option<String>,
    /// Binding keys to bind to the serving endpoint.
    bind: Vec<String>,
    /// A Responses API request: scan the response for its id.
    responses_api: bool,
    served: Option<SocketAddr>,
    scanner: Option<ResponseIdScanner>,
}

fn request_header(name: &str) -> Option<String> {
    kvoy_filter_common::header(MapType::HttpRequestHeaders, name)
}

impl SessionStream {
    /// The whole Responses API body is buffered (`body_size` bytes): read its keys and pin.
    fn read_body(&mut self, body_size: usize) -> Action {
        self.reading_body = false;
        let state = self.state.clone();
        let guard = state.borrow();
        let Some(vm) = guard.as_ref() else {
            return Action::Continue;
        };
        let body = if body_size <= vm.config.max_body_bytes {
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

    pub fn new(state: SharedState) -> Self {
        SessionStream {
            state,
            reading_body: false,
            body_size: 0,
            header: None,
            cookie: None,
            token: None,
            bind: Vec::new(),
            responses_api: false,
            served: None,
            scanner: None,
        }
    }

    /// Resolves the keys (with the body's, when read) and hands the pin over.
    fn pin(
        &mut self,
        vm: &VmState,
        previous_response_id: Option<&str>,
        conversation: Option<&str>,
    ) {
        let now = now_ms();
        let keys = RequestKeys {
            header: self.header.as_deref(),
            cookie: self.cookie.as_deref(),
            token: self.token.as_deref(),
            previous_response_id,
            conversation,
        };
        let r = resolve(&vm.config, &keys, |key| {
            vm.table.lookup(&HostStore, key, now)
        });
        if r.keyed {
            Metrics::add(vm.metrics.keyed, 1);
        }
        if r.invalid_token {
            Metrics::add(vm.metrics.invalid_tokens, 1);
        }
        match r.pin {
            Some((source, endpoint)) => {
                Metrics::add(vm.metrics.hits, 1);
                debug!("kvoy_session: {} pins {endpoint}", source.tag());
                let _ = hostcalls::set_map_value(
                    MapType::HttpRequestHeaders,
                    PIN_HEADER,
                    Some(&endpoint.to_string()),
                );
            }
            None if r.keyed => Metrics::add(vm.metrics.misses, 1),
            None => {}
        }
        self.bind = r.bind;
    }

    fn bind(&self, vm: &VmState, key: &str, endpoint: SocketAddr) {
        match vm.table.bind(&HostStore, key, endpoint, now_ms()) {
            Ok(()) => Metrics::add(vm.metrics.bindings, 1),
            Err(_) => Metrics::add(vm.metrics.shared_state_errors, 1),
        }
    }
}

impl Context for SessionStream {}

impl HttpContext for SessionStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Only this filter sets the pin; a client's value is dropped.
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, PIN_HEADER, None);
        let state = self.state.clone();
        let guard = state.borrow();
        let Some(vm) = guard.as_ref() else {
            return Action::Continue;
        };
        self.header = request_header(&vm.config.header);
        self.cookie = vm.config.cookie.as_deref().and_then(|name| {
            request_header("cookie").and_then(|c| cookie_value(&c, name).map(str::to_owned))
        });
        self.token = request_header(&vm.config.token_header);
        let post = request_header(":method").is_some_and(|m| m.eq_ignore_ascii_case("POST"));
        self.responses_api = post
            && request_header(":path").and_then(|p| Api::from_path(&p)) == Some(Api::Responses);
        if self.responses_api && vm.config.reads_body() && !end_of_stream {
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
        let served = kvoy_filter_common::header(MapType::HttpResponseHeaders, SERVED_HEADER)
            .and_then(|s| s.trim().parse::<SocketAddr>().ok());
        let Some(served) = served else {
            return Action::Continue;
        };
        self.served = Some(served);
        let state = self.state.clone();
        let guard = state.borrow();
        let Some(vm) = guard.as_ref() else {
            return Action::Continue;
        };
        for key in &self.bind {
            self.bind(vm, key, served);
        }
        if vm.config.write_token {
            let _ = hostcalls::set_map_value(
                MapType::HttpResponseHeaders,
                &vm.config.token_header,
                Some(&encode_token(served)),
            );
        }
        let ok = kvoy_filter_common::header(MapType::HttpResponseHeaders, ":status")
            .is_some_and(|s| s.trim() == "200");
        if self.responses_api && ok {
            self.scanner = Some(ResponseIdScanner::new());
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        let (Some(scanner), Some(served)) = (self.scanner.as_mut(), self.served) else {
            return Action::Continue;
        };
        if body_size > 0 {
            if let Ok(Some(chunk)) =
                hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
            {
                scanner.feed(&chunk);
            }
        }
        if let Some(id) = scanner.found().map(str::to_owned) {
            self.scanner = None;
            let state = self.state.clone();
            let guard = state.borrow();
            if let Some(vm) = guard.as_ref() {
                self.bind(vm, &binding_key(KeySource::PreviousResponseId, &id), served);
                Metrics::add(vm.metrics.response_ids, 1);
            }
        } else if scanner.done() {
            self.scanner = None;
        }
        Action::Continue
    }
}
