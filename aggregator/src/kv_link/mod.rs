//! Links relayed routing decisions (text block keys) to the server blocks their prefill stored,
//! by causal correlation, with no tokenizer: see `DESIGN.md`, "Relating the filters' text
//! blocks to the servers' token blocks".
//!
//! A decision sent prompt keys `K` to endpoint `E`. Its *anchor* is the last key of `K` already
//! linked on `E` (a server block and the key's estimated token position), or the root for a
//! prompt that shares nothing linked. Its prefill is a `BlockStored` chain on `E` that hangs
//! (directly, or through other unlinked chains such as chunked prefill or decode blocks) under
//! a linked block on the anchor's branch within a few blocks of it (or is a root chain, for a
//! root anchor), and that ends where the new text ends: the anchor's position plus the new
//! bytes over the configured bytes per token, give or take one text span, a relative tolerance
//! and a few tokens. A decision and a chain are linked only when each is the other's only
//! match; when several fit, the decisions are dropped unlinked ("ambiguous"): a wrong link
//! would later remove the wrong keys, a missing one only costs affinity. Their chains stay
//! (contested, never linked on their own) so that the next turn's chain, which hangs under one
//! of them, still links its whole new text through it.
//!
//! Decisions and events arrive in either order (the relay is pushed on the proxies' poll
//! interval), so both wait in per-endpoint pending lists, capped and aged out after
//! [`LinkSettings::window`]. A chain is linked only once it is [`LinkSettings::relay_lag`] old
//! (a competing decision relayed late has arrived by then), and a chain stored more than that
//! before a decision arrived cannot be its prefill.
//!
//! A `BlockRemoved` (GPU) of a linked block removes the text keys linked to it and to every
//! block below it (the suffix: those prefixes are no longer cached whole), recorded as a
//! [`Removal`]; `AllBlocksCleared` removes every key of the endpoint. A block the server also
//! holds on a slower tier (its `BlockStored` with medium CPU or STORAGE, as vLLM's CPU
//! offloading writes every block through) is offloaded instead: its keys stay linked, and the
//! record says the tier they moved to, where they still save prefill; they are removed when
//! the last slower copy goes, and back on the GPU when the server stores the block there
//! again (it loaded it back). Time is passed in.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvoy_aggregator::kv_link::{LinkSettings, Linker};
//! use kvoy_kvevents::{BlockHash, EventBatch, KvEvent, Medium};
//! use kvoy_shared::prefix::BlockKey;
//! use kvoy_shared::relay::RelayedDecision;
//!
//! let e = "10.0.0.1:8000".parse().unwrap();
//! let mut linker = Linker::new(LinkSettings { enabled: true, ..LinkSettings::default() });
//! let t0 = Instant::now();
//! // Two 64-byte text blocks: 32 tokens at 4 bytes per token, two 16-token server blocks.
//! let keys = vec![BlockKey(1), BlockKey(2)];
//! linker.decisions(&[RelayedDecision { endpoint: e, keys, routed_at_ms: None }], t0);
//! let stored = KvEvent::BlockStored {
//!     block_hashes: vec![BlockHash::from_u64(10), BlockHash::from_u64(11)],
//!     parent_block_hash: None,
//!     token_ids: vec![0; 32],
//!     block_size: 16,
//!     lora_id: None,
//!     medium: Medium::Gpu,
//!     lora_name: None,
//!     group_idx: None,
//! };
//! let batch = |events| EventBatch { ts: 0.0, events, data_parallel_rank: None };
//! linker.events(e, &batch(vec![stored]), t0);
//! linker.tick(t0 + Duration::from_secs(1));
//! assert_eq!(linker.counters().decisions_linked, 1);
//! let removed = KvEvent::BlockRemoved {
//!     block_hashes: vec![BlockHash::from_u64(11)],
//!     medium: Medium::Gpu,
//!     group_idx: None,
//! };
//! linker.events(e, &batch(vec![removed]), t0 + Duration::from_secs(2));
//! let r = linker.removals_after(0, 10);
//! assert_eq!(r[0].keys, vec![BlockKey(2)]);
//! ```

use std::cell::Cell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvoy_kvevents::{BlockHash, EventBatch, KvEvent, Medium};
use kvoy_shared::prefix::{BlockKey, KeySchedule};
use kvoy_shared::relay::RelayedDecision;
use kvoy_shared::Tier;

#[cfg(test)]
mod tests;

/// Pending chains a walk goes through at most to find where a chain forks off the linked tree.
const MAX_WALK: usize = 16;

/// How the linker matches, and what it holds at most.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkSettings {
    /// On by default. Off, the linker keeps and does nothing (no removals reach the proxies;
    /// they still cut an endpoint's index to its reported block count).
    pub enabled: bool,
    /// The filters' key schedule (`block_size`, `dense_blocks`, `blocks_per_doubling`,
    /// `max_blocks` of their configuration): where each text key ends, in prompt bytes.
    pub schedule: KeySchedule,
    /// Prompt bytes per token (the filters' `cost.bytes_per_token`).
    pub bytes_per_token: f64,
    /// How long unlinked decisions and chains wait for each other.
    pub window: Duration,
    /// How late a decision reaches the aggregator after the proxy routed it, at most (the
    /// proxies' poll interval and then some).
    pub relay_lag: Duration,
    /// The chain's end may miss the predicted end by this fraction of the new tokens...
    pub tolerance: f64,
    /// ...plus this many tokens (the chat template's markers, rounding).
    pub slack_tokens: u64,
    /// Linked blocks between a chain's fork and the anchor at most (either way).
    pub fork_blocks: usize,
    /// Pending decisions per endpoint at most (the oldest go first).
    pub max_pending_decisions: usize,
    /// Pending chains per endpoint at most (the oldest go first).
    pub max_pending_chains: usize,
    /// Linked server blocks per endpoint at most (then decisions stay unlinked).
    pub max_linked_blocks: usize,
    /// Removal records kept at most, for all endpoints.
    pub max_removals: usize,
    /// Matching passes one [`Linker::tick`] makes on one endpoint at most (a pass ends at a
    /// link, which changes the tree: the next recomputes the forks, about the pending chains
    /// times their walk); the rest wait for the next tick.
    pub max_matches_per_tick: usize,
    /// Keys one removal record names at most (the count is always exact).
    pub max_removal_keys: usize,
    /// Blocks per endpoint whose copies on slower tiers (CPU, storage) are followed, at most
    /// (beyond, a block evicted from the GPU counts as removed).
    pub max_offloaded_blocks: usize,
    /// Matching runs on a tick at most this often (ageing on every tick).
    pub match_interval: Duration,
    /// Chains in a decision's window at most before it counts as ambiguous outright.
    pub max_candidates: usize,
    /// How far the servers' clocks may be behind the proxies', seconds: a chain stored (its
    /// event batch's time) more than this before a decision was routed is not its prefill.
    pub clock_skew_s: f64,
}

