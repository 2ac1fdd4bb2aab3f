//! The paged KV cache with prefix caching, like vLLM v1's `KVCacheManager`.
//!
//! - Blocks hold `block_size` tokens. A full block's hash chains over the token ids:
//!   `h_0 = xxh3(0x00 ‖ tokens_0)`, `h_i = xxh3(0x01 ‖ le64(h_{i-1}) ‖ tokens_i)` (token ids as
//!   little-endian u32). Only full blocks are cached.
//! - Admission looks up the longest run of cached blocks from the start of the sequence, capped
//!   so that at least one token is computed (vLLM recomputes the last token of a fully cached
//!   prompt to get logits).
//! - Blocks are cached (and `BlockStored` is emitted) when the step that fills them is
//!   scheduled, as vLLM does; consecutive newly cached blocks of one sequence go in one event.
//!   A block whose hash another block already holds stays uncached and unannounced.
//! - A finished or preempted sequence frees its blocks tail first, so that when they are later
//!   reused in LRU order the tail goes before the head and shared prefixes survive longer.
//! - Usage counts referenced blocks only (`vllm:kv_cache_usage_perc`): cached blocks that no
//!   request holds are free, reusable, and not counted.
//! - With a CPU offload tier ([`CpuTier`]), every block cached on GPU is also stored there
//!   (write-through, as vLLM's `OffloadingConnector` stores each computed block): a
//!   `BlockStored` CPU follows the GPU one for the blocks the tier did not hold, after a
//!   `BlockRemoved` CPU for each block it evicted to make room. GPU eviction leaves the CPU copy.
//!   Admission continues the GPU prefix lookup on the tier; blocks found there are loaded: given
//!   fresh GPU blocks, counted as computed, and cached on GPU again.

use super::block_pool::{BlockId, BlockPool};
use super::cpu_tier::CpuTier;
use super::events::{KvEvent, MEDIUM_CPU, MEDIUM_GPU};

/// The blocks one sequence holds, and the hash chain of its full blocks.
#[derive(Debug, Clone, Default)]
pub(crate) struct SeqBlocks {
    /// Physical blocks, in sequence order.
    pub(crate) blocks: Vec<BlockId>,
    /// Hashes of the sequence's full blocks, computed so far (kept across preemption).
    hashes: Vec<u64>,
    /// How many leading blocks have been through caching.
    num_cached: usize,
}

/// The KV cache: a block pool plus prefix-cache bookkeeping and an event queue.
#[derive(Debug, Clone)]
pub(crate) struct KvCache {
    pool: BlockPool,
    cpu: CpuTier,
    block_size: usize,
    events: Vec<KvEvent>,
    scratch: Vec<u8>,
}

/// Hash of one full block of `tokens` chained to its parent block's hash (`None` for the first
/// block), the chain in this module's doc; `scratch` is reused across calls. The hashes the
/// engine's `BlockStored` events carry, so kvoy-bench's mirror of an engine's cache computes a
/// prompt's hashes with it.
pub fn block_hash(scratch: &mut Vec<u8>, parent: Option<u64>, tokens: &[u32]) -> u64 {
    scratch.clear();
    match parent {
        None => scratch.push(0),
        Some(p) => {
            scratch.push(1);
            scratch.extend_from_slice(&p.to_le_bytes());
        }
    }
    for t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(scratch)
}

