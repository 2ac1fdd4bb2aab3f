//! The prefix index: which endpoint is believed to hold which prefix block.
//!
//! One trie of key chains serves every endpoint. Keys are chained ([`crate::prefix`]): a key
//! stands for its whole prefix, so the chains requests carry form a tree. A node of the trie
//! is a run of keys with no branch between them, held contiguously and found by its parent and
//! its first key in one seeded table; it lists its holders, the endpoints believed to hold its
//! first `held` keys. An endpoint's match for a request is the longest run of the request's
//! keys, from the first, that it holds. One walk down the trie gives it for every endpoint
//! ([`PrefixIndex::matched_all`]): a table probe per node on the path, the node's keys compared
//! as one slice, its holders read as one small vector. A fresh prompt is one probe to match and,
//! to record, one new node; recording a decision again (another worker replaying it) costs
//! what recording it did.
//!
//! Each endpoint remembers at most `capacity_per_endpoint` keys, least recently used first. A
//! record touches the request's keys last-first (as in vLLM's free queue), so a chain's tail is
//! evicted before its head, the part other requests share. The recency list holds holdings
//! (one endpoint's share of one node). Recording splits a node where the request leaves it or
//! ends, so every node a record touches is touched whole: the keys of a holding were all last
//! touched by the same record, in chain order, and a holding sits in its endpoint's list behind
//! its parent's. Trimming keys off the end of the least recently used holding is therefore
//! exact least-recently-used eviction of keys: each endpoint keeps the very keys a per-endpoint
//! LRU set touched last-first would keep. (For sequences that are not chains, e.g. one key
//! after two different keys, the trie is one of sequences: a key is held per position.)
//!
//! A holding also says how much of it sits on each of the server's tiers
//! ([`PrefixIndex::demote`]: a block offloaded from the GPU to CPU memory still saves its
//! prefill, for less), so a match is counted per tier ([`Match`]). As an eviction, an offload
//! takes a key's suffix with it; recording the keys again brings them back to the GPU.
//!
//! ```
//! use kvoy_shared::{prefix::BlockKey, EndpointId, PrefixIndex};
//! let mut index = PrefixIndex::new(2, 1000, 7);
//! let keys = [BlockKey(1), BlockKey(2), BlockKey(3)];
//! index.record(EndpointId(1), &keys);
//! let mut matched = Vec::new();
//! index.matched_all(&[BlockKey(1), BlockKey(2), BlockKey(9)], &mut matched);
//! assert_eq!(matched.iter().map(|m| m.keys()).collect::<Vec<_>>(), [0, 2]);
//! ```

mod edges;
mod slab;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use crate::endpoint::EndpointId;
use crate::prefix::BlockKey;
use edges::Edges;
use slab::{Slab, Vacancy, NIL};

/// Marks a vacant node (in `children`).
const VACANT: u32 = u32::MAX;
/// Heap bytes a small allocation costs beyond its contents (header and rounding), for
/// [`PrefixIndex::max_bytes`].
const ALLOC_OVERHEAD: u64 = 16;
/// Endpoint ids are `u16`.
const MAX_ENDPOINTS: usize = u16::MAX as usize + 1;

/// A run of chained keys: `first`, then `rest`.
#[derive(Clone, Debug)]
struct Node {
    first: u64,
    rest: Box<[u64]>,
    /// Endpoints holding a prefix of the run; at least one holds it all.
    holders: Vec<Holder>,
    /// [`NIL`] for a chain's first node; the next vacant id when vacant.
    parent: u32,
    /// Live child nodes; [`VACANT`] when vacant.
    children: u32,
}

impl Node {
    fn len(&self) -> usize {
        1 + self.rest.len()
    }

    /// Leading `keys` equal to the run's (`keys[0]` is known to equal `first`).
    #[inline]
    fn common(&self, keys: &[BlockKey]) -> usize {
        let tail = keys.get(1..).unwrap_or_default();
        1 + self
            .rest
            .iter()
            .zip(tail)
            .take_while(|(a, b)| **a == b.0)
            .count()
    }

