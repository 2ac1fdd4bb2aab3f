//! One HTTP request through the three stages, in one pass.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;

use log::warn;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use kvoy_filter_common::{ClockPass, HeaderCache};
use kvoy_filter_stages::admission::{AdmissionStage, Verdict};
use kvoy_filter_stages::prefix_affinity::{
    request_body, BodyVerdict, HeadersVerdict, PrefixStage, PrefixVm, DESTINATION_HEADER,
    PREFILLER_HEADER,
};
use kvoy_filter_stages::session::SessionStage;
use kvoy_shared::prefix_affinity::RouteError;
use kvoy_shared::request::Api;
use kvoy_shared::session::PIN_HEADER;

use crate::Vm;

/// Where a request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Its headers have not been seen yet.
    Start,
    /// Waiting in the admission queue (its body keeps buffering).
    Held,
    /// Admitted, its body being buffered for the route.
    ReadingBody,
    /// Routed: the destination is set, the request goes on.
    Routed,
    /// Answered by a stage (a local reply ends it): paused for good.
    Replied,
}

/// One request's state in all three stages; the VM's held list shares it while the admission
/// stage holds the request.
pub(crate) struct Request {
    /// The request headers, each read from the host at most once.
    headers: HeaderCache,
    phase: Phase,
    end_of_stream_at_headers: bool,
    /// Bytes of body buffered so far, and whether it is complete.
    body_size: usize,
    body_complete: bool,
    session: Option<SessionStage>,
    /// The session's keys wait for the body (a Responses API request).
    session_reads_body: bool,
    /// The endpoint the session is pinned to (the prefix-affinity stage validates it).
    pin: Option<SocketAddr>,
    admission: Option<AdmissionStage>,
    prefix: PrefixStage,
    finished: bool,
}

impl Request {
    fn new() -> Self {
        Request {
            headers: HeaderCache::new(MapType::HttpRequestHeaders),
            phase: Phase::Start,
            end_of_stream_at_headers: false,
            body_size: 0,
            body_complete: false,
            session: None,
            session_reads_body: false,
            pin: None,
            admission: None,
            prefix: PrefixStage::new(),
            finished: false,
        }
    }
}

/// What a callback should return after a step.
fn action(phase: Phase) -> Action {
    match phase {
        Phase::Routed => Action::Continue,
        Phase::Start | Phase::Held | Phase::ReadingBody | Phase::Replied => Action::Pause,
    }
}

/// Answers 503 a request that cannot be routed now (unreachable in practice: the
/// prefix-affinity stage is always configured, and never busy when a request reaches it): a
/// request never goes on without a destination.
fn unroutable(req: &mut Request) {
    warn!("kvoy: the prefix-affinity stage cannot route this request now; answering 503");
    let err = RouteError::NoEndpoint;
    let _ = hostcalls::send_http_response(
        err.status().into(),
        vec![("content-type", "application/json")],
        Some(err.body().as_bytes()),
    );
    req.phase = Phase::Replied;
}

/// The admission stage let the request go (at its headers, or on release): the prefix-affinity
/// stage takes it, and routes it at once if nothing more is to come.
fn admitted(vm: &Vm, req: &mut Request) {
    let Ok(mut guard) = vm.prefix.try_borrow_mut() else {
        unroutable(req);
        return;
    };
    let Some(prefix) = guard.as_mut() else {
        unroutable(req);
        return;
    };
    let api =
        match req
            .prefix
            .on_request_headers(prefix, &req.headers, req.end_of_stream_at_headers)
        {
            HeadersVerdict::Routed => {
                req.phase = Phase::Routed;
                return;
            }
            HeadersVerdict::Replied => {
                req.phase = Phase::Replied;
                return;
            }
            HeadersVerdict::ReadBody(api) => api,
        };
    if req.end_of_stream_at_headers {
        route(vm, prefix, req, api, 0);
        return;
    }
    req.phase = Phase::ReadingBody;
    // A request released after (some of) its body arrived: that part is checked now.
    if req.body_size > 0 || req.body_complete {
        body(vm, prefix, req);
    }
}

/// The body grew to `req.body_size` (complete if `req.body_complete`), while reading it.
fn body(vm: &Vm, prefix: &mut PrefixVm, req: &mut Request) {
    match req
        .prefix
        .on_request_body(prefix, req.body_size, req.body_complete)
    {
        // Unreachable: the stage reads the body of every request in this phase.
        BodyVerdict::NotReading => unroutable(req),
        BodyVerdict::More => {}
        BodyVerdict::Replied => req.phase = Phase::Replied,
        BodyVerdict::Complete(api) => route(vm, prefix, req, api, req.body_size),
    }
}