impl KvCache {
    /// `block_size` must be at least 1 (checked by `Profile::validate`; 0 is treated as 1);
    /// `cpu_blocks` 0 is no CPU tier.
    pub(crate) fn new(num_blocks: u32, block_size: u32, cpu_blocks: u32) -> KvCache {
        KvCache {
            pool: BlockPool::new(num_blocks),
            cpu: CpuTier::new(cpu_blocks),
            block_size: (block_size as usize).max(1),
            events: Vec::new(),
            scratch: Vec::new(),
        }
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Extends `seq.hashes` to cover the first `upto` blocks of `tokens` (all full).
    fn extend_hashes(&mut self, seq: &mut SeqBlocks, tokens: &[u32], upto: usize) {
        let bs = self.block_size;
        let upto = upto.min(tokens.len() / bs);
        while seq.hashes.len() < upto {
            let i = seq.hashes.len();
            let parent = i.checked_sub(1).and_then(|p| seq.hashes.get(p).copied());
            let h = block_hash(&mut self.scratch, parent, &tokens[i * bs..(i + 1) * bs]);
            seq.hashes.push(h);
        }
    }

    /// The longest run of cached blocks at the start of `tokens` (at most `(len - 1) / bs`
    /// blocks). Takes no references: pass the result to [`KvCache::allocate_slots`].
    pub(crate) fn computed_blocks(&mut self, seq: &mut SeqBlocks, tokens: &[u32]) -> Vec<BlockId> {
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        self.extend_hashes(seq, tokens, max_blocks);
        seq.hashes
            .iter()
            .take(max_blocks)
            .map_while(|&h| self.pool.lookup(h))
            .collect()
    }

    /// How many blocks after the first `from` (the GPU hits of [`KvCache::computed_blocks`],
    /// called first) are on the CPU tier, consecutively, under the same cap.
    pub(crate) fn loadable_blocks(&self, seq: &SeqBlocks, tokens: &[u32], from: usize) -> usize {
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        seq.hashes
            .iter()
            .take(max_blocks)
            .skip(from)
            .take_while(|&&h| self.cpu.contains(h))
            .count()
    }

    /// True when there is a CPU tier.
    pub(crate) fn offload_enabled(&self) -> bool {
        self.cpu.enabled()
    }

    /// Makes room for `num_new` more tokens after `num_computed` computed ones plus the cache
    /// hits `new_computed` and `loaded` blocks loaded from the CPU tier (both only on admission,
    /// when the sequence holds no block yet). Returns false, changing nothing, when too few
    /// blocks are free. On success, caches the blocks that this step fills (loaded ones
    /// included) and queues the events.
    pub(crate) fn allocate_slots(
        &mut self,
        seq: &mut SeqBlocks,
        tokens: &[u32],
        num_computed: usize,
        new_computed: &[BlockId],
        loaded: usize,
        num_new: usize,
    ) -> bool {
        let bs = self.block_size;
        let total = num_computed + (new_computed.len() + loaded) * bs + num_new;
        let needed = total.div_ceil(bs);
        let have = seq.blocks.len() + new_computed.len();
        let to_allocate = needed.saturating_sub(have);
        let evictable_hits = new_computed
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == 0)
            .count();
        if to_allocate + evictable_hits > self.pool.num_free() {
            return false;
        }
        for &b in new_computed {
            self.pool.touch(b);
            seq.blocks.push(b);
        }
        for _ in 0..to_allocate {
            match self.pool.allocate(&mut self.events) {
                Some(b) => seq.blocks.push(b),
                None => break, // unreachable: counted above
            }
        }
        // A hit makes the loaded blocks the tier's most recent, before the write-through below
        // can evict anything.
        let first_loaded = new_computed.len();
        if let Some(hashes) = seq.hashes.get(first_loaded..first_loaded + loaded) {
            for &h in hashes {
                self.cpu.touch(h);
            }
        }
        self.cache_full_blocks(seq, tokens, total);
        true
    }

