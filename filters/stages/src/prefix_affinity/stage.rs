//! One request through the prefix-affinity stage.

use std::net::SocketAddr;
use std::time::Duration;

use log::{debug, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

use kvoy_filter_common::{now, Headers, HostStore};
use kvoy_shared::prefix_affinity::{Decision, DecisionKind, RouteError, SessionOutcome};
use kvoy_shared::request::{classify_path, Api, ParsedRequest, PathClass};
use kvoy_shared::usage::{OutputScanner, UsageScanner};
use kvoy_shared::{Charge, EndpointId, OutstandingDelta, RequestError};

use super::{Metrics, PrefixVm as VmState};

pub use kvoy_shared::protocol::{DESTINATION_HEADER, PREFILLER_HEADER, SERVED_HEADER};

pub use kvoy_shared::usage::SAMPLE_EVERY as USAGE_SAMPLE_EVERY;

/// Other workers' decisions one request replays at most before it is routed (each a
/// shared-data read and up to 256 keys into the index). A worker that sat idle while others
/// routed catches up on its tick, not on the request that wakes it; one that is merely behind
/// by more than this routes on a slightly older index, never a wrong pool.
pub const CATCH_UP_SLOTS_PER_REQUEST: usize = 32;

/// An answer whose token counts are being looked for: the prompt's (while `scanner` is
/// not done) and the output's (`output`, known at the end of the body).
struct UsageProbe {
    scanner: Option<UsageScanner>,
    output: Option<OutputScanner>,
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

/// What the stage made of a request at its headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadersVerdict {
    /// An inference request: buffer its body (pause) and route it once it is complete
    /// ([`PrefixStage::route_body`]).
    ReadBody(Api),
    /// Routed without its body (any pool endpoint will do): the request goes on.
    Routed,
    /// Answered (400, 413, 503): pause it, the local reply ends it.
    Replied,
}

/// What the stage made of a chunk of the request body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyVerdict {
    /// Not reading this request's body.
    NotReading,
    /// More to come: keep buffering (pause).
    More,
    /// The body is complete: route it ([`PrefixStage::route_body`]).
    Complete(Api),
    /// Answered (413): pause it.
    Replied,
}

/// One request's routing state.
#[derive(Default)]
pub struct PrefixStage {
    /// Set while the body of an inference request is being buffered.
    api: Option<Api>,
    /// Bytes buffered so far (the last body callback's size), for a body that ends with
    /// trailers.
    body_size: usize,
    chosen: Option<EndpointId>,
    /// Counted in the shared outstanding table; released once, when the stream ends.
    acquired: Option<Acquired>,
    /// A disaggregated request's prefill endpoint, counted until the answer begins (its
    /// prefill is then done).
    prefill_acquired: Option<Acquired>,
    /// Set when this answer's `usage` is sampled.
    usage: Option<UsageProbe>,
    /// The API of the request being routed by its body (kept for its answer's `usage`).
    routed_api: Option<Api>,
}

/// Answers the current request with `err` (counted, a bound logged once).
fn reply_error(vm: &mut VmState, err: &RouteError) {
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
}

/// Brings this VM's view up to date at `now` (the host's clock, read once per request): the
/// live pool, other workers' decisions and the outstanding work.
fn refresh(vm: &mut VmState, now: Duration) {
    if vm.live.is_some() {
        let now_ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
        super::pool::refresh(vm, now_ms);
    }
    // One read gives the outstanding work and the decision log's head (one value): the
    // replay goes up to that head without reading it again.
    vm.outstanding
        .read(&HostStore, vm.router.pool(), &mut vm.counts);
    let head = vm.outstanding.log_head();
    vm.catch_up_to(head, CATCH_UP_SLOTS_PER_REQUEST);
}

/// The request body as buffered (`size` bytes), copied into the VM once.
pub fn request_body(size: usize) -> Vec<u8> {
    match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size) {
        Ok(Some(b)) => b,
        Ok(None) => Vec::new(),
        Err(status) => {
            warn!("kvoy_prefix_affinity: cannot read the request body: {status:?}");
            Vec::new()
        }
    }
}

impl PrefixStage {
    pub fn new() -> Self {
        PrefixStage::default()
    }

