use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

fn keys(v: &[u64]) -> Vec<BlockKey> {
    v.iter().copied().map(BlockKey).collect()
}

/// Today's semantics, naively: per endpoint a most-recent-first list of keys, touched
/// last-first, the least recent dropped past capacity; and per endpoint the tier of each key
/// offloaded from the GPU since it was last recorded.
struct Model {
    capacity: usize,
    sets: Vec<Vec<u64>>,
    tiers: Vec<BTreeMap<u64, Tier>>,
}

impl Model {
    fn new(endpoints: usize, capacity: usize) -> Self {
        Model {
            capacity: capacity.max(1),
            sets: vec![Vec::new(); endpoints],
            tiers: vec![BTreeMap::new(); endpoints],
        }
    }

    fn record(&mut self, e: usize, keys: &[BlockKey]) {
        let capacity = self.capacity;
        if let Some(tiers) = self.tiers.get_mut(e) {
            for k in keys {
                tiers.remove(&k.0);
            }
        }
        let Some(set) = self.sets.get_mut(e) else {
            return;
        };
        for k in keys.iter().rev() {
            if let Some(p) = set.iter().position(|&m| m == k.0) {
                set.remove(p);
            } else if set.len() == capacity {
                set.pop();
            }
            set.insert(0, k.0);
        }
    }

    /// Leading keys held on `tier` or a faster one.
    fn within(&self, e: usize, keys: &[BlockKey], tier: Tier) -> usize {
        self.sets.get(e).map_or(0, |set| {
            keys.iter()
                .take_while(|k| {
                    set.contains(&k.0) && self.tiers[e].get(&k.0).is_none_or(|&t| t <= tier)
                })
                .count()
        })
    }

    /// Moves every held key whose chain goes through a demoted key down to `tier`.
    fn demote(
        &mut self,
        e: usize,
        demoted: &[u64],
        tier: Tier,
        chain_of: impl Fn(u64) -> Vec<u64>,
    ) -> usize {
        let Some(set) = self.sets.get(e) else {
            return 0;
        };
        let mut moved = 0;
        for &k in set {
            if chain_of(k).iter().any(|c| demoted.contains(c)) {
                let t = self.tiers[e].entry(k).or_insert(Tier::Gpu);
                if *t < tier {
                    moved += 1;
                    *t = tier;
                }
            }
        }
        moved
    }

    fn resize(&mut self, endpoints: usize) {
        self.sets.resize(endpoints, Vec::new());
        self.tiers.resize(endpoints, BTreeMap::new());
    }

    fn clear(&mut self, e: usize) {
        if let Some(set) = self.sets.get_mut(e) {
            set.clear();
        }
    }

    fn trim(&mut self, e: usize, max: usize) {
        if let Some(set) = self.sets.get_mut(e) {
            set.truncate(max);
        }
    }

    /// Drops every key whose chain (`chain_of`) goes through a removed key.
    fn remove(&mut self, e: usize, removed: &[u64], chain_of: impl Fn(u64) -> Vec<u64>) {
        if let Some(set) = self.sets.get_mut(e) {
            set.retain(|&k| !chain_of(k).iter().any(|c| removed.contains(c)));
        }
    }
}

/// The keys `e` holds, by walking its recency list (most recent first).
fn held(idx: &PrefixIndex, e: usize) -> Vec<u64> {
    let mut out = Vec::new();
    let mut t = idx.endpoints[e].head;
    while t != NIL {
        let n = idx.entries[t].node;
        let node = &idx.nodes[n];
        let h = node.holder(e).map_or(0, |h| h.held as usize);
        out.extend(
            std::iter::once(node.first)
                .chain(node.rest.iter().copied())
                .take(h),
        );
        t = idx.entries[t].next;
    }
    out
}

