//! [`FlowQueue`]: the requests one VM (Envoy worker) holds while the pool is saturated.

use std::collections::BTreeMap;

use super::band::{Band, Flow, Flows, Position};
use super::classify::Class;
use super::config::{AdmissionConfig, Fairness, FlowOrdering};

/// What to do with an offered request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Dispatch it now.
    Admit,
    /// Hold it (pause at headers, and at body callbacks) until [`FlowQueue::release`] names
    /// it, or it expires, or the client goes ([`FlowQueue::remove`]).
    Queued,
    /// Answer 429 with the reason at once.
    Reject(RejectReason),
}

/// Why a request was turned away (answer 429).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// The pool is saturated and the request is sheddable (priority < 0).
    Saturated,
    /// Its band, or the whole queue, is at its cap in requests or bytes.
    QueueFull,
}

impl RejectReason {
    /// The drop reason the filter reports.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Saturated => "saturated",
            RejectReason::QueueFull => "queue-full",
        }
    }
}

/// The drop reason of a request that expired in the queue (answer 429).
pub const EXPIRED_REASON: &str = "ttl-expired";

/// The queue's content for one band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BandStats {
    pub priority: i32,
    pub requests: usize,
    pub bytes: u64,
    /// Flows (fairness ids) with requests in the band.
    pub flows: usize,
}

/// One queued request.
#[derive(Clone, Copy, Debug)]
struct Node {
    seq: u64,
    priority: i32,
    flow: usize,
    key: u64,
    arrival: u64,
    expires: u64,
    bytes: u64,
}

impl Node {
    fn position(&self) -> Position {
        (self.key, self.seq)
    }
}

/// The requests one VM holds, by band (strict priority), flow (round-robin, or one FCFS queue
/// per band) and position (FCFS or EDF). A held request can only be resumed by the VM that
/// paused it, so each VM has its own queue; see the module docs for what that means for
/// fairness across workers.
///
/// Every offered request ends exactly once: [`Offer::Admit`], [`Offer::Reject`], or, once
/// queued, named by [`FlowQueue::release`] or [`FlowQueue::expire`], or taken out by
/// [`FlowQueue::remove`]. Memory is bounded by `max_requests`: flows and bands exist only
/// while they hold requests. Every operation is O(log n) per request it touches.
#[derive(Debug)]
pub struct FlowQueue {
    fairness: Fairness,
    ordering: FlowOrdering,
    ttl_ms: u64,
    band_max_requests: usize,
    band_max_bytes: u64,
    max_requests: usize,
    queue_sheddable: bool,
    /// Non-empty bands, highest priority first.
    bands: Vec<Band>,
    flows: Flows,
    /// Queued requests by id (the filter's context id).
    nodes: BTreeMap<u64, Node>,
    /// (expiry, seq) -> id: what [`FlowQueue::expire`] takes first.
    by_expiry: BTreeMap<(u64, u64), u64>,
    /// (arrival, seq) -> id: for [`FlowQueue::oldest_wait_ms`].
    by_arrival: BTreeMap<(u64, u64), u64>,
    next_seq: u64,
    bytes: u64,
}

impl FlowQueue {
    pub fn new(config: &AdmissionConfig) -> Self {
        let mut q = FlowQueue {
            fairness: config.fairness,
            ordering: config.ordering,
            ttl_ms: 0,
            band_max_requests: 0,
            band_max_bytes: 0,
            max_requests: 0,
            queue_sheddable: false,
            bands: Vec::new(),
            flows: Flows::default(),
            nodes: BTreeMap::new(),
            by_expiry: BTreeMap::new(),
            by_arrival: BTreeMap::new(),
            next_seq: 0,
            bytes: 0,
        };
        q.reconfigure(config);
        q
    }

