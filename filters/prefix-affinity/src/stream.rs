//! One HTTP request through the filter.

use std::net::SocketAddr;
use std::time::Duration;

use log::{debug, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};

use kvoy_shared::request::{classify_path, Api, PathClass};
use kvoy_shared::session::PIN_HEADER;
use kvoy_shared::usage::UsageScanner;
use kvoy_shared::{
    Charge, Decision, DecisionKind, EndpointId, OutstandingDelta, RequestError, RouteError,
    SessionOutcome,
};

use crate::metrics::Metrics;
use crate::{SharedState, VmState};
use kvoy_filter_common::{now, HostStore};

/// The destination the ORIGINAL_DST cluster routes by (Gateway API Inference Extension).
pub(crate) const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The endpoint that actually served the request, on the response.
pub(crate) const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";

/// One answer in this many (of requests routed by their body) has its `usage` read: enough to
/// learn a model's bytes per token within minutes, without scanning every answer.
pub(crate) const USAGE_SAMPLE_EVERY: u64 = 8;

/// Other workers' decisions one request replays at most before it is routed (each a
/// shared-data read and up to 256 keys into the index). A worker that sat idle while others
/// routed catches up on its tick, not on the request that wakes it; one that is merely behind
/// by more than this routes on a slightly older index, never a wrong pool.
pub(crate) const CATCH_UP_SLOTS_PER_REQUEST: usize = 32;

/// An answer whose prompt-token count is being looked for.
struct UsageProbe {
    scanner: UsageScanner,
    model: String,
    prompt_bytes: u64,
}

/// What this request added to the outstanding table, at the endpoint's address (its id may
/// change with the pool before the request ends).
#[derive(Clone, Copy)]
struct Acquired {
    endpoint: SocketAddr,
    charge: Charge,
    /// The answer began (the prefill tokens were released).
    answered: bool,
}

pub(crate) struct RequestStream {
    state: SharedState,
    /// Set while the body of an inference request is being buffered.
    api: Option<Api>,
    /// Bytes buffered so far (the last body callback's size), for a body that ends with
    /// trailers.
    body_size: usize,
    chosen: Option<EndpointId>,
    /// Counted in the shared outstanding table; released once, when the stream ends.
    acquired: Option<Acquired>,
    /// The session pin `kvoy_session` handed over (validated against the pool when routing).
    pin: Option<String>,
    /// Set when this answer's `usage` is sampled.
    usage: Option<UsageProbe>,
    /// The API of the request being routed by its body (kept for its answer's `usage`).
    routed_api: Option<Api>,
}

impl RequestStream {
    pub fn new(state: SharedState) -> Self {
        RequestStream {
            state,
            api: None,
            body_size: 0,
            chosen: None,
            acquired: None,
            pin: None,
            usage: None,
            routed_api: None,
        }
    }

    fn header(&self, name: &str) -> Option<String> {
        kvoy_filter_common::header(MapType::HttpRequestHeaders, name)
    }

    fn reply_error(&self, vm: &mut VmState, err: &RouteError) -> Action {
        Metrics::add(vm.metrics.rejected(err.reason()), 1);
        if let RouteError::BadRequest(
            e @ (RequestError::TooManySegments { .. } | RequestError::BadPath),
        ) = err
        {
            if matches!(e, RequestError::TooManySegments { .. }) {
                Metrics::add(vm.metrics.rejected_too_many_segments, 1);
            }
            // A bound or a bad path: say why once, count every time.
            if vm
                .logged
                .first(&("request", err.reason(), std::mem::discriminant(e)))
            {
                warn!(
                    "kvoy_prefix_affinity: request refused {}: {err} (logged once)",
                    err.status()
                );
            }
        }
        debug!("kvoy_prefix_affinity: {} {}", err.status(), err);
        let body = err.body();
        let _ = hostcalls::send_http_response(
            u32::from(err.status()),
            vec![("content-type", "application/json")],
            Some(body.as_bytes()),
        );
        Action::Pause
    }