    /// Caches the full blocks among the first `total` tokens that are not cached yet.
    fn cache_full_blocks(&mut self, seq: &mut SeqBlocks, tokens: &[u32], total: usize) {
        let bs = self.block_size;
        let full = (total.min(tokens.len()) / bs).min(seq.blocks.len());
        if full <= seq.num_cached {
            return;
        }
        self.extend_hashes(seq, tokens, full);
        let mut run_start: Option<usize> = None;
        for i in seq.num_cached..full {
            let (block, hash) = (seq.blocks[i], seq.hashes[i]);
            let newly = self.pool.hash(block).is_none() && self.pool.cache(block, hash);
            match (newly, run_start) {
                (true, None) => run_start = Some(i),
                (false, Some(start)) => {
                    self.emit_stored(seq, tokens, start, i);
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(start) = run_start {
            self.emit_stored(seq, tokens, start, full);
        }
        seq.num_cached = full;
    }

    /// Announces blocks `start..end` of `seq` newly cached on GPU, and writes them through to
    /// the CPU tier.
    fn emit_stored(&mut self, seq: &SeqBlocks, tokens: &[u32], start: usize, end: usize) {
        self.push_stored(seq, tokens, start, end, MEDIUM_GPU);
        if !self.cpu.enabled() {
            return;
        }
        let fresh = self.cpu.store(&seq.hashes[start..end], &mut self.events);
        // One CPU event per run of consecutive newly stored blocks, as on GPU.
        let mut run_start: Option<usize> = None;
        for (i, &new) in (start..end).zip(fresh.iter()) {
            match (new, run_start) {
                (true, None) => run_start = Some(i),
                (false, Some(s)) => {
                    self.push_stored(seq, tokens, s, i, MEDIUM_CPU);
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = run_start {
            self.push_stored(seq, tokens, s, end, MEDIUM_CPU);
        }
    }

    /// A `BlockStored` for blocks `start..end` of `seq`. On the GPU with their parent and
    /// token ids; on the CPU tier as vLLM's offloading connector announces its stores: the
    /// hashes only (no parent, no token ids).
    fn push_stored(
        &mut self,
        seq: &SeqBlocks,
        tokens: &[u32],
        start: usize,
        end: usize,
        medium: &'static str,
    ) {
        let bs = self.block_size;
        let gpu = medium == MEDIUM_GPU;
        self.events.push(KvEvent::BlockStored {
            block_hashes: seq.hashes[start..end].to_vec(),
            parent_block_hash: start.checked_sub(1).filter(|_| gpu).map(|p| seq.hashes[p]),
            token_ids: if gpu {
                tokens[start * bs..end * bs].to_vec()
            } else {
                Vec::new()
            },
            block_size: bs as u32,
            medium,
        });
    }

    /// Releases every block of `seq`, tail first; their hashes stay cached until evicted.
    pub(crate) fn free(&mut self, seq: &mut SeqBlocks) {
        for &b in seq.blocks.iter().rev() {
            self.pool.release(b);
        }
        seq.blocks.clear();
        seq.num_cached = 0;
    }

    /// Drops the prefix cache, both tiers, if no block is referenced (vLLM's
    /// `reset_prefix_cache`; vLLM clears the offload tier too when asked with
    /// `reset_connector`): queues one `AllBlocksCleared` and returns true; otherwise changes
    /// nothing and returns false.
    pub(crate) fn reset(&mut self) -> bool {
        if self.pool.num_free() != self.pool.num_blocks() {
            return false;
        }
        self.pool.clear_cache();
        self.cpu.clear();
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// Events queued since the last call, in order.
    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Referenced blocks / all blocks.
    pub(crate) fn usage(&self) -> f64 {
        let n = self.pool.num_blocks();
        if n == 0 {
            return 0.0;
        }
        (n - self.pool.num_free()) as f64 / n as f64
    }

    pub(crate) fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached()
    }

    pub(crate) fn cached_block_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.pool.cached_hashes()
    }

    /// The hashes on the CPU tier.
    pub(crate) fn cpu_block_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.cpu.hashes()
    }

    pub(crate) fn num_cpu_blocks(&self) -> usize {
        self.cpu.len()
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub(crate) fn ref_cnt(&self, id: BlockId) -> u32 {
        self.pool.ref_cnt(id)
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        self.pool.check()?;
        self.cpu.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| i.wrapping_mul(31).wrapping_add(salt))
            .collect()
    }

    /// The chain in the module's doc, its bytes written out: other crates' tests compute the
    /// engine's hashes with [`block_hash`] and rely on it.
    #[test]
    fn block_hash_is_xxh3_of_the_documented_bytes() {
        use xxhash_rust::xxh3::xxh3_64;
        let mut scratch = Vec::new();
        let first = block_hash(&mut scratch, None, &[1, 0x0302]);
        assert_eq!(first, xxh3_64(&[0, 1, 0, 0, 0, 2, 3, 0, 0]));
        let parent = 0x0807_0605_0403_0201;
        assert_eq!(
            block_hash(&mut scratch, Some(parent), &[9]),
            xxh3_64(&[1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0])
        );
    }

    #[test]
    fn prefix_hit_is_capped_below_the_last_token_and_whole_blocks() {
        let mut cache = KvCache::new(16, 4, 0);
        let t = tokens(12, 0);
        let mut a = SeqBlocks::default();
        assert!(cache.computed_blocks(&mut a, &t).is_empty());
        assert!(cache.allocate_slots(&mut a, &t, 0, &[], 0, 12));
        let events = cache.take_events();
        assert_eq!(events.len(), 1, "three blocks in one BlockStored");
        let KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            ..
        } = &events[0]
        else {
            panic!("expected BlockStored");
        };
        assert_eq!(block_hashes.len(), 3);
        assert_eq!(*parent_block_hash, None);
        assert_eq!(token_ids, &t);
        // Same 12 tokens again: 2 blocks hit (the last token must be recomputed).
        let mut b = SeqBlocks::default();
        assert_eq!(cache.computed_blocks(&mut b, &t).len(), 2);
        // 13 tokens sharing 12: all 3 blocks hit.
        let mut longer = t.clone();
        longer.push(99);
        let mut c = SeqBlocks::default();
        assert_eq!(cache.computed_blocks(&mut c, &longer).len(), 3);
        cache.check().unwrap();
    }

    #[test]
    fn decode_fills_blocks_and_chains_parents() {
        let mut cache = KvCache::new(16, 4, 0);
        let mut t = tokens(6, 1);
        let mut s = SeqBlocks::default();
        assert!(cache.allocate_slots(&mut s, &t, 0, &[], 0, 6));
        let first = cache.take_events();
        assert_eq!(first.len(), 1);
        t.extend([7, 8]); // two decode steps: tokens 6 and 7 computed
        assert!(cache.allocate_slots(&mut s, &t, 6, &[], 0, 1));
        assert!(cache.take_events().is_empty());
        assert!(cache.allocate_slots(&mut s, &t, 7, &[], 0, 1));
        let second = cache.take_events();
        let (
            KvEvent::BlockStored {
                block_hashes: h0, ..
            },
            KvEvent::BlockStored {
                block_hashes: h1,
                parent_block_hash,
                ..
            },
        ) = (&first[0], &second[0])
        else {
            panic!("expected two BlockStored");
        };
        assert_eq!(*parent_block_hash, Some(h0[0]));
        assert_eq!(h1.len(), 1);
        assert_eq!(s.blocks.len(), 2);
    }

    #[test]
    fn allocation_fails_without_change_and_eviction_emits_removed() {
        let mut cache = KvCache::new(2, 4, 0);
        let mut a = SeqBlocks::default();
        let t = tokens(8, 2);
        assert!(cache.allocate_slots(&mut a, &t, 0, &[], 0, 8));
        let mut b = SeqBlocks::default();
        let u = tokens(4, 3);
        assert!(!cache.allocate_slots(&mut b, &u, 0, &[], 0, 4));
        assert!(b.blocks.is_empty());
        cache.free(&mut a);
        assert_eq!(cache.usage(), 0.0);
        assert_eq!(cache.num_cached_blocks(), 2);
        cache.take_events();
        assert!(cache.allocate_slots(&mut b, &u, 0, &[], 0, 4));
        // Tail block of `a` was freed first, so it is evicted first; the head survives.
        let events = cache.take_events();
        assert!(
            matches!(&events[0], KvEvent::BlockRemoved { block_hashes, .. }
            if block_hashes[0] == a.hashes[1])
        );
        let mut again = SeqBlocks::default();
        assert_eq!(cache.computed_blocks(&mut again, &t).len(), 1);
        cache.check().unwrap();
    }

    #[test]
    fn reset_only_when_idle() {
        let mut cache = KvCache::new(4, 4, 0);
        let mut a = SeqBlocks::default();
        let t = tokens(8, 4);
        assert!(cache.allocate_slots(&mut a, &t, 0, &[], 0, 8));
        assert!(!cache.reset());
        cache.free(&mut a);
        cache.take_events();
        assert!(cache.reset());
        assert_eq!(cache.take_events(), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(cache.cached_block_hashes().count(), 0);
        cache.check().unwrap();
    }

    /// The block hashes `events` store (`stored`) or remove (`!stored`) on `medium`, in order.
    fn hashes_of(events: &[KvEvent], medium: &str, stored: bool) -> Vec<u64> {
        events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    medium: m,
                    ..
                }
                | KvEvent::BlockRemoved {
                    block_hashes,
                    medium: m,
                } if *m == medium && matches!(e, KvEvent::BlockStored { .. }) == stored => {
                    Some(block_hashes)
                }
                _ => None,
            })
            .flatten()
            .copied()
            .collect()
    }

    fn stored(events: &[KvEvent], medium: &str) -> Vec<u64> {
        hashes_of(events, medium, true)
    }

    fn removed(events: &[KvEvent], medium: &str) -> Vec<u64> {
        hashes_of(events, medium, false)
    }

    fn run(cache: &mut KvCache, t: &[u32]) -> (SeqBlocks, Vec<KvEvent>) {
        let mut s = SeqBlocks::default();
        let hits = cache.computed_blocks(&mut s, t);
        let loaded = cache.loadable_blocks(&s, t, hits.len());
        let n = t.len() - (hits.len() + loaded) * cache.block_size();
        assert!(cache.allocate_slots(&mut s, t, 0, &hits, loaded, n));
        cache.free(&mut s);
        (s, cache.take_events())
    }

    #[test]
    fn write_through_stores_the_same_blocks_on_cpu() {
        let mut cache = KvCache::new(16, 4, 8);
        let t = tokens(12, 10);
        let (s, events) = run(&mut cache, &t);
        assert_eq!(events.len(), 2, "{events:?}");
        let KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            medium,
            ..
        } = &events[1]
        else {
            panic!("expected BlockStored CPU");
        };
        assert_eq!(*medium, MEDIUM_CPU);
        assert_eq!(block_hashes, &s.hashes);
        // As vLLM's offloading connector: hashes only.
        assert_eq!(*parent_block_hash, None);
        assert!(token_ids.is_empty());
        let (
            KvEvent::BlockStored { block_size: g, .. },
            KvEvent::BlockStored { block_size: c, .. },
        ) = (&events[0], &events[1])
        else {
            panic!("expected two BlockStored");
        };
        assert_eq!((g, c), (&4, &4));
        // A longer prompt sharing the prefix stores only its new block (chained to the prefix
        // on the GPU, a bare hash on the CPU tier).
        let mut longer = t.clone();
        longer.extend(tokens(5, 11));
        let (l, events) = run(&mut cache, &longer);
        assert_eq!(stored(&events, MEDIUM_CPU), vec![l.hashes[3]]);
        assert!(events.iter().any(|e| matches!(e,
            KvEvent::BlockStored { medium, parent_block_hash, .. }
            if *medium == MEDIUM_GPU && *parent_block_hash == Some(s.hashes[2]))));
        assert_eq!(cache.num_cpu_blocks(), 4);
        cache.check().unwrap();
    }

