//! The trie's edges: `(parent node, first key of the child)` to the child node, in one
//! open-addressing table (linear probing, at most half full, removal by backward shift as in
//! [`crate::LruSet`]).
//!
//! A slot is 8 bytes: the child's id and 32 bits of the edge's hash, which place the slot (its
//! top bits) and filter the probe run, so that only a likely hit reads the node to confirm it.
//! The hash is a seeded multiply of the key and the parent, so crafted keys cannot pile into
//! one probe run without knowing the seed.

use super::slab::NIL;

#[derive(Clone, Copy, Debug)]
struct Slot {
    hash: u32,
    /// The child, [`NIL`] if the slot is free.
    node: u32,
}

const EMPTY: Slot = Slot { hash: 0, node: NIL };
const MIN_SLOTS: usize = 16;

#[derive(Clone, Debug)]
pub(super) struct Edges {
    seed: u64,
    slots: Vec<Slot>,
    /// `log2(slots.len())`, 0 before the first insert.
    bits: u32,
    len: usize,
}

impl Edges {
    pub fn new(seed: u64) -> Self {
        Edges {
            seed,
            slots: Vec::new(),
            bits: 0,
            len: 0,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// The most memory a table of at most `edges` edges holds: at most half full, a power of two
    /// of slots, and while it grows the old table (half that) too.
    pub fn max_bytes(edges: u64) -> u64 {
        let slots = edges
            .saturating_mul(2)
            .checked_next_power_of_two()
            .unwrap_or(u64::MAX)
            .max(MIN_SLOTS as u64);
        let table = slots.saturating_mul(std::mem::size_of::<Slot>() as u64);
        table.saturating_add(table / 2)
    }

    #[inline]
    fn hash(&self, parent: u32, key: u64) -> u32 {
        let x = (key ^ self.seed)
            .wrapping_add(u64::from(parent).wrapping_mul(0xD6E8_FEB8_6659_FD93))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 32) as u32
    }

    /// The home slot: the top `bits` bits of the hash.
    #[inline]
    fn home(&self, hash: u32) -> usize {
        ((u64::from(hash) << self.bits) >> 32) as usize
    }

    /// The slot of the edge whose child satisfies `is`, or `Err` with the free slot that ends
    /// its probe run. The table must not be empty.
    #[inline]
    fn find(&self, hash: u32, is: impl Fn(u32) -> bool) -> Result<usize, usize> {
        let mask = self.slots.len().wrapping_sub(1);
        let mut i = self.home(hash);
        loop {
            let s = self.slots[i];
            if s.node == NIL {
                return Err(i);
            }
            if s.hash == hash && is(s.node) {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The child of `parent` whose first key is `key`; `is` confirms a candidate child.
    #[inline]
    pub fn get(&self, parent: u32, key: u64, is: impl Fn(u32) -> bool) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let i = self.find(self.hash(parent, key), is).ok()?;
        Some(self.slots[i].node)
    }

    /// Points the edge `(parent, key)` (the one whose child satisfies `is`, if any) at `node`.
    pub fn insert(&mut self, parent: u32, key: u64, node: u32, is: impl Fn(u32) -> bool) {
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        let hash = self.hash(parent, key);
        match self.find(hash, is) {
            Ok(i) => self.slots[i].node = node,
            Err(i) => {
                self.slots[i] = Slot { hash, node };
                self.len += 1;
            }
        }
    }

    /// Removes the edge `(parent, key)` to `node`, if present.
    pub fn remove(&mut self, parent: u32, key: u64, node: u32) {
        if self.slots.is_empty() {
            return;
        }
        let Ok(i) = self.find(self.hash(parent, key), |n| n == node) else {
            return;
        };
        // Move later members of the probe run back so every edge stays reachable from home.
        let mask = self.slots.len() - 1;
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let s = self.slots[j];
            if s.node == NIL {
                break;
            }
            let home = self.home(s.hash);
            // `s` may fill the hole unless its home lies cyclically in (hole, j].
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    /// Doubles the table (or makes the first one).
    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; size]);
        self.bits = size.trailing_zeros();
        let mask = size - 1;
        for s in old.into_iter().filter(|s| s.node != NIL) {
            let mut i = self.home(s.hash);
            while self.slots[i].node != NIL {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }

    pub fn clear(&mut self) {
        *self = Edges::new(self.seed);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn matches_a_map_through_growth_and_removal() {
        // Node `i` is the edge `edges[i]`; ids are reused after removal, as the slab does.
        let mut table = Edges::new(0x1234);
        let mut model: HashMap<(u32, u64), u32> = HashMap::new();
        let mut nodes: Vec<(u32, u64)> = Vec::new();
        let mut free: Vec<u32> = Vec::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for step in 0..40_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A small edge space, so inserts, hits and removals mix.
            let edge = ((x % 7) as u32, (x >> 8) % 300);
            let is = |nodes: &Vec<(u32, u64)>, n: u32| nodes[n as usize] == edge;
            match model.get(&edge).copied() {
                Some(n) if step % 3 != 0 => {
                    table.remove(edge.0, edge.1, n);
                    model.remove(&edge);
                    free.push(n);
                }
                Some(n) => assert_eq!(table.get(edge.0, edge.1, |m| is(&nodes, m)), Some(n)),
                None => {
                    assert_eq!(table.get(edge.0, edge.1, |m| is(&nodes, m)), None);
                    let n = match free.pop() {
                        Some(n) => {
                            nodes[n as usize] = edge;
                            n
                        }
                        None => {
                            nodes.push(edge);
                            nodes.len() as u32 - 1
                        }
                    };
                    table.insert(edge.0, edge.1, n, |m| is(&nodes, m));
                    model.insert(edge, n);
                }
            }
            assert_eq!(table.len(), model.len());
        }
        for (&(p, k), &n) in &model {
            assert_eq!(table.get(p, k, |m| nodes[m as usize] == (p, k)), Some(n));
        }
        assert!(table.slots.len() <= 4 * model.len().max(MIN_SLOTS));
    }
}