/// Every structural invariant the index relies on.
fn check(idx: &PrefixIndex) {
    let mut children: BTreeMap<u32, u32> = BTreeMap::new();
    let mut live = 0;
    for (n, node) in idx.nodes.iter() {
        live += 1;
        assert!(!node.holders.is_empty(), "node {n} has no holder");
        assert!(node.holders.capacity() <= 2 * node.holders.len());
        let longest = node.holders.iter().map(|h| h.held).max().unwrap_or(0);
        assert_eq!(
            longest as usize,
            node.len(),
            "node {n} longer than its holdings"
        );
        let mut seen = BTreeSet::new();
        for h in &node.holders {
            assert!(seen.insert(h.endpoint), "node {n} holder twice");
            assert!(h.held >= 1);
            assert_eq!(idx.entries[h.entry].node, n);
            if node.parent != NIL {
                // Prefix-closed: a holder of a node holds all of its parent.
                let p = &idx.nodes[node.parent];
                let ph = p.holder(usize::from(h.endpoint)).expect("parent held");
                assert_eq!(ph.held as usize, p.len(), "node {n}: parent not held whole");
            }
        }
        if node.parent != NIL {
            *children.entry(node.parent).or_default() += 1;
            assert!(idx.nodes[node.parent].next_vacant().is_none());
        }
        assert_eq!(idx.child(node.parent, node.first), Some(n), "edge to {n}");
    }
    for (n, node) in idx.nodes.iter() {
        assert_eq!(
            node.children,
            children.get(&n).copied().unwrap_or(0),
            "children of {n}"
        );
    }
    assert_eq!(idx.nodes.live(), live);
    assert_eq!(idx.edges.len(), live, "one edge per node");
    let mut entries = 0;
    for (e, lru) in idx.endpoints.iter().enumerate() {
        assert!(lru.blocks <= idx.capacity, "endpoint {e} over capacity");
        let (mut t, mut prev, mut blocks) = (lru.head, NIL, 0);
        let mut rank = BTreeMap::new();
        while t != NIL {
            let entry = idx.entries[t];
            assert_eq!(entry.prev, prev);
            let node = &idx.nodes[entry.node];
            let h = node.holder(e).expect("entry has a holder");
            assert_eq!(h.entry, t);
            blocks += h.held as usize;
            // A parent is more recent than its children.
            if node.parent != NIL {
                assert!(rank.contains_key(&node.parent), "parent after child");
            }
            rank.insert(entry.node, rank.len());
            entries += 1;
            prev = t;
            t = entry.next;
        }
        assert_eq!(lru.tail, prev);
        assert_eq!(blocks, lru.blocks, "endpoint {e} block count");
    }
    assert_eq!(idx.entries.live(), entries, "no stray entries");
}

fn assert_matches(idx: &PrefixIndex, model: &Model, chain: &[BlockKey]) {
    let mut all = Vec::new();
    idx.matched_all(chain, &mut all);
    assert_eq!(all.len(), model.sets.len());
    for (e, &got) in all.iter().enumerate() {
        let id = EndpointId(e as u16);
        for tier in Tier::ALL {
            assert_eq!(
                got.within(tier),
                model.within(e, chain, tier),
                "endpoint {e}, {tier:?}, chain {chain:?}"
            );
        }
        assert_eq!(idx.matched(id, chain), got.keys());
    }
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
    let mut all = Vec::new();
    idx.matched_all(&keys(&[1, 2, 3, 4]), &mut all);
    assert_eq!(all, [Match::on_gpu(3), Match::on_gpu(1)]);
    check(&idx);
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
    check(&idx);
}

#[test]
fn trimming_forgets_the_least_recently_used_keys_first() {
    let mut idx = PrefixIndex::new(1, 100, 3);
    let e = EndpointId(0);
    idx.record(e, &keys(&[1, 2, 3, 4]));
    idx.record(e, &keys(&[10, 11]));
    idx.trim(e, 4);
    check(&idx);
    // The older chain loses its tail; the newer one is whole.
    assert_eq!(idx.blocks(e), 4);
    assert_eq!(idx.matched(e, &keys(&[10, 11])), 2);
    assert_eq!(idx.matched(e, &keys(&[1, 2, 3, 4])), 2);
    idx.trim(e, 10);
    assert_eq!(idx.blocks(e), 4, "trimming to more than held keeps all");
    idx.trim(e, 0);
    assert_eq!(idx.blocks(e), 0);
    check(&idx);
}