/// The body (`size` bytes) is complete: copied in once, parsed once, the session's body keys
/// read from that parse, then routed.
fn route(vm: &Vm, prefix: &mut PrefixVm, req: &mut Request, api: Api, size: usize) {
    let bytes = if size > 0 {
        request_body(size)
    } else {
        Vec::new()
    };
    let parsed = prefix.router.parse(api, &bytes);
    if req.session_reads_body {
        req.session_reads_body = false;
        if let (Some(stage), Ok(guard)) = (req.session.as_mut(), vm.session.try_borrow()) {
            if let Some(session) = guard.as_ref() {
                // As the separate filter: a body over the session's limit, or one that does not
                // parse, just has no body keys.
                let keys = parsed
                    .as_ref()
                    .ok()
                    .filter(|_| SessionStage::reads_body_of(session, size));
                req.pin = stage.pin(
                    session,
                    keys.and_then(|p| p.previous_response_id.as_deref()),
                    keys.and_then(|p| p.conversation.as_deref()),
                );
            }
        }
    }
    let pin = req.pin.map(|p| p.to_string());
    req.phase = if req.prefix.route_parsed(prefix, api, parsed, pin.as_deref()) {
        Phase::Routed
    } else {
        Phase::Replied
    };
}

/// The admission stage releases `context` (its context is effective): route it before it is
/// resumed. `true`: resume it now; `false`: it was answered, or its body is still arriving and
/// the body's end continues it.
pub(crate) fn on_release(vm: &Vm, context: u32) -> bool {
    let held = vm
        .held
        .try_borrow_mut()
        .ok()
        .and_then(|mut held| held.remove(&context));
    // A request the VM does not know (unreachable: every held request is listed) or cannot
    // reach now is never let go unrouted: it is answered 503 instead.
    let Some(mut req) = held.as_ref().and_then(|r| r.try_borrow_mut().ok()) else {
        warn!("kvoy: released request {context} is not held here");
        unroutable(&mut Request::new());
        return false;
    };
    if req.phase != Phase::Held {
        return false;
    }
    admitted(vm, &mut req);
    req.phase == Phase::Routed
}

pub(crate) struct KvoyStream {
    vm: Rc<Vm>,
    id: u32,
    req: Rc<RefCell<Request>>,
}

impl KvoyStream {
    pub fn new(vm: Rc<Vm>, id: u32) -> Self {
        KvoyStream {
            vm,
            id,
            req: Rc::new(RefCell::new(Request::new())),
        }
    }

    /// A body or trailers callback: the body stands at `size` bytes (complete or not).
    fn on_body(&mut self, size: usize, complete: bool) -> Action {
        let vm = self.vm.clone();
        let Ok(mut req) = self.req.try_borrow_mut() else {
            return Action::Pause;
        };
        req.body_size = size;
        req.body_complete |= complete;
        match req.phase {
            Phase::Held => {
                // Still queued, or answered by the VM (its TTL expired, the pool emptied).
                let queued = match (req.admission.as_mut(), vm.admission.try_borrow()) {
                    (Some(stage), Ok(guard)) => stage.is_held(guard.as_ref()),
                    _ => false,
                };
                if !queued {
                    req.phase = Phase::Replied;
                    if let Ok(mut held) = vm.held.try_borrow_mut() {
                        held.remove(&self.id);
                    }
                }
            }
            Phase::ReadingBody => {
                if let Ok(mut guard) = vm.prefix.try_borrow_mut() {
                    if let Some(prefix) = guard.as_mut() {
                        body(&vm, prefix, &mut req);
                    }
                }
            }
            Phase::Start | Phase::Routed | Phase::Replied => {}
        }
        action(req.phase)
    }

    /// The stream ended (done or log, whichever comes first): outstanding work released, out
    /// of the admission queue, its in-flight count released and the next held requests let go.
    fn finish(&mut self) {
        let vm = self.vm.clone();
        let Ok(mut req) = self.req.try_borrow_mut() else {
            return;
        };
        if req.finished {
            return;
        }
        req.finished = true;
        if req.prefix.holds_outstanding() {
            if let Ok(mut guard) = vm.prefix.try_borrow_mut() {
                if let Some(prefix) = guard.as_mut() {
                    req.prefix.release(prefix);
                }
            }
        }
        if let Ok(mut held) = vm.held.try_borrow_mut() {
            held.remove(&self.id);
        }
        if let Some(stage) = req.admission.as_mut() {
            if let Ok(mut guard) = vm.admission.try_borrow_mut() {
                if let Some(admission) = guard.as_mut() {
                    stage.finish(admission, &mut |context| on_release(&vm, context));
                }
            }
        }
    }
}

