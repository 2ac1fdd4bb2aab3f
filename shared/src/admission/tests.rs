//! Scenario tests of the admission core: release order, caps, TTL, shedding, and a
//! virtual-clock simulation of a saturated pool.

use std::collections::HashMap;

use super::*;
use crate::Rng;

fn config(json: &str) -> AdmissionConfig {
    AdmissionConfig::from_json(json.as_bytes()).unwrap()
}

fn class(priority: i32, flow: &str, bytes: u64) -> Class<'_> {
    Class {
        priority,
        flow,
        bytes,
        sheddable: priority < 0,
        deadline_ms: None,
    }
}

/// Releases up to `capacity` at `now`; panics if anything expires.
fn release(q: &mut FlowQueue, now: u64, capacity: u32) -> Vec<u64> {
    let (mut out, mut expired) = (Vec::new(), Vec::new());
    q.release(now, capacity, &mut out, &mut expired);
    assert!(expired.is_empty(), "expired {expired:?}");
    out
}

#[test]
fn strict_priority_between_bands() {
    let mut q = FlowQueue::new(&config(r#"{"queue_sheddable":true}"#));
    for (id, p) in [(1, 0), (2, -3), (3, 7), (4, 0), (5, 7), (6, 100)] {
        assert_eq!(q.offer(id, &class(p, "f", 1), id, true), Offer::Queued);
    }
    let order: Vec<i32> = q.bands().map(|b| b.priority).collect();
    assert_eq!(order, [100, 7, 0, -3]);
    assert_eq!(release(&mut q, 10, 3), [6, 3, 5]);
    assert_eq!(release(&mut q, 10, 10), [1, 4, 2]);
    assert!(q.is_empty());
    assert_eq!(release(&mut q, 10, 10), Vec::<u64>::new());
    assert_eq!(release(&mut q, 10, 0), Vec::<u64>::new());
}

#[test]
fn round_robin_across_flows_continues_where_it_left_off() {
    let mut q = FlowQueue::new(&config("{}"));
    let arrivals = [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "c"), (6, "c")];
    for (id, f) in arrivals {
        assert_eq!(q.offer(id, &class(0, f, 1), id, true), Offer::Queued);
    }
    assert_eq!(q.flow_count(), 3);
    assert_eq!(release(&mut q, 10, 2), [1, 4]);
    // a new flow joins at the back of the rotation
    assert_eq!(q.offer(7, &class(0, "d", 1), 11, true), Offer::Queued);
    assert_eq!(release(&mut q, 12, 2), [5, 2]);
    assert_eq!(release(&mut q, 13, 10), [7, 6, 3]);
}

#[test]
fn fcfs_fairness_is_one_queue_per_band() {
    let mut q = FlowQueue::new(&config(r#"{"fairness":"fcfs"}"#));
    for (id, f) in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "c")] {
        q.offer(id, &class(0, f, 1), id, true);
    }
    assert_eq!(q.bands().next().map(|b| b.flows), Some(1));
    assert_eq!(release(&mut q, 10, 10), [1, 2, 3, 4, 5]);
}

#[test]
fn edf_orders_a_flow_by_deadline() {
    let mut q = FlowQueue::new(&config(r#"{"ordering":"edf","queue_ttl_ms":1000}"#));
    let with_deadline = |deadline| Class {
        deadline_ms: Some(deadline),
        ..class(0, "a", 1)
    };
    q.offer(1, &class(0, "a", 1), 0, true); // due at 1000
    q.offer(2, &with_deadline(500), 10, true);
    q.offer(3, &with_deadline(5000), 20, true); // capped by the TTL: due at 1020
    q.offer(4, &with_deadline(200), 30, true);
    assert_eq!(release(&mut q, 40, 10), [4, 2, 1, 3]);
    // FCFS ignores deadlines for the order, but they still expire the request
    let mut q = FlowQueue::new(&config(r#"{"queue_ttl_ms":1000}"#));
    q.offer(1, &class(0, "a", 1), 0, true);
    q.offer(2, &with_deadline(50), 10, true);
    let mut expired = Vec::new();
    q.expire(49, &mut expired);
    assert!(expired.is_empty());
    q.expire(50, &mut expired);
    assert_eq!(expired, [2]);
    assert_eq!(release(&mut q, 60, 10), [1]);
}

#[test]
fn ttl_expiry() {
    let mut q = FlowQueue::new(&config(r#"{"queue_ttl_ms":1000}"#));
    q.offer(1, &class(0, "a", 5), 0, true);
    q.offer(2, &class(0, "b", 5), 500, true);
    q.offer(3, &class(9, "a", 5), 700, true);
    let mut expired = Vec::new();
    q.expire(999, &mut expired);
    assert!(expired.is_empty());
    assert_eq!(q.oldest_wait_ms(999), Some(999));
    q.expire(1000, &mut expired);
    assert_eq!(expired, [1], "queued for the whole TTL");
    assert_eq!((q.len(), q.bytes()), (2, 10));
    // release expires first: request 2 is never dispatched late
    let (mut out, mut expired) = (Vec::new(), Vec::new());
    q.release(1600, 10, &mut out, &mut expired);
    assert_eq!((out, expired), (vec![3], vec![2]));
    assert!(q.is_empty());
}

#[test]
fn band_caps_in_requests_and_bytes() {
    let cfg = config(r#"{"band_max_requests":2,"band_max_bytes":100}"#);
    let mut q = FlowQueue::new(&cfg);
    assert_eq!(q.offer(1, &class(0, "a", 10), 0, true), Offer::Queued);
    assert_eq!(q.offer(2, &class(0, "b", 10), 0, true), Offer::Queued);
    let full = Offer::Reject(RejectReason::QueueFull);
    assert_eq!(q.offer(3, &class(0, "c", 10), 0, true), full);
    assert_eq!(q.offer(4, &class(1, "c", 60), 0, true), Offer::Queued);
    assert_eq!(q.offer(5, &class(1, "c", 41), 0, true), full, "101 bytes");
    assert_eq!(q.offer(6, &class(1, "c", 40), 0, true), Offer::Queued);
    assert_eq!(
        q.offer(7, &class(2, "c", 101), 0, true),
        full,
        "alone too big"
    );
    // a freed place can be taken again
    assert!(q.remove(1));
    assert_eq!(q.offer(3, &class(0, "c", 10), 0, true), Offer::Queued);
    // the caps only bind when a request has to wait
    assert_eq!(q.offer(8, &class(5, "c", 1 << 40), 0, false), Offer::Admit);
}

#[test]
fn global_cap() {
    let mut q = FlowQueue::new(&config(r#"{"max_requests":3}"#));
    for (id, p) in [(1, 0), (2, 1), (3, 2)] {
        assert_eq!(q.offer(id, &class(p, "a", 1), 0, true), Offer::Queued);
    }
    let full = Offer::Reject(RejectReason::QueueFull);
    assert_eq!(q.offer(4, &class(3, "a", 1), 0, true), full);
    assert_eq!(q.offer(5, &class(0, "z", 0), 0, true), full);
    assert_eq!(release(&mut q, 1, 1), [3]);
    assert_eq!(q.offer(4, &class(3, "a", 1), 0, true), Offer::Queued);
}

#[test]
fn sheddable_requests_when_saturated() {
    let mut q = FlowQueue::new(&config("{}"));
    let shed = Offer::Reject(RejectReason::Saturated);
    assert_eq!(q.offer(1, &class(-1, "a", 1), 0, true), shed);
    assert!(q.is_empty());
    assert_eq!(q.offer(2, &class(-1, "a", 1), 0, false), Offer::Admit);
    assert_eq!(q.offer(3, &class(-1, "a", 1), 0, true), shed);
    assert_eq!(q.offer(4, &class(0, "a", 1), 0, true), Offer::Queued);
    // not saturated but behind a queued higher band: it waits, it is not shed
    assert_eq!(q.offer(5, &class(-1, "a", 1), 0, false), Offer::Queued);
    let mut q = FlowQueue::new(&config(r#"{"queue_sheddable":true}"#));
    assert_eq!(q.offer(1, &class(-1, "a", 1), 0, true), Offer::Queued);
    assert_eq!(q.offer(2, &class(0, "a", 1), 0, true), Offer::Queued);
    assert_eq!(release(&mut q, 1, 2), [2, 1], "sheddable goes last");
}

#[test]
fn reconfigure_keeps_what_is_queued() {
    let mut q = FlowQueue::new(&config("{}"));
    for id in 1..=4 {
        q.offer(id, &class(0, "a", 1), id, true);
    }
    q.reconfigure(&config(r#"{"max_requests":2,"fairness":"fcfs"}"#));
    assert_eq!(q.len(), 4);
    assert_eq!(
        q.offer(5, &class(0, "b", 1), 5, true),
        Offer::Reject(RejectReason::QueueFull)
    );
    assert_eq!(release(&mut q, 6, 10), [1, 2, 3, 4]);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Dispatched,
    Rejected,
    Expired,
    Removed,
}

#[test]
fn a_burst_of_ten_thousand_ends_exactly_once() {
    let mut q = FlowQueue::new(&config(r#"{"queue_ttl_ms":5000}"#));
    let mut rng = Rng::new(42);
    let flows = ["a", "b", "c", "d", "e", "f", "g"];
    let mut ends: HashMap<u64, End> = HashMap::new();
    let mut end = |id: u64, how: End| assert!(ends.insert(id, how).is_none(), "{id} twice");
    let (mut out, mut expired) = (Vec::new(), Vec::new());
    for id in 0..10_000u64 {
        let now = id / 10; // 10 requests per ms
        let priority = [-1, 0, 0, 5][rng.below(4)];
        let flow = flows[rng.below(flows.len())];
        let c = class(priority, flow, rng.below(1 << 20) as u64);
        match q.offer(id, &c, now, rng.below(10) != 0) {
            Offer::Admit => end(id, End::Dispatched),
            Offer::Reject(_) => end(id, End::Rejected),
            Offer::Queued => {}
        }
        if rng.below(20) == 0 {
            let victim = id.saturating_sub(rng.below(500) as u64);
            if q.remove(victim) {
                end(victim, End::Removed);
            }
        }
        if rng.below(50) == 0 {
            q.release(now, rng.below(30) as u32, &mut out, &mut expired);
        }
        for id in out.drain(..) {
            end(id, End::Dispatched);
        }
        for id in expired.drain(..) {
            end(id, End::Expired);
        }
    }
    assert!(q.len() > 1000, "the burst backs up: {}", q.len());
    // drain: half released, the rest expires
    let mut now = 1000;
    while !q.is_empty() {
        now += 100;
        q.release(now, 40, &mut out, &mut expired);
        for id in out.drain(..) {
            end(id, End::Dispatched);
        }
        for id in expired.drain(..) {
            end(id, End::Expired);
        }
    }
    assert_eq!(ends.len(), 10_000);
    let count = |how| ends.values().filter(|&&e| e == how).count();
    for how in [End::Dispatched, End::Rejected, End::Expired, End::Removed] {
        assert!(count(how) > 0, "{how:?}");
    }
    assert_eq!((q.len(), q.bytes(), q.flow_count()), (0, 0, 0));
    assert_eq!(q.bands().count(), 0);
}

/// A pool of `capacity` concurrent slots, each request taking `service_ms`, fed by periodic
/// arrivals; saturation comes from the in-flight count. One step per virtual millisecond.
struct Sim {
    cfg: AdmissionConfig,
    queue: FlowQueue,
    service_ms: u64,
    running: Vec<u64>,
    /// id -> (source, arrival)
    waiting: HashMap<u64, (usize, u64)>,
    served: Vec<u64>,
    waits: Vec<Vec<u64>>,
    next_id: u64,
}

impl Sim {
    fn new(json: &str, sources: usize, service_ms: u64) -> Self {
        let cfg = config(json);
        Sim {
            queue: FlowQueue::new(&cfg),
            cfg,
            service_ms,
            running: Vec::new(),
            waiting: HashMap::new(),
            served: vec![0; sources],
            waits: vec![Vec::new(); sources],
            next_id: 0,
        }
    }

    fn saturation(&self) -> Saturation {
        saturation_from_inflight(&self.cfg, &[self.running.len() as u32], None)
    }

    fn start(&mut self, source: usize, waited: u64, now: u64) {
        self.running.push(now + self.service_ms);
        self.served[source] += 1;
        self.waits[source].push(waited);
    }

    /// One millisecond: completions, then `arrivals` (source, class), then releases.
    fn step(&mut self, now: u64, arrivals: &[(usize, Class<'_>)]) {
        self.running.retain(|&end| end > now);
        for &(source, c) in arrivals {
            let id = self.next_id;
            self.next_id += 1;
            match self.queue.offer(id, &c, now, self.saturation().saturated) {
                Offer::Admit => self.start(source, 0, now),
                Offer::Queued => {
                    self.waiting.insert(id, (source, now));
                }
                Offer::Reject(r) => panic!("rejected {r:?}"),
            }
        }
        let (mut out, mut expired) = (Vec::new(), Vec::new());
        let capacity = self.saturation().release_capacity();
        self.queue.release(now, capacity, &mut out, &mut expired);
        assert!(expired.is_empty());
        for id in out {
            let (source, arrival) = self.waiting.remove(&id).unwrap();
            self.start(source, now - arrival, now);
        }
    }

    fn backlogged(&self, source: usize) -> bool {
        self.waiting.values().any(|&(s, _)| s == source)
    }
}

/// Two flows in one band offer 10:1 to a pool of 8 slots x 100 ms (80/s): 500/s and 50/s,
/// both above the fair share of 40/s. Returns the served counts from 1 s on, while both are
/// backlogged.
fn two_flows(fairness: &str) -> (u64, u64) {
    let json = format!(
        r#"{{"saturation":{{"max_inflight_per_endpoint":8}},"fairness":"{fairness}",
            "band_max_requests":100000,"max_requests":100000}}"#
    );
    let mut sim = Sim::new(&json, 2, 100);
    let mut at_warmup = (0, 0);
    for now in 0..6_000u64 {
        let mut arrivals = Vec::new();
        if now % 2 == 0 {
            arrivals.push((0, class(0, "bulk", 100)));
        }
        if now % 20 == 0 {
            arrivals.push((1, class(0, "interactive", 100)));
        }
        sim.step(now, &arrivals);
        if now == 1_000 {
            at_warmup = (sim.served[0], sim.served[1]);
        }
        if now >= 1_000 {
            assert!(sim.backlogged(0) && sim.backlogged(1), "at {now} ms");
        }
    }
    (sim.served[0] - at_warmup.0, sim.served[1] - at_warmup.1)
}

#[test]
fn simulation_fair_share_between_two_flows() {
    let (bulk, interactive) = two_flows("round_robin");
    // 5 s at 80/s: 400 served, half each
    assert!(bulk + interactive >= 390, "{bulk} + {interactive}");
    let diff = bulk.abs_diff(interactive) as f64;
    assert!(
        diff <= 0.1 * bulk.max(interactive) as f64,
        "bulk {bulk} vs interactive {interactive}"
    );
    // without fairness the heavy flow takes almost everything
    let (bulk, interactive) = two_flows("fcfs");
    assert!(bulk > 5 * interactive, "fcfs: {bulk} vs {interactive}");
}

fn percentile(waits: &[u64], p: f64) -> u64 {
    let mut w = waits.to_vec();
    w.sort_unstable();
    let i = ((w.len() as f64 - 1.0) * p).round() as usize;
    w[i]
}

#[test]
fn simulation_high_band_waits_less_than_low_band() {
    // 80/s of capacity; high priority 25/s, low priority 100/s
    let mut sim = Sim::new(
        r#"{"objectives":{"high":10,"low":0},
            "saturation":{"max_inflight_per_endpoint":8}}"#,
        2,
        100,
    );
    let cfg = sim.cfg.clone();
    for now in 0..10_000u64 {
        let mut arrivals = Vec::new();
        if now % 40 == 0 {
            arrivals.push((0, classify(&cfg, Some("high"), Some("h"), Some(10))));
        }
        if now % 10 == 5 {
            arrivals.push((1, classify(&cfg, Some("low"), Some("l"), Some(10))));
        }
        sim.step(now, &arrivals);
    }
    let high_p99 = percentile(&sim.waits[0], 0.99);
    let low_p50 = percentile(&sim.waits[1], 0.50);
    assert!(
        sim.waits[0].len() >= 240,
        "high served {}",
        sim.waits[0].len()
    );
    assert!(
        high_p99 < low_p50,
        "high p99 {high_p99} ms, low p50 {low_p50} ms"
    );
    assert!(high_p99 <= sim.service_ms, "high p99 {high_p99} ms");
}