#[test]
fn a_shorter_record_splits_and_ages_only_its_part() {
    let mut idx = PrefixIndex::new(1, 6, 1);
    let e = EndpointId(0);
    idx.record(e, &keys(&[1, 2, 3, 4]));
    idx.record(e, &keys(&[9, 8]));
    // 1, 2 are now newer than 9, 8, and 3, 4 older.
    idx.record(e, &keys(&[1, 2]));
    check(&idx);
    idx.record(e, &keys(&[5, 6]));
    // Over capacity by 2: 4 and 3 go, not 9 and 8.
    assert_eq!(idx.matched(e, &keys(&[1, 2, 3, 4])), 2);
    assert_eq!(idx.matched(e, &keys(&[9, 8])), 2);
    assert_eq!(held(&idx, 0), [5, 6, 1, 2, 9, 8]);
    check(&idx);
}

#[test]
fn a_conversation_stays_one_node() {
    let mut idx = PrefixIndex::new(2, 1000, 1);
    let chain: Vec<BlockKey> = keys(&(1..=60).collect::<Vec<_>>());
    for turn in 1..=6 {
        idx.record(EndpointId(0), &chain[..turn * 10]);
    }
    assert_eq!(idx.nodes.live(), 1);
    idx.record(EndpointId(1), &chain[..25]);
    assert_eq!(
        idx.nodes.live(),
        2,
        "split where endpoint 1's request ended"
    );
    let mut all = Vec::new();
    idx.matched_all(&chain, &mut all);
    assert_eq!(all, [Match::on_gpu(60), Match::on_gpu(25)]);
    check(&idx);
}

#[test]
fn clearing_every_endpoint_returns_the_memory() {
    let mut idx = PrefixIndex::new(3, 50, 9);
    for e in 0..3u16 {
        idx.record(EndpointId(e), &keys(&[1, 2, 3, u64::from(e) + 10]));
        idx.record(EndpointId(e), &keys(&[7, u64::from(e)]));
    }
    check(&idx);
    idx.clear_endpoint(EndpointId(1));
    check(&idx);
    assert_eq!(idx.blocks(EndpointId(1)), 0);
    assert_eq!(idx.matched(EndpointId(0), &keys(&[1, 2, 3, 10])), 4);
    idx.resize(1);
    check(&idx);
    idx.clear_endpoint(EndpointId(0));
    assert_eq!((idx.nodes.live(), idx.edges.len()), (0, 0));
    idx.resize(4);
    assert_eq!(idx.matched(EndpointId(3), &keys(&[1])), 0);
    idx.record(EndpointId(3), &keys(&[1]));
    assert_eq!(idx.matched(EndpointId(3), &keys(&[1, 2])), 1);
    check(&idx);
}

#[test]
fn max_bytes_bounds_the_default_and_grows_with_size() {
    let default = PrefixIndex::max_bytes(256, 31_250);
    assert!(
        default < crate::prefix_affinity::INDEX_MEMORY_LIMIT,
        "{default}"
    );
    assert!(PrefixIndex::max_bytes(4096, 31_250) > crate::prefix_affinity::INDEX_MEMORY_LIMIT);
    assert!(PrefixIndex::max_bytes(16, 100) < PrefixIndex::max_bytes(16, 200));
    assert!(
        PrefixIndex::max_bytes(usize::MAX, usize::MAX) > crate::prefix_affinity::INDEX_MEMORY_LIMIT
    );
}