impl Default for LinkSettings {
    /// The filters' defaults (64-byte blocks, 128 dense keys then doublings every 64, 512 keys,
    /// 4 bytes per token).
    fn default() -> Self {
        LinkSettings {
            enabled: true,
            schedule: KeySchedule {
                block_size: 64,
                max_keys: 512,
                dense: 128,
                group: 64,
            },
            bytes_per_token: 4.0,
            window: Duration::from_secs(10),
            relay_lag: Duration::from_millis(500),
            tolerance: 0.1,
            slack_tokens: 4,
            fork_blocks: 2,
            max_pending_decisions: 256,
            max_pending_chains: 1024,
            max_linked_blocks: 1 << 16,
            max_removals: 256,
            max_removal_keys: 4096,
            max_offloaded_blocks: 1 << 18,
            max_matches_per_tick: 16,
            match_interval: Duration::from_millis(50),
            max_candidates: 16,
            clock_skew_s: 0.05,
        }
    }
}

/// What the linker did, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkCounters {
    pub decisions_linked: u64,
    /// Unlinked: no fitting chain arrived within the window.
    pub unlinked_no_chain: u64,
    /// Unlinked: more than one chain or decision fitted.
    pub unlinked_ambiguous: u64,
    /// Unlinked: dropped from a full pending list, or the linked blocks at their cap.
    pub unlinked_capacity: u64,
    /// Decisions whose every key was linked already (nothing new to store).
    pub decisions_known: u64,
    /// Decisions equal to one pending already (merged into it).
    pub decisions_repeated: u64,
    pub keys_linked: u64,
    /// `BlockRemoved` or `AllBlocksCleared` events that removed linked keys.
    pub exact_removals: u64,
    pub keys_removed: u64,
    /// `BlockRemoved` events that moved linked keys off the GPU to a slower tier, and the keys.
    pub offloads: u64,
    pub keys_offloaded: u64,
    /// Blocks on slower tiers not followed (over [`LinkSettings::max_offloaded_blocks`]).
    pub offloaded_over_cap: u64,
    /// Chains no decision claimed within the window.
    pub chains_expired: u64,
}

/// Linked keys an endpoint lost: their prefix is no longer cached there (or, with
/// `offloaded_to`, no longer on its GPU).
#[derive(Clone, Debug, PartialEq)]
pub struct Removal {
    /// Numbered from 1, across endpoints.
    pub seq: u64,
    pub endpoint: SocketAddr,
    /// The keys (at most [`LinkSettings::max_removal_keys`]).
    pub keys: Vec<BlockKey>,
    /// Keys removed, including any left out of `keys`.
    pub count: usize,
    /// Every key of the endpoint went (`AllBlocksCleared`, a publisher restart).
    pub cleared: bool,
    /// The event batch's timestamp (the server's clock, seconds since the Unix epoch); none
    /// for a publisher restart.
    pub event_ts: Option<f64>,
    /// The keys moved to this slower tier rather than out of the server's caches.
    pub offloaded_to: Option<Tier>,
}

/// One endpoint's state, for the pool view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointLinks {
    pub linked_keys: usize,
    pub linked_blocks: usize,
    pub pending_decisions: usize,
    pub pending_chains: usize,
}

/// A server block in the linked tree.
#[derive(Debug)]
struct Node {
    parent: Option<BlockHash>,
    children: Vec<BlockHash>,
    keys: Vec<BlockKey>,
    /// Token position of the block's end, from the root.
    end: u64,
    /// The server evicted the block from its GPU and holds it on a slower tier only.
    off_gpu: bool,
}

/// A block's copies on the tiers below the GPU.
const COPY_CPU: u8 = 1;
const COPY_STORAGE: u8 = 2;

/// The fastest slower tier among `copies`.
fn copy_tier(copies: u8) -> Option<Tier> {
    if copies & COPY_CPU != 0 {
        Some(Tier::Cpu)
    } else if copies & COPY_STORAGE != 0 {
        Some(Tier::Storage)
    } else {
        None
    }
}

#[derive(Debug)]
struct Chain {
    blocks: Vec<BlockHash>,
    parent: Option<BlockHash>,
    block_tokens: u64,
    at: Instant,
    /// Its event batch's timestamp (the server's clock, seconds since the Unix epoch).
    ts: f64,
    /// Fitted several decisions: never linked as one's own, but a later turn's chain still
    /// links through it (that turn's keys cover this one's text too).
    contested: bool,
}

#[derive(Debug)]
struct Decision {
    keys: Vec<BlockKey>,
    at: Instant,
    /// When the proxy routed it (seconds since the Unix epoch, its clock), when it said.
    routed: Option<f64>,
    /// The anchor found last, and the endpoint's [`Endpoint::removals`] then: it holds until a
    /// removal, or a link of a decision with the same first key (keys chain: only those share
    /// keys with this one).
    anchor: Cell<Option<(u64, Anchor)>>,
}

/// Where a pending chain hangs off the linked tree, and what lies between.
#[derive(Debug, Clone)]
struct Fork {
    /// The linked block it hangs under (`None`: a root chain).
    node: Option<BlockHash>,
    /// Token position of the chain's end.
    end: u64,
    /// The pending chains on the way, from the chain itself up: (id, blocks used).
    path: Vec<(u64, usize)>,
}

/// What a decision predicts.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    /// The block its last linked key is linked to (`None`: root).
    node: Option<BlockHash>,
    /// Index of that key in the decision (`None`: root).
    key: Option<usize>,
    /// Token position of that key's end (0 at the root).
    pos: f64,
}

