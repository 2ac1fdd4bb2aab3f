//! The per-endpoint KV block index: which blocks one model server holds, per medium, under keys
//! the aggregator computes itself.
//!
//! A server names its blocks by *engine hashes* seeded per process (vLLM's `NONE_HASH`, SGLang's
//! Python `hash`), so equal content on two servers usually gets different engine hashes. The
//! index therefore keys every block by its own chained hash of the token ids ([`block_key`],
//! starting from [`root_key`]), which equal content gets on every server, and keeps the
//! engine-hash → key map that `BlockRemoved` (engine hashes only) needs.
//!
//! ```
//! use kvoy_aggregator::kv_index::{block_key, root_key, EndpointCache, Tier};
//! use kvoy_kvevents::{BlockHash, EventBatch, KvEvent, Medium};
//!
//! let stored = KvEvent::BlockStored {
//!     block_hashes: vec![BlockHash::from_u64(7), BlockHash::from_u64(8)],
//!     parent_block_hash: None,
//!     token_ids: (0..32).collect(),
//!     block_size: 16,
//!     lora_id: None,
//!     medium: Medium::Gpu,
//!     lora_name: None,
//!     group_idx: None,
//! };
//! let mut cache = EndpointCache::new();
//! let batch = EventBatch { ts: 0.0, events: vec![stored], data_parallel_rank: None };
//! let stats = cache.apply_batch(&batch);
//! assert_eq!((stats.stored, cache.blocks(Tier::Gpu)), (2, 2));
//! let first = block_key(root_key(None), &(0..16).collect::<Vec<u32>>());
//! let second = block_key(first, &(16..32).collect::<Vec<u32>>());
//! assert_eq!(cache.key_of(&BlockHash::from_u64(8)), Some(second));
//! assert!(cache.contains_key(second, Tier::Gpu));
//! ```
//!
//! # Semantics
//! - **Residency is counted** per (tier, engine hash): vLLM can cache two physical blocks with
//!   one hash (and announces and evicts each), hybrid models store a hash once per KV-cache
//!   group (`group_idx` is not told apart), and vLLM's snapshot program stores a block several
//!   times and then removes the teaching store. A block is in a tier while its count there is
//!   above zero (counts saturate at 65,535); removing from one tier keeps the others.
//! - **Keys.** A new block of a `BlockStored` chain with one token span per block
//!   (`token_ids.len() == block_hashes.len() * block_size`) gets
//!   `block_key(parent, span)`; the first block's parent is the key held for
//!   `parent_block_hash`, or [`root_key`] of the event's LoRA adapter when there is none (by
//!   name; a nameless `lora_id` gets its own root, so that adapter blocks never share keys with
//!   base-model blocks). An engine hash the index already holds keeps the key it has, and the
//!   chain continues from that key, so a chain keys the same however it is split into events.
//! - **Unknown parent** (an orphan chain): the parent key is [`hash_key`] of the parent's
//!   engine hash and the chain's newly keyed blocks count in [`ApplyStats::orphan_blocks`]. Such
//!   keys match no prompt, but stay consistent with later events about the same blocks (a parent
//!   that turns up later without tokens is keyed by that same `hash_key`).
//! - **No token spans.** vLLM's offloading connector announces CPU blocks with
//!   `token_ids: []` (and `block_size` 0 in its placeholder stores): a known hash keeps its key,
//!   an unknown one is keyed by [`hash_key`] ([`ApplyStats::hash_keyed`]); this is not counted as
//!   malformed. Non-empty `token_ids` that do not give each block exactly `block_size` tokens
//!   (including `block_size` 0) are counted in [`ApplyStats::malformed`] and keyed the same way,
//!   without tokens: vLLM's own reader treats such stores (hybrid models skipping null or masked
//!   blocks) as giving no per-block span, so slicing them would only produce wrong keys. The
//!   engine hashes are recorded in every case, so removals and residency stay exact.
//! - **Recently removed blocks are remembered** (their key, by default the last
//!   [`DEFAULT_RECENT_REMOVED`] per hash width): an offload store can arrive after its GPU copy
//!   was evicted, and a running sequence can extend a chain whose parent was just evicted (the
//!   simulator does this when its own copy of the parent stayed uncached as a duplicate); both
//!   then find the right key instead of falling back to `hash_key`. They are not resident:
//!   [`EndpointCache::key_of`] and the tier queries do not see them.
//! - **Media.** GPU, CPU and STORAGE map to [`Tier`]s; any other medium name counts as
//!   [`Tier::Storage`] (whatever else a server offloads to is slower than host memory), counted
//!   in [`ApplyStats::other_medium`]. Per-tier counts keep two such names from overwriting each
//!   other.
//! - **`AllBlocksCleared`** drops every tier and bumps the generation. vLLM's
//!   `reset_prefix_cache` clears its GPU cache only, but the event names no medium and some
//!   bridges send it for host caches; forgetting too much heals as blocks are stored again
//!   (removals of forgotten blocks just count as [`ApplyStats::unknown_removals`]), while
//!   keeping too much could leave stale CPU blocks forever. [`EndpointCache::clear`] (a
//!   publisher restart, when engine hashes may change meaning) also forgets removed blocks.
//! - Not seen by the index: vLLM's `extra_keys` (multimodal content, cache salt; the decoder
//!   drops them, so such blocks key by token ids alone) and `data_parallel_rank` (keep one cache
//!   per rank if a server publishes several).
//!
//! # Cost
//! Applying an event allocates nothing but table growth ([`EndpointCache::with_capacity`]
//! avoids most of it). A block costs one probe of the engine-hash table and one of the key
//! table, both hashed by one folded multiply from a per-table random seed (the keys are hashes
//! already). Engine hashes that fit a `u64` (vLLM's default integer form, SGLang's) are held in
//! 8 bytes rather than 32, which keeps a 25k-block table about half the size: the work is
//! memory-bound, so that is worth about half again in throughput.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};

