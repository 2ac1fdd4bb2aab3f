//! One HTTP request through the admission filter.

use log::debug;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};

use kvoy_filter_common::{add, now_ms, HostStore};
use kvoy_shared::flow::{classify, Offer, FAIRNESS_HEADERS, OBJECTIVE_HEADERS};
use kvoy_shared::openai_error_body;
use kvoy_shared::RouteError;

use crate::metrics::Metrics;
use crate::{Room, SharedState};

/// Why a request was dropped, on its 429 (and 503).
pub(crate) const DROPPED_REASON_HEADER: &str = "x-kvoy-dropped-reason";
/// The reason on a 503 for a pool with no endpoint.
pub(crate) const NO_ENDPOINT_REASON: &str = "no-endpoint";

/// Answers the current request 429 with `reason` (`saturated`, `queue-full`, `ttl-expired`).
pub(crate) fn reject(metrics: &Metrics, reason: &str) {
    add(metrics.rejected(reason), 1);
    let message = match reason {
        "saturated" => "the pool is saturated and this request is sheddable",
        "queue-full" => "the pool is saturated and the admission queue is full",
        _ => "the request waited in the admission queue longer than its time to live",
    };
    let body = openai_error_body(message, "rate_limit_exceeded", None, Some(reason));
    let _ = hostcalls::send_http_response(
        429,
        vec![
            ("content-type", "application/json"),
            (DROPPED_REASON_HEADER, reason),
        ],
        Some(body.as_bytes()),
    );
}

/// Answers the current request 503: the pool has no endpoint (the reason header says so too).
pub(crate) fn reject_no_endpoint(metrics: &Metrics) {
    add(metrics.rejected_no_endpoint, 1);
    let error = RouteError::NoEndpoint;
    let _ = hostcalls::send_http_response(
        error.status().into(),
        vec![
            ("content-type", "application/json"),
            (DROPPED_REASON_HEADER, NO_ENDPOINT_REASON),
        ],
        Some(error.body().as_bytes()),
    );
}

fn first_header(names: &[&str]) -> Option<String> {
    names.iter().find_map(|n| {
        kvoy_filter_common::header(MapType::HttpRequestHeaders, n).filter(|v| !v.trim().is_empty())
    })
}

pub(crate) struct AdmissionStream {
    state: SharedState,
    id: u32,
    /// Paused in the queue (until released, expired or gone).
    held: bool,
    /// The end of the stream was handled.
    finished: bool,
}

impl AdmissionStream {
    pub fn new(state: SharedState, id: u32) -> Self {
        AdmissionStream {
            state,
            id,
            held: false,
            finished: false,
        }
    }
}

impl Context for AdmissionStream {
    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for AdmissionStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        let Some(vm) = guard.as_mut() else {
            return Action::Continue;
        };
        let objective = first_header(&OBJECTIVE_HEADERS);
        let fairness = first_header(&FAIRNESS_HEADERS);
        let length = first_header(&["content-length"]).and_then(|v| v.trim().parse().ok());
        let saturated = match vm.room() {
            Room::Pool { saturated, .. } => saturated,
            Room::NoEndpoint => {
                reject_no_endpoint(&vm.metrics);
                return Action::Pause;
            }
        };
        let class = classify(
            &vm.config.flow,
            objective.as_deref(),
            fairness.as_deref(),
            length,
        );
        let now = now_ms();
        // Room in the pool, but another worker holds a higher band: that one goes first.
        let saturated = saturated || vm.held.outranked(&HostStore, class.priority, now);
        match vm.queue.offer(u64::from(self.id), &class, now, saturated) {
            Offer::Admit => {
                vm.acquire(self.id);
                add(vm.metrics.admitted, 1);
                Action::Continue
            }
            Offer::Queued => {
                debug!(
                    "kvoy_admission: queued request {} (priority {}, flow {})",
                    self.id, class.priority, class.flow
                );
                self.held = true;
                vm.queued_at.insert(self.id, now);
                add(vm.metrics.queued, 1);
                vm.queue_changed();
                Action::Pause
            }
            Offer::Reject(reason) => {
                reject(&vm.metrics, reason.as_str());
                Action::Pause
            }
        }
    }

    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        self.hold()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A request ending with trailers (HTTP/2, chunked HTTP/1.1) stays held too: the SDK's
        // default would let it go on while it still waits in the queue, uncounted.
        self.hold()
    }

    fn on_log(&mut self) {
        self.finish();
    }
}

impl AdmissionStream {
    /// `Pause` while this request waits in the queue (Envoy would continue it when its body
    /// or trailers arrive), `Continue` otherwise.
    fn hold(&mut self) -> Action {
        if !self.held {
            return Action::Continue;
        }
        let still_held = self
            .state
            .borrow()
            .as_ref()
            .is_some_and(|vm| vm.queue.contains(u64::from(self.id)));
        if still_held {
            Action::Pause
        } else {
            self.held = false;
            Action::Continue
        }
    }

    /// The stream ended (done or log, whichever comes first; the second finds nothing): out
    /// of the queue if still held, its in-flight count released.
    fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        let Some(vm) = guard.as_mut() else {
            return;
        };
        if self.held && vm.queue.remove(u64::from(self.id)) {
            // The client went away while held.
            vm.queued_at.remove(&self.id);
            add(vm.metrics.removed, 1);
            vm.queue_changed();
        }
        vm.release_inflight(self.id);
        // Capacity may have freed: release the next held requests now, not at the next tick.
        vm.release_held();
    }
}
