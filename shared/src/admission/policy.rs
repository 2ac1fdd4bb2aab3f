//! The admission stage's decisions, apart from the host: when a request is admitted, waits,
//! is shed or answered 503; what a release lets go; and the room the pool has. The filter
//! measures (its in-flight counts, the held board, the clock) and carries out the answers
//! (counting in flight, resuming, replying).

use fnv::FnvHashMap;

use super::config::AdmissionConfig;
use super::filter_config::AdmissionFilterConfig;
use super::saturation::{saturation, saturation_from_inflight};
use super::{Class, FlowQueue, Offer, RejectReason};
use crate::snapshot::EndpointStatus;

/// What the pool has room for, at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Room {
    /// The pool's saturation and how many held requests may be released into it.
    Pool { saturated: bool, capacity: u32 },
    /// The aggregator's pool has no endpoint the proxy may route to: answer 503.
    NoEndpoint,
}

/// The pool as this proxy knows it, for [`Room::measure`].
#[derive(Clone, Copy, Debug)]
pub enum PoolState<'a> {
    /// The aggregator's fresh snapshot, cut to the endpoints the proxy may route to;
    /// `with_loads`: it carries the servers' queues and KV use.
    Live {
        endpoints: &'a [EndpointStatus],
        with_loads: bool,
    },
    /// No (fresh) snapshot: the configured static pool.
    Static,
}

/// Scratch space for [`Room::measure`], kept by the caller so that measuring allocates nothing
/// once warm.
#[derive(Clone, Debug, Default)]
pub struct RoomScratch {
    inflight: Vec<u32>,
    slots: Vec<u16>,
}

impl Room {
    /// The room in `pool` for this proxy's `inflight` requests (across workers): from the
    /// servers' queues and KV use when the snapshot carries them (this proxy's in-flight
    /// count spread over the endpoints, against the per-endpoint limit), else from the
    /// in-flight count alone against the configured endpoints. A live pool with no endpoint
    /// is [`Room::NoEndpoint`].
    pub fn measure(
        config: &AdmissionFilterConfig,
        pool: PoolState<'_>,
        inflight: u32,
        scratch: &mut RoomScratch,
    ) -> Room {
        if let PoolState::Live {
            endpoints,
            with_loads,
        } = pool
        {
            if endpoints.is_empty() {
                return Room::NoEndpoint;
            }
            if with_loads {
                scratch.slots.clear();
                scratch.slots.extend(endpoints.iter().map(|e| e.slot));
                AdmissionFilterConfig::spread_by_slot(
                    inflight,
                    &scratch.slots,
                    &mut scratch.inflight,
                );
                let sat = saturation(&config.flow, endpoints, &scratch.inflight, None);
                return Room::Pool {
                    saturated: sat.saturated,
                    capacity: sat.release_capacity(),
                };
            }
        }
        config.spread(inflight, &mut scratch.inflight);
        let sat = saturation_from_inflight(&config.flow, &scratch.inflight, None);
        Room::Pool {
            saturated: sat.saturated,
            capacity: sat.release_capacity(),
        }
    }
}

/// What becomes of a request at its headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// It goes on now (the caller counts it in flight).
    Admit,
    /// It waits in the queue until a release names it.
    Queued,
    /// Shed: answer 429 with the reason.
    Reject(RejectReason),
    /// The pool has no endpoint: answer 503.
    NoEndpoint,
}

/// What one release pass decided. Ids are the callers' request ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Release {
    /// Resume these (count them in flight first), with how long each waited, in ms.
    pub resume: Vec<(u64, Option<u64>)>,
    /// Answer these 503: the pool has no endpoint (they would only wait out their TTL).
    pub no_endpoint: Vec<u64>,
    /// Answer these 429: they waited longer than the queue's TTL.
    pub expired: Vec<u64>,
    released: Vec<u64>,
}

impl Release {
    /// Whether the pass let anything go or answered anything.
    pub fn is_empty(&self) -> bool {
        self.resume.is_empty() && self.no_endpoint.is_empty() && self.expired.is_empty()
    }
}

