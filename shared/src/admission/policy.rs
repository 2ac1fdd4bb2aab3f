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
    /// The pool's saturation (every band waits), whether sheddable requests must stop
    /// ([`super::Saturation::sheddable_saturated`]), and how many held requests may be
    /// released into it.
    Pool {
        saturated: bool,
        sheddable_saturated: bool,
        capacity: u32,
    },
    /// The aggregator's pool has no endpoint the proxy may route to: answer 503.
    NoEndpoint,
}

/// The pool as this proxy knows it, for [`Room::measure`].
#[derive(Clone, Copy, Debug)]
pub enum PoolState<'a> {
    /// The aggregator's fresh snapshot, cut to the endpoints the proxy may route to;
    /// `with_loads`: it carries the servers' queues and KV use; `unseen`: how many more
    /// requests this proxy has in flight than when that snapshot arrived (admitted since,
    /// less those finished), which its figures cannot show yet.
    Live {
        endpoints: &'a [EndpointStatus],
        with_loads: bool,
        unseen: u32,
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
            unseen,
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
                    sheddable_saturated: sat.sheddable_saturated(
                        &config.flow.saturation,
                        unseen,
                        endpoints.len(),
                    ),
                    capacity: sat.release_capacity(),
                };
            }
        }
        config.spread(inflight, &mut scratch.inflight);
        let sat = saturation_from_inflight(&config.flow, &scratch.inflight, None);
        Room::Pool {
            saturated: sat.saturated,
            // The level here is the share of the operator's own in-flight limit that is used,
            // with nothing unseen: sheddable requests may fill it as the rest do.
            sheddable_saturated: sat.saturated,
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
            Room::Pool {
                sheddable_saturated,
                ..
            } if class.sheddable => sheddable_saturated,
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
            // Bands are released highest first: capping at the held non-sheddable requests
            // leaves the sheddable ones held.
            Room::Pool {
                sheddable_saturated: true,
                capacity,
                ..
            } => capacity.min(self.held_not_sheddable()),
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

    /// Held requests of the bands that are not sheddable (priority >= 0).
    fn held_not_sheddable(&self) -> u32 {
        let held: usize = self
            .queue
            .bands()
            .filter(|b| b.priority >= 0)
            .map(|b| b.requests)
            .sum();
        u32::try_from(held).unwrap_or(u32::MAX)
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
        sheddable_saturated: false,
        capacity: u32::MAX,
    };
    const FULL: Room = Room::Pool {
        saturated: true,
        sheddable_saturated: true,
        capacity: 0,
    };
    /// Over the sheddable level, under saturation.
    const BUSY: Room = Room::Pool {
        saturated: false,
        sheddable_saturated: true,
        capacity: u32::MAX,
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
    fn over_the_sheddable_level_only_sheddable_requests_stop() {
        let cfg = config(r#"{"objectives": {"chat": 5, "batch": -1}, "queue_sheddable": true}"#);
        let mut p = AdmissionPolicy::new(&cfg);
        assert_eq!(arrive(&mut p, &cfg, 1, "chat", BUSY, 0), Arrival::Admit);
        assert_eq!(arrive(&mut p, &cfg, 2, "batch", BUSY, 1), Arrival::Queued);
        assert_eq!(arrive(&mut p, &cfg, 3, "chat", FULL, 2), Arrival::Queued);
        // busy: the chat request goes, the batch one stays held
        let mut out = Release::default();
        p.release(3, BUSY, |_| false, &mut out);
        assert_eq!(out.resume, vec![(3, Some(1))]);
        assert!(p.holds(2));
        p.release(4, FREE, |_| false, &mut out);
        assert_eq!(out.resume, vec![(2, Some(3))]);
        // without queue_sheddable it is refused
        let cfg = config(r#"{"objectives": {"batch": -1}}"#);
        let mut p = AdmissionPolicy::new(&cfg);
        assert_eq!(
            arrive(&mut p, &cfg, 4, "batch", BUSY, 0),
            Arrival::Reject(RejectReason::Saturated)
        );
        assert_eq!(arrive(&mut p, &cfg, 5, "", BUSY, 0), Arrival::Admit);
    }

    #[test]
    fn room_counts_unseen_admissions_against_the_sheddable_level() {
        let cfg = AdmissionFilterConfig::from_json(br#"{"endpoints": 2}"#).unwrap();
        let mut scratch = RoomScratch::default();
        let ep = |slot: u16, waiting: u32| EndpointStatus {
            waiting,
            ..EndpointStatus::ready(slot, ([10, 0, 0, 1], 8000 + slot).into(), &["m"])
        };
        // level (2/5 + 2/5) / 2 = 0.4
        let endpoints = [ep(0, 2), ep(1, 2)];
        let live = |unseen| PoolState::Live {
            endpoints: &endpoints,
            with_loads: true,
            unseen,
        };
        let room = |pool, scratch: &mut RoomScratch| Room::measure(&cfg, pool, 0, scratch);
        assert_eq!(
            room(live(0), &mut scratch),
            Room::Pool {
                saturated: false,
                sheddable_saturated: false,
                capacity: u32::MAX
            }
        );
        // one more request in flight than the snapshot shows: 0.4 + 1 / 10 = 0.5
        assert_eq!(
            room(live(1), &mut scratch),
            Room::Pool {
                saturated: false,
                sheddable_saturated: true,
                capacity: u32::MAX
            }
        );
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
            sheddable_saturated: false,
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
                sheddable_saturated: false,
                capacity: 1
            }
        );
        assert_eq!(
            room(4, PoolState::Static, &mut scratch),
            Room::Pool {
                saturated: true,
                sheddable_saturated: true,
                capacity: 0
            }
        );
        let live = PoolState::Live {
            endpoints: &[],
            with_loads: true,
            unseen: 0,
        };
        assert_eq!(room(0, live, &mut scratch), Room::NoEndpoint);
    }
}