#[test]
fn a_full_index_stays_within_its_bound() {
    // The worst case for memory: one-key prompts, every node one key long with one holder.
    let (endpoints, capacity) = (4, 3000);
    let mut idx = PrefixIndex::new(endpoints, capacity, 5);
    for i in 0..(endpoints * capacity * 2) as u64 {
        idx.record(EndpointId((i % 4) as u16), &keys(&[i]));
    }
    assert_eq!(idx.nodes.live(), endpoints * capacity);
    let used = Slab::<Node>::max_bytes(idx.nodes.live() as u64)
        + Slab::<Entry>::max_bytes(idx.entries.live() as u64)
        + Edges::max_bytes(idx.edges.len() as u64);
    assert!(used <= PrefixIndex::max_bytes(endpoints, capacity));
    check(&idx);
}

/// A random tree of keys: key `i`'s parent is `parents[i]` (an earlier key) or none. Each
/// key's chain is its path from its root, as [`crate::prefix`] would make it.
fn chains(parents: &[(bool, usize)]) -> Vec<Vec<BlockKey>> {
    let mut out: Vec<Vec<BlockKey>> = Vec::with_capacity(parents.len());
    for (i, &(run, r)) in parents.iter().enumerate() {
        // Mostly a run (the previous key's child), else any earlier key or a new root.
        let parent = if run && i > 0 {
            Some(i - 1)
        } else {
            Some(r % (i + 1)).filter(|&p| p < i)
        };
        let mut chain = parent.map_or_else(Vec::new, |p| out[p].clone());
        chain.push(BlockKey((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        out.push(chain);
    }
    out
}

#[derive(Clone, Debug)]
enum Op {
    Record(usize, usize),
    Match(usize),
    Clear(usize),
    Trim(usize, usize),
    Resize(usize),
    Remove(usize, Vec<usize>),
    Demote(usize, Vec<usize>, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..5usize, any::<usize>()).prop_map(|(e, c)| Op::Record(e, c)),
        2 => any::<usize>().prop_map(Op::Match),
        1 => (0..5usize).prop_map(Op::Clear),
        1 => (0..5usize, 0..20usize).prop_map(|(e, n)| Op::Trim(e, n)),
        1 => (0..6usize).prop_map(Op::Resize),
        2 => (0..5usize, prop::collection::vec(any::<usize>(), 1..3))
            .prop_map(|(e, ks)| Op::Remove(e, ks)),
        2 => (0..5usize, prop::collection::vec(any::<usize>(), 1..3), any::<bool>())
            .prop_map(|(e, ks, storage)| Op::Demote(e, ks, storage)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// On chained keys the trie keeps exactly what per-endpoint LRU sets of keys keep.
    #[test]
    fn matches_per_endpoint_lru_sets(
        parents in prop::collection::vec((prop::bool::weighted(0.7), any::<usize>()), 1..40),
        endpoints in 1..4usize,
        capacity in 1..16usize,
        seed in any::<u64>(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let chains = chains(&parents);
        let mut idx = PrefixIndex::new(endpoints, capacity, seed);
        let mut model = Model::new(endpoints, capacity);
        for op in ops {
            match op {
                Op::Record(e, c) => {
                    let chain = &chains[c % chains.len()];
                    idx.record(EndpointId(e as u16), chain);
                    model.record(e, chain);
                    if e < model.sets.len() {
                        // A chain just recorded is held as far as capacity allows.
                        let want = chain.len().min(capacity);
                        prop_assert_eq!(idx.matched(EndpointId(e as u16), chain), want);
                    }
                }
                Op::Match(c) => assert_matches(&idx, &model, &chains[c % chains.len()]),
                Op::Clear(e) => {
                    idx.clear_endpoint(EndpointId(e as u16));
                    model.clear(e);
                }
                Op::Trim(e, n) => {
                    idx.trim(EndpointId(e as u16), n);
                    model.trim(e, n);
                }
                Op::Resize(n) => {
                    idx.resize(n);
                    model.resize(n);
                }
                Op::Remove(e, picks) => {
                    let removed: Vec<u64> = picks
                        .iter()
                        .filter_map(|c| chains[c % chains.len()].last().map(|k| k.0))
                        .collect();
                    let before = model.sets.get(e).map_or(0, Vec::len);
                    let forgot = idx.remove(EndpointId(e as u16), &keys(&removed));
                    model.remove(e, &removed, |k| {
                        chains
                            .iter()
                            .find(|c| c.last().map(|l| l.0) == Some(k))
                            .map_or_else(Vec::new, |c| c.iter().map(|b| b.0).collect())
                    });
                    let after = model.sets.get(e).map_or(0, Vec::len);
                    prop_assert_eq!(forgot, before - after);
                }
                Op::Demote(e, picks, storage) => {
                    let tier = if storage { Tier::Storage } else { Tier::Cpu };
                    let demoted: Vec<u64> = picks
                        .iter()
                        .filter_map(|c| chains[c % chains.len()].last().map(|k| k.0))
                        .collect();
                    let moved = idx.demote(EndpointId(e as u16), &keys(&demoted), tier);
                    let want = model.demote(e, &demoted, tier, |k| {
                        chains
                            .iter()
                            .find(|c| c.last().map(|l| l.0) == Some(k))
                            .map_or_else(Vec::new, |c| c.iter().map(|b| b.0).collect())
                    });
                    prop_assert_eq!(moved, want);
                }
            }
            check(&idx);
            for (e, set) in model.sets.iter().enumerate() {
                prop_assert_eq!(idx.blocks(EndpointId(e as u16)), set.len());
                // The same keys, in the same recency order.
                prop_assert_eq!(&held(&idx, e), set);
            }
        }
        for chain in &chains {
            assert_matches(&idx, &model, chain);
        }
    }

    /// Any key sequences at all (repeats, one key after several others): never a panic,
    /// never over capacity, a match never longer than the request, and a just-recorded
    /// sequence held as far as capacity allows.
    #[test]
    fn any_key_sequences_stay_bounded(
        records in prop::collection::vec(
            (0..3usize, prop::collection::vec(0..6u64, 0..12)), 1..80),
        capacity in 1..10usize,
    ) {
        let mut idx = PrefixIndex::new(2, capacity, 11);
        let mut all = Vec::new();
        for (e, ks) in records {
            let ks = keys(&ks);
            idx.record(EndpointId(e as u16), &ks);
            check(&idx);
            idx.matched_all(&ks, &mut all);
            for (i, m) in all.iter().map(Match::keys).enumerate() {
                prop_assert!(m <= ks.len());
                prop_assert_eq!(idx.matched(EndpointId(i as u16), &ks), m);
                prop_assert!(idx.blocks(EndpointId(i as u16)) <= capacity);
            }
            if e < 2 {
                prop_assert_eq!(all[e], Match::on_gpu(ks.len().min(capacity)));
            }
        }
    }
}

#[test]
fn removing_a_key_forgets_its_suffix_on_that_endpoint_only() {
    let mut idx = PrefixIndex::new(2, 100, 3);
    let a = keys(&[1, 2, 3, 4]);
    let b = keys(&[1, 2, 7]);
    idx.record(EndpointId(0), &a);
    idx.record(EndpointId(0), &b);
    idx.record(EndpointId(1), &a);
    // Key 3 evicted on endpoint 0: 3 and 4 go, the branch through 7 stays.
    assert_eq!(idx.remove(EndpointId(0), &keys(&[3])), 2);
    check(&idx);
    assert_eq!(idx.matched(EndpointId(0), &a), 2);
    assert_eq!(idx.matched(EndpointId(0), &b), 3);
    assert_eq!(idx.matched(EndpointId(1), &a), 4);
    // Key 1: everything of endpoint 0 goes.
    assert_eq!(idx.remove(EndpointId(0), &keys(&[1])), 3);
    check(&idx);
    assert_eq!(idx.blocks(EndpointId(0)), 0);
    assert_eq!(idx.matched(EndpointId(1), &b), 2);
    // Unknown keys, or an endpoint out of range: nothing.
    assert_eq!(idx.remove(EndpointId(1), &keys(&[99])), 0);
    assert_eq!(idx.remove(EndpointId(9), &keys(&[1])), 0);
    assert_eq!(idx.matched(EndpointId(1), &a), 4);
}