    /// The request headers (the caller has removed any client-supplied destination): an
    /// inference request's body is read; anything else is routed now, or refused.
    pub fn on_request_headers(
        &mut self,
        vm: &mut VmState,
        headers: &impl Headers,
        end_of_stream: bool,
    ) -> HeadersVerdict {
        let method = headers.get(":method").unwrap_or_default();
        // A path that is not UTF-8 (Envoy always has one) is not guessed at either: a
        // deployment that routes by prefix could otherwise send it on unchecked.
        let class = headers
            .get(":path")
            .map_or(PathClass::Ambiguous, |p| classify_path(&p));
        let api = match class {
            PathClass::Api(api) => Some(api),
            PathClass::Other => None,
            // `/v1/chat%2Fcompletions` and the like: never guess whether to read the body.
            PathClass::Ambiguous => {
                reply_error(vm, &RouteError::BadRequest(RequestError::BadPath));
                return HeadersVerdict::Replied;
            }
        }
        .filter(|_| method.eq_ignore_ascii_case("POST"));
        let Some(api) = api else {
            let now = now();
            refresh(vm, now);
            let counts = std::mem::take(&mut vm.counts);
            let result = vm.router.route_passthrough(&counts);
            vm.counts = counts;
            return match result {
                Ok(decision) => self.commit(vm, decision, now),
                Err(err) => {
                    reply_error(vm, &err);
                    HeadersVerdict::Replied
                }
            };
        };
        let limit = vm.router.config().max_body_bytes;
        if let Some(size) = headers
            .get("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            if size > limit as u64 {
                let err = RouteError::BadRequest(RequestError::TooLarge {
                    size: usize::try_from(size).unwrap_or(usize::MAX),
                    limit,
                });
                reply_error(vm, &err);
                return HeadersVerdict::Replied;
            }
        }
        if !end_of_stream {
            self.api = Some(api);
        }
        HeadersVerdict::ReadBody(api)
    }

    /// The API whose body is being buffered, if any.
    pub fn reading(&self) -> Option<Api> {
        self.api
    }

    /// A request body callback (`body_size` bytes buffered so far).
    pub fn on_request_body(
        &mut self,
        vm: &mut VmState,
        body_size: usize,
        end_of_stream: bool,
    ) -> BodyVerdict {
        let Some(api) = self.api else {
            return BodyVerdict::NotReading;
        };
        let limit = vm.router.config().max_body_bytes;
        if body_size > limit {
            self.api = None;
            let err = RouteError::BadRequest(RequestError::TooLarge {
                size: body_size,
                limit,
            });
            reply_error(vm, &err);
            return BodyVerdict::Replied;
        }
        self.body_size = body_size;
        if !end_of_stream {
            return BodyVerdict::More;
        }
        self.api = None;
        BodyVerdict::Complete(api)
    }

    /// The request ended with trailers: a body being buffered is complete now (its size, and
    /// API), else `None`.
    pub fn on_request_trailers(&mut self) -> Option<(Api, usize)> {
        let api = self.api.take()?;
        Some((api, self.body_size))
    }

    /// Routes the complete body: `true` when the destination is set (continue), `false` when
    /// the request was answered.
    pub fn route_body(
        &mut self,
        vm: &mut VmState,
        api: Api,
        body: &[u8],
        pin: Option<&str>,
    ) -> bool {
        let parsed = vm.router.parse(api, body);
        self.route_parsed(vm, api, parsed, pin)
    }

    /// [`PrefixStage::route_body`] for a body parsed with [`kvoy_shared::prefix_affinity::Router::parse`].
    pub fn route_parsed(
        &mut self,
        vm: &mut VmState,
        api: Api,
        parsed: Result<ParsedRequest<'_>, RequestError>,
        pin: Option<&str>,
    ) -> bool {
        self.api = None;
        let now = now();
        refresh(vm, now);
        self.routed_api = Some(api);
        let counts = std::mem::take(&mut vm.counts);
        let result = vm.router.route_parsed(parsed, &counts, pin, now);
        vm.counts = counts;
        match result {
            Ok(decision) => self.commit(vm, decision, now) == HeadersVerdict::Routed,
            Err(err) => {
                reply_error(vm, &err);
                false
            }
        }
    }

    /// Sets the destination, counts the request in flight, shares the decision.
    fn commit(&mut self, vm: &mut VmState, decision: Decision, now: Duration) -> HeadersVerdict {
        let Some(endpoint) = vm.router.pool().get(decision.endpoint) else {
            reply_error(vm, &RouteError::NoEndpoint);
            return HeadersVerdict::Replied;
        };
        let address = endpoint.address;
        if hostcalls::set_map_value(
            MapType::HttpRequestHeaders,
            DESTINATION_HEADER,
            Some(&endpoint.address_text),
        )
        .is_err()
        {
            reply_error(vm, &RouteError::NoEndpoint);
            return HeadersVerdict::Replied;
        }
        self.chosen = Some(decision.endpoint);
        if let Some(p) = decision.prefill {
            self.name_prefiller(vm, p, now);
        }
        let charge = decision.charge;
        // A scored decision is logged for the other workers: the write that counts the
        // request outstanding also claims its log slot.
        let logs = decision.kind == DecisionKind::Scored && !vm.router.last_keys().is_empty();
        let sent = OutstandingDelta::sent(charge);
        let (counted, slot) = if logs {
            match vm.outstanding.add_claiming(&HostStore, address, sent, now) {
                Ok(seq) => (true, Some(seq)),
                Err(_) => (false, None),
            }
        } else {
            (
                vm.outstanding.add(&HostStore, address, sent, now).is_ok(),
                None,
            )
        };
        if counted {
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
                let cost = &vm.router.config().cost;
                let (ratio, output) = (cost.learn_bytes_per_token, cost.learn_output_tokens);
                if let Some(api) = self.routed_api.filter(|_| ratio || output) {
                    if vm.scored % USAGE_SAMPLE_EVERY == 1 {
                        let (model, prompt_bytes) = vm.router.last_prompt();
                        self.usage = Some(UsageProbe {
                            scanner: ratio.then(|| UsageScanner::new(api)),
                            output: output.then(|| OutputScanner::new(api)),
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
                if decision.longest_match > decision.matched_blocks {
                    Metrics::add(vm.metrics.spilled, 1);
                }
                if logs {
                    let keys = vm.router.last_keys();
                    // Not counted (the table full, or contended past its retries): the
                    // decision still claims a slot of its own.
                    let logged = match slot {
                        Some(seq) => vm.log.write(
                            &HostStore,
                            seq,
                            decision.endpoint,
                            keys,
                            now.as_millis() as u64,
                        ),
                        None => vm
                            .log
                            .append(&HostStore, decision.endpoint, keys)
                            .map(|_| ()),
                    };
                    if logged.is_err() {
                        Metrics::add(vm.metrics.shared_state_errors, 1);
                    }
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
        HeadersVerdict::Routed
    }

    /// Names the prefill endpoint for the decode endpoint's sidecar and counts its prefill
    /// outstanding. Should the header not be set, the decode endpoint prefills itself (the
    /// sidecar's behaviour without it) and the prefill endpoint is not charged.
    fn name_prefiller(
        &mut self,
        vm: &mut VmState,
        p: kvoy_shared::prefix_affinity::PrefillChoice,
        now: Duration,
    ) {
        let Some(endpoint) = vm.router.pool().get(p.endpoint) else {
            return;
        };
        let address = endpoint.address;
        if hostcalls::set_map_value(
            MapType::HttpRequestHeaders,
            PREFILLER_HEADER,
            Some(&endpoint.address_text),
        )
        .is_err()
        {
            return;
        }
        Metrics::add(vm.metrics.disaggregated, 1);
        let sent = OutstandingDelta::sent(p.charge);
        if vm.outstanding.add(&HostStore, address, sent, now).is_ok() {
            self.prefill_acquired = Some(Acquired {
                endpoint: address,
                charge: p.charge,
                answered: false,
            });
        } else {
            Metrics::add(vm.metrics.shared_state_errors, 1);
        }
    }

    /// Releases the prefill endpoint's charge, once.
    fn release_prefill(&mut self, vm: &mut VmState) {
        let Some(a) = self.prefill_acquired.take() else {
            return;
        };
        let delta = OutstandingDelta::finished(a.charge, false);
        if vm
            .outstanding
            .add(&HostStore, a.endpoint, delta, now())
            .is_err()
        {
            Metrics::add(vm.metrics.shared_state_errors, 1);
        }
    }

    /// Whether the request was routed (and so has an upstream answer to follow).
    pub fn routed(&self) -> bool {
        self.chosen.is_some()
    }

    /// The response headers: reports the endpoint that served (only ever a pool member) in
    /// `x-gateway-destination-endpoint-served`, and returns it.
    pub fn on_response_headers(&mut self, vm: &VmState) -> Option<SocketAddr> {
        let chosen = self.chosen?;
        let pool = vm.router.pool();
        // The upstream Envoy actually used; only a pool member is reported.
        let served = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .and_then(|b| String::from_utf8(b).ok())
            .and_then(|a| pool.find(&a))
            .unwrap_or(chosen);
        let endpoint = pool.get(served)?;
        let _ = hostcalls::set_map_value(
            MapType::HttpResponseHeaders,
            SERVED_HEADER,
            Some(&endpoint.address_text),
        );
        Some(endpoint.address)
    }

    /// Whether the answer's body is read (its `usage` is sampled): the next chunk should be
    /// passed to [`PrefixStage::on_response_body`].
    pub fn reads_response_body(&self) -> bool {
        self.usage.is_some()
    }

    /// A response body callback, with the chunk when [`PrefixStage::reads_response_body`]
    /// asked for it: a sampled answer's `usage` teaches the router the model's bytes per token;
    /// the first byte releases the request's pending prefill tokens, the end everything.
    pub fn on_response_body(
        &mut self,
        vm: &mut VmState,
        chunk: Option<&[u8]>,
        end_of_stream: bool,
    ) {
        self.read_usage(vm, chunk, end_of_stream);
        // The answer is complete: release everything now, in one write (for an answer that
        // comes in one piece, one read-modify-write instead of "answered" here and
        // "finished" at the end of the stream).
        if end_of_stream {
            self.release(vm);
            return;
        }
        self.release_prefill(vm);
        // The first byte of the answer: its prefill is done, release its pending tokens (the
        // cost model's queue at that endpoint). Headers do not tell: a streamed answer's
        // headers leave the server before its first token.
        if let Some(a) = self.acquired.as_mut().filter(|a| !a.answered) {
            a.answered = true;
            let (endpoint, charge) = (a.endpoint, a.charge);
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

    /// Feeds a sampled answer's chunk to its usage scanners: the prompt's count found teaches
    /// the router the model's bytes per token, the output's (at the end) its output length.
    fn read_usage(&mut self, vm: &mut VmState, chunk: Option<&[u8]>, end_of_stream: bool) {
        let Some(probe) = self.usage.as_mut() else {
            return;
        };
        let chunk = chunk.filter(|c| !c.is_empty());
        if let Some(scanner) = probe.scanner.as_mut() {
            let mut found = chunk.and_then(|c| scanner.feed(c));
            if found.is_none() && end_of_stream {
                found = scanner.finish();
            }
            if let Some(tokens) = found {
                vm.router
                    .observe_usage(&probe.model, probe.prompt_bytes, tokens);
                Metrics::add(vm.metrics.usage_observed, 1);
            }
            if scanner.done() {
                probe.scanner = None;
            }
        }
        if let Some(output) = probe.output.as_mut() {
            if let Some(c) = chunk {
                output.feed(c);
            }
            if end_of_stream {
                if let Some(tokens) = output.finish() {
                    vm.router.observe_output(&probe.model, tokens);
                    Metrics::add(vm.metrics.output_observed, 1);
                }
            }
            if output.done() || end_of_stream {
                probe.output = None;
            }
        }
        if (probe.scanner.is_none() && probe.output.is_none()) || end_of_stream {
            self.usage = None;
        }
    }

    /// Whether the request still holds outstanding work (to release at the end of the stream).
    pub fn holds_outstanding(&self) -> bool {
        self.acquired.is_some() || self.prefill_acquired.is_some()
    }

    /// Releases what this request charged to the outstanding table, once, at the address it
    /// was sent to. Whichever comes first of the answer's end, done and log releases (a
    /// reset, a local reply, an upstream failure all end here); the others find nothing left.
    pub fn release(&mut self, vm: &mut VmState) {
        self.release_prefill(vm);
        let Some(a) = self.acquired.take() else {
            return;
        };
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
