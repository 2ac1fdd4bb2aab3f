//! The prefix index: which endpoint is believed to hold which prefix block.
//!
//! Each endpoint keeps an LRU set of block keys sized like its KV cache, so memory is bounded
//! by `endpoints x capacity`. Because keys are chained, an endpoint's match for a request is
//! the longest run of the request's keys, from the first, that the endpoint holds.

use crate::endpoint::EndpointId;
use crate::lru::LruSet;
use crate::prefix::BlockKey;

#[derive(Clone, Debug)]
pub struct PrefixIndex {
    endpoints: Vec<LruSet>,
    capacity: usize,
    seed: u64,
}

impl PrefixIndex {
    /// `seed` keys the index's hash maps; pass something the client does not know.
    pub fn new(endpoints: usize, capacity_per_endpoint: usize, seed: u64) -> Self {
        let mut index = PrefixIndex {
            endpoints: Vec::new(),
            capacity: capacity_per_endpoint,
            seed,
        };
        index.resize(endpoints);
        index
    }

    /// The most memory an index of `endpoints` endpoints of `capacity_per_endpoint` blocks
    /// holds (see [`LruSet::max_bytes`]); checked against [`crate::INDEX_MEMORY_LIMIT`] when the
    /// configuration is read.
    pub fn max_bytes(endpoints: usize, capacity_per_endpoint: usize) -> u64 {
        let full = LruSet::max_bytes(capacity_per_endpoint);
        // Every set full, and one growing (its old table, half the size, still held).
        full.saturating_mul(endpoints as u64)
            .saturating_add(full / 2)
    }

    /// Grows or shrinks the id space to `endpoints` (the pool changed). New endpoints start
    /// empty; those cut off are forgotten.
    pub fn resize(&mut self, endpoints: usize) {
        self.endpoints.truncate(endpoints);
        let (capacity, seed) = (self.capacity, self.seed);
        for i in self.endpoints.len()..endpoints {
            self.endpoints
                .push(LruSet::new(capacity, seed ^ (i as u64)));
        }
    }

    /// Number of leading `keys` that `endpoint` holds.
    pub fn matched(&self, endpoint: EndpointId, keys: &[BlockKey]) -> usize {
        let Some(set) = self.endpoints.get(endpoint.index()) else {
            return 0;
        };
        keys.iter().take_while(|k| set.contains(k.0)).count()
    }

    /// Records that `endpoint` now holds `keys` (it is serving a request with this prefix).
    /// Keys are touched last-first so that, as in vLLM's free queue, a chain's tail is evicted
    /// before its head: the head is what other requests share.
    pub fn record(&mut self, endpoint: EndpointId, keys: &[BlockKey]) {
        if let Some(set) = self.endpoints.get_mut(endpoint.index()) {
            for k in keys.iter().rev() {
                set.touch(k.0);
            }
        }
    }

    /// Blocks remembered for `endpoint`.
    pub fn blocks(&self, endpoint: EndpointId) -> usize {
        self.endpoints.get(endpoint.index()).map_or(0, LruSet::len)
    }

    pub fn clear_endpoint(&mut self, endpoint: EndpointId) {
        if let Some(set) = self.endpoints.get_mut(endpoint.index()) {
            set.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &[u64]) -> Vec<BlockKey> {
        v.iter().copied().map(BlockKey).collect()
    }

    #[test]
    fn longest_consecutive_prefix() {
        let mut idx = PrefixIndex::new(2, 100, 3);
        idx.record(EndpointId(0), &keys(&[1, 2, 3]));
        idx.record(EndpointId(1), &keys(&[1, 5]));
        assert_eq!(idx.matched(EndpointId(0), &keys(&[1, 2, 3, 4])), 3);
        assert_eq!(idx.matched(EndpointId(1), &keys(&[1, 2, 3, 4])), 1);
        // a hole stops the match even if later keys are held
        assert_eq!(idx.matched(EndpointId(0), &keys(&[1, 9, 3])), 1);
        assert_eq!(idx.matched(EndpointId(7), &keys(&[1])), 0);
    }

    #[test]
    fn bounded_per_endpoint() {
        let mut idx = PrefixIndex::new(1, 4, 0);
        idx.record(EndpointId(0), &keys(&[1, 2, 3, 4, 5, 6]));
        assert_eq!(idx.blocks(EndpointId(0)), 4);
        // the head of the chain survives, the tail went first
        assert_eq!(idx.matched(EndpointId(0), &keys(&[1, 2, 3, 4, 5, 6])), 4);
        idx.record(EndpointId(0), &keys(&[7, 8]));
        assert_eq!(idx.matched(EndpointId(0), &keys(&[1, 2, 3, 4])), 2);
        assert_eq!(idx.matched(EndpointId(0), &keys(&[7, 8])), 2);
    }
}