    /// Applies a new configuration to requests offered from now on; queued requests keep
    /// their places and deadlines, nothing is dropped (even above new, lower caps).
    pub fn reconfigure(&mut self, config: &AdmissionConfig) {
        self.fairness = config.fairness;
        self.ordering = config.ordering;
        self.ttl_ms = config.queue_ttl_ms;
        self.band_max_requests = config.band_max_requests as usize;
        self.band_max_bytes = config.band_max_bytes;
        self.max_requests = config.max_requests as usize;
        self.queue_sheddable = config.queue_sheddable;
    }

    /// Decides a request at its headers. `saturated` is [`super::Saturation::saturated`].
    ///
    /// Not saturated and nothing of equal or higher priority queued: [`Offer::Admit`], with no
    /// allocation. Otherwise a sheddable request is rejected while saturated (unless
    /// `queue_sheddable`), a request over a cap is rejected, and the rest is queued. A request
    /// queued while the pool is not saturated (it waits behind its equals) should be followed
    /// by a [`FlowQueue::release`] at once, which may name it: the filter then continues
    /// instead of pausing. Offering an id that is already queued changes nothing and says
    /// [`Offer::Queued`].
    pub fn offer(&mut self, id: u64, class: &Class<'_>, now_ms: u64, saturated: bool) -> Offer {
        let outranks_queue = self
            .bands
            .first()
            .is_none_or(|b| b.priority < class.priority);
        let duplicate = !self.nodes.is_empty() && self.nodes.contains_key(&id);
        if !saturated && outranks_queue && !duplicate {
            return Offer::Admit;
        }
        if duplicate {
            return Offer::Queued;
        }
        if saturated && class.sheddable && !self.queue_sheddable {
            return Offer::Reject(RejectReason::Saturated);
        }
        if self.nodes.len() >= self.max_requests {
            return Offer::Reject(RejectReason::QueueFull);
        }
        let (band_requests, band_bytes) = self
            .band_index(class.priority)
            .ok()
            .and_then(|i| self.bands.get(i))
            .map_or((0, 0), |b| (b.requests, b.bytes));
        if band_requests >= self.band_max_requests
            || band_bytes.saturating_add(class.bytes) > self.band_max_bytes
        {
            return Offer::Reject(RejectReason::QueueFull);
        }
        self.insert(id, class, now_ms);
        Offer::Queued
    }

    /// Expires what is due (as [`FlowQueue::expire`], into `expired`), then names up to
    /// `capacity` requests to resume, in order: higher bands first; inside a band one request
    /// per flow in turn, continuing where the last call stopped (or band-wide FCFS/EDF with
    /// `fairness: fcfs`); inside a flow FCFS (or EDF). Expiring first means a request past
    /// its deadline is never dispatched. Use [`super::Saturation::release_capacity`] for
    /// `capacity`.
    pub fn release(
        &mut self,
        now_ms: u64,
        capacity: u32,
        released: &mut Vec<u64>,
        expired: &mut Vec<u64>,
    ) {
        self.expire(now_ms, expired);
        for _ in 0..capacity {
            let Some((turn, fi)) = self.bands.first().and_then(Band::next_flow) else {
                break;
            };
            let Some(id) = self
                .flows
                .get(fi)
                .and_then(|f| f.queue.first_key_value())
                .map(|(_, &id)| id)
            else {
                break;
            };
            if self.take(id).is_none() {
                break;
            }
            released.push(id);
            // The flow still has requests (so its band still exists): back of the line.
            if let (Some(flow), Some(band)) = (self.flows.get_mut(fi), self.bands.first_mut()) {
                if band.turns.remove(&turn).is_some() {
                    flow.turn = band.take_turn(fi);
                }
            }
        }
    }

    /// Takes out the requests whose TTL (or own deadline) has passed by `now_ms` and appends
    /// their ids to `out`, soonest due first; the filter answers them 429
    /// [`EXPIRED_REASON`].
    pub fn expire(&mut self, now_ms: u64, out: &mut Vec<u64>) {
        while let Some((&(expires, _), &id)) = self.by_expiry.first_key_value() {
            if expires > now_ms || self.take(id).is_none() {
                break;
            }
            out.push(id);
        }
    }