    /// Sets the destination, counts the request in flight, shares the decision.
    fn commit(&mut self, vm: &mut VmState, decision: Decision, now: Duration) -> Action {
        let Some(endpoint) = vm.router.pool().get(decision.endpoint) else {
            return self.reply_error(vm, &RouteError::NoEndpoint);
        };
        let address = endpoint.address;
        if hostcalls::set_map_value(
            MapType::HttpRequestHeaders,
            DESTINATION_HEADER,
            Some(&endpoint.address_text),
        )
        .is_err()
        {
            return self.reply_error(vm, &RouteError::NoEndpoint);
        }
        self.chosen = Some(decision.endpoint);
        let charge = decision.charge;
        if vm
            .outstanding
            .add(&HostStore, address, OutstandingDelta::sent(charge), now)
            .is_ok()
        {
            self.acquired = Some(Acquired {
                endpoint: address,
                charge,
                answered: false,
            });
            vm.metrics.inflight.add(1);
        } else {
            Metrics::add(vm.metrics.shared_state_errors, 1);
        }
        Metrics::add(vm.metrics.decisions, 1);
        match decision.kind {
            DecisionKind::Scored => {
                vm.scored += 1;
                let learn = vm.router.config().cost.learn_bytes_per_token;
                if let Some(api) = self.routed_api.filter(|_| learn) {
                    if vm.scored % USAGE_SAMPLE_EVERY == 1 {
                        let (model, prompt_bytes) = vm.router.last_prompt();
                        self.usage = Some(UsageProbe {
                            scanner: UsageScanner::new(api),
                            model: model.to_owned(),
                            prompt_bytes,
                        });
                    }
                }
                Metrics::add(
                    vm.metrics.blocks_requested,
                    u64::from(decision.request_blocks),
                );
                Metrics::add(
                    vm.metrics.blocks_matched,
                    u64::from(decision.matched_blocks),
                );
                let keys = vm.router.last_keys();
                if !keys.is_empty() && vm.log.append(&HostStore, decision.endpoint, keys).is_err() {
                    Metrics::add(vm.metrics.shared_state_errors, 1);
                }
            }
            DecisionKind::Passthrough => Metrics::add(vm.metrics.passthrough, 1),
            DecisionKind::Fallback => Metrics::add(vm.metrics.fallbacks, 1),
        }
        match decision.session {
            SessionOutcome::None => {}
            SessionOutcome::Honoured => Metrics::add(vm.metrics.session_honoured, 1),
            SessionOutcome::Broken(reason) => {
                debug!(
                    "kvoy_prefix_affinity: session pin broken: {}",
                    reason.label()
                );
                Metrics::add(vm.metrics.session_broken(reason), 1)
            }
        }
        Action::Continue
    }

    /// Brings this VM's view up to date: the live pool, other workers' decisions and the
    /// outstanding work.
    /// Brings the VM's view up to date at `now` (the host's clock, read once per request).
    fn refresh(vm: &mut VmState, now: Duration) {
        if vm.live.is_some() {
            let now_ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
            crate::live::refresh(vm, now_ms);
        }
        vm.catch_up(CATCH_UP_SLOTS_PER_REQUEST);
        vm.outstanding
            .read(&HostStore, vm.router.pool(), &mut vm.counts);
    }

    /// The whole body is buffered (`size` bytes): read it and route.
    fn finish_body(&mut self, api: Api, size: usize) -> Action {
        self.api = None;
        let body =
            match hostcalls::get_buffer(proxy_wasm::types::BufferType::HttpRequestBody, 0, size) {
                Ok(Some(b)) => b,
                Ok(None) => Vec::new(),
                Err(status) => {
                    warn!("kvoy_prefix_affinity: cannot read the request body: {status:?}");
                    Vec::new()
                }
            };
        self.route_body(api, &body)
    }

    /// Releases what this request charged to the outstanding table, once, at the address it
    /// was sent to.
    fn release(&mut self) {
        let Some(a) = self.acquired.take() else {
            return;
        };
        let mut guard = self.state.borrow_mut();
        if let Some(vm) = guard.as_mut() {
            vm.metrics.inflight.add(-1);
            let delta = OutstandingDelta::finished(a.charge, a.answered);
            if vm
                .outstanding
                .add(&HostStore, a.endpoint, delta, now())
                .is_err()
            {
                Metrics::add(vm.metrics.shared_state_errors, 1);
            }
        }
    }

    fn route_body(&mut self, api: Api, body: &[u8]) -> Action {
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        let Some(vm) = guard.as_mut() else {
            return Action::Continue;
        };
        let now = now();
        Self::refresh(vm, now);
        self.routed_api = Some(api);
        let counts = std::mem::take(&mut vm.counts);
        let result = vm
            .router
            .route_pinned(api, body, &counts, self.pin.as_deref(), now);
        vm.counts = counts;
        match result {
            Ok(decision) => self.commit(vm, decision, now),
            Err(err) => self.reply_error(vm, &err),
        }
    }
}

