//! The CPU offload tier, like vLLM's `OffloadingConnector` with its CPU backend and LRU policy
//! (`--kv-offloading-size`): a set of block hashes in host memory, least recently used evicted
//! first.
//!
//! Only hashes are kept: the simulator holds no KV data. A block stored here is a copy of a GPU
//! block with the same hash; it outlives the GPU block's eviction, which is the point.

use kvoy_shared::LruSet;

use super::events::{KvEvent, MEDIUM_CPU};

/// The seed of the tier's hash table: block hashes are the engine's own xxh3 digests, so any
/// fixed seed spreads them, and a fixed one keeps the fleet simulation reproducible.
const TABLE_SEED: u64 = 0x6b76_6f79_2d63_7075;

/// The tier: kvoy-shared's LRU set of block hashes, `None` without a tier.
#[derive(Debug, Clone, Default)]
pub(crate) struct CpuTier {
    blocks: Option<LruSet>,
}

impl CpuTier {
    /// A tier of `capacity` blocks; 0 is no tier (nothing is ever stored).
    pub(crate) fn new(capacity: u32) -> CpuTier {
        CpuTier {
            blocks: (capacity > 0).then(|| LruSet::new(capacity as usize, TABLE_SEED)),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.blocks.is_some()
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.blocks.as_ref().is_some_and(|b| b.contains(hash))
    }

    pub(crate) fn len(&self) -> usize {
        self.blocks.as_ref().map_or(0, LruSet::len)
    }

    pub(crate) fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.iter().flat_map(LruSet::iter_mru)
    }

    /// Makes `hash` the most recently used, if held.
    pub(crate) fn touch(&mut self, hash: u64) {
        if let Some(b) = self.blocks.as_mut().filter(|b| b.contains(hash)) {
            b.touch(hash);
        }
    }

    /// Stores the hashes it does not hold yet, in order, evicting the least recently used blocks
    /// for room (a `BlockRemoved` CPU each, queued on `events`). Stops after `capacity` new
    /// blocks, so that a run longer than the tier never evicts its own head. Returns, per hash,
    /// whether it was newly stored; the caller announces those.
    pub(crate) fn store(&mut self, hashes: &[u64], events: &mut Vec<KvEvent>) -> Vec<bool> {
        let mut fresh = vec![false; hashes.len()];
        let Some(blocks) = self.blocks.as_mut() else {
            return fresh;
        };
        let mut stored = 0;
        for (i, &hash) in hashes.iter().enumerate() {
            if stored == blocks.capacity() {
                break;
            }
            if blocks.contains(hash) {
                continue;
            }
            // With fewer than `capacity` blocks stored by this call, the tier holds an older
            // one, so the least recently used is never one of this call's.
            if let Some(evicted) = blocks.touch(hash) {
                events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![evicted],
                    medium: MEDIUM_CPU,
                });
            }
            fresh[i] = true;
            stored += 1;
        }
        fresh
    }

    /// Drops every block (no event: the caller announces the reset).
    pub(crate) fn clear(&mut self) {
        if let Some(b) = self.blocks.as_mut() {
            b.clear();
        }
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        match &self.blocks {
            Some(b) if b.len() > b.capacity() => Err(format!(
                "CPU tier holds {} blocks, over its {}",
                b.len(),
                b.capacity()
            )),
            _ => Ok(()),
        }
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
