//! Property tests of [`FlowQueue`] against a plain model: random interleavings of offer,
//! release, expire and remove with random classes. Every offered id ends exactly once, the
//! counters match, and releases respect band priority and the order inside a flow.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
enum Op {
    Offer {
        priority: i32,
        flow: u8,
        bytes: u64,
        saturated: bool,
        deadline_in: Option<u64>,
    },
    /// Offer again an id picked among those offered (queued or not).
    Reoffer {
        pick: usize,
        saturated: bool,
    },
    Release {
        capacity: u32,
    },
    Expire,
    Remove {
        pick: usize,
    },
    Advance {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (
            prop::sample::select(vec![-1, 0, 0, 3, 7]),
            0u8..4,
            0u64..80,
            any::<bool>(),
            prop::option::of(0u64..3000),
        )
            .prop_map(|(priority, flow, bytes, saturated, deadline_in)| Op::Offer {
                priority,
                flow,
                bytes,
                saturated,
                deadline_in,
            }),
        1 => (any::<usize>(), any::<bool>())
            .prop_map(|(pick, saturated)| Op::Reoffer { pick, saturated }),
        2 => (0u32..6).prop_map(|capacity| Op::Release { capacity }),
        1 => Just(Op::Expire),
        2 => any::<usize>().prop_map(|pick| Op::Remove { pick }),
        2 => (0u64..400).prop_map(|ms| Op::Advance { ms }),
    ]
}

#[derive(Clone, Copy, Debug)]
struct Queued {
    priority: i32,
    flow: u8,
    bytes: u64,
    expires: u64,
    /// The order inside its flow: (key, arrival sequence).
    order: (u64, u64),
}

const FLOWS: [&str; 4] = ["a", "b", "c", "default-flow"];

struct Model {
    queued: BTreeMap<u64, Queued>,
    ends: HashMap<u64, &'static str>,
    offered: Vec<u64>,
    cfg: AdmissionConfig,
}

impl Model {
    fn end(&mut self, id: u64, how: &'static str) {
        if let Some(before) = self.ends.insert(id, how) {
            panic!("{id} ended twice: {before} then {how}");
        }
    }

    fn max_priority(&self) -> Option<i32> {
        self.queued.values().map(|q| q.priority).max()
    }

    /// The flow an entry is queued in: the whole band under `fairness: fcfs`.
    fn flow_of(&self, q: &Queued) -> (i32, u8) {
        match self.cfg.fairness {
            Fairness::RoundRobin => (q.priority, q.flow),
            Fairness::Fcfs => (q.priority, 0),
        }
    }

    /// Takes `id` out as released: it must be first in its flow.
    fn released(&mut self, id: u64) {
        let q = self.queued.remove(&id).expect("released id was queued");
        let flow = self.flow_of(&q);
        for other in self.queued.values() {
            if self.flow_of(other) == flow {
                assert!(q.order < other.order, "{id} overtook its flow");
            }
        }
        self.end(id, "released");
    }

    fn expired(&mut self, id: u64, now: u64) {
        let q = self.queued.remove(&id).expect("expired id was queued");
        assert!(q.expires <= now, "{id} expired early");
        self.end(id, "expired");
    }

    fn check(&self, queue: &FlowQueue, now: u64) {
        assert_eq!(queue.len(), self.queued.len());
        assert_eq!(
            queue.bytes(),
            self.queued.values().map(|q| q.bytes).sum::<u64>()
        );
        assert_eq!(queue.highest_waiting_priority(), self.max_priority());
        assert!(queue.flow_count() <= queue.len());
        let mut bands: BTreeMap<i32, (usize, u64)> = BTreeMap::new();
        for q in self.queued.values() {
            let b = bands.entry(q.priority).or_default();
            *b = (b.0 + 1, b.1 + q.bytes);
        }
        let want: Vec<_> = bands.into_iter().rev().collect();
        let got: Vec<_> = queue
            .bands()
            .map(|b| (b.priority, (b.requests, b.bytes)))
            .collect();
        assert_eq!(got, want);
        let oldest = self.queued.values().map(|q| q.order.1).min();
        assert_eq!(queue.oldest_wait_ms(now).is_some(), oldest.is_some());
    }
}