use kvoy_kvevents::{BlockHash, EventBatch, KvEvent, Medium};
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Seeds of the key derivations (distinct, so that the derivations cannot meet by design).
const ROOT_SEED: u64 = 0x6b76_6f79_5f72_6f6f;
const LORA_NAME_SEED: u64 = 0x6b76_6f79_5f6c_6e6d;
const LORA_ID_SEED: u64 = 0x6b76_6f79_5f6c_6964;
const HASH_KEY_SEED: u64 = 0x6b76_6f79_5f65_6e67;

/// Token ids hashed from a stack buffer; longer blocks go through the streaming hasher.
const STACK_TOKENS: usize = 64;

/// How many removed blocks (per hash width) an [`EndpointCache`] remembers the key of, unless
/// told otherwise.
pub const DEFAULT_RECENT_REMOVED: usize = 4096;

/// Our key of a block: xxh3-64 of the block's token ids (little-endian `u32`s), seeded by the
/// parent block's key.
pub fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = [0u8; STACK_TOKENS * 4];
    if tokens.len() <= STACK_TOKENS {
        let n = le_bytes(&mut buf, tokens);
        return xxh3_64_with_seed(&buf[..n], parent);
    }
    let mut hasher = Xxh3::with_seed(parent);
    for chunk in tokens.chunks(STACK_TOKENS) {
        let n = le_bytes(&mut buf, chunk);
        hasher.update(&buf[..n]);
    }
    hasher.digest()
}

/// Writes `tokens` (at most [`STACK_TOKENS`]) little-endian into `buf`; returns the byte count.
fn le_bytes(buf: &mut [u8; STACK_TOKENS * 4], tokens: &[u32]) -> usize {
    for (dst, t) in buf.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    tokens.len().min(STACK_TOKENS) * 4
}

/// The parent key of a chain's first block (a prompt start): one per LoRA adapter name, and one
/// for the base model (`None`, distinct from every name, the empty one included).
pub fn root_key(lora_name: Option<&str>) -> u64 {
    match lora_name {
        None => xxh3_64_with_seed(&[], ROOT_SEED),
        Some(name) => xxh3_64_with_seed(name.as_bytes(), LORA_NAME_SEED),
    }
}

/// The root of a chain stored under `lora_name`, or only `lora_id` (older servers): ids are
/// local to one server, but still keep its adapter blocks apart from its base-model blocks.
fn event_root(lora_name: Option<&str>, lora_id: Option<i64>) -> u64 {
    match (lora_name, lora_id) {
        (None, Some(id)) => xxh3_64_with_seed(&id.to_le_bytes(), LORA_ID_SEED),
        _ => root_key(lora_name),
    }
}