impl Context for KvoyStream {
    fn on_done(&mut self) -> bool {
        let _clock = ClockPass::begin();
        self.finish();
        true
    }
}

impl HttpContext for KvoyStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let _clock = ClockPass::begin();
        let strip = || {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, DESTINATION_HEADER, None);
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, PREFILLER_HEADER, None);
        };
        let vm = self.vm.clone();
        let Ok(mut guard) = self.req.try_borrow_mut() else {
            strip();
            return Action::Pause;
        };
        let req = &mut *guard;
        // Whatever happens next, the client never chooses the upstream: a destination it sent
        // (any value) is removed; the header map read once tells whether there is one. Nor
        // does kvoy's internal pin header leave the proxy (the session stage's pin is a value
        // here, and a client's is never followed).
        // The prefill endpoint a sidecar would pull KV from is the router's to name too.
        if req.headers.may_contain(DESTINATION_HEADER) || req.headers.may_contain(PREFILLER_HEADER)
        {
            strip();
        }
        if req.headers.may_contain(PIN_HEADER) {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, PIN_HEADER, None);
        }
        req.end_of_stream_at_headers = end_of_stream;
        req.body_complete = end_of_stream;
        if let Ok(session) = vm.session.try_borrow() {
            if let Some(session) = session.as_ref() {
                let mut stage = SessionStage::new();
                req.session_reads_body =
                    stage.on_request_headers(session, &req.headers, end_of_stream);
                if !req.session_reads_body {
                    req.pin = stage.pin(session, None, None);
                }
                req.session = Some(stage);
            }
        }
        if let Ok(mut admission) = vm.admission.try_borrow_mut() {
            if let Some(admission) = admission.as_mut() {
                let mut stage = AdmissionStage::new(self.id);
                let verdict = stage.on_request_headers(admission, &req.headers);
                req.admission = Some(stage);
                match verdict {
                    Verdict::Admit => {}
                    Verdict::Replied => {
                        req.phase = Phase::Replied;
                        return Action::Pause;
                    }
                    Verdict::Hold => {
                        req.phase = Phase::Held;
                        if let Ok(mut held) = vm.held.try_borrow_mut() {
                            held.insert(self.id, self.req.clone());
                        }
                        return Action::Pause;
                    }
                }
            }
        }
        admitted(&vm, req);
        action(req.phase)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let _clock = ClockPass::begin();
        self.on_body(body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let _clock = ClockPass::begin();
        // A request that ends with trailers (HTTP/2, chunked HTTP/1.1): its body is complete
        // now; the body callbacks never saw the end of the stream.
        let size = self.req.try_borrow().map_or(0, |r| r.body_size);
        self.on_body(size, true)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let _clock = ClockPass::begin();
        let vm = self.vm.clone();
        let Ok(mut req) = self.req.try_borrow_mut() else {
            return Action::Continue;
        };
        let served = match (vm.prefix.try_borrow(), req.prefix.routed()) {
            (Ok(guard), true) => guard
                .as_ref()
                .and_then(|prefix| req.prefix.on_response_headers(prefix)),
            _ => None,
        };
        if let (Some(served), Some(stage), Ok(guard)) =
            (served, req.session.as_mut(), vm.session.try_borrow())
        {
            if let Some(session) = guard.as_ref() {
                stage.on_served(session, served, || {
                    kvoy_filter_common::header(MapType::HttpResponseHeaders, ":status")
                        .is_some_and(|s| s.trim() == "200")
                });
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let _clock = ClockPass::begin();
        let vm = self.vm.clone();
        let Ok(mut req) = self.req.try_borrow_mut() else {
            return Action::Continue;
        };
        let session_reads = req
            .session
            .as_ref()
            .is_some_and(SessionStage::reads_response_body);
        let wanted = req.prefix.reads_response_body() || session_reads;
        // The chunk is copied in once, for both stages.
        let chunk = if wanted && body_size > 0 {
            hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
                .ok()
                .flatten()
        } else {
            None
        };
        if let Ok(mut guard) = vm.prefix.try_borrow_mut() {
            if let Some(prefix) = guard.as_mut() {
                req.prefix
                    .on_response_body(prefix, chunk.as_deref(), end_of_stream);
            }
        }
        if session_reads {
            if let (Some(stage), Ok(guard)) = (req.session.as_mut(), vm.session.try_borrow()) {
                if let Some(session) = guard.as_ref() {
                    stage.on_response_chunk(session, chunk.as_deref().unwrap_or_default());
                }
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let _clock = ClockPass::begin();
        self.finish();
    }
}