#[derive(Debug, Default)]
struct Endpoint {
    tree: HashMap<BlockHash, Node>,
    /// Linked keys: the block each is linked to, and the key's estimated token end.
    keys: HashMap<BlockKey, (BlockHash, f64)>,
    chains: HashMap<u64, Chain>,
    chain_order: VecDeque<u64>,
    /// Blocks of pending chains: (chain id, index in the chain).
    pending_blocks: HashMap<BlockHash, (u64, usize)>,
    decisions: HashMap<u64, Decision>,
    decision_order: VecDeque<u64>,
    /// Something arrived since the last match (see [`Linker::tick`]).
    dirty: bool,
    /// Removals so far (a removal can shorten any decision's anchor).
    removals: u64,
    /// Blocks held on slower tiers ([`COPY_CPU`], [`COPY_STORAGE`]), linked or not.
    copies: HashMap<BlockHash, u8>,
    /// When the next pending chain settles (then a match may link it).
    settle_at: Option<Instant>,
}

/// The causal join of relayed decisions and KV events, for every endpoint (see the module doc).
#[derive(Debug)]
pub struct Linker {
    settings: LinkSettings,
    endpoints: HashMap<SocketAddr, Endpoint>,
    counters: LinkCounters,
    removals: VecDeque<Removal>,
    next_seq: u64,
    next_id: u64,
    /// When matching last ran.
    matched_at: Option<Instant>,
}

impl Linker {
    pub fn new(settings: LinkSettings) -> Self {
        Linker {
            settings,
            endpoints: HashMap::new(),
            counters: LinkCounters::default(),
            removals: VecDeque::new(),
            next_seq: 1,
            next_id: 1,
            matched_at: None,
        }
    }

    pub fn settings(&self) -> &LinkSettings {
        &self.settings
    }

    pub fn counters(&self) -> LinkCounters {
        self.counters
    }

