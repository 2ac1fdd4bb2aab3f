//! The physical blocks: reference counts, the free queue (LRU) and the hash → block map.
//!
//! Like vLLM's `BlockPool`: a block whose reference count drops to zero joins the tail of the
//! free queue and keeps its hash, so it can still be hit by a later request ("touch" takes it out
//! of the queue again). New blocks come from the head of the queue: the least recently freed
//! block is reused first, and if it was cached its hash is evicted (a `BlockRemoved` event).
//! At most one block holds a given hash; a second block computing the same content stays
//! uncached (so a subscriber keeping a set of hashes stays exact).

use std::collections::BTreeMap;

use fnv::FnvHashMap;

use super::events::{KvEvent, MEDIUM_GPU};

/// Index of a physical block.
pub(crate) type BlockId = u32;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
    /// Position in the free queue, `Some` exactly when `ref_cnt == 0`.
    free_stamp: Option<u64>,
}

#[derive(Debug, Clone)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    /// Free queue ordered by the time a block was freed: first entry = next to reuse.
    free: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    cached: FnvHashMap<u64, BlockId>,
}

impl BlockPool {
    pub(crate) fn new(num_blocks: u32) -> BlockPool {
        let mut pool = BlockPool {
            blocks: vec![Block::default(); num_blocks as usize],
            free: BTreeMap::new(),
            next_stamp: 0,
            cached: FnvHashMap::default(),
        };
        for id in 0..num_blocks {
            pool.push_free(id);
        }
        pool
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.ref_cnt)
    }

    pub(crate) fn hash(&self, id: BlockId) -> Option<u64> {
        self.blocks.get(id as usize).and_then(|b| b.hash)
    }

    /// The block holding `hash`, if cached.
    pub(crate) fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    pub(crate) fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.cached.keys().copied()
    }

    pub(crate) fn num_cached(&self) -> usize {
        self.cached.len()
    }

    fn push_free(&mut self, id: BlockId) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(block) = self.blocks.get_mut(id as usize) {
            block.free_stamp = Some(stamp);
            self.free.insert(stamp, id);
        }
    }

    /// Takes a reference; a free block leaves the free queue.
    pub(crate) fn touch(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id as usize) else {
            return;
        };
        if let Some(stamp) = block.free_stamp.take() {
            self.free.remove(&stamp);
        }
        block.ref_cnt = block.ref_cnt.saturating_add(1);
    }

    /// Drops a reference; at zero the block joins the tail of the free queue, keeping its hash.
    pub(crate) fn release(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id as usize) else {
            return;
        };
        debug_assert!(block.ref_cnt > 0, "block {id} released with no reference");
        if block.ref_cnt == 0 {
            return;
        }
        block.ref_cnt -= 1;
        if block.ref_cnt == 0 {
            self.push_free(id);
        }
    }

    /// Takes the least recently freed block (with one reference), evicting its hash.
    pub(crate) fn allocate(&mut self, events: &mut Vec<KvEvent>) -> Option<BlockId> {
        let (_, id) = self.free.pop_first()?;
        let block = self.blocks.get_mut(id as usize)?;
        block.free_stamp = None;
        block.ref_cnt = 1;
        if let Some(hash) = block.hash.take() {
            if self.cached.get(&hash) == Some(&id) {
                self.cached.remove(&hash);
            }
            events.push(KvEvent::BlockRemoved {
                block_hashes: vec![hash],
                medium: MEDIUM_GPU,
            });
        }
        Some(id)
    }

    /// Marks `id` as holding `hash`; false (and no change) when another block holds it already.
    pub(crate) fn cache(&mut self, id: BlockId, hash: u64) -> bool {
        if self.cached.contains_key(&hash) {
            return false;
        }
        let Some(block) = self.blocks.get_mut(id as usize) else {
            return false;
        };
        if block.hash.is_some() {
            return false;
        }
        block.hash = Some(hash);
        self.cached.insert(hash, id);
        true
    }

    /// Drops every hash (blocks stay where they are in the free queue).
    pub(crate) fn clear_cache(&mut self) {
        self.cached.clear();
        for block in &mut self.blocks {
            block.hash = None;
        }
    }

    /// Checks the pool's own invariants.
    pub(crate) fn check(&self) -> Result<(), String> {
        for (id, block) in self.blocks.iter().enumerate() {
            match block.free_stamp {
                Some(stamp) if block.ref_cnt == 0 => {
                    if self.free.get(&stamp) != Some(&(id as BlockId)) {
                        return Err(format!("block {id} not at its place in the free queue"));
                    }
                }
                None if block.ref_cnt > 0 => {}
                _ => {
                    return Err(format!(
                        "block {id}: ref_cnt {} but free_stamp {:?}",
                        block.ref_cnt, block.free_stamp
                    ))
                }
            }
            if let Some(hash) = block.hash {
                if self.cached.get(&hash) != Some(&(id as BlockId)) {
                    return Err(format!(
                        "block {id} has hash {hash:#x} missing from the map"
                    ));
                }
            }
        }
        if self.free.len() != self.blocks.iter().filter(|b| b.ref_cnt == 0).count() {
            return Err("free queue length differs from unreferenced blocks".to_owned());
        }
        for (&hash, &id) in &self.cached {
            if self.hash(id) != Some(hash) {
                return Err(format!("map entry {hash:#x} -> {id} not held by the block"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_reuses_least_recently_freed_and_evicts_hashes() {
        let mut pool = BlockPool::new(3);
        let mut events = Vec::new();
        let a = pool.allocate(&mut events).unwrap();
        let b = pool.allocate(&mut events).unwrap();
        assert!(pool.cache(a, 10));
        assert!(pool.cache(b, 11));
        assert!(!pool.cache(b, 10), "a hash is held by one block only");
        pool.release(b);
        pool.release(a);
        // Free queue: [2, b, a]: block 2 first, then b (freed before a).
        assert_eq!(pool.allocate(&mut events), Some(2));
        assert!(events.is_empty());
        assert_eq!(pool.allocate(&mut events), Some(b));
        assert_eq!(
            events,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![11],
                medium: MEDIUM_GPU
            }]
        );
        assert_eq!(pool.lookup(10), Some(a));
        pool.touch(a);
        assert_eq!(pool.num_free(), 0);
        assert_eq!(pool.allocate(&mut events), None);
        pool.check().unwrap();
    }

    #[test]
    fn release_never_underflows_in_release_builds() {
        let mut pool = BlockPool::new(1);
        pool.touch(0);
        pool.release(0);
        assert_eq!(pool.ref_cnt(0), 0);
        assert_eq!(pool.num_free(), 1);
        pool.check().unwrap();
    }
}