    #[test]
    fn gpu_eviction_keeps_the_cpu_copy_and_cpu_eviction_is_announced() {
        // 3 GPU blocks, 4 CPU blocks; prompts of 2 full blocks + 1 token.
        let mut cache = KvCache::new(3, 4, 4);
        let a = tokens(9, 20);
        let (sa, _) = run(&mut cache, &a);
        let b = tokens(9, 21);
        let (sb, events) = run(&mut cache, &b);
        // b took a's blocks: GPU removals of a, no CPU removal, a still on CPU.
        let gpu_removed = removed(&events, MEDIUM_GPU);
        assert_eq!(gpu_removed.len(), 2, "{events:?}");
        assert!(gpu_removed.iter().all(|h| sa.hashes.contains(h)));
        assert!(removed(&events, MEDIUM_CPU).is_empty());
        let cpu: Vec<u64> = cache.cpu_block_hashes().collect();
        assert!(sa.hashes[..2].iter().all(|h| cpu.contains(h)));
        assert_eq!(stored(&events, MEDIUM_CPU), sb.hashes[..2]);
        // A third prompt overflows the CPU tier: a's blocks, the least recently used, go.
        let c = tokens(9, 22);
        let (sc, events) = run(&mut cache, &c);
        let mut cpu_removed = removed(&events, MEDIUM_CPU);
        cpu_removed.sort_unstable();
        let mut expected = sa.hashes[..2].to_vec();
        expected.sort_unstable();
        assert_eq!(cpu_removed, expected);
        assert_eq!(stored(&events, MEDIUM_CPU), sc.hashes[..2]);
        // Each CPU removal precedes the CPU store that needed the room.
        let last_removed = events.iter().rposition(
            |e| matches!(e, KvEvent::BlockRemoved { medium, .. } if *medium == MEDIUM_CPU),
        );
        let cpu_stored = events.iter().position(
            |e| matches!(e, KvEvent::BlockStored { medium, .. } if *medium == MEDIUM_CPU),
        );
        assert!(last_removed < cpu_stored);
        cache.check().unwrap();
    }

