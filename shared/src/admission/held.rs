//! Strict priority across the workers of one proxy: each worker publishes, in shared data, the
//! highest priority it holds; a worker admits or releases a request only when no other worker
//! holds a higher one. The holder releases its own at its next tick (a held request can only
//! be resumed by its worker), so a higher band goes first proxy-wide, at most one tick late.
//!
//! One value, bounded to [`MAX_WORKERS`] entries of 24 bytes, changed by compare-and-swap.
//! Entries not refreshed within `max_age_ms` are ignored and dropped: a worker that stopped
//! publishing cannot block the others.

use crate::shared_data::{SharedStore, StoreError};

/// Workers one board tracks; more are ignored (never blocked on).
pub const MAX_WORKERS: usize = 256;
const ENTRY_BYTES: usize = 24;
const CAS_RETRIES: usize = 32;

/// One worker's entry: the highest priority it holds, how many requests it holds (all
/// priorities; refreshed with the entry, so up to half its age behind), when published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    worker: u64,
    priority: i32,
    requests: u32,
    at_ms: u64,
}

fn decode(bytes: &[u8], out: &mut Vec<Entry>) {
    out.clear();
    out.extend(
        bytes
            .chunks_exact(ENTRY_BYTES)
            .take(MAX_WORKERS)
            .map(|c| Entry {
                worker: u64::from_le_bytes(c[0..8].try_into().unwrap_or([0; 8])),
                priority: i32::from_le_bytes(c[8..12].try_into().unwrap_or([0; 4])),
                requests: u32::from_le_bytes(c[12..16].try_into().unwrap_or([0; 4])),
                at_ms: u64::from_le_bytes(c[16..24].try_into().unwrap_or([0; 8])),
            }),
    );
}

fn encode(entries: &[Entry], out: &mut Vec<u8>) {
    out.clear();
    for e in entries {
        out.extend_from_slice(&e.worker.to_le_bytes());
        out.extend_from_slice(&e.priority.to_le_bytes());
        out.extend_from_slice(&e.requests.to_le_bytes());
        out.extend_from_slice(&e.at_ms.to_le_bytes());
    }
}

/// This worker's view of the board.
#[derive(Debug)]
pub struct HeldBoard {
    key: String,
    worker: u64,
    max_age_ms: u64,
    /// What this worker last published (`None`: nothing held) and when.
    published: Option<Option<i32>>,
    published_at: u64,
    scratch: Vec<Entry>,
}

impl HeldBoard {
    /// `worker` must differ between the workers (a random per-VM id); entries older than
    /// `max_age_ms` are ignored.
    pub fn new(namespace: &str, worker: u64, max_age_ms: u64) -> Self {
        HeldBoard {
            key: format!("{namespace}.held"),
            worker,
            max_age_ms: max_age_ms.max(1),
            published: None,
            published_at: 0,
            scratch: Vec::new(),
        }
    }

    /// The highest priority another worker holds (fresh entries only).
    pub fn top_of_others(&mut self, store: &impl SharedStore, now_ms: u64) -> Option<i32> {
        let (bytes, _) = store.get(&self.key)?;
        decode(&bytes, &mut self.scratch);
        self.scratch
            .iter()
            .filter(|e| e.worker != self.worker && self.fresh(e, now_ms))
            .map(|e| e.priority)
            .max()
    }

    /// The requests every worker of the proxy holds, this one's included, as last published
    /// (fresh entries only): the proxy's admission queue depth, for the aggregator.
    pub fn held_in_proxy(&mut self, store: &impl SharedStore, now_ms: u64) -> u64 {
        let Some((bytes, _)) = store.get(&self.key) else {
            return 0;
        };
        decode(&bytes, &mut self.scratch);
        self.scratch
            .iter()
            .filter(|e| self.fresh(e, now_ms))
            .map(|e| u64::from(e.requests))
            .sum()
    }

    /// Whether another worker holds a request that outranks `priority`.
    pub fn outranked(&mut self, store: &impl SharedStore, priority: i32, now_ms: u64) -> bool {
        self.top_of_others(store, now_ms)
            .is_some_and(|p| p > priority)
    }

    /// Published within `max_age_ms` of now, either way: a stamp from the future is garbage.
    fn fresh(&self, e: &Entry, now_ms: u64) -> bool {
        e.at_ms.abs_diff(now_ms) < self.max_age_ms
    }