/// The key of a block known only by its engine hash: a block stored without token ids, or the
/// stand-in parent of an orphan chain. Equal for every width the hash arrived in.
pub fn hash_key(hash: &BlockHash) -> u64 {
    xxh3_64_with_seed(hash.as_bytes(), HASH_KEY_SEED)
}

/// Where a block is cached (kvoy-shared's tier, which the filters' index uses too).
pub use kvoy_shared::Tier;

/// The tier of a wire medium: `GPU` (or no medium at all), `CPU`, and `STORAGE` with any
/// medium name kvoy does not know (whatever else a server offloads to is slower than host
/// memory).
pub fn tier_of_medium(medium: &Medium) -> Tier {
    match medium {
        Medium::Gpu => Tier::Gpu,
        Medium::Cpu => Tier::Cpu,
        Medium::Storage | Medium::Other(_) => Tier::Storage,
    }
}

/// What applying events did, for counters. Blocks are counted per block hash in an event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// `BlockStored` events.
    pub store_events: u64,
    /// `BlockRemoved` events.
    pub remove_events: u64,
    /// Blocks stored (residencies added).
    pub stored: u64,
    /// Blocks removed (residencies dropped).
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Events of a type the decoder did not know (skipped).
    pub unknown_events: u64,
    /// Newly keyed blocks whose chain hangs under a parent hash the index does not know.
    pub orphan_blocks: u64,
    /// Removals of a hash the tier does not hold.
    pub unknown_removals: u64,
    /// `BlockStored` events whose non-empty `token_ids` do not give each block `block_size`
    /// tokens (`block_size` 0 included); their blocks are recorded, keyed without tokens.
    pub malformed: u64,
    /// Newly keyed blocks that had no token span, keyed by [`hash_key`].
    pub hash_keyed: u64,
    /// Store and remove events under a medium name kvoy does not know (applied to
    /// [`Tier::Storage`]).
    pub other_medium: u64,
    /// New blocks not stored because the cache held its cap of blocks
    /// ([`EndpointCache::set_block_cap`]).
    pub over_cap: u64,
    /// The first malformed `BlockStored` (for the log).
    pub first_malformed: Option<MalformedStore>,
    /// The type name of the first unknown event (for the log; at most 64 bytes kept).
    pub first_unknown: Option<UnknownType>,
}

/// What was wrong with a malformed `BlockStored`: its counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MalformedStore {
    pub block_hashes: usize,
    pub block_size: u32,
    pub token_ids: usize,
}

impl fmt::Display for MalformedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BlockStored with {} block hashes, block_size {} and {} token ids (want block hashes x block_size token ids); its blocks are kept, keyed without tokens",
            self.block_hashes, self.block_size, self.token_ids
        )
    }
}

/// The start of an unknown event type's name, kept without allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownType {
    bytes: [u8; 64],
    len: u8,
}

impl UnknownType {
    fn new(name: &str) -> Self {
        let mut bytes = [0u8; 64];
        let mut len = name.len().min(64);
        while !name.is_char_boundary(len) {
            len -= 1;
        }
        bytes[..len].copy_from_slice(&name.as_bytes()[..len]);
        UnknownType {
            bytes,
            len: len as u8,
        }
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or("?")
    }
}

impl ApplyStats {
    /// Adds `other` field by field.
    pub fn add(&mut self, other: &ApplyStats) {
        self.store_events += other.store_events;
        self.remove_events += other.remove_events;
        self.stored += other.stored;
        self.removed += other.removed;
        self.cleared += other.cleared;
        self.unknown_events += other.unknown_events;
        self.orphan_blocks += other.orphan_blocks;
        self.unknown_removals += other.unknown_removals;
        self.malformed += other.malformed;
        self.hash_keyed += other.hash_keyed;
        self.other_medium += other.other_medium;
        self.over_cap += other.over_cap;
        self.first_malformed = self.first_malformed.or(other.first_malformed);
        self.first_unknown = self.first_unknown.or(other.first_unknown);
    }

