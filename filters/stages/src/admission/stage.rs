//! One request through the admission stage.

use log::debug;
use proxy_wasm::hostcalls;

use kvoy_filter_common::{add, now_ms, Headers, HostStore};
use kvoy_shared::admission::{classify, Arrival};
use kvoy_shared::prefix_affinity::RouteError;
use kvoy_shared::protocol::openai_error_body;
use kvoy_shared::protocol::{FAIRNESS_HEADERS, OBJECTIVE_HEADERS};

use super::{AdmissionVm, Metrics};

pub use kvoy_shared::protocol::DROPPED_REASON_HEADER;
/// The reason on a 503 for a pool with no endpoint.
pub const NO_ENDPOINT_REASON: &str = "no-endpoint";

/// Answers the current request 429 with `reason` (`saturated`, `queue-full`, `ttl-expired`).
pub fn reject(metrics: &Metrics, reason: &str) {
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
pub fn reject_no_endpoint(metrics: &Metrics) {
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

fn first_header(headers: &impl Headers, names: &[&str]) -> Option<String> {
    names
        .iter()
        .find_map(|n| headers.get(n).filter(|v| !v.trim().is_empty()))
}

/// What the stage made of a request at its headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Admitted (counted in flight): the request goes on.
    Admit,
    /// Held in the queue: pause it until the VM releases it (or answers it).
    Hold,
    /// Answered (429 or 503): pause it, the local reply ends it.
    Replied,
}

/// One request's admission state.
pub struct AdmissionStage {
    id: u32,
    /// Paused in the queue (until released, expired or gone).
    held: bool,
    /// The end of the stream was handled.
    finished: bool,
}

impl AdmissionStage {
    /// The stage of the request whose context is `id`.
    pub fn new(id: u32) -> Self {
        AdmissionStage {
            id,
            held: false,
            finished: false,
        }
    }

    /// Admits, holds or rejects the request.
    pub fn on_request_headers(&mut self, vm: &mut AdmissionVm, headers: &impl Headers) -> Verdict {
        let objective = first_header(headers, &OBJECTIVE_HEADERS);
        let fairness = first_header(headers, &FAIRNESS_HEADERS);
        let length = headers
            .get("content-length")
            .filter(|v| !v.trim().is_empty())
            .and_then(|v| v.trim().parse().ok());
        // A pool with no endpoint is the policy's to answer (Arrival::NoEndpoint).
        let room = vm.room();
        let class = classify(
            &vm.config.flow,
            objective.as_deref(),
            fairness.as_deref(),
            length,
        );
        // The clock is read once, and only if the answer depends on it: an admission into an
        // empty queue, with no other worker on the held board, needs none.
        let mut clock = None;
        let mut now = || *clock.get_or_insert_with(now_ms);
        // The held board is read (and the clock with it) only when another worker is on it.
        let holders = vm.holders_besides_me();
        let board = &mut vm.held;
        let arrival = vm.policy.arrive(
            u64::from(self.id),
            &class,
            room,
            &mut now,
            |priority, now| holders && board.outranked(&HostStore, priority, now()),
        );
        match arrival {
            Arrival::Admit => {
                vm.acquire(self.id);
                add(vm.metrics.admitted, 1);
                Verdict::Admit
            }
            Arrival::Queued => {
                debug!(
                    "kvoy_admission: queued request {} (priority {}, flow {})",
                    self.id, class.priority, class.flow
                );
                self.held = true;
                add(vm.metrics.queued, 1);
                vm.queue_changed();
                Verdict::Hold
            }
            Arrival::Reject(reason) => {
                reject(&vm.metrics, reason.as_str());
                Verdict::Replied
            }
            Arrival::NoEndpoint => {
                reject_no_endpoint(&vm.metrics);
                Verdict::Replied
            }
        }
    }

    /// Whether this request still waits in the queue (its body and trailers must be paused:
    /// Envoy would continue it when they arrive).
    pub fn is_held(&mut self, vm: Option<&AdmissionVm>) -> bool {
        if !self.held {
            return false;
        }
        if vm.is_some_and(|vm| vm.policy.holds(u64::from(self.id))) {
            true
        } else {
            self.held = false;
            false
        }
    }

    /// The stream ended (done or log, whichever comes first; the second finds nothing): out
    /// of the queue if still held, its in-flight count released, and the next held requests
    /// released into the room it leaves (`on_release` as for
    /// [`AdmissionVm::release_held_with`]).
    pub fn finish(&mut self, vm: &mut AdmissionVm, on_release: &mut dyn FnMut(u32) -> bool) {
        if self.finished {
            return;
        }
        self.finished = true;
        if self.held && vm.policy.remove(u64::from(self.id)) {
            // The client went away while held.
            add(vm.metrics.removed, 1);
            vm.queue_changed();
        }
        vm.release_inflight(self.id);
        // Capacity may have freed: release the next held requests now, not at the next tick.
        vm.release_held_with(on_release);
    }
}
