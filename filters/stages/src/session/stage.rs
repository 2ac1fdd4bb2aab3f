//! One request through the session stage.

use std::net::SocketAddr;

use log::debug;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MapType;

use kvoy_filter_common::{now_ms, Headers, HostStore};
use kvoy_shared::request::Api;
use kvoy_shared::session::{
    binding_key, cookie_value, encode_token, resolve, KeySource, RequestKeys, ResponseIdScanner,
};

use super::{Metrics, SessionVm};

/// One request's session state: its keys until they are resolved, the keys to bind on the
/// response, and the Responses API id scan.
#[derive(Default)]
pub struct SessionStage {
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

impl SessionStage {
    pub fn new() -> Self {
        SessionStage::default()
    }

    /// Reads the request's header-borne keys. `true` when the keys are only complete with the
    /// body's (a Responses API request with a body, and body keys configured): resolve with
    /// [`SessionStage::pin`] once it is read; otherwise resolve now, without body keys.
    pub fn on_request_headers(
        &mut self,
        vm: &SessionVm,
        headers: &impl Headers,
        end_of_stream: bool,
    ) -> bool {
        self.header = headers.get(&vm.config.header);
        self.cookie = vm.config.cookie.as_deref().and_then(|name| {
            headers
                .get("cookie")
                .and_then(|c| cookie_value(&c, name).map(str::to_owned))
        });
        self.token = headers.get(&vm.config.token_header);
        let post = headers
            .get(":method")
            .is_some_and(|m| m.eq_ignore_ascii_case("POST"));
        self.responses_api =
            post && headers.get(":path").and_then(|p| Api::from_path(&p)) == Some(Api::Responses);
        self.responses_api && vm.config.reads_body() && !end_of_stream
    }

    /// Whether a body of `body_size` bytes is read for its keys (larger ones have none).
    pub fn reads_body_of(vm: &SessionVm, body_size: usize) -> bool {
        body_size <= vm.config.max_body_bytes
    }

    /// Resolves the keys (with the body's, when read): the endpoint the session is pinned to.
    pub fn pin(
        &mut self,
        vm: &SessionVm,
        previous_response_id: Option<&str>,
        conversation: Option<&str>,
    ) -> Option<SocketAddr> {
        let keys = RequestKeys {
            header: self.header.as_deref(),
            cookie: self.cookie.as_deref(),
            token: self.token.as_deref(),
            previous_response_id,
            conversation,
        };
        // The clock is read once, and only if there is a key to look up.
        let mut now = None;
        let r = resolve(&vm.config, &keys, |key| {
            let now = *now.get_or_insert_with(now_ms);
            vm.table.lookup(&HostStore, key, now)
        });
        if r.keyed {
            Metrics::add(vm.metrics.keyed, 1);
        }
        if r.invalid_token {
            Metrics::add(vm.metrics.invalid_tokens, 1);
        }
        self.bind = r.bind;
        match r.pin {
            Some((source, endpoint)) => {
                Metrics::add(vm.metrics.hits, 1);
                debug!("kvoy_session: {} pins {endpoint}", source.tag());
                Some(endpoint)
            }
            None => {
                if r.keyed {
                    Metrics::add(vm.metrics.misses, 1);
                }
                None
            }
        }
    }

    fn bind(vm: &SessionVm, key: &str, endpoint: SocketAddr) {
        match vm.table.bind(&HostStore, key, endpoint, now_ms()) {
            Ok(()) => Metrics::add(vm.metrics.bindings, 1),
            Err(_) => Metrics::add(vm.metrics.shared_state_errors, 1),
        }
    }

    /// The response came from `served` (a pool member): binds the request's keys to it and
    /// writes the session token on the response. `status_ok` is read (the response's `:status`
    /// is 200) only for a Responses API request, whose answer is then scanned for its id.
    pub fn on_served(
        &mut self,
        vm: &SessionVm,
        served: SocketAddr,
        status_ok: impl FnOnce() -> bool,
    ) {
        self.served = Some(served);
        for key in &self.bind {
            Self::bind(vm, key, served);
        }
        if vm.config.write_token {
            let _ = hostcalls::set_map_value(
                MapType::HttpResponseHeaders,
                &vm.config.token_header,
                Some(&encode_token(served)),
            );
        }
        if self.responses_api && status_ok() {
            self.scanner = Some(ResponseIdScanner::new());
        }
    }

    /// Whether the response body is scanned (the next chunk should be read for
    /// [`SessionStage::on_response_chunk`]).
    pub fn reads_response_body(&self) -> bool {
        self.scanner.is_some() && self.served.is_some()
    }

    /// A chunk of the response body: a Responses API id found in it is bound to the endpoint.
    pub fn on_response_chunk(&mut self, vm: &SessionVm, chunk: &[u8]) {
        let (Some(scanner), Some(served)) = (self.scanner.as_mut(), self.served) else {
            return;
        };
        scanner.feed(chunk);
        if let Some(id) = scanner.found().map(str::to_owned) {
            self.scanner = None;
            Self::bind(vm, &binding_key(KeySource::PreviousResponseId, &id), served);
            Metrics::add(vm.metrics.response_ids, 1);
        } else if scanner.done() {
            self.scanner = None;
        }
    }
}