    /// Relayed decisions, as they reach the aggregator (pool members only).
    pub fn decisions(&mut self, decisions: &[RelayedDecision], now: Instant) {
        if !self.settings.enabled {
            return;
        }
        for d in decisions {
            if d.keys.is_empty() {
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            let ep = self.endpoints.entry(d.endpoint).or_default();
            if d.keys.last().is_some_and(|k| ep.keys.contains_key(k)) {
                self.counters.decisions_known += 1;
                continue;
            }
            // The same prompt pending already (a repeat, or a decision relayed twice): keys
            // chain, so an equal last key is an equal prompt, and one link serves both.
            if ep
                .decisions
                .values()
                .any(|p| p.keys.last() == d.keys.last())
            {
                self.counters.decisions_repeated += 1;
                continue;
            }
            ep.decisions.insert(
                id,
                Decision {
                    keys: d.keys.clone(),
                    at: now,
                    routed: d.routed_at_ms.map(|ms| ms as f64 / 1000.0),
                    anchor: Cell::new(None),
                },
            );
            ep.decision_order.push_back(id);
            while ep.decision_order.len() > self.settings.max_pending_decisions {
                if let Some(old) = ep.decision_order.pop_front() {
                    if ep.decisions.remove(&old).is_some() {
                        self.counters.unlinked_capacity += 1;
                    }
                }
            }
            ep.dirty = true;
        }
    }

    /// One batch of `endpoint`'s KV events.
    pub fn events(&mut self, endpoint: SocketAddr, batch: &EventBatch, now: Instant) {
        if !self.settings.enabled {
            return;
        }
        for event in &batch.events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    block_size,
                    medium,
                    ..
                } if *medium == Medium::Gpu => {
                    // A store without its tokens cannot be matched to a prompt's prefill.
                    if event.block_tokens().is_none() {
                        continue;
                    }
                    self.stored(
                        endpoint,
                        block_hashes,
                        *parent_block_hash,
                        *block_size,
                        (now, batch.ts),
                    );
                }
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } => self.copied(endpoint, block_hashes, medium, true, batch.ts),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } if *medium == Medium::Gpu => self.removed(endpoint, block_hashes, batch.ts),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => self.copied(endpoint, block_hashes, medium, false, batch.ts),
                KvEvent::AllBlocksCleared => self.clear_at(endpoint, Some(batch.ts)),
                _ => {}
            }
        }
        if let Some(ep) = self.endpoints.get_mut(&endpoint) {
            ep.dirty = true;
        }
    }

    /// Forgets `endpoint`'s blocks (its publisher restarted): every linked key is removed.
    pub fn clear(&mut self, endpoint: SocketAddr) {
        self.clear_at(endpoint, None);
    }

    fn clear_at(&mut self, endpoint: SocketAddr, event_ts: Option<f64>) {
        let Some(ep) = self.endpoints.get_mut(&endpoint) else {
            return;
        };
        let keys: Vec<BlockKey> = ep
            .tree
            .values()
            .flat_map(|n| n.keys.iter().copied())
            .collect();
        ep.tree.clear();
        ep.keys.clear();
        ep.copies.clear();
        ep.removals += 1;
        ep.chains.clear();
        ep.chain_order.clear();
        ep.pending_blocks.clear();
        self.record_removal(endpoint, keys, true, event_ts, None);
    }

    /// Forgets `endpoint` altogether (it left the pool).
    pub fn forget(&mut self, endpoint: SocketAddr) {
        self.endpoints.remove(&endpoint);
    }

    /// Ages out what waited too long and links what settled, on every endpoint. Decisions and
    /// events only queue (their callers hold the lock on the aggregator's hot paths); the
    /// matching happens here, on the endpoints where something arrived or a chain settled
    /// since, at most [`LinkSettings::max_matches_per_tick`] passes each: the rest waits for
    /// the next tick.
    pub fn tick(&mut self, now: Instant) {
        let (settings, lag) = (self.settings, self.settings.relay_lag);
        for ep in self.endpoints.values_mut() {
            ep.age(&settings, now, &mut self.counters);
        }
        if self
            .matched_at
            .is_some_and(|t| now.saturating_duration_since(t) < settings.match_interval)
        {
            return;
        }
        self.matched_at = Some(now);
        let due: Vec<SocketAddr> = self
            .endpoints
            .iter()
            .filter(|(_, ep)| ep.dirty || ep.settle_at.is_some_and(|t| now >= t))
            .map(|(e, _)| *e)
            .collect();
        for e in due {
            self.process(e, now);
            if let Some(ep) = self.endpoints.get_mut(&e) {
                // The next chain to settle wakes the endpoint again.
                ep.settle_at = ep
                    .chains
                    .values()
                    .map(|c| c.at + lag)
                    .filter(|&t| t > now)
                    .min();
            }
        }
    }

    /// Removal records numbered after `seq`, oldest first, at most `limit`.
    pub fn removals_after(&self, seq: u64, limit: usize) -> Vec<Removal> {
        self.removals
            .iter()
            .filter(|r| r.seq > seq)
            .take(limit)
            .cloned()
            .collect()
    }

    /// What a proxy polling with removal cursor `from` gets: up to `limit` records numbered
    /// `from` or later, oldest first, and the cursor to ask with next (the number after the
    /// last one returned). A proxy that just started (0) gets none and the number the next
    /// record will have: what it learns from now on postdates the removals before. One ahead of
    /// the numbering (this aggregator restarted since) gets every record from the oldest held.
    pub fn removals_for_proxy(&self, from: u64, limit: usize) -> (Vec<Removal>, u64) {
        if from == 0 {
            return (Vec::new(), self.next_seq);
        }
        let from = if from > self.next_seq { 1 } else { from };
        let page = self.removals_after(from - 1, limit);
        let next = page.last().map_or(from, |r| r.seq + 1);
        (page, next)
    }

    /// The newest `n` removal records, oldest first.
    pub fn recent_removals(&self, n: usize) -> Vec<Removal> {
        let skip = self.removals.len().saturating_sub(n);
        self.removals.iter().skip(skip).cloned().collect()
    }

    /// `endpoint`'s state now.
    pub fn endpoint(&self, endpoint: SocketAddr) -> EndpointLinks {
        self.endpoints
            .get(&endpoint)
            .map_or_else(EndpointLinks::default, |ep| EndpointLinks {
                linked_keys: ep.keys.len(),
                linked_blocks: ep.tree.len(),
                pending_decisions: ep.decisions.len(),
                pending_chains: ep.chains.len(),
            })
    }

    /// The keys linked on `endpoint` now (for tests and debugging).
    pub fn linked_keys(&self, endpoint: SocketAddr) -> Vec<BlockKey> {
        let mut keys: Vec<BlockKey> = self
            .endpoints
            .get(&endpoint)
            .map(|ep| ep.keys.keys().copied().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    fn stored(
        &mut self,
        endpoint: SocketAddr,
        blocks: &[BlockHash],
        parent: Option<BlockHash>,
        block_size: u32,
        (now, ts): (Instant, f64),
    ) {
        let ep = self.endpoints.entry(endpoint).or_default();
        // Linked blocks stored again: the server loaded them back from a slower tier (or holds
        // two copies of one hash). They are on the GPU again, and what follows them in the
        // event (the rest of the prompt, prefilled) hangs under the last of them.
        let known = blocks
            .iter()
            .take_while(|b| match ep.tree.get_mut(b) {
                Some(n) => {
                    n.off_gpu = false;
                    true
                }
                None => false,
            })
            .count();
        let (parent, blocks) = match known.checked_sub(1) {
            Some(last) => (Some(blocks[last]), &blocks[known..]),
            None => (parent, blocks),
        };
        // A block stored again (vLLM may hold two copies of one hash) changes nothing.
        if blocks.is_empty()
            || blocks
                .iter()
                .any(|b| ep.tree.contains_key(b) || ep.pending_blocks.contains_key(b))
        {
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        for (i, b) in blocks.iter().enumerate() {
            ep.pending_blocks.insert(*b, (id, i));
        }
        ep.chains.insert(
            id,
            Chain {
                blocks: blocks.to_vec(),
                parent,
                block_tokens: u64::from(block_size),
                at: now,
                ts,
                contested: false,
            },
        );
        ep.chain_order.push_back(id);
        while ep.chain_order.len() > self.settings.max_pending_chains {
            if let Some(old) = ep.chain_order.pop_front() {
                ep.drop_chain(old);
            }
        }
    }

    fn removed(&mut self, endpoint: SocketAddr, blocks: &[BlockHash], event_ts: f64) {
        let Some(ep) = self.endpoints.get_mut(&endpoint) else {
            return;
        };
        let mut keys = Vec::new();
        let mut offloaded: [Vec<BlockKey>; 2] = Default::default();
        for b in blocks {
            if ep.tree.contains_key(b) {
                ep.evict_from_gpu(*b, &mut keys, &mut offloaded);
            } else if let Some(&(id, _)) = ep.pending_blocks.get(b) {
                // Its prefix is gone: it can no longer be anyone's cached continuation.
                ep.drop_chain(id);
            }
        }
        self.record_removal(endpoint, keys, false, Some(event_ts), None);
        let [cpu, storage] = offloaded;
        self.record_removal(endpoint, cpu, false, Some(event_ts), Some(Tier::Cpu));
        self.record_removal(
            endpoint,
            storage,
            false,
            Some(event_ts),
            Some(Tier::Storage),
        );
    }

    /// A `BlockStored` (`stored`) or `BlockRemoved` on any tier: the blocks' copies below the
    /// GPU. A linked block off the GPU whose last slower copy goes is removed; one that keeps
    /// only a slower copy moves there.
    fn copied(
        &mut self,
        endpoint: SocketAddr,
        blocks: &[BlockHash],
        medium: &Medium,
        stored: bool,
        event_ts: f64,
    ) {
        let bit = match medium {
            Medium::Cpu => COPY_CPU,
            Medium::Storage => COPY_STORAGE,
            _ => return,
        };
        let cap = self.settings.max_offloaded_blocks;
        let ep = self.endpoints.entry(endpoint).or_default();
        let mut keys = Vec::new();
        let mut moved = Vec::new();
        for b in blocks {
            if stored {
                if let Some(c) = ep.copies.get_mut(b) {
                    *c |= bit;
                } else if ep.copies.len() < cap {
                    ep.copies.insert(*b, bit);
                } else {
                    self.counters.offloaded_over_cap += 1;
                }
                continue;
            }
            let left = match ep.copies.get_mut(b) {
                Some(c) => {
                    *c &= !bit;
                    *c
                }
                None => continue,
            };
            if left == 0 {
                ep.copies.remove(b);
            }
            if !ep.tree.get(b).is_some_and(|n| n.off_gpu) {
                continue;
            }
            match copy_tier(left) {
                None => ep.remove_subtree(*b, &mut keys),
                // Only storage left: the block and its suffix are there at best.
                Some(_) => ep.subtree_keys(*b, &mut moved),
            }
        }
        self.record_removal(endpoint, keys, false, Some(event_ts), None);
        // A block's subtree holds the blocks below it, which may be listed too.
        moved.sort_unstable();
        moved.dedup();
        self.record_removal(endpoint, moved, false, Some(event_ts), Some(Tier::Storage));
    }

    fn record_removal(
        &mut self,
        endpoint: SocketAddr,
        mut keys: Vec<BlockKey>,
        cleared: bool,
        event_ts: Option<f64>,
        offloaded_to: Option<Tier>,
    ) {
        if keys.is_empty() {
            return;
        }
        let count = keys.len();
        if offloaded_to.is_some() {
            self.counters.offloads += 1;
            self.counters.keys_offloaded += count as u64;
        } else {
            self.counters.exact_removals += 1;
            self.counters.keys_removed += count as u64;
        }
        keys.truncate(self.settings.max_removal_keys);
        self.removals.push_back(Removal {
            seq: self.next_seq,
            endpoint,
            keys,
            count,
            cleared,
            event_ts: event_ts.filter(|t| t.is_finite()),
            offloaded_to,
        });
        self.next_seq += 1;
        while self.removals.len() > self.settings.max_removals {
            self.removals.pop_front();
        }
    }

    /// Ages out, then links every decision that has exactly one settled chain which has
    /// exactly that decision; drops ambiguous groups.
    fn process(&mut self, endpoint: SocketAddr, now: Instant) {
        let s = self.settings;
        let Some(ep) = self.endpoints.get_mut(&endpoint) else {
            return;
        };
        // (Aged already: `tick` ages every endpoint before it matches.)
        let c = &mut self.counters;
        ep.dirty = false;
        if ep.decisions.is_empty() || ep.chains.is_empty() {
            return;
        }
        // Each link can make another decision's anchor (its previous turn) known, and each
        // drop changes who fits what: recompute after either, a bounded number of times.
        // Where the chains fork changes only with a link (drops change who fits, not where).
        let mut cached: Option<(Vec<(u64, Fork)>, ForkBuckets)> = None;
        for pass in 0.. {
            if pass == s.max_matches_per_tick {
                ep.dirty = true;
                break;
            }
            let (forks, buckets) = &*cached.get_or_insert_with(|| {
                let forks: Vec<(u64, Fork)> = ep
                    .chain_order
                    .iter()
                    .filter_map(|&id| ep.fork(id).map(|f| (id, f)))
                    .collect();
                let buckets = ForkBuckets::new(ep, &s, &forks);
                (forks, buckets)
            });
            // A later turn waits for its earlier turn's decision: until that one is linked its
            // anchor would be the root, and a root prediction fits the earlier turn's chain.
            let lasts: HashSet<BlockKey> = ep
                .decisions
                .values()
                .filter_map(|d| d.keys.last().copied())
                .collect();
            // A decision with more chains in its window than `max_candidates` cannot be told
            // apart from them (many concurrent prompts of one length): dropped as ambiguous at
            // once, its chains contested, without trying each pair.
            let mut crowded: Vec<(u64, Vec<usize>)> = Vec::new();
            let mut table: Vec<(u64, Vec<usize>)> = ep
                .decision_order
                .iter()
                .filter_map(|&did| {
                    let d = ep.decisions.get(&did)?;
                    let (_, earlier) = d.keys.split_last()?;
                    if earlier.iter().any(|k| lasts.contains(k)) {
                        return None;
                    }
                    let anchor = ep.anchor_of(d);
                    let near = buckets.near(ep, &s, d, &anchor);
                    if near.len() > s.max_candidates {
                        crowded.push((did, near));
                        return None;
                    }
                    let mut fitting: Vec<usize> = near
                        .into_iter()
                        .filter(|&i| {
                            let (cid, f) = &forks[i];
                            ep.chains.get(cid).is_some_and(|ch| {
                                !ch.contested
                                    && ch.at + s.relay_lag >= d.at
                                    && d.routed.is_none_or(|r| ch.ts + s.clock_skew_s >= r)
                                    && ep.fits(&s, d, &anchor, f)
                            })
                        })
                        .collect();
                    fitting.sort_unstable();
                    fitting.dedup();
                    Some((did, fitting))
                })
                .collect();
            // Earliest routed first (those without a time after, in arrival order): the FIFO
            // rule below takes a run of one length in the order the server served it.
            table.sort_by(|(a, _), (b, _)| {
                let at = |id| {
                    ep.decisions
                        .get(id)
                        .and_then(|d| d.routed)
                        .unwrap_or(f64::MAX)
                };
                at(a).total_cmp(&at(b))
            });
            if !crowded.is_empty() {
                for (did, near) in crowded {
                    if ep.decisions.remove(&did).is_some() {
                        c.unlinked_ambiguous += 1;
                    }
                    for i in near {
                        if let Some(ch) = ep.chains.get_mut(&forks[i].0) {
                            ch.contested = true;
                        }
                    }
                }
                ep.decision_order.retain(|id| ep.decisions.contains_key(id));
                // The others' rivals changed: match again.
                continue;
            }
            // Which decisions fit each chain, for the rivals of a pick.
            let mut fitted_by: HashMap<usize, Vec<u64>> = HashMap::new();
            for (did, cs) in &table {
                for &ci in cs {
                    fitted_by.entry(ci).or_default().push(*did);
                }
            }
            let order: HashMap<u64, usize> = table
                .iter()
                .enumerate()
                .map(|(i, (d, _))| (*d, i))
                .collect();
            // A link changes the tree, hence forks and anchors: the pass ends after one. A drop
            // of an ambiguous group does not; the pass goes on with the decisions none of whose
            // chains it touched (their table rows still hold).
            let mut changed = false;
            let mut linked = false;
            let mut touched: HashSet<usize> = HashSet::new();
            for (did, candidates) in &table {
                if candidates.is_empty()
                    || !ep.decisions.contains_key(did)
                    || candidates.iter().any(|ci| touched.contains(ci))
                {
                    continue;
                }
                let settled = candidates.iter().all(|&ci| {
                    ep.chains
                        .get(&forks[ci].0)
                        .is_some_and(|ch| now.saturating_duration_since(ch.at) >= s.relay_lag)
                });
                if !settled {
                    continue;
                }
                // Several chains that all descend from the best fitting one are the prompt and
                // its own continuation (decode blocks, or a next turn's chain relayed late):
                // the best one is the prefill, the rest are taken in without keys.
                let best = ep.best(&s, *did, candidates, forks);
                let nested = best.is_some_and(|b| {
                    candidates
                        .iter()
                        .all(|&ci| ci == b || forks[ci].1.path.iter().any(|p| p.0 == forks[b].0))
                });
                let chosen: Vec<usize> = match best {
                    Some(b) if nested => vec![b],
                    _ => candidates.clone(),
                };
                // Every decision that fits one of the chosen chains, in decision order.
                let mut rivals: Vec<u64> = chosen
                    .iter()
                    .flat_map(|ci| fitted_by.get(ci).into_iter().flatten().copied())
                    .collect();
                rivals.retain(|r| ep.decisions.contains_key(r));
                rivals.sort_unstable_by_key(|d| order.get(d).copied().unwrap_or(usize::MAX));
                rivals.dedup();
                // With routing times, the chain stored first among a decision's candidates is
                // its prefill when it fits no other pending decision (the others were routed
                // after it was stored): prompts of one length served one after another.
                let fifo = || {
                    ep.decisions.get(did)?.routed?;
                    let ts = |ci: usize| ep.chains.get(&forks[ci].0).map_or(f64::MAX, |c| c.ts);
                    let first = *candidates
                        .iter()
                        .min_by(|&&a, &&b| ts(a).total_cmp(&ts(b)))?;
                    let alone = candidates
                        .iter()
                        .all(|&ci| ci == first || ts(ci) > ts(first));
                    let theirs = fitted_by.get(&first).is_some_and(|ds| {
                        ds.iter()
                            .filter(|d| ep.decisions.contains_key(d))
                            .all(|d| d == did)
                    });
                    (alone && theirs).then_some(first)
                };
                let pick = match (chosen.len(), rivals == [*did]) {
                    (1, true) => Some(chosen[0]),
                    _ => fifo(),
                };
                if let Some(pick) = pick {
                    let chosen = [pick];
                    let fork = &forks[chosen[0]].1;
                    let Some(d) = ep.decisions.remove(did) else {
                        continue;
                    };
                    if ep.tree.len() + fork_blocks(ep, fork) > s.max_linked_blocks {
                        c.unlinked_capacity += 1;
                    } else {
                        let anchor = ep.anchor_of(&d);
                        c.keys_linked += ep.link(&s, &d, &anchor, fork) as u64;
                        c.decisions_linked += 1;
                        // Decisions sharing its first key may have a longer anchor now.
                        for other in ep.decisions.values() {
                            if other.keys.first() == d.keys.first() {
                                other.anchor.set(None);
                            }
                        }
                        // The continuation chains no other decision (a later turn waiting
                        // for this one included) fits now.
                        for &ci in candidates.iter().filter(|&&ci| ci != chosen[0]) {
                            let cid = forks[ci].0;
                            if let Some(f) = ep.fork(cid).filter(|f| !ep.claimed(&s, cid, f)) {
                                ep.attach(&f);
                            }
                        }
                    }
                    changed = true;
                    linked = true;
                    break;
                } else {
                    // Several fit: none of them can be told apart, now or later.
                    for r in &rivals {
                        if ep.decisions.remove(r).is_some() {
                            c.unlinked_ambiguous += 1;
                        }
                    }
                    // The chains that could be one of them's own prefill; those hanging under
                    // another candidate are continuations, left to the next turns.
                    for &ci in candidates {
                        let nested = candidates.iter().any(|&cj| {
                            cj != ci && forks[ci].1.path.iter().any(|p| p.0 == forks[cj].0)
                        });
                        if nested {
                            continue;
                        }
                        if let Some(ch) = ep.chains.get_mut(&forks[ci].0) {
                            ch.contested = true;
                        }
                    }
                    // A decision that fits one of these chains sees them differently now (the
                    // rivals' other chains are not: a rival gone only leaves fewer rivals).
                    touched.extend(candidates.iter().copied());
                    changed = true;
                }
            }
            if linked {
                cached = None;
            }
            ep.decision_order.retain(|id| ep.decisions.contains_key(id));
            ep.chain_order.retain(|id| ep.chains.contains_key(id));
            if !changed || ep.decisions.is_empty() || ep.chains.is_empty() {
                break;
            }
        }
    }
}

/// New blocks a link through `fork` adds to the tree.
fn fork_blocks(ep: &Endpoint, fork: &Fork) -> usize {
    fork.path
        .iter()
        .map(|(id, used)| ep.chains.get(id).map_or(0, |_| *used))
        .sum()
}

/// Where key `i` of a prompt ends, in bytes (dense keys, then spans doubling every `group`).
fn key_end(schedule: &KeySchedule, i: usize) -> f64 {
    let dense = schedule.dense.min(i + 1);
    let mut bytes = (dense * schedule.block_size) as f64;
    let mut j = dense;
    while j <= i {
        // The keys from `j` up to the end of its group share one span.
        let group = schedule.group.max(1);
        let group_end = (j - schedule.dense) / group * group + group + schedule.dense;
        let n = group_end.min(i + 1) - j;
        bytes += (n * schedule.span(j)) as f64;
        j += n;
    }
    bytes
}

/// The token positions a decision's prefill ends between: at its last whole key, and up to the
/// next key's span beyond (the prompt's partial tail).
fn predicted(s: &LinkSettings, d: &Decision, anchor: &Anchor) -> (f64, f64) {
    let last = d.keys.len().saturating_sub(1);
    let from = anchor.key.map_or(0.0, |k| key_end(&s.schedule, k));
    let bpt = s.bytes_per_token.max(0.01);
    let lo = anchor.pos + (key_end(&s.schedule, last) - from) / bpt;
    (lo, lo + s.schedule.span(last + 1) as f64 / bpt)
}

/// The pending chains' forks grouped for lookup, each group sorted by the fork's end: by the
/// node they hang under, and under each of that node's ancestors up to `fork_blocks` above, so
/// that a decision finds the forks near its anchor (the proximity [`Endpoint::fits`] asks) in
/// a few probes and binary searches instead of trying every chain.
struct ForkBuckets {
    /// Forks hanging under exactly this node (`None`: root chains).
    at: HashMap<Option<BlockHash>, Vec<(u64, usize)>>,
    /// Forks hanging under a descendant of this node, at most `fork_blocks` below.
    below: HashMap<BlockHash, Vec<(u64, usize)>>,
}

impl ForkBuckets {
    fn new(ep: &Endpoint, s: &LinkSettings, forks: &[(u64, Fork)]) -> Self {
        let mut at: HashMap<Option<BlockHash>, Vec<(u64, usize)>> = HashMap::new();
        let mut below: HashMap<BlockHash, Vec<(u64, usize)>> = HashMap::new();
        for (i, (_, f)) in forks.iter().enumerate() {
            at.entry(f.node).or_default().push((f.end, i));
            let mut n = f.node;
            for _ in 0..s.fork_blocks {
                n = n.and_then(|x| ep.tree.get(&x)).and_then(|x| x.parent);
                let Some(p) = n else { break };
                below.entry(p).or_default().push((f.end, i));
            }
        }
        for group in at.values_mut().chain(below.values_mut()) {
            group.sort_unstable();
        }
        ForkBuckets { at, below }
    }

    /// The forks that may fit `d` at `anchor`: near the anchor, ending in its predicted window
    /// (a superset of what [`Endpoint::fits`] accepts; it decides).
    fn near(&self, ep: &Endpoint, s: &LinkSettings, d: &Decision, anchor: &Anchor) -> Vec<usize> {
        let (lo, hi) = predicted(s, d, anchor);
        let give = s.tolerance * (lo - anchor.pos) + s.slack_tokens as f64;
        let (min, max) = (lo - give, hi + give);
        let mut groups: Vec<&Vec<(u64, usize)>> = Vec::new();
        match anchor.node {
            None => groups.extend(self.at.get(&None)),
            Some(a) => {
                groups.extend(self.at.get(&Some(a)));
                groups.extend(self.below.get(&a));
                let mut n = Some(a);
                for _ in 0..s.fork_blocks {
                    n = n.and_then(|x| ep.tree.get(&x)).and_then(|x| x.parent);
                    let Some(p) = n else { break };
                    groups.extend(self.at.get(&Some(p)));
                }
            }
        }
        let mut out = Vec::new();
        for g in groups {
            let from = g.partition_point(|&(end, _)| (end as f64) < min);
            let to = g.partition_point(|&(end, _)| (end as f64) <= max);
            out.extend(g[from..to.max(from)].iter().map(|&(_, i)| i));
        }
        out
    }
}

impl Endpoint {
    /// Drops the decisions and chains that waited longer than the window.
    fn age(&mut self, s: &LinkSettings, now: Instant, c: &mut LinkCounters) {
        while let Some(&id) = self.decision_order.front() {
            match self.decisions.get(&id) {
                Some(d) if now.saturating_duration_since(d.at) <= s.window => break,
                Some(_) => {
                    self.decisions.remove(&id);
                    c.unlinked_no_chain += 1;
                }
                None => {}
            }
            self.decision_order.pop_front();
        }
        while let Some(&id) = self.chain_order.front() {
            match self.chains.get(&id) {
                Some(ch) if now.saturating_duration_since(ch.at) <= s.window => break,
                Some(_) => {
                    self.drop_chain(id);
                    c.chains_expired += 1;
                }
                None => {}
            }
            self.chain_order.pop_front();
        }
    }

    fn drop_chain(&mut self, id: u64) {
        if let Some(ch) = self.chains.remove(&id) {
            for b in &ch.blocks {
                self.pending_blocks.remove(b);
            }
        }
    }

    /// The server evicted `root` from its GPU: each block of its subtree still on the GPU
    /// moves to its fastest slower copy (its keys into `offloaded[CPU, storage]`), or, with
    /// none, goes with its own subtree (its keys into `removed`: a prefix through it is no
    /// longer cached anywhere there). Blocks already off the GPU stay as they are.
    fn evict_from_gpu(
        &mut self,
        root: BlockHash,
        removed: &mut Vec<BlockKey>,
        offloaded: &mut [Vec<BlockKey>; 2],
    ) {
        let mut stack = vec![root];
        while let Some(b) = stack.pop() {
            let copies = self.copies.get(&b).copied().unwrap_or(0);
            let Some(tier) = copy_tier(copies) else {
                self.remove_subtree(b, removed);
                continue;
            };
            let Some(n) = self.tree.get_mut(&b) else {
                continue;
            };
            if !n.off_gpu {
                n.off_gpu = true;
                let to = if tier == Tier::Cpu { 0 } else { 1 };
                offloaded[to].extend_from_slice(&n.keys);
            }
            stack.extend(n.children.iter().copied());
        }
    }

    /// The keys linked to `root` and every block below it.
    fn subtree_keys(&self, root: BlockHash, keys: &mut Vec<BlockKey>) {
        let mut stack = vec![root];
        while let Some(b) = stack.pop() {
            if let Some(n) = self.tree.get(&b) {
                keys.extend_from_slice(&n.keys);
                stack.extend(n.children.iter().copied());
            }
        }
    }

    fn remove_subtree(&mut self, root: BlockHash, keys: &mut Vec<BlockKey>) {
        self.removals += 1;
        if let Some(parent) = self.tree.get(&root).and_then(|n| n.parent) {
            if let Some(p) = self.tree.get_mut(&parent) {
                p.children.retain(|c| *c != root);
            }
        }
        let mut stack = vec![root];
        while let Some(b) = stack.pop() {
            if let Some(n) = self.tree.remove(&b) {
                for k in &n.keys {
                    self.keys.remove(k);
                }
                keys.extend_from_slice(&n.keys);
                stack.extend(n.children);
            }
        }
    }

    /// [`Endpoint::anchor`] of a pending decision, remembered until it may have changed.
    fn anchor_of(&self, d: &Decision) -> Anchor {
        if let Some((at, anchor)) = d.anchor.get() {
            if at == self.removals {
                return anchor;
            }
        }
        let anchor = self.anchor(&d.keys);
        d.anchor.set(Some((self.removals, anchor)));
        anchor
    }

    /// The decision's last key linked here (scanning from the end: keys chain, so the longest
    /// linked prefix ends at the last linked key).
    fn anchor(&self, keys: &[BlockKey]) -> Anchor {
        keys.iter()
            .enumerate()
            .rev()
            .find_map(|(i, k)| {
                self.keys.get(k).map(|&(node, pos)| Anchor {
                    node: Some(node),
                    key: Some(i),
                    pos,
                })
            })
            .unwrap_or(Anchor {
                node: None,
                key: None,
                pos: 0.0,
            })
    }

    /// Where pending chain `id` hangs off the tree, through other pending chains.
    fn fork(&self, id: u64) -> Option<Fork> {
        let ch = self.chains.get(&id)?;
        let mut tokens = ch.block_tokens * ch.blocks.len() as u64;
        let mut path = vec![(id, ch.blocks.len())];
        let mut parent = ch.parent;
        for _ in 0..MAX_WALK {
            let Some(p) = parent else {
                return Some(Fork {
                    node: None,
                    end: tokens,
                    path,
                });
            };
            if let Some(n) = self.tree.get(&p) {
                return Some(Fork {
                    node: Some(p),
                    end: n.end + tokens,
                    path,
                });
            }
            let &(up, index) = self.pending_blocks.get(&p)?;
            let up_chain = self.chains.get(&up)?;
            tokens += up_chain.block_tokens * (index as u64 + 1);
            path.push((up, index + 1));
            parent = up_chain.parent;
        }
        None
    }

    /// Whether `a` is `b` or one of its ancestors, within `steps` blocks.
    fn above(&self, a: BlockHash, b: BlockHash, steps: usize) -> bool {
        let mut at = Some(b);
        for _ in 0..=steps {
            match at {
                Some(x) if x == a => return true,
                Some(x) => at = self.tree.get(&x).and_then(|n| n.parent),
                None => return false,
            }
        }
        false
    }

    fn fits(&self, s: &LinkSettings, d: &Decision, anchor: &Anchor, fork: &Fork) -> bool {
        match (anchor.node, fork.node) {
            (None, None) => {}
            (Some(a), Some(f)) => {
                if !(self.above(f, a, s.fork_blocks) || self.above(a, f, s.fork_blocks)) {
                    return false;
                }
            }
            _ => return false,
        }
        let (lo, hi) = predicted(s, d, anchor);
        let new_tokens = lo - anchor.pos;
        let give = s.tolerance * new_tokens + s.slack_tokens as f64;
        let end = fork.end as f64;
        end + give >= lo && end <= hi + give
    }

    /// Whether any pending decision fits chain `cid` (at `fork`).
    fn claimed(&self, s: &LinkSettings, cid: u64, fork: &Fork) -> bool {
        let Some(ch) = self.chains.get(&cid) else {
            return false;
        };
        self.decisions.values().any(|d| {
            let anchor = self.anchor_of(d);
            !ch.contested && ch.at + s.relay_lag >= d.at && self.fits(s, d, &anchor, fork)
        })
    }

    /// The candidate closest to the decision's predicted end (before its unkeyed tail).
    fn best(
        &self,
        s: &LinkSettings,
        did: u64,
        candidates: &[usize],
        forks: &[(u64, Fork)],
    ) -> Option<usize> {
        let d = self.decisions.get(&did)?;
        let anchor = self.anchor_of(d);
        let (lo, _) = predicted(s, d, &anchor);
        candidates.iter().copied().min_by(|&a, &b| {
            let da = (forks[a].1.end as f64 - lo).abs();
            let db = (forks[b].1.end as f64 - lo).abs();
            da.total_cmp(&db)
        })
    }

    /// Moves the fork's pending blocks into the tree (without keys); returns them with their
    /// token ends, root side first.
    fn attach(&mut self, fork: &Fork) -> Vec<(BlockHash, u64)> {
        let mut parent = fork.node;
        let mut at = fork
            .node
            .and_then(|n| self.tree.get(&n))
            .map_or(0, |n| n.end);
        let mut new_blocks = Vec::new();
        for &(id, used) in fork.path.iter().rev() {
            let Some(ch) = self.chains.remove(&id) else {
                continue;
            };
            for b in &ch.blocks {
                self.pending_blocks.remove(b);
            }
            for b in ch.blocks.iter().take(used) {
                at += ch.block_tokens;
                self.tree.insert(
                    *b,
                    Node {
                        parent,
                        children: Vec::new(),
                        keys: Vec::new(),
                        end: at,
                        off_gpu: false,
                    },
                );
                if let Some(p) = parent.and_then(|p| self.tree.get_mut(&p)) {
                    p.children.push(*b);
                }
                parent = Some(*b);
                new_blocks.push((*b, at));
            }
        }
        new_blocks
    }

    /// Links the decision's new keys to the fork's blocks; returns the keys linked.
    fn link(&mut self, s: &LinkSettings, d: &Decision, anchor: &Anchor, fork: &Fork) -> usize {
        let new_blocks = self.attach(fork);
        let Some(&(last_block, _)) = new_blocks.last() else {
            return 0;
        };
        let bpt = s.bytes_per_token.max(0.01);
        let first = anchor.key.map_or(0, |k| k + 1);
        let from = anchor.key.map_or(0.0, |k| key_end(&s.schedule, k));
        let mut end_bytes = from;
        let mut linked = 0;
        let mut block = 0;
        for (i, key) in d.keys.iter().enumerate().skip(first) {
            end_bytes += s.schedule.span(i) as f64;
            let pos = anchor.pos + (end_bytes - from) / bpt;
            // The block holding the key's last token; past the chain's end, its last block.
            while block < new_blocks.len() && (new_blocks[block].1 as f64) < pos.ceil() {
                block += 1;
            }
            let target = new_blocks.get(block).map_or(last_block, |b| b.0);
            if self.keys.contains_key(key) {
                continue;
            }
            if let Some(n) = self.tree.get_mut(&target) {
                n.keys.push(*key);
                self.keys.insert(*key, (target, pos));
                linked += 1;
            }
        }
        linked
    }
}
