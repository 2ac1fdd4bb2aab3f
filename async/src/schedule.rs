//! Which waiting job runs next: lanes in strict priority order; inside a lane, tenants share by
//! weight (the tenant with the fewest weighted tokens started goes first, start-time fair
//! queueing); each tenant's concurrency and tokens-per-minute quota; a job backing off waits
//! for its time. Plain data, time passed in (milliseconds on any monotonic clock).
//!
//! A higher lane whose every waiting job is held back (quota, backoff) does not block a lower
//! one: capacity the higher lane cannot use goes down the lanes.
//!
//! ```
//! use kvoy_async::config::TenantQuota;
//! use kvoy_async::schedule::Scheduler;
//! let mut s = Scheduler::new(2);
//! s.push(1, "t", 10, 0, "batch job");
//! s.push(0, "t", 10, 0, "async job");
//! let quota = TenantQuota::default();
//! let first = s.next(0, |_| &quota).unwrap();
//! assert_eq!((first.lane, first.item), (0, "async job"));
//! ```

use std::collections::{BTreeMap, VecDeque};

use fnv::FnvHashMap;

use crate::config::TenantQuota;

/// The quota window of `tokens_per_minute`.
pub const WINDOW_MS: u64 = 60_000;

struct Waiting<T> {
    item: T,
    tokens: u64,
    not_before: u64,
}

#[derive(Default)]
struct Tenant {
    running: u32,
    /// Tokens started, with when (a later correction is its own entry).
    window: VecDeque<(u64, i64)>,
    window_sum: i64,
}

impl Tenant {
    fn expire(&mut self, now: u64) {
        while let Some(&(at, tokens)) = self.window.front() {
            if at + WINDOW_MS > now {
                break;
            }
            self.window_sum -= tokens;
            self.window.pop_front();
        }
    }
}

struct Lane<T> {
    waiting: BTreeMap<String, VecDeque<Waiting<T>>>,
    /// Each tenant's weighted tokens started in this lane.
    virtual_tokens: FnvHashMap<String, f64>,
    /// When each tenant last had a job started here.
    last_started: FnvHashMap<String, u64>,
}

/// A job taken to run.
#[derive(Debug, PartialEq)]
pub struct Dispatched<T> {
    /// Its lane's index (0 = highest priority).
    pub lane: usize,
    /// Its tenant.
    pub tenant: String,
    /// The tokens it was charged.
    pub tokens: u64,
    /// The job.
    pub item: T,
}

/// The waiting jobs of every lane.
pub struct Scheduler<T> {
    lanes: Vec<Lane<T>>,
    tenants: FnvHashMap<String, Tenant>,
}

impl<T> Scheduler<T> {
    /// A scheduler for `lanes` lanes.
    pub fn new(lanes: usize) -> Self {
        Scheduler {
            lanes: (0..lanes)
                .map(|_| Lane {
                    waiting: BTreeMap::new(),
                    virtual_tokens: FnvHashMap::default(),
                    last_started: FnvHashMap::default(),
                })
                .collect(),
            tenants: FnvHashMap::default(),
        }
    }

    /// Adds a job of `tenant` to `lane`, expected to take `tokens`, not to start before
    /// `not_before`. An unknown lane index is clamped to the lowest lane.
    pub fn push(&mut self, lane: usize, tenant: &str, tokens: u64, not_before: u64, item: T) {
        let lane = lane.min(self.lanes.len().saturating_sub(1));
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        let queue = l.waiting.entry(tenant.to_owned()).or_default();
        if queue.is_empty() {
            // A tenant coming back from idle starts level with the busiest-served backlogged
            // tenant's floor, not with the credit of the time it sent nothing.
            let floor = l
                .waiting
                .iter()
                .filter(|(t, q)| !q.is_empty() && t.as_str() != tenant)
                .filter_map(|(t, _)| l.virtual_tokens.get(t).copied())
                .reduce(f64::min);
            let own = l.virtual_tokens.entry(tenant.to_owned()).or_insert(0.0);
            if let Some(floor) = floor {
                *own = own.max(floor);
            }
        }
        if let Some(queue) = l.waiting.get_mut(tenant) {
            queue.push_back(Waiting {
                item,
                tokens,
                not_before,
            });
        }
    }