    fn holder(&self, endpoint: usize) -> Option<&Holder> {
        self.holders
            .iter()
            .find(|h| usize::from(h.endpoint) == endpoint)
    }
}

impl Vacancy for Node {
    fn vacant(next: u32) -> Self {
        Node {
            first: 0,
            rest: Box::default(),
            holders: Vec::new(),
            parent: next,
            children: VACANT,
        }
    }

    fn next_vacant(&self) -> Option<u32> {
        (self.children == VACANT).then_some(self.parent)
    }
}

/// One endpoint's share of a node: its first `held` keys.
#[derive(Clone, Copy, Debug)]
struct Holder {
    endpoint: u16,
    held: u32,
    /// How many of the held keys, from the first, are on the GPU (`[0]`) and on the GPU or
    /// CPU (`[1]`); the rest were offloaded further. `fast[0] <= fast[1] <= held`, and below a
    /// key that left a tier every key has left it too (a demotion takes a key's suffix).
    fast: [u32; 2],
    /// Its place in the endpoint's recency list.
    entry: u32,
}

impl Holder {
    /// Keeps the tiers within `held`.
    fn fit_tiers(&mut self) {
        for f in &mut self.fast {
            *f = (*f).min(self.held);
        }
    }
}

/// Where a server holds a block: its GPU, or offloaded to CPU memory or to storage (vLLM's KV
/// event `medium`). Ordered fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Gpu = 0,
    Cpu = 1,
    Storage = 2,
}

impl Tier {
    /// Every tier, fastest first (index order).
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// Its name as vLLM's KV events spell the medium.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Cpu => "CPU",
            Tier::Storage => "STORAGE",
        }
    }
}

/// How far an endpoint holds a request's keys, by tier: [`Match::keys`] leading keys at all,
/// and of those the leading ones on each tier or a faster one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Match {
    /// `[GPU, GPU or CPU, any tier]`.
    within: [usize; 3],
}

impl Match {
    /// Leading keys held at all.
    pub fn keys(&self) -> usize {
        self.within[2]
    }

    /// Leading keys held on `tier` or a faster one.
    pub fn within(&self, tier: Tier) -> usize {
        self.within[tier as usize]
    }

    /// A match of `keys` keys, all on the GPU.
    pub fn on_gpu(keys: usize) -> Match {
        Match { within: [keys; 3] }
    }
}

/// A holding in its endpoint's recency list.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// [`NIL`] when vacant.
    node: u32,
    /// Towards the most recently used end, [`NIL`] at the head.
    prev: u32,
    /// Towards the least recently used end, [`NIL`] at the tail; the next vacant id when vacant.
    next: u32,
}

impl Vacancy for Entry {
    fn vacant(next: u32) -> Self {
        Entry {
            node: NIL,
            prev: NIL,
            next,
        }
    }

    fn next_vacant(&self) -> Option<u32> {
        (self.node == NIL).then_some(self.next)
    }
}

/// One endpoint's recency list of holdings.
#[derive(Clone, Copy, Debug)]
struct Lru {
    /// Most recently used.
    head: u32,
    /// Least recently used: trimmed first.
    tail: u32,
    blocks: usize,
}

const EMPTY_LRU: Lru = Lru {
    head: NIL,
    tail: NIL,
    blocks: 0,
};

#[derive(Clone)]
pub struct PrefixIndex {
    endpoints: Vec<Lru>,
    nodes: Slab<Node>,
    entries: Slab<Entry>,
    edges: Edges,
    capacity: usize,
    /// Scratch: the nodes of the chain being recorded.
    path: Vec<u32>,
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("endpoints", &self.endpoints.len())
            .field("capacity", &self.capacity)
            .field("nodes", &self.nodes.live())
            .field("holdings", &self.entries.live())
            .finish()
    }
}

impl PrefixIndex {
    /// `seed` keys the index's hash table; pass something the client does not know.
    pub fn new(endpoints: usize, capacity_per_endpoint: usize, seed: u64) -> Self {
        let mut index = PrefixIndex {
            endpoints: Vec::new(),
            nodes: Slab::new(),
            entries: Slab::new(),
            edges: Edges::new(seed),
            capacity: capacity_per_endpoint.clamp(1, u32::MAX as usize),
            path: Vec::new(),
        };
        index.resize(endpoints);
        index
    }

