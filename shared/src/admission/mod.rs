//! Flow control for the `kvoy_admission` filter: priority bands and fair share when the pool
//! saturates. Pure: the filter passes the time, the pool state and its own in-flight counts.
//!
//! Per request, at the request headers: [`classify`] the request (objective -> priority band,
//! fairness id -> flow), compute [`saturation`] (or [`saturation_from_inflight`] for a static
//! pool), and [`FlowQueue::offer`] it. [`Offer::Admit`] continues; [`Offer::Reject`] answers
//! 429 with [`RejectReason::as_str`]; [`Offer::Queued`] pauses the request (at its body
//! callbacks too). On every tick and whenever a request of this proxy completes, the filter
//! calls [`FlowQueue::release`] with [`Saturation::release_capacity`] and resumes the ids it
//! names, answering 429 [`EXPIRED_REASON`] to those that expired; when a held client goes
//! away it calls [`FlowQueue::remove`]. [`AdmissionPolicy`] is that sequence as one type, with
//! [`Room::measure`] for the pool's room: the filter measures and carries out its answers.
//!
//! ```
//! use kvoy_shared::admission::{classify, saturation_from_inflight, AdmissionConfig, FlowQueue, Offer};
//! let cfg = AdmissionConfig::from_json(br#"{
//!     "objectives": {"interactive": 10, "batch": -1},
//!     "saturation": {"max_inflight_per_endpoint": 1},
//!     "queue_sheddable": true
//! }"#).unwrap();
//! let mut queue = FlowQueue::new(&cfg);
//! let mut inflight = vec![0u32; 2]; // this proxy's requests per endpoint
//! let offer = |q: &mut FlowQueue, inflight: &[u32], id, objective: &str, now| {
//!     let class = classify(&cfg, Some(objective), Some("tenant-a"), Some(1000));
//!     let sat = saturation_from_inflight(&cfg, inflight, None);
//!     q.offer(id, &class, now, sat.saturated)
//! };
//! assert_eq!(offer(&mut queue, &inflight, 1, "batch", 0), Offer::Admit);
//! inflight[0] = 1;
//! assert_eq!(offer(&mut queue, &inflight, 2, "interactive", 1), Offer::Admit);
//! inflight[1] = 1;
//! // the pool is full: both wait, the interactive one is released first
//! assert_eq!(offer(&mut queue, &inflight, 3, "batch", 2), Offer::Queued);
//! assert_eq!(offer(&mut queue, &inflight, 4, "interactive", 3), Offer::Queued);
//! inflight[0] = 0; // request 1 completed
//! let capacity = saturation_from_inflight(&cfg, &inflight, None).release_capacity();
//! let (mut released, mut expired) = (Vec::new(), Vec::new());
//! queue.release(4, capacity, &mut released, &mut expired);
//! assert_eq!((released, expired, queue.len()), (vec![4], vec![], 1));
//! ```
//!
//! # Two levels
//!
//! Every band waits from a pool level of 1.0 (the reference's saturation); sheddable
//! requests (priority < 0) stop earlier, at `saturation.sheddable_level` (0.5 by default),
//! counting the requests this proxy admitted since the servers' figures were scraped
//! ([`UnseenInflight`]). The headroom is what keeps interactive traffic inside its SLO when
//! the pool saturates: the servers' queues lag admission by a scrape, and a pool that
//! admits sheddable work up to 1.0 is already past it for the interactive requests behind.
//! With `sheddable_level: 1.0` the rule is the reference's (llm-d's legacy admission sheds
//! sheddable requests at 1.0 and lets the rest through). A static pool's level is the share
//! of the operator's in-flight limit in use, exact and not lagging: there sheddable requests
//! stop with the rest.
//!
//! # One queue per worker
//!
//! A paused request can only be resumed by the VM (worker thread) that paused it, so each VM
//! has its own `FlowQueue`, while the capacity it releases into (the pool's saturation, the
//! in-flight counts in shared data) is global. What follows for fairness:
//!
//! - Strict priority between bands holds across the workers, at most one tick late: each
//!   worker publishes the highest band it holds on a [`HeldBoard`] in shared data, and a
//!   worker neither admits nor releases a request while another holds a higher band (that one
//!   releases its own at its next tick). Entries not refreshed within ten ticks (at least
//!   250 ms) are ignored, so a stuck worker blocks no one for long.
//! - Round-robin between flows and FCFS/EDF inside a flow hold *within* one worker only.
//!   Across workers they hold statistically, in as much as Envoy spreads connections evenly:
//!   a flow whose connections all land on one worker gets that worker's share, not the
//!   proxy's, and two workers holding the same band release into free capacity in whatever
//!   order their ticks and completions come.
//! - Every worker that sees free capacity releases into it: N workers may together release up
//!   to N times the free slots before the shared in-flight counts catch up. An in-flight
//!   limit per endpoint bounds the overshoot; without one, a release on a non-saturated pool
//!   lets everything go, and the saturation level only reacts at the next metrics scrape.
//! - Caps (`band_max_requests`, `max_requests`, ...) and the TTL are per worker: a proxy with
//!   N workers holds up to N times `max_requests`.
//! - Across proxy replicas nothing is coordinated at all; the pool's saturation is the only
//!   shared signal.
//!
//! Fairness is by request count, not by tokens or bytes, and the band caps are shared by the
//! band's flows: a flow that floods a band can fill its cap and get other flows' requests
//! rejected as `queue-full`, while the round-robin still gives each backlogged flow an equal
//! share of what is released.

mod band;
mod classify;
mod config;
mod filter_config;
mod held;
mod policy;
mod queue;
mod saturation;

pub use classify::{classify, flow_id, Class, DEFAULT_FLOW, MAX_FLOW_BYTES};
pub use config::{
    AdmissionConfig, AdmissionConfigError, Fairness, FlowOrdering, SaturationThresholds,
    MAX_OBJECTIVES, MAX_OBJECTIVE_NAME_BYTES, MAX_QUEUED,
};
pub use filter_config::AdmissionFilterConfig;
pub use held::{HeldBoard, MAX_WORKERS};
pub use policy::{AdmissionPolicy, Arrival, PoolState, Release, Room, RoomScratch};
pub use queue::{BandStats, FlowQueue, Offer, RejectReason, EXPIRED_REASON};
pub use saturation::{
    endpoint_fullness, pool_level, saturation, saturation_from_inflight, Saturation, UnseenInflight,
};

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