/// One worker's admission: its queue of held requests and when each was queued.
#[derive(Debug)]
pub struct AdmissionPolicy {
    queue: FlowQueue,
    queued_at: FnvHashMap<u64, u64>,
}

impl AdmissionPolicy {
    pub fn new(config: &AdmissionConfig) -> Self {
        AdmissionPolicy {
            queue: FlowQueue::new(config),
            queued_at: FnvHashMap::default(),
        }
    }

    /// The held requests.
    pub fn queue(&self) -> &FlowQueue {
        &self.queue
    }

    /// Whether nothing is held (a release has nothing to do, and need not measure the room).
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether request `id` is still held.
    pub fn holds(&self, id: u64) -> bool {
        self.queue.contains(id)
    }

    /// Request `id` of `class` arrives while the pool has `room`. `outranked(priority, now)`:
    /// whether another worker holds a request of a higher band (strict priority across
    /// workers: the request then counts the pool as saturated, that one goes first). `now` is
    /// the clock, asked for only when the answer depends on it.
    pub fn arrive(
        &mut self,
        id: u64,
        class: &Class<'_>,
        room: Room,
        now: &mut dyn FnMut() -> u64,
        outranked: impl FnOnce(i32, &mut dyn FnMut() -> u64) -> bool,
    ) -> Arrival {
        let saturated = match room {
            Room::Pool { saturated, .. } => saturated,
            Room::NoEndpoint => return Arrival::NoEndpoint,
        };
        let saturated = saturated || outranked(class.priority, now);
        if self.queue.admits_at_once(saturated) {
            return Arrival::Admit;
        }
        match self.queue.offer(id, class, now(), saturated) {
            Offer::Admit => Arrival::Admit,
            Offer::Queued => {
                self.queued_at.insert(id, now());
                Arrival::Queued
            }
            Offer::Reject(reason) => Arrival::Reject(reason),
        }
    }

    /// Lets go what `room` allows at `now` and expires what waited too long, into `out`
    /// (cleared first). `outranked(priority)`: whether another worker holds a band above this
    /// worker's highest; then nothing is released here (that worker releases first, at its
    /// next tick), though expiry still runs. With no endpoint, every held request is answered
    /// 503 rather than left to its TTL.
    pub fn release(
        &mut self,
        now: u64,
        room: Room,
        outranked: impl FnOnce(i32) -> bool,
        out: &mut Release,
    ) {
        out.resume.clear();
        out.no_endpoint.clear();
        out.expired.clear();
        out.released.clear();
        if self.queue.is_empty() {
            return;
        }
        let capacity = match room {
            Room::Pool { .. } if self.queue.highest_waiting_priority().is_some_and(outranked) => 0,
            Room::Pool { capacity, .. } => capacity,
            Room::NoEndpoint => u32::MAX,
        };
        let mut released = std::mem::take(&mut out.released);
        self.queue
            .release(now, capacity, &mut released, &mut out.expired);
        for &id in &released {
            let queued_at = self.queued_at.remove(&id);
            if room == Room::NoEndpoint {
                out.no_endpoint.push(id);
            } else {
                out.resume
                    .push((id, queued_at.map(|at| now.saturating_sub(at))));
            }
        }
        for id in &out.expired {
            self.queued_at.remove(id);
        }
        out.released = released;
    }

