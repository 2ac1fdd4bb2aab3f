//! The CPU offload tier, like vLLM's `OffloadingConnector` with its CPU backend and LRU policy
//! (`--kv-offloading-size`): a set of block hashes in host memory, least recently used evicted
//! first.
//!
//! Only hashes are kept: the simulator holds no KV data. A block stored here is a copy of a GPU
//! block with the same hash; it outlives the GPU block's eviction, which is the point.

use std::collections::{BTreeMap, HashMap};

use super::events::{KvEvent, MEDIUM_CPU};

#[derive(Debug, Clone, Default)]
pub(crate) struct CpuTier {
    capacity: usize,
    /// Hash → stamp of its last store or hit.
    stamps: HashMap<u64, u64>,
    /// Stamp → hash; the first entry is the least recently used.
    lru: BTreeMap<u64, u64>,
    next_stamp: u64,
}

impl CpuTier {
    /// A tier of `capacity` blocks; 0 is no tier (nothing is ever stored).
    pub(crate) fn new(capacity: u32) -> CpuTier {
        CpuTier {
            capacity: capacity as usize,
            ..CpuTier::default()
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.capacity > 0
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.stamps.contains_key(&hash)
    }

    pub(crate) fn len(&self) -> usize {
        self.stamps.len()
    }

    pub(crate) fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.stamps.keys().copied()
    }

    fn stamp(&mut self) -> u64 {
        let s = self.next_stamp;
        self.next_stamp += 1;
        s
    }

    /// Makes `hash` the most recently used, if held.
    pub(crate) fn touch(&mut self, hash: u64) {
        let stamp = self.stamp();
        if let Some(old) = self.stamps.get_mut(&hash) {
            self.lru.remove(old);
            *old = stamp;
            self.lru.insert(stamp, hash);
        }
    }

    /// Stores the hashes it does not hold yet, in order, evicting the least recently used blocks
    /// for room (a `BlockRemoved` CPU each, queued on `events`). Stops after `capacity` new
    /// blocks, so that a run longer than the tier never evicts its own head. Returns, per hash,
    /// whether it was newly stored; the caller announces those.
    pub(crate) fn store(&mut self, hashes: &[u64], events: &mut Vec<KvEvent>) -> Vec<bool> {
        let mut fresh = vec![false; hashes.len()];
        let mut stored = 0;
        for (i, &hash) in hashes.iter().enumerate() {
            if stored == self.capacity {
                break;
            }
            if self.contains(hash) {
                continue;
            }
            // With fewer than `capacity` blocks stored by this call, the tier holds an older
            // one, so the least recently used is never one of this call's.
            if self.stamps.len() >= self.capacity {
                if let Some((_, evicted)) = self.lru.pop_first() {
                    self.stamps.remove(&evicted);
                    events.push(KvEvent::BlockRemoved {
                        block_hashes: vec![evicted],
                        medium: MEDIUM_CPU,
                    });
                }
            }
            let stamp = self.stamp();
            self.stamps.insert(hash, stamp);
            self.lru.insert(stamp, hash);
            fresh[i] = true;
            stored += 1;
        }
        fresh
    }

    /// Drops every block (no event: the caller announces the reset).
    pub(crate) fn clear(&mut self) {
        self.stamps.clear();
        self.lru.clear();
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        if self.stamps.len() > self.capacity {
            return Err(format!(
                "CPU tier holds {} blocks, over its {}",
                self.stamps.len(),
                self.capacity
            ));
        }
        if self.lru.len() != self.stamps.len() {
            return Err("CPU tier's LRU and map differ in length".to_owned());
        }
        for (&stamp, &hash) in &self.lru {
            if self.stamps.get(&hash) != Some(&stamp) {
                return Err(format!("CPU tier: LRU entry {hash:#x} not in the map"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_new_hashes_and_evicts_least_recently_used() {
        let mut tier = CpuTier::new(3);
        let mut events = Vec::new();
        assert_eq!(tier.store(&[1, 2], &mut events), [true, true]);
        assert_eq!(tier.store(&[2, 3], &mut events), [false, true]);
        assert!(events.is_empty());
        tier.touch(1); // LRU order now 2, 3, 1
        assert_eq!(tier.store(&[4], &mut events), [true]);
        assert_eq!(
            events,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![2],
                medium: MEDIUM_CPU
            }]
        );
        assert!(tier.contains(1) && !tier.contains(2));
        tier.check().unwrap();
    }

    #[test]
    fn a_run_longer_than_the_tier_keeps_its_head() {
        let mut tier = CpuTier::new(2);
        let mut events = Vec::new();
        assert_eq!(tier.store(&[9], &mut events), [true]);
        assert_eq!(tier.store(&[1, 2, 3], &mut events), [true, true, false]);
        assert_eq!(events.len(), 1, "only 9 evicted");
        assert!(tier.contains(1) && tier.contains(2));
        tier.check().unwrap();
    }

    #[test]
    fn a_zero_tier_stores_nothing() {
        let mut tier = CpuTier::new(0);
        let mut events = Vec::new();
        assert!(!tier.enabled());
        assert_eq!(tier.store(&[1], &mut events), [false]);
        assert_eq!(tier.len(), 0);
        assert!(events.is_empty());
    }
}