fn run(ops: Vec<Op>, fairness: Fairness, ordering: FlowOrdering, queue_sheddable: bool) {
    let cfg = AdmissionConfig {
        fairness,
        ordering,
        queue_sheddable,
        queue_ttl_ms: 1000,
        band_max_requests: 6,
        band_max_bytes: 200,
        max_requests: 10,
        ..AdmissionConfig::default()
    };
    let mut queue = FlowQueue::new(&cfg);
    let mut m = Model {
        queued: BTreeMap::new(),
        ends: HashMap::new(),
        offered: Vec::new(),
        cfg,
    };
    let (mut now, mut seq, mut next_id) = (0u64, 0u64, 1u64);
    let (mut out, mut expired) = (Vec::new(), Vec::new());
    for op in ops {
        match op {
            Op::Offer {
                priority,
                flow,
                bytes,
                saturated,
                deadline_in,
            } => {
                let id = next_id;
                next_id += 1;
                let deadline_ms = deadline_in.map(|d| (now + d).saturating_sub(100));
                let class = Class {
                    priority,
                    flow: FLOWS[usize::from(flow)],
                    bytes,
                    sheddable: priority < 0,
                    deadline_ms,
                };
                let band: Vec<_> = m
                    .queued
                    .values()
                    .filter(|q| q.priority == priority)
                    .collect();
                let band_bytes: u64 = band.iter().map(|q| q.bytes).sum();
                let want = if !saturated && m.max_priority().is_none_or(|p| p < priority) {
                    Offer::Admit
                } else if saturated && priority < 0 && !queue_sheddable {
                    Offer::Reject(RejectReason::Saturated)
                } else if m.queued.len() >= 10 || band.len() >= 6 || band_bytes + bytes > 200 {
                    Offer::Reject(RejectReason::QueueFull)
                } else {
                    Offer::Queued
                };
                assert_eq!(queue.offer(id, &class, now, saturated), want);
                m.offered.push(id);
                match want {
                    Offer::Admit => m.end(id, "admitted"),
                    Offer::Reject(_) => m.end(id, "rejected"),
                    Offer::Queued => {
                        let expires = deadline_ms.map_or(now + 1000, |d| d.min(now + 1000));
                        let key = match ordering {
                            FlowOrdering::Fcfs => now,
                            FlowOrdering::Edf => expires,
                        };
                        m.queued.insert(
                            id,
                            Queued {
                                priority,
                                flow,
                                bytes,
                                expires,
                                order: (key, seq),
                            },
                        );
                    }
                }
                seq += 1;
            }
            Op::Reoffer { pick, saturated } => {
                if let Some(&id) = m.offered.get(pick % m.offered.len().max(1)) {
                    if m.queued.contains_key(&id) {
                        let c = classify(&m.cfg, None, Some("zzz"), Some(1));
                        assert_eq!(queue.offer(id, &c, now, saturated), Offer::Queued);
                    }
                }
            }
            Op::Release { capacity } => {
                queue.release(now, capacity, &mut out, &mut expired);
                for id in expired.drain(..) {
                    m.expired(id, now);
                }
                assert!(m.queued.values().all(|q| q.expires > now));
                assert!(out.len() <= capacity as usize);
                let mut last = i32::MAX;
                for id in out.drain(..) {
                    let p = m.queued.get(&id).map(|q| q.priority).expect("queued");
                    assert!(p <= last, "priority order");
                    last = p;
                    m.released(id);
                }
                if let Some(highest) = m.max_priority() {
                    assert!(highest <= last, "a higher band was left waiting");
                }
            }
            Op::Expire => {
                queue.expire(now, &mut expired);
                for id in expired.drain(..) {
                    m.expired(id, now);
                }
                assert!(m.queued.values().all(|q| q.expires > now));
            }
            Op::Remove { pick } => {
                if let Some(&id) = m.offered.get(pick % m.offered.len().max(1)) {
                    let was = m.queued.remove(&id).is_some();
                    assert_eq!(queue.remove(id), was);
                    if was {
                        m.end(id, "removed");
                    }
                }
            }
            Op::Advance { ms } => now += ms,
        }
        m.check(&queue, now);
    }
    // Everything still queued expires in the end; every offered id ended exactly once.
    now += 10_000;
    queue.expire(now, &mut expired);
    for id in expired.drain(..) {
        m.expired(id, now);
    }
    m.check(&queue, now);
    assert!(queue.is_empty() && m.queued.is_empty());
    assert_eq!(queue.flow_count(), 0);
    assert_eq!(m.ends.len(), m.offered.len());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_request_ends_exactly_once(
        ops in prop::collection::vec(op(), 0..300),
        fairness in prop::sample::select(vec![Fairness::RoundRobin, Fairness::Fcfs]),
        ordering in prop::sample::select(vec![FlowOrdering::Fcfs, FlowOrdering::Edf]),
        queue_sheddable in any::<bool>(),
    ) {
        run(ops, fairness, ordering, queue_sheddable);
    }

    #[test]
    fn classify_never_panics(objective in ".{0,300}", flow in ".{0,300}", len in any::<Option<u64>>()) {
        let cfg = AdmissionConfig::default();
        let c = classify(&cfg, Some(&objective), Some(&flow), len);
        prop_assert!(!c.flow.is_empty() && c.flow.len() <= MAX_FLOW_BYTES);
        prop_assert_eq!(c.flow, c.flow.trim());
        prop_assert!(c.flow == DEFAULT_FLOW || flow.contains(c.flow));
    }

    #[test]
    fn config_parsing_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = AdmissionConfig::from_json(&bytes);
    }
}
