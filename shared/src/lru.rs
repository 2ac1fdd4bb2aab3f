//! A bounded set of `u64` keys with least-recently-used eviction.
//!
//! The hash table is the list: one open-addressing table (linear probing, at most half full)
//! whose slots hold the key and the `u32` indices of its neighbours in recency order. A touch
//! thus reads one table line and its list neighbours, where a map beside a node slab reads the
//! map's control bytes, its bucket and the node, each a cache miss once the set outgrows the
//! cache (a full 31,250-key endpoint is about 1 MB). Removal shifts the probe run back instead of
//! leaving tombstones. Slots are placed by the key through a seeded multiply, so crafted keys
//! cannot pile into one probe run without knowing the seed. The table grows with the set.
//!
//! kvoy's own index is no longer made of these ([`crate::PrefixIndex`] is one trie for all
//! endpoints); the benchmark's reference policies use them, and `benches/index.rs` keeps the old
//! per-endpoint index on them to compare.

const NIL: u32 = u32::MAX;
/// `prev` of a free slot.
const FREE: u32 = u32::MAX - 1;
const MIN_SLOTS: usize = 16;

#[derive(Clone, Copy, Debug)]
struct Slot {
    key: u64,
    /// Neighbour towards the most recently used end, `NIL` at the head, `FREE` if unused.
    prev: u32,
    /// Neighbour towards the least recently used end, `NIL` at the tail.
    next: u32,
}

const EMPTY: Slot = Slot {
    key: 0,
    prev: FREE,
    next: NIL,
};

#[derive(Clone, Debug)]
pub struct LruSet {
    capacity: usize,
    seed: u64,
    slots: Vec<Slot>,
    /// `slots.len() - 1` (a power of two minus one); 0 before the first insert.
    mask: usize,
    /// `64 - log2(slots.len())`: the home slot is the top bits of the mixed key.
    shift: u32,
    len: usize,
    /// Most recently used.
    head: u32,
    /// Least recently used: evicted first.
    tail: u32,
}

impl LruSet {
    pub fn new(capacity: usize, seed: u64) -> Self {
        LruSet {
            capacity: capacity.max(1),
            seed,
            slots: Vec::new(),
            mask: 0,
            shift: 64,
            len: 0,
            head: NIL,
            tail: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The memory a set of `capacity` keys holds once full: its table (at most half full, a
    /// power of two of 16-byte slots). While it grows, the old table (half that) is held too.
    pub fn max_bytes(capacity: usize) -> u64 {
        let slots = capacity
            .max(1)
            .saturating_mul(2)
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX)
            .max(MIN_SLOTS) as u64;
        slots.saturating_mul(std::mem::size_of::<Slot>() as u64)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        let x = (key ^ self.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9) >> self.shift) as usize
    }

    /// The slot holding `key`, or `Err` with the free slot that ends its probe run.
    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        if self.slots.is_empty() {
            return Err(0);
        }
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.prev == FREE {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    pub fn contains(&self, key: u64) -> bool {
        self.find(key).is_ok()
    }

    fn unlink(&mut self, i: usize) {
        let Slot { prev, next, .. } = self.slots[i];
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, i: usize) {
        let old = self.head;
        self.slots[i].prev = NIL;
        self.slots[i].next = old;
        if old != NIL {
            self.slots[old as usize].prev = i as u32;
        }
        self.head = i as u32;
        if self.tail == NIL {
            self.tail = i as u32;
        }
    }

    /// Frees slot `i` (already unlinked), moving later members of its probe run back so that
    /// every key stays reachable from its home slot; moved slots' neighbours follow them.
    fn remove_slot(&mut self, i: usize) {
        let mask = self.mask;
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let s = self.slots[j];
            if s.prev == FREE {
                break;
            }
            let home = self.home(s.key);
            // `s` may fill the hole unless its home lies cyclically in (hole, j].
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                let to = hole as u32;
                if s.prev == NIL {
                    self.head = to;
                } else {
                    self.slots[s.prev as usize].next = to;
                }
                if s.next == NIL {
                    self.tail = to;
                } else {
                    self.slots[s.next as usize].prev = to;
                }
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    /// Doubles the table (or makes the first one), keeping the recency order.
    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; size]);
        self.mask = size - 1;
        self.shift = 64 - size.trailing_zeros();
        let mut i = self.tail;
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
        // Least recently used first, each pushed in front of the ones before.
        while i != NIL {
            let s = old[i as usize];
            self.insert_new(s.key);
            i = s.prev;
        }
    }

    /// Inserts a key known to be absent, in front, with room in the table.
    fn insert_new(&mut self, key: u64) {
        if let Err(i) = self.find(key) {
            self.slots[i].key = key;
            self.push_front(i);
            self.len += 1;
        }
    }

    /// Inserts `key` or marks it most recently used. Returns the key evicted to make room.
    pub fn touch(&mut self, key: u64) -> Option<u64> {
        let free = match self.find(key) {
            Ok(i) => {
                if self.head != i as u32 {
                    self.unlink(i);
                    self.push_front(i);
                }
                return None;
            }
            Err(free) => free,
        };
        let mut evicted = None;
        if self.len >= self.capacity {
            let t = self.tail as usize;
            evicted = Some(self.slots[t].key);
            self.unlink(t);
            self.remove_slot(t);
        } else if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
            self.insert_new(key);
            return None;
        }
        // A removal may have moved the probe run's end; only then look again.
        let i = if evicted.is_some() {
            let (Ok(i) | Err(i)) = self.find(key);
            i
        } else {
            free
        };
        self.slots[i].key = key;
        self.push_front(i);
        self.len += 1;
        evicted
    }

    pub fn clear(&mut self) {
        self.slots = Vec::new();
        self.mask = 0;
        self.shift = 64;
        self.len = 0;
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
            let s = self.slots[i as usize];
            i = s.next;
            Some(s.key)
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

    #[test]
    fn matches_a_model_across_capacities_growth_and_clear() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for capacity in [1usize, 2, 3, 7, 8, 9, 31, 64, 100] {
            let mut l = LruSet::new(capacity, next());
            let mut model: Vec<u64> = Vec::new();
            for step in 0..20_000 {
                if step % 7_919 == 7_918 {
                    l.clear();
                    model.clear();
                }
                // A key space a little larger than the set, so hits, misses and evictions mix.
                let k = next() % (capacity as u64 * 2 + 3);
                let evicted = l.touch(k);
                let expected = if let Some(p) = model.iter().position(|&m| m == k) {
                    model.remove(p);
                    None
                } else if model.len() == capacity {
                    model.pop()
                } else {
                    None
                };
                model.insert(0, k);
                assert_eq!(evicted, expected, "capacity {capacity}, step {step}");
                assert_eq!(l.len(), model.len());
            }
            assert_eq!(l.iter_mru().collect::<Vec<_>>(), model);
            assert!(model.iter().all(|&k| l.contains(k)));
        }
    }
}