    /// Events applied, of every type.
    pub fn events(&self) -> u64 {
        self.store_events + self.remove_events + self.cleared + self.unknown_events
    }
}

/// Folded multiply: the high and low halves of the 128-bit product, xored.
fn fold_mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// Hashes keys that are hashes already: one folded multiply per word, from a per-map random
/// seed (so that crafted prompts cannot aim keys at one bucket without knowing it). Not `fnv`:
/// its hash is unseeded, and these keys follow from clients' prompts.
#[derive(Clone, Copy, Debug)]
struct Mixer {
    seed: u64,
}

impl Mixer {
    fn random() -> Self {
        Mixer {
            seed: RandomState::new().build_hasher().finish(),
        }
    }
}

struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = fold_mul(self.0 ^ n, MIX);
    }
}

impl BuildHasher for Mixer {
    type Hasher = MixHasher;

    fn build_hasher(&self) -> MixHasher {
        MixHasher(self.seed)
    }
}

/// An engine hash that fits a `u64` (vLLM's integer form, SGLang's): held in 8 bytes, which
/// keeps the map small enough for the CPU cache to matter.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Narrow(u64);

/// A wider engine hash (vLLM's byte form): held whole, hashed as one pre-mixed word.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Wide(BlockHash);

impl Hash for Wide {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut w = [0u64; 4];
        for (dst, chunk) in w.iter_mut().zip(self.0.as_bytes().chunks_exact(8)) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            *dst = u64::from_le_bytes(word);
        }
        let [a, b, c, d] = w;
        state.write_u64(
            fold_mul(a ^ 0x243f_6a88_85a3_08d3, b ^ 0x1319_8a2e_0370_7344)
                ^ fold_mul(c ^ MIX, d ^ 0xa409_3822_299f_31d0),
        );
    }
}

/// How one table holds engine hashes.
trait Held: Copy + Eq + Hash {
    fn block_hash(self) -> BlockHash;
}

impl Held for Narrow {
    fn block_hash(self) -> BlockHash {
        BlockHash::from_u64(self.0)
    }
}

impl Held for Wide {
    fn block_hash(self) -> BlockHash {
        self.0
    }
}

/// The table an engine hash belongs in.
enum Slot {
    Narrow(Narrow),
    Wide(Wide),
}

fn slot(hash: &BlockHash) -> Slot {
    match hash.as_u64() {
        Some(v) => Slot::Narrow(Narrow(v)),
        None => Slot::Wide(Wide(*hash)),
    }
}

/// One resident engine hash: its key and its residency count per tier.
#[derive(Clone, Copy, Debug)]
struct Block {
    key: u64,
    refs: [u16; 3],
}

/// Recently removed blocks: their keys, the oldest forgotten beyond `cap`. Small, so that it
/// stays in the CPU cache; none of its blocks is resident.
#[derive(Clone)]
struct Recent<K> {
    /// Engine hash -> (key, stamp of its ring entry).
    keys: HashMap<K, (u64, u32), Mixer>,
    /// Oldest first; an entry whose stamp no longer matches is stale (stored or removed again).
    ring: VecDeque<(K, u32)>,
    cap: usize,
    next_stamp: u32,
}

impl<K: Held> Recent<K> {
    fn new(cap: usize) -> Self {
        Recent {
            keys: HashMap::with_hasher(Mixer::random()),
            ring: VecDeque::new(),
            cap,
            next_stamp: 0,
        }
    }

    /// Takes a block back out (it is stored again).
    fn take(&mut self, k: &K) -> Option<u64> {
        if self.keys.is_empty() {
            return None;
        }
        self.keys.remove(k).map(|(key, _)| key)
    }

    fn remember(&mut self, k: K, key: u64) {
        if self.cap == 0 {
            return;
        }
        let stamp = self.next_stamp;
        self.next_stamp = stamp.wrapping_add(1);
        self.keys.insert(k, (key, stamp));
        self.ring.push_back((k, stamp));
        self.prune();
    }

    fn prune(&mut self) {
        while self.ring.len() > self.cap {
            let Some((k, stamp)) = self.ring.pop_front() else {
                break;
            };
            if self.keys.get(&k).is_some_and(|&(_, s)| s == stamp) {
                self.keys.remove(&k);
            }
        }
    }
}