    /// The most memory an index of `endpoints` endpoints of `capacity_per_endpoint` blocks
    /// holds; checked against [`crate::prefix_affinity::INDEX_MEMORY_LIMIT`] when the configuration is read.
    ///
    /// Every endpoint full, plus one record's keys before its evictions, is at most `n` held
    /// keys; then there are at most `n` nodes (each has a holder), `n` holdings and `n` stored
    /// keys (a node is as long as its longest holding). The worst case is every node one key
    /// long with one holder (prompts of one block); long shared prompts take a small fraction.
    pub fn max_bytes(endpoints: usize, capacity_per_endpoint: usize) -> u64 {
        use std::mem::size_of;
        let capacity = capacity_per_endpoint.clamp(1, u32::MAX as usize) as u64;
        let n = (endpoints.min(MAX_ENDPOINTS) as u64)
            .saturating_add(1)
            .saturating_mul(capacity);
        // A node's keys after the first are one allocation; its holders another, at most
        // twice as long as needed.
        let keys = 8 + ALLOC_OVERHEAD / 2;
        let holders = 2 * size_of::<Holder>() as u64 + ALLOC_OVERHEAD;
        let heap = n.saturating_mul(keys + holders);
        // A node's keys are copied when it is split, extended or trimmed.
        let scratch = capacity.saturating_mul(2 * 8 + 2 * size_of::<u32>() as u64);
        Slab::<Node>::max_bytes(n)
            .saturating_add(Slab::<Entry>::max_bytes(n))
            .saturating_add(Edges::max_bytes(n))
            .saturating_add(heap)
            .saturating_add(scratch)
            .saturating_add(endpoints.min(MAX_ENDPOINTS) as u64 * size_of::<Lru>() as u64)
    }

    /// Grows or shrinks the id space to `endpoints` (the pool changed). New endpoints start
    /// empty; those cut off are forgotten.
    pub fn resize(&mut self, endpoints: usize) {
        let endpoints = endpoints.min(MAX_ENDPOINTS);
        for e in endpoints..self.endpoints.len() {
            self.clear(e);
        }
        self.endpoints.resize(endpoints, EMPTY_LRU);
    }

    /// Number of leading `keys` that `endpoint` holds.
    pub fn matched(&self, endpoint: EndpointId, keys: &[BlockKey]) -> usize {
        let e = endpoint.index();
        if e >= self.endpoints.len() {
            return 0;
        }
        let (mut parent, mut pos) = (NIL, 0);
        while let Some(&key) = keys.get(pos) {
            let Some(n) = self.child(parent, key.0) else {
                break;
            };
            let node = &self.nodes[n];
            let Some(h) = node.holder(e) else {
                break;
            };
            let m = node.common(&keys[pos..]).min(h.held as usize);
            pos += m;
            if m < node.len() {
                break;
            }
            parent = n;
        }
        pos
    }

    /// Every endpoint's [`PrefixIndex::matched`] in one walk of `keys`, by tier: `out[i]` for
    /// `EndpointId(i)`, `out` as long as the id space.
    pub fn matched_all(&self, keys: &[BlockKey], out: &mut Vec<Match>) {
        out.clear();
        out.resize(self.endpoints.len(), Match::default());
        let (mut parent, mut pos) = (NIL, 0);
        while let Some(&key) = keys.get(pos) {
            let Some(n) = self.child(parent, key.0) else {
                break;
            };
            let node = &self.nodes[n];
            let m = node.common(&keys[pos..]);
            for h in &node.holders {
                // Only an endpoint holding the whole path so far extends its match here, and
                // only a tier that holds the whole path so far extends that tier's.
                if let Some(o) = out.get_mut(usize::from(h.endpoint)) {
                    if o.within[2] == pos {
                        let held = m.min(h.held as usize);
                        for (w, &fast) in o.within.iter_mut().zip(&h.fast) {
                            if *w == pos {
                                *w = pos + held.min(fast as usize);
                            }
                        }
                        o.within[2] = pos + held;
                    }
                }
            }
            if m < node.len() {
                break;
            }
            pos += m;
            parent = n;
        }
    }