    /// Publishes this worker's highest held priority and the requests it holds (`None`: holds
    /// nothing) when the priority changed, or when the entry is half its age limit old (the
    /// count goes with it); cheap otherwise.
    pub fn publish(
        &mut self,
        store: &impl SharedStore,
        top: Option<(i32, u32)>,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        let priority = top.map(|(p, _)| p);
        let due = top.is_some() && now_ms.saturating_sub(self.published_at) >= self.max_age_ms / 2;
        if self.published == Some(priority) && !due {
            return Ok(());
        }
        let mut bytes = Vec::new();
        let mut last = StoreError::CasMismatch;
        for _ in 0..CAS_RETRIES {
            let (cas, had) = match store.get(&self.key) {
                Some((b, cas)) => {
                    decode(&b, &mut self.scratch);
                    (cas, true)
                }
                None => {
                    self.scratch.clear();
                    (0, false)
                }
            };
            if !had && top.is_none() {
                // Nothing stored and nothing to publish.
                self.published = Some(None);
                self.published_at = now_ms;
                return Ok(());
            }
            let (worker, max_age) = (self.worker, self.max_age_ms);
            self.scratch
                .retain(|e| e.worker != worker && e.at_ms.abs_diff(now_ms) < max_age);
            if let Some((priority, requests)) = top {
                if self.scratch.len() < MAX_WORKERS {
                    self.scratch.push(Entry {
                        worker,
                        priority,
                        requests,
                        at_ms: now_ms,
                    });
                }
            }
            encode(&self.scratch, &mut bytes);
            match store.set(&self.key, &bytes, cas) {
                Ok(()) => {
                    self.published = Some(priority);
                    self.published_at = now_ms;
                    return Ok(());
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::shared_data::MemoryStore;

    #[test]
    fn a_worker_sees_what_the_others_hold() {
        let store = MemoryStore::default();
        let mut a = HeldBoard::new("ns", 1, 100);
        let mut b = HeldBoard::new("ns", 2, 100);
        assert_eq!(a.top_of_others(&store, 0), None);
        a.publish(&store, Some((10, 3)), 0).unwrap();
        b.publish(&store, Some((0, 7)), 0).unwrap();
        assert_eq!(b.top_of_others(&store, 10), Some(10));
        assert_eq!(
            a.top_of_others(&store, 10),
            Some(0),
            "its own entry is not counted"
        );
        assert!(b.outranked(&store, 0, 10));
        assert!(!b.outranked(&store, 10, 10), "equal does not outrank");
        // A holds nothing any more: its entry goes.
        a.publish(&store, None, 20).unwrap();
        assert_eq!(b.top_of_others(&store, 20), None);
        assert_eq!(store.get("ns.held").unwrap().0.len(), ENTRY_BYTES);
    }

    #[test]
    fn the_proxys_queue_depth_adds_every_fresh_entry() {
        let store = MemoryStore::default();
        let mut a = HeldBoard::new("ns", 1, 100);
        let mut b = HeldBoard::new("ns", 2, 100);
        assert_eq!(a.held_in_proxy(&store, 0), 0, "no board yet");
        a.publish(&store, Some((10, 3)), 0).unwrap();
        b.publish(&store, Some((0, 7)), 10).unwrap();
        assert_eq!(a.held_in_proxy(&store, 20), 10);
        assert_eq!(b.held_in_proxy(&store, 20), 10, "its own counted too");
        // A's entry ages out unrefreshed; B's count is refreshed at half its age.
        assert_eq!(b.held_in_proxy(&store, 105), 7);
        b.publish(&store, Some((0, 2)), 61).unwrap();
        assert_eq!(b.held_in_proxy(&store, 105), 2);
        b.publish(&store, None, 110).unwrap();
        assert_eq!(b.held_in_proxy(&store, 110), 0);
    }

    #[test]
    fn stale_entries_are_ignored_then_dropped() {
        let store = MemoryStore::default();
        let mut a = HeldBoard::new("ns", 1, 100);
        let mut b = HeldBoard::new("ns", 2, 100);
        a.publish(&store, Some((10, 1)), 0).unwrap();
        assert_eq!(b.top_of_others(&store, 99), Some(10));
        assert_eq!(b.top_of_others(&store, 100), None, "A stopped refreshing");
        b.publish(&store, Some((0, 1)), 150).unwrap();
        assert_eq!(
            store.get("ns.held").unwrap().0.len(),
            ENTRY_BYTES,
            "A's dropped"
        );
        // A holder refreshes its entry every half age while it holds.
        let writes = |s: &MemoryStore| s.get("ns.held").unwrap().1;
        let before = writes(&store);
        b.publish(&store, Some((0, 1)), 170).unwrap();
        assert_eq!(writes(&store), before, "unchanged and young: no write");
        b.publish(&store, Some((0, 1)), 200).unwrap();
        assert_ne!(writes(&store), before, "refreshed at half its age");
        assert_eq!(a.top_of_others(&store, 290), Some(0));
    }

    #[test]
    fn garbage_in_shared_data_is_survived() {
        let store = MemoryStore::default();
        store.set("ns.held", &[7u8; 61], 0).unwrap();
        let mut a = HeldBoard::new("ns", 1, 100);
        let _ = a.top_of_others(&store, 0);
        a.publish(&store, Some((3, 1)), 0).unwrap();
        let mut b = HeldBoard::new("ns", 2, 100);
        assert_eq!(
            b.top_of_others(&store, 1),
            Some(3),
            "the garbage entries are dropped"
        );
        // A stamp far in the future does not block the others forever.
        let mut c = HeldBoard::new("ns", 3, 100);
        c.publish(&store, Some((50, 1)), 1_000_000).unwrap();
        a.publish(&store, Some((3, 2)), 60).unwrap();
        assert_eq!(b.top_of_others(&store, 60), Some(3));
    }
}