    /// Takes out a queued request (its client went away). False when `id` is not queued:
    /// never offered, admitted, rejected, or already released, expired or removed.
    pub fn remove(&mut self, id: u64) -> bool {
        self.take(id).is_some()
    }

    /// Requests queued.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether [`FlowQueue::offer`] admits any request at once, whatever the time: the pool has
    /// room and nothing waits (a filter then need not read the clock to offer it).
    pub fn admits_at_once(&self, saturated: bool) -> bool {
        !saturated && self.is_empty()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.nodes.contains_key(&id)
    }

    /// Bytes queued (sum of the requests' sizes).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Flows with queued requests, all bands together.
    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// The bands that hold requests, highest priority first.
    pub fn bands(&self) -> impl Iterator<Item = BandStats> + '_ {
        self.bands.iter().map(|b| BandStats {
            priority: b.priority,
            requests: b.requests,
            bytes: b.bytes,
            flows: b.flows.len(),
        })
    }

    /// How long the longest-waiting request has waited, if any is queued.
    pub fn oldest_wait_ms(&self, now_ms: u64) -> Option<u64> {
        self.by_arrival
            .first_key_value()
            .map(|(&(arrival, _), _)| now_ms.saturating_sub(arrival))
    }

    /// The highest priority with a queued request.
    pub fn highest_waiting_priority(&self) -> Option<i32> {
        self.bands.first().map(|b| b.priority)
    }

    /// Where the band of `priority` is, or would go (bands are sorted highest first).
    fn band_index(&self, priority: i32) -> Result<usize, usize> {
        self.bands.binary_search_by(|b| priority.cmp(&b.priority))
    }

    fn insert(&mut self, id: u64, class: &Class<'_>, now_ms: u64) {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let ttl_deadline = now_ms.saturating_add(self.ttl_ms);
        let expires = class
            .deadline_ms
            .map_or(ttl_deadline, |d| d.min(ttl_deadline));
        let key = match self.ordering {
            FlowOrdering::Fcfs => now_ms,
            FlowOrdering::Edf => expires,
        };
        let name = match self.fairness {
            Fairness::RoundRobin => class.flow,
            // one flow per band: the band is a single queue
            Fairness::Fcfs => "",
        };
        let bi = match self.band_index(class.priority) {
            Ok(i) => i,
            Err(i) => {
                self.bands.insert(i, Band::new(class.priority));
                i
            }
        };
        let Some(band) = self.bands.get_mut(bi) else {
            return;
        };
        let fi = match band.flows.get(name) {
            Some(&fi) => fi,
            None => {
                let fi = self.flows.insert(Flow {
                    name: name.into(),
                    turn: 0,
                    queue: BTreeMap::new(),
                });
                band.flows.insert(name.into(), fi);
                let turn = band.take_turn(fi);
                if let Some(flow) = self.flows.get_mut(fi) {
                    flow.turn = turn;
                }
                fi
            }
        };
        let node = Node {
            seq,
            priority: class.priority,
            flow: fi,
            key,
            arrival: now_ms,
            expires,
            bytes: class.bytes,
        };
        if let Some(flow) = self.flows.get_mut(fi) {
            flow.queue.insert(node.position(), id);
        }
        band.requests += 1;
        band.bytes = band.bytes.saturating_add(node.bytes);
        self.bytes = self.bytes.saturating_add(node.bytes);
        self.by_expiry.insert((expires, seq), id);
        self.by_arrival.insert((now_ms, seq), id);
        self.nodes.insert(id, node);
    }

    /// Takes a queued request out of every structure; drops its flow and band when they
    /// become empty.
    fn take(&mut self, id: u64) -> Option<Node> {
        let node = self.nodes.remove(&id)?;
        self.by_expiry.remove(&(node.expires, node.seq));
        self.by_arrival.remove(&(node.arrival, node.seq));
        self.bytes = self.bytes.saturating_sub(node.bytes);
        if let Ok(bi) = self.band_index(node.priority) {
            if let Some(band) = self.bands.get_mut(bi) {
                band.requests = band.requests.saturating_sub(1);
                band.bytes = band.bytes.saturating_sub(node.bytes);
                let emptied = self.flows.get_mut(node.flow).is_some_and(|flow| {
                    flow.queue.remove(&node.position());
                    flow.queue.is_empty()
                });
                if emptied {
                    if let Some(flow) = self.flows.remove(node.flow) {
                        band.turns.remove(&flow.turn);
                        band.flows.remove(&flow.name);
                    }
                }
                if band.requests == 0 {
                    self.bands.remove(bi);
                }
            }
        }
        if self.nodes.is_empty() {
            // Give back the memory of a burst, and make sure nothing lingers.
            self.bands = Vec::new();
            self.flows.clear();
        }
        Some(node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(priority: i32, flow: &str) -> Class<'_> {
        Class {
            priority,
            flow,
            bytes: 10,
            sheddable: priority < 0,
            deadline_ms: None,
        }
    }

    #[test]
    fn admits_at_once_when_free_and_nothing_outranks() {
        let mut q = FlowQueue::new(&AdmissionConfig::default());
        assert_eq!(q.offer(1, &class(0, "a"), 0, false), Offer::Admit);
        assert!(q.is_empty());
        assert_eq!(q.offer(2, &class(0, "a"), 0, true), Offer::Queued);
        // an equal priority waits behind the queued one even when not saturated
        assert_eq!(q.offer(3, &class(0, "b"), 1, false), Offer::Queued);
        // a higher one goes first; a lower one waits
        assert_eq!(q.offer(4, &class(1, "b"), 1, false), Offer::Admit);
        assert_eq!(q.offer(5, &class(-1, "b"), 1, false), Offer::Queued);
        assert_eq!(q.offer(2, &class(9, "z"), 1, false), Offer::Queued, "dup");
        assert_eq!(q.len(), 3);
        assert_eq!(q.highest_waiting_priority(), Some(0));
        let (mut out, mut exp) = (Vec::new(), Vec::new());
        q.release(2, 10, &mut out, &mut exp);
        assert_eq!(out, [2, 3, 5]);
        assert!(exp.is_empty() && q.is_empty());
        assert_eq!(q.highest_waiting_priority(), None);
    }

    #[test]
    fn remove_and_stats() {
        let mut q = FlowQueue::new(&AdmissionConfig::default());
        for (id, p, f) in [(1, 5, "a"), (2, 5, "b"), (3, 0, "a"), (4, 5, "a")] {
            assert_eq!(q.offer(id, &class(p, f), id * 10, true), Offer::Queued);
        }
        let bands: Vec<_> = q.bands().collect();
        assert_eq!(
            bands,
            [
                BandStats {
                    priority: 5,
                    requests: 3,
                    bytes: 30,
                    flows: 2
                },
                BandStats {
                    priority: 0,
                    requests: 1,
                    bytes: 10,
                    flows: 1
                }
            ]
        );
        assert_eq!((q.len(), q.bytes(), q.flow_count()), (4, 40, 3));
        assert_eq!(q.oldest_wait_ms(100), Some(90));
        assert!(q.remove(1) && !q.remove(1) && !q.remove(99));
        assert_eq!(q.oldest_wait_ms(100), Some(80));
        assert!(q.remove(2));
        assert_eq!(q.flow_count(), 2, "flow b is gone with its last request");
        assert!(q.remove(4));
        assert_eq!(q.highest_waiting_priority(), Some(0), "band 5 is gone");
        assert!(q.contains(3) && q.remove(3) && !q.contains(3));
        assert_eq!((q.len(), q.bytes(), q.flow_count()), (0, 0, 0));
        assert_eq!(q.oldest_wait_ms(100), None);
    }

    #[test]
    fn reason_strings() {
        assert_eq!(RejectReason::Saturated.as_str(), "saturated");
        assert_eq!(RejectReason::QueueFull.as_str(), "queue-full");
        assert_eq!(EXPIRED_REASON, "ttl-expired");
    }
}
