//! A bounded set of `u64` keys with least-recently-used eviction.
//!
//! Nodes live in a slab linked by `u32` indices; the map is keyed by the block key through a
//! seeded mixer, so crafted keys cannot pile into one bucket chain without knowing the seed.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// Hashes `u64` keys with one multiply, mixed with a seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct SeededU64 {
    seed: u64,
}

impl SeededU64 {
    pub fn new(seed: u64) -> Self {
        SeededU64 { seed }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct SeededU64Hasher {
    seed: u64,
    state: u64,
}

impl Hasher for SeededU64Hasher {
    fn finish(&self) -> u64 {
        self.state
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u64(&mut self, k: u64) {
        let x = (k ^ self.seed ^ self.state.rotate_left(23)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.state = x ^ (x >> 29);
    }
}

impl BuildHasher for SeededU64 {
    type Hasher = SeededU64Hasher;
    fn build_hasher(&self) -> SeededU64Hasher {
        SeededU64Hasher {
            seed: self.seed,
            state: 0,
        }
    }
}

#[derive(Clone, Debug)]
pub struct LruSet {
    capacity: usize,
    map: HashMap<u64, u32, SeededU64>,
    nodes: Vec<Node>,
    /// Most recently used.
    head: u32,
    /// Least recently used: evicted first.
    tail: u32,
}

impl LruSet {
    pub fn new(capacity: usize, seed: u64) -> Self {
        let capacity = capacity.max(1);
        LruSet {
            capacity,
            map: HashMap::with_hasher(SeededU64::new(seed)),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, i: u32) {
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    /// Inserts `key` or marks it most recently used. Returns the key evicted to make room.
    pub fn touch(&mut self, key: u64) -> Option<u64> {
        if let Some(&i) = self.map.get(&key) {
            if self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return None;
        }
        if self.map.len() < self.capacity {
            let i = self.nodes.len() as u32;
            self.nodes.push(Node {
                key,
                prev: NIL,
                next: NIL,
            });
            self.map.insert(key, i);
            self.push_front(i);
            return None;
        }
        // Full: reuse the least recently used node.
        let i = self.tail;
        let old = self.nodes[i as usize].key;
        self.unlink(i);
        self.map.remove(&old);
        self.nodes[i as usize].key = key;
        self.map.insert(key, i);
        self.push_front(i);
        Some(old)
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.nodes.clear();
        self.head = NIL;
        self.tail = NIL;
    }

    /// Keys from most to least recently used (tests and debugging).
    pub fn iter_mru(&self) -> impl Iterator<Item = u64> + '_ {
        let mut i = self.head;
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let n = self.nodes[i as usize];
            i = n.next;
            Some(n.key)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut l = LruSet::new(3, 1);
        assert_eq!(l.touch(1), None);
        assert_eq!(l.touch(2), None);
        assert_eq!(l.touch(3), None);
        assert_eq!(l.touch(1), None); // 1 is now most recent
        assert_eq!(l.touch(4), Some(2));
        assert_eq!(l.iter_mru().collect::<Vec<_>>(), vec![4, 1, 3]);
        assert_eq!(l.touch(5), Some(3));
        assert!(l.contains(1) && l.contains(4) && l.contains(5) && !l.contains(2));
        assert_eq!(l.len(), 3);
    }

    #[test]
    fn capacity_one() {
        let mut l = LruSet::new(1, 0);
        l.touch(9);
        assert_eq!(l.touch(9), None);
        assert_eq!(l.touch(8), Some(9));
        assert_eq!(l.iter_mru().collect::<Vec<_>>(), vec![8]);
    }

    #[test]
    fn matches_a_model_under_random_use() {
        // Compare with a naive Vec-based LRU.
        let mut l = LruSet::new(16, 7);
        let mut model: Vec<u64> = Vec::new();
        let mut x = 12345u64;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = x % 40;
            let evicted = l.touch(k);
            let expected = if let Some(p) = model.iter().position(|&m| m == k) {
                model.remove(p);
                None
            } else if model.len() == 16 {
                model.pop()
            } else {
                None
            };
            model.insert(0, k);
            assert_eq!(evicted, expected);
        }
        assert_eq!(l.iter_mru().collect::<Vec<_>>(), model);
    }
}