    /// Records that `endpoint` now holds `keys` (it is serving a request with this prefix).
    /// Keys are touched last-first so that, as in vLLM's free queue, a chain's tail is evicted
    /// before its head: the head is what other requests share. Only the first
    /// `capacity_per_endpoint` keys are kept (as touching more would evict the rest).
    pub fn record(&mut self, endpoint: EndpointId, keys: &[BlockKey]) {
        let e = endpoint.index();
        if e >= self.endpoints.len() || keys.is_empty() {
            return;
        }
        let keys = &keys[..keys.len().min(self.capacity)];
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        self.insert_chain(keys, &mut path);
        for &n in path.iter().rev() {
            self.touch(e, n);
        }
        self.path = path;
        self.evict(e);
    }

    /// Blocks remembered for `endpoint`.
    pub fn blocks(&self, endpoint: EndpointId) -> usize {
        self.endpoints
            .get(endpoint.index())
            .map_or(0, |lru| lru.blocks)
    }

    pub fn clear_endpoint(&mut self, endpoint: EndpointId) {
        self.clear(endpoint.index());
    }

    /// Forgets `endpoint`'s least recently used keys until it holds at most `max_blocks`: the
    /// server reported holding less than the index believes (it evicted), and what it evicted
    /// first is what was used least recently, here as there.
    pub fn trim(&mut self, endpoint: EndpointId, max_blocks: usize) {
        self.evict_to(endpoint.index(), max_blocks);
    }

    /// Forgets that `endpoint` holds `removed` and every key after one of them in a chain: the
    /// server evicted those blocks (a confirmed removal from the aggregator), so the prefixes
    /// through them are no longer cached there whole. Other endpoints keep theirs, and what
    /// `endpoint` still holds keeps its recency. Returns the keys forgotten.
    ///
    /// The work is a walk of the endpoint's holdings (a key can sit anywhere in a node, and a
    /// node does not list its children), so it belongs on the tick, not a request's path.
    pub fn remove(&mut self, endpoint: EndpointId, removed: &[BlockKey]) -> usize {
        let e = endpoint.index();
        let Some(cuts) = self.cuts(e, removed) else {
            return 0;
        };
        // Leaves first, so that a node freed has no children left.
        let before = self.endpoints[e].blocks;
        for &(entry, held, keep) in cuts.iter().rev() {
            if keep < held {
                self.cut(e, entry, (held - keep) as usize);
            }
        }
        before - self.endpoints[e].blocks
    }

    /// Moves `demoted` and every key after one of them in a chain down to `tier` on `endpoint`
    /// (those still on a faster one): the server offloaded those blocks (evicted them from its
    /// GPU while a CPU copy stays, say), so the prefixes through them still save prefill there,
    /// at a lower credit. Recency is unchanged; recording the keys again brings them back to
    /// the GPU, as serving a request loads them back. Returns the keys moved down. A walk of
    /// the endpoint's holdings, as [`PrefixIndex::remove`].
    pub fn demote(&mut self, endpoint: EndpointId, demoted: &[BlockKey], tier: Tier) -> usize {
        let e = endpoint.index();
        if tier == Tier::Gpu {
            return 0;
        }
        let Some(cuts) = self.cuts(e, demoted) else {
            return 0;
        };
        let faster = tier as usize;
        let mut moved = 0usize;
        for (entry, _, keep) in cuts {
            let n = self.entries[entry].node;
            if let Some(h) = self.nodes[n]
                .holders
                .iter_mut()
                .find(|h| usize::from(h.endpoint) == e)
            {
                moved += h.fast[faster - 1].saturating_sub(keep) as usize;
                for f in &mut h.fast[..faster] {
                    *f = (*f).min(keep);
                }
            }
        }
        moved
    }