/// Per key, how many resident engine hashes with that key each tier holds; and per tier, how
/// many engine hashes it holds.
#[derive(Clone)]
struct Residency {
    keys: HashMap<u64, [u32; 3], Mixer>,
    held: [usize; 3],
}

impl Residency {
    fn enter(&mut self, key: u64, t: usize) {
        self.held[t] += 1;
        let c = self.keys.entry(key).or_default();
        c[t] = c[t].saturating_add(1);
    }

    fn leave(&mut self, key: u64, t: usize) {
        self.held[t] = self.held[t].saturating_sub(1);
        if let Entry::Occupied(mut e) = self.keys.entry(key) {
            let c = e.get_mut();
            c[t] = c[t].saturating_sub(1);
            if *c == [0; 3] {
                e.remove();
            }
        }
    }

    fn clear(&mut self) {
        self.keys.clear();
        self.held = [0; 3];
    }
}

/// How the blocks of one `BlockStored` get their keys.
struct Keying<'a> {
    /// The tier index the blocks go to.
    tier: usize,
    /// The key the next new block chains from.
    parent: u64,
    /// Whether that parent is a stand-in for an unknown hash.
    orphan: bool,
    /// One span per block, when the event gives them.
    spans: Option<std::slice::ChunksExact<'a, u32>>,
    /// How many more engine hashes the cache may take in.
    room: usize,
}

/// The engine hashes of one width: resident blocks and recently removed ones.
#[derive(Clone)]
struct Table<K> {
    blocks: HashMap<K, Block, Mixer>,
    removed: Recent<K>,
}

impl<K: Held> Table<K> {
    fn new(capacity: usize) -> Self {
        Table {
            blocks: HashMap::with_capacity_and_hasher(capacity, Mixer::random()),
            removed: Recent::new(DEFAULT_RECENT_REMOVED),
        }
    }

    /// The key of a resident or recently removed block.
    fn known_key(&self, k: &K) -> Option<u64> {
        match self.blocks.get(k) {
            Some(b) => Some(b.key),
            None => self.removed.keys.get(k).map(|&(key, _)| key),
        }
    }

    /// Stores the next block of a chain; moves the chain on to its key.
    fn store(&mut self, k: K, c: &mut Keying<'_>, res: &mut Residency, s: &mut ApplyStats) {
        let span = c.spans.as_mut().and_then(Iterator::next);
        let t = c.tier;
        if c.room == 0 && !self.blocks.contains_key(&k) {
            // Over the cap: not stored, but the chain goes on under the key it would have.
            s.over_cap += 1;
            c.parent = match (self.removed.keys.get(&k), span) {
                (Some(&(key, _)), _) => key,
                (None, Some(tokens)) => block_key(c.parent, tokens),
                (None, None) => hash_key(&k.block_hash()),
            };
            return;
        }
        s.stored += 1;
        let (key, entered) = match self.blocks.entry(k) {
            Entry::Occupied(e) => {
                let b = e.into_mut();
                let was = b.refs[t];
                b.refs[t] = was.saturating_add(1);
                c.orphan = false;
                (b.key, was == 0)
            }
            Entry::Vacant(e) => {
                let key = match (self.removed.take(&k), span) {
                    (Some(key), _) => {
                        c.orphan = false;
                        key
                    }
                    (None, Some(tokens)) => {
                        s.orphan_blocks += u64::from(c.orphan);
                        block_key(c.parent, tokens)
                    }
                    (None, None) => {
                        s.hash_keyed += 1;
                        hash_key(&k.block_hash())
                    }
                };
                let mut refs = [0; 3];
                refs[t] = 1;
                e.insert(Block { key, refs });
                c.room -= 1;
                (key, true)
            }
        };
        if entered {
            res.enter(key, t);
        }
        c.parent = key;
    }

    fn remove(&mut self, k: K, t: usize, res: &mut Residency, s: &mut ApplyStats) {
        // Not `entry`: it reserves room even when the hash is unknown.
        let Some(b) = self.blocks.get_mut(&k).filter(|b| b.refs[t] > 0) else {
            s.unknown_removals += 1;
            return;
        };
        s.removed += 1;
        b.refs[t] -= 1;
        if b.refs[t] > 0 {
            return;
        }
        let key = b.key;
        if b.refs == [0; 3] {
            self.blocks.remove(&k);
            self.removed.remember(k, key);
        }
        res.leave(key, t);
    }