    #[test]
    fn a_prefix_evicted_from_gpu_loads_from_cpu() {
        let mut cache = KvCache::new(3, 4, 8);
        let a = tokens(9, 30);
        let (sa, _) = run(&mut cache, &a);
        run(&mut cache, &tokens(9, 31)); // evicts a's two blocks from GPU
        let mut s = SeqBlocks::default();
        let hits = cache.computed_blocks(&mut s, &a);
        assert!(hits.is_empty(), "not on GPU any more");
        assert_eq!(
            cache.loadable_blocks(&s, &a, 0),
            2,
            "capped below the last token"
        );
        assert!(cache.allocate_slots(&mut s, &a, 0, &hits, 2, 1));
        let events = cache.take_events();
        assert_eq!(
            stored(&events, MEDIUM_GPU),
            sa.hashes[..2],
            "cached on GPU again"
        );
        assert!(stored(&events, MEDIUM_CPU).is_empty(), "already on CPU");
        let gpu: Vec<u64> = cache.cached_block_hashes().collect();
        assert!(sa.hashes[..2].iter().all(|h| gpu.contains(h)));
        cache.free(&mut s);
        // Loading touched a's blocks: the next overflow evicts the other prompt's instead.
        let mut cache2 = cache.clone();
        run(&mut cache2, &tokens(9, 32));
        run(&mut cache2, &tokens(9, 33));
        let cpu: Vec<u64> = cache2.cpu_block_hashes().collect();
        assert!(sa.hashes[..2].iter().all(|h| cpu.contains(h)), "{cpu:?}");
        cache.check().unwrap();
    }