    /// For each holding of endpoint `e`, parents before children: its entry, the keys it holds,
    /// and how many of them come before the first of `keys` or below one (`None`: none of
    /// `keys` is held).
    fn cuts(&self, e: usize, keys: &[BlockKey]) -> Option<Vec<(u32, u32, u32)>> {
        if e >= self.endpoints.len() || keys.is_empty() {
            return None;
        }
        let mut keys: Vec<u64> = keys.iter().map(|k| k.0).collect();
        keys.sort_unstable();
        // Each holding: its node, what it holds, and how much of it comes before the first
        // listed key.
        let mut holdings: Vec<(u32, u32, u32, u32)> = Vec::new(); // (entry, node, held, keep)
        let mut t = self.endpoints[e].head;
        while t != NIL {
            let n = self.entries[t].node;
            let node = &self.nodes[n];
            let held = node.holder(e).map_or(0, |h| h.held);
            let keep = std::iter::once(&node.first)
                .chain(node.rest.iter())
                .take(held as usize)
                .position(|k| keys.binary_search(k).is_ok())
                .map_or(held, |p| p as u32);
            holdings.push((t, n, held, keep));
            t = self.entries[t].next;
        }
        if holdings.iter().all(|&(_, _, held, keep)| keep == held) {
            return None;
        }
        // A holding below a cut is cut whole: its prefix now stops above it. Nodes this
        // endpoint holds are prefix-closed, so looking up each parent's cut is enough, and
        // parents come first when the holdings are ordered by depth.
        let mut keep_of: HashMap<u32, u32> =
            holdings.iter().map(|&(_, n, _, keep)| (n, keep)).collect();
        let depth = |mut n: u32| {
            let mut d = 0usize;
            while self.nodes[n].parent != NIL {
                n = self.nodes[n].parent;
                d += 1;
            }
            d
        };
        let mut order: Vec<(usize, u32, u32, u32)> = holdings
            .iter()
            .map(|&(entry, n, held, _)| (depth(n), entry, n, held))
            .collect();
        order.sort_unstable_by_key(|&(d, _, _, _)| d);
        let mut cuts = Vec::with_capacity(order.len());
        for &(_, entry, n, held) in &order {
            let parent = self.nodes[n].parent;
            let parent_cut = keep_of
                .get(&parent)
                .is_some_and(|&keep| (keep as usize) < self.nodes[parent].len());
            if parent_cut {
                keep_of.insert(n, 0);
            }
            cuts.push((entry, held, keep_of.get(&n).copied().unwrap_or(held)));
        }
        Some(cuts)
    }

    fn clear(&mut self, e: usize) {
        let Some(lru) = self.endpoints.get(e) else {
            return;
        };
        // From the tail: a chain's nodes go leaf first, so a node freed has no children left.
        let mut t = lru.tail;
        while t != NIL {
            let prev = self.entries[t].prev;
            self.cut(e, t, usize::MAX);
            t = prev;
        }
        self.endpoints[e] = EMPTY_LRU;
        if self.nodes.live() == 0 {
            // Give the memory back (a pool replaced whole).
            self.nodes.clear();
            self.entries.clear();
            self.edges.clear();
        }
    }

    #[inline]
    fn child(&self, parent: u32, key: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.edges.get(parent, key, |n| {
            let node = &nodes[n];
            node.first == key && node.parent == parent
        })
    }

    /// Makes `keys` a path of whole nodes from the root, splitting and adding nodes, and lists
    /// them in `path`.
    fn insert_chain(&mut self, keys: &[BlockKey], path: &mut Vec<u32>) {
        let (mut parent, mut pos) = (NIL, 0);
        while let Some(&key) = keys.get(pos) {
            let rest = &keys[pos..];
            let Some(mut n) = self.child(parent, key.0) else {
                match parent {
                    // A leaf grows in place: a conversation stays one node as it goes on.
                    p if p != NIL && self.nodes[p].children == 0 => self.extend(p, rest),
                    p => path.push(self.add_node(p, rest)),
                }
                return;
            };
            let m = self.nodes[n].common(rest);
            if m < self.nodes[n].len() {
                n = self.split(n, m);
            }
            path.push(n);
            pos += m;
            parent = n;
        }
    }