    /// Every resident block becomes a removed one.
    fn remove_all(&mut self) {
        for (k, b) in self.blocks.drain() {
            self.removed.remember(k, b.key);
        }
    }

    fn clear(&mut self) {
        self.blocks.clear();
        self.removed.keys.clear();
        self.removed.ring.clear();
    }

    fn hashes(&self, t: usize) -> impl Iterator<Item = BlockHash> + '_ {
        self.blocks
            .iter()
            .filter(move |(_, b)| b.refs[t] > 0)
            .map(|(k, _)| k.block_hash())
    }
}

/// The blocks one endpoint caches, per tier, under the aggregator's keys. See the module doc.
#[derive(Clone)]
pub struct EndpointCache {
    narrow: Table<Narrow>,
    wide: Table<Wide>,
    res: Residency,
    generation: u32,
    /// At most this many resident engine hashes (both widths).
    cap: usize,
}

impl Default for EndpointCache {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for EndpointCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EndpointCache")
            .field("blocks", &self.res.held)
            .field("keys", &self.res.keys.len())
            .field(
                "recent_removed",
                &(self.narrow.removed.keys.len() + self.wide.removed.keys.len()),
            )
            .field("generation", &self.generation)
            .finish()
    }
}

impl EndpointCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty cache with room for `blocks` resident blocks (size it from the server's
    /// `num_gpu_blocks`, plus its CPU blocks when it offloads) before it reallocates. The room
    /// is for integer hashes (vLLM's default form, SGLang's); byte hashes get theirs as they
    /// come.
    pub fn with_capacity(blocks: usize) -> Self {
        EndpointCache {
            narrow: Table::new(blocks),
            wide: Table::new(0),
            res: Residency {
                keys: HashMap::with_capacity_and_hasher(blocks, Mixer::random()),
                held: [0; 3],
            },
            generation: 0,
            cap: usize::MAX,
        }
    }

    /// Holds at most `blocks` distinct engine hashes: new blocks beyond it are not stored
    /// (counted in [`ApplyStats::over_cap`]) until removals make room. A server never holds
    /// more than its capacity, so reaching the cap means lost removals or a lying publisher;
    /// the cap bounds memory either way. Blocks already held stay when the cap is lowered.
    pub fn set_block_cap(&mut self, blocks: usize) {
        self.cap = blocks;
    }

    /// The cap of [`EndpointCache::set_block_cap`] (`usize::MAX`: none).
    pub fn block_cap(&self) -> usize {
        self.cap
    }

    /// Remember the keys of the last `n` removed blocks, per hash width (integer and byte
    /// hashes; default [`DEFAULT_RECENT_REMOVED`]).
    pub fn with_recent_removed(mut self, n: usize) -> Self {
        self.narrow.removed.cap = n;
        self.narrow.removed.prune();
        self.wide.removed.cap = n;
        self.wide.removed.prune();
        self
    }

    /// Applies one event, adding to `stats`.
    pub fn apply(&mut self, event: &KvEvent, stats: &mut ApplyStats) {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                group_idx: _,
            } => {
                stats.store_events += 1;
                let tier = tier_of(medium, stats) as usize;
                let spans = event.block_tokens();
                if !token_ids.is_empty() && spans.is_none() {
                    stats.malformed += 1;
                    stats.first_malformed.get_or_insert(MalformedStore {
                        block_hashes: block_hashes.len(),
                        block_size: *block_size,
                        token_ids: token_ids.len(),
                    });
                }
                let (parent, orphan) = match parent_block_hash {
                    _ if spans.is_none() => (0, false),
                    None => (event_root(lora_name.as_deref(), *lora_id), false),
                    Some(p) => match self.known_key(p) {
                        Some(key) => (key, false),
                        None => (hash_key(p), true),
                    },
                };
                let resident = self.narrow.blocks.len() + self.wide.blocks.len();
                let mut keying = Keying {
                    tier,
                    parent,
                    orphan,
                    spans,
                    room: self.cap.saturating_sub(resident),
                };
                for hash in block_hashes {
                    match slot(hash) {
                        Slot::Narrow(k) => self.narrow.store(k, &mut keying, &mut self.res, stats),
                        Slot::Wide(k) => self.wide.store(k, &mut keying, &mut self.res, stats),
                    }
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx: _,
            } => {
                stats.remove_events += 1;
                let t = tier_of(medium, stats) as usize;
                for hash in block_hashes {
                    match slot(hash) {
                        Slot::Narrow(k) => self.narrow.remove(k, t, &mut self.res, stats),
                        Slot::Wide(k) => self.wide.remove(k, t, &mut self.res, stats),
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                stats.cleared += 1;
                self.generation = self.generation.wrapping_add(1);
                self.narrow.remove_all();
                self.wide.remove_all();
                self.res.clear();
            }
            KvEvent::Unknown { type_name } => {
                stats.unknown_events += 1;
                stats
                    .first_unknown
                    .get_or_insert_with(|| UnknownType::new(type_name));
            }
        }
    }

    /// Applies a batch's events in order. `data_parallel_rank` is not looked at.
    #[must_use]
    pub fn apply_batch(&mut self, batch: &EventBatch) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for event in &batch.events {
            self.apply(event, &mut stats);
        }
        stats
    }

    /// Forgets everything, removed blocks included, and bumps the generation: for a publisher
    /// restart, after which engine hashes may mean other blocks.
    pub fn clear(&mut self) {
        self.narrow.clear();
        self.wide.clear();
        self.res.clear();
        self.generation = self.generation.wrapping_add(1);
    }

    /// Starts at 0; bumped by every `AllBlocksCleared` and every [`EndpointCache::clear`].
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Blocks (distinct engine hashes) resident in `tier`.
    pub fn blocks(&self, tier: Tier) -> usize {
        self.res.held[tier as usize]
    }

    /// Whether `tier` holds the block with engine hash `hash`.
    pub fn contains_engine_hash(&self, hash: &BlockHash, tier: Tier) -> bool {
        let b = match slot(hash) {
            Slot::Narrow(k) => self.narrow.blocks.get(&k),
            Slot::Wide(k) => self.wide.blocks.get(&k),
        };
        b.is_some_and(|b| b.refs[tier as usize] > 0)
    }

    /// The engine hashes resident in `tier`, in no particular order.
    pub fn engine_hashes(&self, tier: Tier) -> impl Iterator<Item = BlockHash> + '_ {
        let t = tier as usize;
        self.narrow.hashes(t).chain(self.wide.hashes(t))
    }

    /// Our key of a resident block (in any tier).
    pub fn key_of(&self, hash: &BlockHash) -> Option<u64> {
        let b = match slot(hash) {
            Slot::Narrow(k) => self.narrow.blocks.get(&k),
            Slot::Wide(k) => self.wide.blocks.get(&k),
        };
        b.map(|b| b.key)
    }

    /// Whether `tier` holds a block with key `key`.
    pub fn contains_key(&self, key: u64, tier: Tier) -> bool {
        self.res
            .keys
            .get(&key)
            .is_some_and(|c| c[tier as usize] > 0)
    }

    /// The distinct keys resident in `tier`, in no particular order.
    pub fn keys(&self, tier: Tier) -> impl Iterator<Item = u64> + '_ {
        let t = tier as usize;
        self.res
            .keys
            .iter()
            .filter(move |(_, c)| c[t] > 0)
            .map(|(k, _)| *k)
    }

    /// The key of a resident or recently removed block.
    fn known_key(&self, hash: &BlockHash) -> Option<u64> {
        match slot(hash) {
            Slot::Narrow(k) => self.narrow.known_key(&k),
            Slot::Wide(k) => self.wide.known_key(&k),
        }
    }

    /// Recently removed blocks remembered (both widths).
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.narrow.removed.keys.len() + self.wide.removed.keys.len()
    }

    /// Resident engine hashes (both widths).
    #[cfg(test)]
    fn resident(&self) -> usize {
        self.narrow.blocks.len() + self.wide.blocks.len()
    }
}

fn tier_of(medium: &Medium, stats: &mut ApplyStats) -> Tier {
    if let Medium::Other(_) = medium {
        stats.other_medium += 1;
    }
    tier_of_medium(medium)
}

#[cfg(test)]
mod tests;