impl RequestStream {
    /// Feeds a sampled answer's chunk to its usage scanner; a count found teaches the router
    /// the model's bytes per token.
    fn read_usage(&mut self, body_size: usize, end_of_stream: bool) {
        let Some(probe) = self.usage.as_mut() else {
            return;
        };
        let mut found = None;
        if body_size > 0 {
            if let Ok(Some(chunk)) = hostcalls::get_buffer(
                proxy_wasm::types::BufferType::HttpResponseBody,
                0,
                body_size,
            ) {
                found = probe.scanner.feed(&chunk);
            }
        }
        if found.is_none() && end_of_stream {
            found = probe.scanner.finish();
        }
        let give_up = probe.scanner.done();
        if let Some(tokens) = found {
            let mut guard = self.state.borrow_mut();
            if let Some(vm) = guard.as_mut() {
                vm.router
                    .observe_usage(&probe.model, probe.prompt_bytes, tokens);
                Metrics::add(vm.metrics.usage_observed, 1);
            }
        }
        if found.is_some() || give_up || end_of_stream {
            self.usage = None;
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
        // (an internal header) never leaves the proxy.
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, DESTINATION_HEADER, None);
        self.pin = self.header(PIN_HEADER);
        if self.pin.is_some() {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, PIN_HEADER, None);
        }
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        let Some(vm) = guard.as_mut() else {
            // Not configured: Envoy refuses such a plugin, so this is unreachable in practice.
            return Action::Continue;
        };
        let method = self.header(":method").unwrap_or_default();
        // A path that is not UTF-8 (Envoy always has one) is not guessed at either: a
        // deployment that routes by prefix could otherwise send it on unchecked.
        let class = self
            .header(":path")
            .map_or(PathClass::Ambiguous, |p| classify_path(&p));
        let api = match class {
            PathClass::Api(api) => Some(api),
            PathClass::Other => None,
            // `/v1/chat%2Fcompletions` and the like: never guess whether to read the body.
            PathClass::Ambiguous => {
                return self.reply_error(vm, &RouteError::BadRequest(RequestError::BadPath));
            }
        }
        .filter(|_| method.eq_ignore_ascii_case("POST"));
        let Some(api) = api else {
            let now = now();
            Self::refresh(vm, now);
            let counts = std::mem::take(&mut vm.counts);
            let result = vm.router.route_passthrough(&counts);
            vm.counts = counts;
            return match result {
                Ok(decision) => self.commit(vm, decision, now),
                Err(err) => self.reply_error(vm, &err),
            };
        };
        let limit = vm.router.config().max_body_bytes;
        if let Some(size) = self
            .header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            if size > limit as u64 {
                let err = RouteError::BadRequest(RequestError::TooLarge {
                    size: usize::try_from(size).unwrap_or(usize::MAX),
                    limit,
                });
                return self.reply_error(vm, &err);
            }
        }
        drop(guard);
        if end_of_stream {
            return self.route_body(api, b"");
        }
        self.api = Some(api);
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(api) = self.api else {
            return Action::Continue;
        };
        let limit = self
            .state
            .borrow()
            .as_ref()
            .map_or(usize::MAX, |vm| vm.router.config().max_body_bytes);
        if body_size > limit {
            self.api = None;
            let state = self.state.clone();
            let mut guard = state.borrow_mut();
            if let Some(vm) = guard.as_mut() {
                let err = RouteError::BadRequest(RequestError::TooLarge {
                    size: body_size,
                    limit,
                });
                return self.reply_error(vm, &err);
            }
            return Action::Pause;
        }
        if !end_of_stream {
            self.body_size = body_size;
            return Action::Pause;
        }
        self.finish_body(api, body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // An HTTP/2 (or chunked HTTP/1.1) request that ends with trailers: the body callbacks
        // never saw the end of the stream, so the body is complete now. Routed like any other;
        // without this, the SDK's default would let it go on with no destination set.
        let Some(api) = self.api else {
            return Action::Continue;
        };
        self.finish_body(api, self.body_size)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(chosen) = self.chosen else {
            return Action::Continue;
        };
        let guard = self.state.borrow();
        let Some(vm) = guard.as_ref() else {
            return Action::Continue;
        };
        let pool = vm.router.pool();
        // The upstream Envoy actually used; only a pool member is reported.
        let served = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .and_then(|b| String::from_utf8(b).ok())
            .and_then(|a| pool.find(&a))
            .unwrap_or(chosen);
        if let Some(endpoint) = pool.get(served) {
            let _ = hostcalls::set_map_value(
                MapType::HttpResponseHeaders,
                SERVED_HEADER,
                Some(&endpoint.address_text),
            );
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.read_usage(body_size, end_of_stream);
        // The answer is complete: release everything now, in one write (for an answer that
        // comes in one piece, one read-modify-write instead of "answered" here and
        // "finished" at the end of the stream).
        if end_of_stream {
            self.release();
            return Action::Continue;
        }
        // The first byte of the answer: its prefill is done, release its pending tokens (the
        // cost model's queue at that endpoint). Headers do not tell: a streamed answer's
        // headers leave the server before its first token.
        if let Some(a) = self.acquired.as_mut().filter(|a| !a.answered) {
            a.answered = true;
            let (endpoint, charge) = (a.endpoint, a.charge);
            let state = self.state.clone();
            let mut guard = state.borrow_mut();
            if let Some(vm) = guard.as_mut() {
                if vm
                    .outstanding
                    .add(
                        &HostStore,
                        endpoint,
                        OutstandingDelta::answered(charge),
                        now(),
                    )
                    .is_err()
                {
                    Metrics::add(vm.metrics.shared_state_errors, 1);
                }
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release();
    }
}