    fn add_node(&mut self, parent: u32, keys: &[BlockKey]) -> u32 {
        let first = keys.first().map_or(0, |k| k.0);
        let rest = keys.iter().skip(1).map(|k| k.0).collect();
        let n = self.nodes.alloc(Node {
            first,
            rest,
            holders: Vec::new(),
            parent,
            children: 0,
        });
        let nodes = &self.nodes;
        self.edges.insert(parent, first, n, |x| {
            nodes[x].first == first && nodes[x].parent == parent
        });
        if parent != NIL {
            self.nodes[parent].children += 1;
        }
        n
    }

    /// Appends `keys` to the childless node `n`.
    fn extend(&mut self, n: u32, keys: &[BlockKey]) {
        let node = &mut self.nodes[n];
        let mut rest = Vec::with_capacity(node.rest.len() + keys.len());
        rest.extend_from_slice(&node.rest);
        rest.extend(keys.iter().map(|k| k.0));
        node.rest = rest.into_boxed_slice();
    }

    /// Cuts node `n` after its first `m` keys (`0 < m < len`): a new node takes the head and `n`
    /// keeps the tail, so `n`'s children stay where they are. Returns the head. A holding that
    /// spans the cut becomes two, the head's just in front of the tail's in recency.
    fn split(&mut self, n: u32, m: usize) -> u32 {
        let node = &mut self.nodes[n];
        let (first, parent) = (node.first, node.parent);
        let cut = m - 1;
        let head_rest: Box<[u64]> = node.rest[..cut].into();
        let tail_first = node.rest[cut];
        let tail_rest: Box<[u64]> = node.rest[cut + 1..].into();
        let holders = std::mem::take(&mut node.holders);
        let head = self.nodes.alloc(Node {
            first,
            rest: head_rest,
            holders: Vec::new(),
            parent,
            children: 1,
        });
        // The edge into `n` now leads to the head (it has the same parent and first key).
        self.edges.insert(parent, first, head, |x| x == n);
        let node = &mut self.nodes[n];
        node.first = tail_first;
        node.rest = tail_rest;
        node.parent = head;
        let nodes = &self.nodes;
        self.edges.insert(head, tail_first, n, |x| {
            nodes[x].first == tail_first && nodes[x].parent == head
        });
        let m32 = m as u32;
        let mut tail = holders;
        let mut head_holders = Vec::with_capacity(tail.len());
        tail.retain_mut(|h| {
            if h.held <= m32 {
                head_holders.push(*h);
                self.entries[h.entry].node = head;
                false
            } else {
                let mut head_holder = Holder {
                    endpoint: h.endpoint,
                    held: m32,
                    fast: h.fast,
                    entry: NIL,
                };
                head_holder.fit_tiers();
                let entry = self.entries.alloc(Entry {
                    node: head,
                    prev: NIL,
                    next: NIL,
                });
                insert_before(
                    &mut self.entries,
                    &mut self.endpoints[usize::from(h.endpoint)],
                    h.entry,
                    entry,
                );
                head_holder.entry = entry;
                head_holders.push(head_holder);
                h.held -= m32;
                for f in &mut h.fast {
                    *f = f.saturating_sub(m32);
                }
                true
            }
        });
        fit_holders(&mut tail);
        self.nodes[n].holders = tail;
        self.nodes[head].holders = head_holders;
        head
    }

    /// Makes `endpoint` hold all of node `n`, most recently used.
    fn touch(&mut self, e: usize, n: u32) {
        let node = &mut self.nodes[n];
        let len = node.len() as u32;
        let lru = &mut self.endpoints[e];
        if let Some(h) = node
            .holders
            .iter_mut()
            .find(|h| usize::from(h.endpoint) == e)
        {
            lru.blocks += len.saturating_sub(h.held) as usize;
            h.held = len;
            h.fast = [len; 2];
            let entry = h.entry;
            unlink(&mut self.entries, lru, entry);
            push_front(&mut self.entries, lru, entry);
            return;
        }
        let entry = self.entries.alloc(Entry {
            node: n,
            prev: NIL,
            next: NIL,
        });
        if node.holders.len() == node.holders.capacity() {
            node.holders.reserve_exact(node.holders.len().max(1));
        }
        node.holders.push(Holder {
            endpoint: e as u16,
            held: len,
            fast: [len; 2],
            entry,
        });
        lru.blocks += len as usize;
        push_front(&mut self.entries, lru, entry);
    }