    #[test]
    fn the_cpu_lookup_follows_gpu_hits_and_stops_at_a_miss() {
        let mut cache = KvCache::new(8, 4, 8);
        let a = tokens(17, 40); // 4 full blocks
        run(&mut cache, &a);
        let mut s = SeqBlocks::default();
        let hits = cache.computed_blocks(&mut s, &a);
        assert_eq!(hits.len(), 4);
        assert_eq!(cache.loadable_blocks(&s, &a, 4), 0, "nothing after the cap");
        // Only CPU: a fresh GPU with the same CPU tier.
        let mut other = KvCache::new(8, 4, 8);
        other.cpu = cache.cpu.clone();
        let mut s = SeqBlocks::default();
        let mut b = a[..8].to_vec();
        b.extend(tokens(9, 41)); // shares 2 blocks
        assert!(other.computed_blocks(&mut s, &b).is_empty());
        assert_eq!(other.loadable_blocks(&s, &b, 0), 2);
    }

    #[test]
    fn reset_clears_both_tiers() {
        let mut cache = KvCache::new(4, 4, 4);
        run(&mut cache, &tokens(9, 50));
        assert!(cache.num_cpu_blocks() > 0);
        assert!(cache.reset());
        assert_eq!(cache.take_events(), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(cache.num_cpu_blocks(), 0);
        assert_eq!(cache.cached_block_hashes().count(), 0);
        cache.check().unwrap();
    }

    #[test]
    fn without_a_cpu_tier_events_are_gpu_only_and_unchanged() {
        // A workload with GPU hits and GPU evictions but no CPU load (nothing comes back after
        // its GPU eviction): with a tier, the events are the same plus CPU ones.
        let (mut off, mut on) = (KvCache::new(6, 4, 0), KvCache::new(6, 4, 3));
        let is_cpu = |e: &KvEvent| {
            matches!(e, KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. }
                if *medium == MEDIUM_CPU)
        };
        let (mut cpu_events, mut gpu_removals) = (0, 0);
        for salt in [60, 61, 60, 62, 63, 64] {
            let t = tokens(9, salt);
            let (_, a) = run(&mut off, &t);
            let (_, b) = run(&mut on, &t);
            assert!(a.iter().all(|e| !is_cpu(e)), "{a:?}");
            gpu_removals += removed(&a, MEDIUM_GPU).len();
            cpu_events += b.iter().filter(|e| is_cpu(e)).count();
            let gpu_only: Vec<KvEvent> = b.into_iter().filter(|e| !is_cpu(e)).collect();
            assert_eq!(a, gpu_only, "salt {salt}");
        }
        assert!(
            cpu_events > 0 && gpu_removals > 0,
            "{cpu_events} {gpu_removals}"
        );
        assert_eq!(off.num_cpu_blocks(), 0);
        assert_eq!(on.num_cpu_blocks(), 3);
        off.check().unwrap();
        on.check().unwrap();
    }
}