    /// Request `id`'s client went away: `true` if it was held (and is no longer).
    pub fn remove(&mut self, id: u64) -> bool {
        self.queued_at.remove(&id);
        self.queue.remove(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::classify;

    fn config(json: &str) -> AdmissionConfig {
        AdmissionConfig::from_json(json.as_bytes()).unwrap()
    }

    const FREE: Room = Room::Pool {
        saturated: false,
        capacity: u32::MAX,
    };
    const FULL: Room = Room::Pool {
        saturated: true,
        capacity: 0,
    };

    fn arrive(
        p: &mut AdmissionPolicy,
        cfg: &AdmissionConfig,
        id: u64,
        objective: &str,
        room: Room,
        at: u64,
    ) -> Arrival {
        let class = classify(cfg, Some(objective), None, Some(100));
        p.arrive(id, &class, room, &mut || at, |_, _| false)
    }

    #[test]
    fn a_request_waits_only_when_the_pool_is_saturated() {
        let cfg = config(r#"{"objectives": {"chat": 5, "batch": -1}}"#);
        let mut p = AdmissionPolicy::new(&cfg);
        assert_eq!(arrive(&mut p, &cfg, 1, "chat", FREE, 0), Arrival::Admit);
        assert_eq!(arrive(&mut p, &cfg, 2, "chat", FULL, 1), Arrival::Queued);
        // sheddable (negative priority) requests are shed, not queued, by default
        assert_eq!(
            arrive(&mut p, &cfg, 3, "batch", FULL, 2),
            Arrival::Reject(RejectReason::Saturated)
        );
        // while one waits, a newcomer does not overtake it even with room
        assert_eq!(arrive(&mut p, &cfg, 4, "chat", FREE, 3), Arrival::Queued);
        assert_eq!(
            arrive(&mut p, &cfg, 5, "chat", Room::NoEndpoint, 4),
            Arrival::NoEndpoint
        );
        assert!(p.holds(2) && p.holds(4) && !p.holds(5));
    }

    #[test]
    fn a_higher_band_on_another_worker_holds_this_one_back() {
        let cfg = config(r#"{"objectives": {"chat": 5}}"#);
        let mut p = AdmissionPolicy::new(&cfg);
        let class = classify(&cfg, Some("chat"), None, Some(100));
        let mut asked = None;
        let arrival = p.arrive(1, &class, FREE, &mut || 7, |priority, now| {
            asked = Some((priority, now()));
            true
        });
        assert_eq!((arrival, asked), (Arrival::Queued, Some((5, 7))));
        // nor is it released while the other worker outranks it, though it expires on time
        let mut out = Release::default();
        p.release(8, FREE, |_| true, &mut out);
        assert!(out.is_empty() && p.holds(1));
        p.release(9, FREE, |mine| mine < 5, &mut out);
        assert_eq!(out.resume, vec![(1, Some(2))]);
    }

    #[test]
    fn release_resumes_what_fits_answers_503_without_endpoints_and_expires_late_ones() {
        let cfg = config(r#"{"queue_ttl_ms": 100}"#);
        let mut p = AdmissionPolicy::new(&cfg);
        for id in 1..=3 {
            assert_eq!(arrive(&mut p, &cfg, id, "", FULL, id * 10), Arrival::Queued);
        }
        let mut out = Release::default();
        let one = Room::Pool {
            saturated: false,
            capacity: 1,
        };
        p.release(50, one, |_| false, &mut out);
        assert_eq!(
            (out.resume.clone(), out.expired.len()),
            (vec![(1, Some(40))], 0)
        );
        // past request 2's TTL (queued at 20): it expires, 3 is answered 503
        p.release(125, Room::NoEndpoint, |_| false, &mut out);
        assert_eq!(
            (out.expired.clone(), out.no_endpoint.clone()),
            (vec![2], vec![3])
        );
        assert!(out.resume.is_empty() && p.is_empty());
        // a client that leaves while held is removed once
        assert_eq!(arrive(&mut p, &cfg, 4, "", FULL, 200), Arrival::Queued);
        assert!(p.remove(4) && !p.remove(4) && p.is_empty());
    }

    #[test]
    fn room_from_a_live_pool_or_the_static_one() {
        let cfg = AdmissionFilterConfig::from_json(
            br#"{"endpoints": 2, "flow": {"saturation": {"max_inflight_per_endpoint": 2}}}"#,
        )
        .unwrap();
        let mut scratch = RoomScratch::default();
        let room = |inflight, pool, scratch: &mut RoomScratch| {
            Room::measure(&cfg, pool, inflight, scratch)
        };
        assert_eq!(
            room(3, PoolState::Static, &mut scratch),
            Room::Pool {
                saturated: false,
                capacity: 1
            }
        );
        assert_eq!(
            room(4, PoolState::Static, &mut scratch),
            Room::Pool {
                saturated: true,
                capacity: 0
            }
        );
        let live = PoolState::Live {
            endpoints: &[],
            with_loads: true,
        };
        assert_eq!(room(0, live, &mut scratch), Room::NoEndpoint);
    }
}