    /// Trims `endpoint`'s least recently used holdings until it is within capacity.
    fn evict(&mut self, e: usize) {
        self.evict_to(e, self.capacity);
    }

    /// Trims `endpoint`'s least recently used holdings until it holds at most `max` keys.
    fn evict_to(&mut self, e: usize, max: usize) {
        while let Some(&lru) = self.endpoints.get(e) {
            if lru.blocks <= max || lru.tail == NIL {
                break;
            }
            self.cut(e, lru.tail, lru.blocks - max);
        }
    }

    /// Drops up to `count` keys off the end of the holding at `entry` of endpoint `e`, freeing
    /// the holding, and the node if nobody holds it any more.
    fn cut(&mut self, e: usize, entry: u32, count: usize) {
        let n = self.entries[entry].node;
        let node = &mut self.nodes[n];
        let lru = &mut self.endpoints[e];
        let Some(i) = node
            .holders
            .iter()
            .position(|h| usize::from(h.endpoint) == e)
        else {
            // Not reachable: every entry has its holder. Drop the entry all the same.
            unlink(&mut self.entries, lru, entry);
            self.entries.release(entry);
            return;
        };
        let held = node.holders[i].held as usize;
        let cut = count.min(held);
        lru.blocks = lru.blocks.saturating_sub(cut);
        if cut == held {
            node.holders.swap_remove(i);
            fit_holders(&mut node.holders);
            unlink(&mut self.entries, lru, entry);
            self.entries.release(entry);
        } else {
            node.holders[i].held -= cut as u32;
            node.holders[i].fit_tiers();
        }
        if node.holders.is_empty() {
            self.free_node(n);
        } else if held == node.len() {
            // It was the longest: keep the node as long as the longest holding left.
            let longest = node.holders.iter().map(|h| h.held).max().unwrap_or(1) as usize;
            if longest < node.len() {
                let mut rest = std::mem::take(&mut node.rest).into_vec();
                rest.truncate(longest.saturating_sub(1));
                node.rest = rest.into_boxed_slice();
            }
        }
    }

    /// Frees node `n`, which nobody holds (so it has no children left).
    fn free_node(&mut self, n: u32) {
        let (parent, first) = (self.nodes[n].parent, self.nodes[n].first);
        self.edges.remove(parent, first, n);
        if parent != NIL {
            let p = &mut self.nodes[parent];
            p.children = p.children.saturating_sub(1);
        }
        self.nodes.release(n);
    }
}

/// Keeps a holder vector at most twice as long as its holders.
fn fit_holders(holders: &mut Vec<Holder>) {
    if holders.capacity() > 2 * holders.len() {
        holders.shrink_to_fit();
    }
}

fn unlink(entries: &mut Slab<Entry>, lru: &mut Lru, i: u32) {
    let Entry { prev, next, .. } = entries[i];
    if prev == NIL {
        lru.head = next;
    } else {
        entries[prev].next = next;
    }
    if next == NIL {
        lru.tail = prev;
    } else {
        entries[next].prev = prev;
    }
}

fn push_front(entries: &mut Slab<Entry>, lru: &mut Lru, i: u32) {
    let old = lru.head;
    entries[i].prev = NIL;
    entries[i].next = old;
    if old == NIL {
        lru.tail = i;
    } else {
        entries[old].prev = i;
    }
    lru.head = i;
}

/// Links entry `i` just in front of (more recent than) entry `at`.
fn insert_before(entries: &mut Slab<Entry>, lru: &mut Lru, at: u32, i: u32) {
    let prev = entries[at].prev;
    entries[i].prev = prev;
    entries[i].next = at;
    entries[at].prev = i;
    if prev == NIL {
        lru.head = i;
    } else {
        entries[prev].next = i;
    }
}