    /// The next job to run at `now`, with `quota` giving each tenant's limits; `None` when
    /// nothing waiting may start.
    pub fn next<'q>(
        &mut self,
        now: u64,
        quota: impl Fn(&str) -> &'q TenantQuota,
    ) -> Option<Dispatched<T>> {
        for tenant in self.tenants.values_mut() {
            tenant.expire(now);
        }
        for (index, lane) in self.lanes.iter_mut().enumerate() {
            let mut best: Option<(f64, &str, usize)> = None;
            for (name, queue) in &lane.waiting {
                let Some(pos) = queue.iter().position(|w| w.not_before <= now) else {
                    continue;
                };
                let q = quota(name);
                let book = self.tenants.get(name);
                let running = book.map_or(0, |b| b.running);
                if q.max_concurrent.is_some_and(|max| running >= max) {
                    continue;
                }
                if let Some(tpm) = q.tokens_per_minute {
                    let used = book.map_or(0, |b| b.window_sum.max(0) as u64);
                    // A job larger than the whole quota still runs, alone in its window.
                    if used > 0 && used + queue[pos].tokens > tpm {
                        continue;
                    }
                }
                let v = lane.virtual_tokens.get(name).copied().unwrap_or(0.0);
                if best.is_none_or(|(bv, _, _)| v < bv) {
                    best = Some((v, name.as_str(), pos));
                }
            }
            let Some((_, name, pos)) = best else {
                continue;
            };
            let name = name.to_owned();
            let queue = lane.waiting.get_mut(&name)?;
            let waiting = queue.remove(pos)?;
            if queue.is_empty() {
                lane.waiting.remove(&name);
            }
            let weight = quota(&name).weight;
            lane.last_started.insert(name.clone(), now);
            *lane.virtual_tokens.entry(name.clone()).or_insert(0.0) +=
                waiting.tokens as f64 / weight;
            let book = self.tenants.entry(name.clone()).or_default();
            book.running += 1;
            book.window.push_back((now, waiting.tokens as i64));
            book.window_sum += waiting.tokens as i64;
            return Some(Dispatched {
                lane: index,
                tenant: name,
                tokens: waiting.tokens,
                item: waiting.item,
            });
        }
        None
    }

    /// A dispatched job of `tenant` in `lane` ended, charged `charged` tokens at its start;
    /// `used` is what it took (from its answer), if known: the difference corrects its
    /// tenant's share and quota window.
    pub fn finished(
        &mut self,
        lane: usize,
        tenant: &str,
        charged: u64,
        used: Option<u64>,
        weight: f64,
        now: u64,
    ) {
        let delta = used.map_or(0, |u| u as i64 - charged as i64);
        if let Some(l) = self.lanes.get_mut(lane) {
            if let Some(v) = l.virtual_tokens.get_mut(tenant) {
                *v = (*v + delta as f64 / weight).max(0.0);
            }
        }
        if let Some(book) = self.tenants.get_mut(tenant) {
            book.running = book.running.saturating_sub(1);
            if delta != 0 {
                book.window.push_back((now, delta));
                book.window_sum += delta;
            }
        }
    }

    /// Jobs waiting in `lane`, per tenant.
    pub fn waiting(&self, lane: usize) -> impl Iterator<Item = (&str, usize)> {
        self.lanes
            .get(lane)
            .into_iter()
            .flat_map(|l| l.waiting.iter().map(|(t, q)| (t.as_str(), q.len())))
    }

    /// Whether a tenant that started a job in `lane` within `recent_ms` of `now` has fewer
    /// than `min_waiting` jobs waiting there: reading further into the lane may find its next
    /// ones, without which its share goes to the others.
    pub fn starved(&self, lane: usize, min_waiting: usize, recent_ms: u64, now: u64) -> bool {
        let Some(l) = self.lanes.get(lane) else {
            return false;
        };
        l.last_started.iter().any(|(tenant, at)| {
            now.saturating_sub(*at) <= recent_ms
                && l.waiting.get(tenant).map_or(0, VecDeque::len) < min_waiting
        })
    }

    /// Jobs waiting in `lane`.
    pub fn lane_len(&self, lane: usize) -> usize {
        self.waiting(lane).map(|(_, n)| n).sum()
    }

    /// Every waiting job, for the caller to keep their deliveries alive.
    pub fn items(&self) -> impl Iterator<Item = (usize, &T)> {
        self.lanes.iter().enumerate().flat_map(|(i, l)| {
            l.waiting
                .values()
                .flat_map(move |q| q.iter().map(move |w| (i, &w.item)))
        })
    }

    /// Jobs of `tenant` running.
    pub fn running(&self, tenant: &str) -> u32 {
        self.tenants.get(tenant).map_or(0, |t| t.running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas(spec: &[(&str, TenantQuota)]) -> BTreeMap<String, TenantQuota> {
        spec.iter()
            .map(|(n, q)| (n.to_string(), q.clone()))
            .collect()
    }

    fn run_all<T>(
        s: &mut Scheduler<T>,
        q: &BTreeMap<String, TenantQuota>,
        now: u64,
    ) -> Vec<Dispatched<T>> {
        let default = TenantQuota::default();
        let mut out = Vec::new();
        while let Some(d) = s.next(now, |t| q.get(t).unwrap_or(&default)) {
            out.push(d);
        }
        out
    }

    #[test]
    fn lanes_go_in_strict_priority_order() {
        let mut s = Scheduler::new(3);
        for i in 0..3 {
            s.push(2, "t", 1, 0, (2, i));
            s.push(0, "t", 1, 0, (0, i));
            s.push(1, "t", 1, 0, (1, i));
        }
        let order: Vec<_> = run_all(&mut s, &BTreeMap::new(), 0)
            .into_iter()
            .map(|d| d.item)
            .collect();
        let expected: Vec<_> = (0..3).flat_map(|l| (0..3).map(move |i| (l, i))).collect();
        assert_eq!(order, expected);
    }

    #[test]
    fn tenants_share_a_lane_by_weight_in_tokens() {
        let q = quotas(&[
            (
                "a",
                TenantQuota {
                    weight: 3.0,
                    ..Default::default()
                },
            ),
            ("b", TenantQuota::default()),
        ]);
        let mut s = Scheduler::new(1);
        for i in 0..400 {
            s.push(0, "a", 100, 0, i);
            s.push(0, "b", 100, 0, i);
        }
        let default = TenantQuota::default();
        let mut tokens = BTreeMap::<String, u64>::new();
        for _ in 0..400 {
            let d = s.next(0, |t| q.get(t).unwrap_or(&default)).unwrap();
            *tokens.entry(d.tenant.clone()).or_default() += d.tokens;
            s.finished(
                0,
                &d.tenant,
                d.tokens,
                Some(d.tokens),
                q[&d.tenant].weight,
                0,
            );
        }
        assert_eq!(tokens["a"], 30_000);
        assert_eq!(tokens["b"], 10_000);
    }

    #[test]
    fn the_real_token_count_corrects_the_share() {
        let mut s = Scheduler::new(1);
        for i in 0..10 {
            s.push(0, "big", 100, 0, i);
            s.push(0, "small", 100, 0, i);
        }
        let default = TenantQuota::default();
        // "big" really takes 1,000 tokens a job: after one, "small" runs until level.
        let d = s.next(0, |_| &default).unwrap();
        assert_eq!(d.tenant, "big");
        s.finished(0, "big", 100, Some(1000), 1.0, 0);
        let next: Vec<_> = (0..9)
            .map(|_| {
                let d = s.next(0, |_| &default).unwrap();
                s.finished(0, &d.tenant, 100, Some(100), 1.0, 0);
                d.tenant
            })
            .collect();
        assert!(next.iter().all(|t| t == "small"), "{next:?}");
    }

    #[test]
    fn concurrency_and_token_quotas_hold_jobs_back() {
        let q = quotas(&[(
            "t",
            TenantQuota {
                max_concurrent: Some(2),
                tokens_per_minute: Some(250),
                ..Default::default()
            },
        )]);
        let mut s = Scheduler::new(1);
        for i in 0..5 {
            s.push(0, "t", 100, 0, i);
        }
        assert_eq!(run_all(&mut s, &q, 0).len(), 2, "two at once");
        s.finished(0, "t", 100, Some(100), 1.0, 10);
        s.finished(0, "t", 100, Some(100), 1.0, 10);
        // 200 of 250 tokens used in this minute: a 100-token job must wait.
        assert!(run_all(&mut s, &q, 20).is_empty());
        assert_eq!(run_all(&mut s, &q, WINDOW_MS + 1).len(), 2);
    }

    #[test]
    fn a_blocked_lane_lets_the_next_one_run_and_backoff_waits() {
        let q = quotas(&[(
            "hot",
            TenantQuota {
                max_concurrent: Some(1),
                ..Default::default()
            },
        )]);
        let mut s = Scheduler::new(2);
        s.push(0, "hot", 1, 0, "hot-1");
        s.push(0, "hot", 1, 0, "hot-2");
        s.push(1, "cold", 1, 500, "cold-later");
        s.push(1, "cold", 1, 0, "cold-now");
        let items: Vec<_> = run_all(&mut s, &q, 0).into_iter().map(|d| d.item).collect();
        assert_eq!(items, vec!["hot-1", "cold-now"]);
        let items: Vec<_> = run_all(&mut s, &q, 600)
            .into_iter()
            .map(|d| d.item)
            .collect();
        assert_eq!(items, vec!["cold-later"]);
        assert_eq!(s.lane_len(0), 1);
        assert_eq!(s.running("hot"), 1);
    }

    #[test]
    fn a_tenant_that_ran_lately_and_has_little_waiting_is_starved() {
        let mut s = Scheduler::new(1);
        let q = TenantQuota::default();
        s.push(0, "a", 1, 0, 1);
        s.push(0, "b", 1, 0, 2);
        s.push(0, "b", 1, 0, 3);
        assert!(!s.starved(0, 1, 1000, 0), "nobody ran yet");
        let first = s.next(0, |_| &q).unwrap();
        assert_eq!(first.tenant, "a");
        assert!(s.starved(0, 1, 1000, 10), "a ran and has nothing waiting");
        assert!(!s.starved(0, 1, 1000, 2000), "a ran too long ago");
        s.push(0, "a", 1, 0, 4);
        assert!(!s.starved(0, 1, 1000, 10));
    }

    #[test]
    fn a_returning_tenant_gets_no_credit_for_its_idle_time() {
        let mut s = Scheduler::new(1);
        let default = TenantQuota::default();
        for i in 0..50 {
            s.push(0, "steady", 10, 0, i);
        }
        for _ in 0..40 {
            let d = s.next(0, |_| &default).unwrap();
            s.finished(0, &d.tenant, 10, Some(10), 1.0, 0);
        }
        for i in 0..10 {
            s.push(0, "late", 10, 0, 100 + i);
        }
        let order: Vec<_> = (0..10)
            .map(|_| s.next(0, |_| &default).unwrap().tenant)
            .collect();
        let late = order.iter().filter(|t| *t == "late").count();
        assert!(
            (4..=6).contains(&late),
            "alternates, not 10 in a row: {order:?}"
        );
    }
}
