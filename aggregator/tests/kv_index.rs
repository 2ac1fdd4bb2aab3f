//! The KV block index against (a) a plain reference model on random event sequences and (b) the
//! simulator's engine: after every step, the index built from the engine's published events
//! (through the msgpack wire forms) holds exactly the engine's cached blocks, under the keys
//! computed independently from the request tokens (the engine's hashes by the engine's own
//! `block_hash`, whose bytes the engine's tests pin).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use kvoy_aggregator::kv_index::{block_key, hash_key, root_key, ApplyStats, EndpointCache, Tier};
use kvoy_kvevents::{decode_batch, encode_batch, BlockHash, EventBatch, KvEvent, Medium, WireForm};
use kvoy_sim::engine::{block_hash, Engine, EngineRequest, OutputKind, Profile};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// (a) Random event sequences against a reference model.

const UNIVERSE: u8 = 40;
const BLOCK: usize = 4;

/// Hash number `i`: integers below 32, 32-byte binaries above.
fn hash(i: u8) -> BlockHash {
    if i < 32 {
        BlockHash::from_u64(u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15))
    } else {
        BlockHash::from_canonical([i; 32])
    }
}

fn medium(m: u8) -> Medium {
    match m {
        0 => Medium::Gpu,
        1 => Medium::Cpu,
        2 => Medium::Storage,
        3 => Medium::Other("NVME".into()),
        _ => Medium::Other("remote".into()),
    }
}

#[derive(Clone, Debug)]
enum Shape {
    Full,
    Empty,
    Short,
    ZeroBlockSize,
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        medium: u8,
        parent: Option<u8>,
        hashes: Vec<u8>,
        /// Token content (a small alphabet, so that equal content under other hashes occurs).
        tokens: Vec<u32>,
        shape: Shape,
        lora: Option<&'static str>,
    },
    Remove {
        medium: u8,
        hashes: Vec<u8>,
    },
    Cleared,
    Restart,
    Unknown,
}

fn op() -> impl Strategy<Value = Op> {
    let store = (
        0u8..5,
        proptest::option::weighted(0.7, 0..UNIVERSE),
        proptest::collection::vec(0..UNIVERSE, 0..6),
        proptest::collection::vec(0u32..3, 6 * BLOCK),
        prop_oneof![
            6 => Just(Shape::Full),
            2 => Just(Shape::Empty),
            1 => Just(Shape::Short),
            1 => Just(Shape::ZeroBlockSize),
        ],
        prop_oneof![4 => Just(None), 1 => Just(Some("a")), 1 => Just(Some(""))],
    )
        .prop_map(|(medium, parent, hashes, tokens, shape, lora)| Op::Store {
            medium,
            parent,
            hashes,
            tokens,
            shape,
            lora,
        });
    let remove = (0u8..5, proptest::collection::vec(0..UNIVERSE, 1..5))
        .prop_map(|(medium, hashes)| Op::Remove { medium, hashes });
    prop_oneof![
        10 => store,
        8 => remove,
        1 => Just(Op::Cleared),
        1 => Just(Op::Restart),
        1 => Just(Op::Unknown),
    ]
}

/// The event of a store or remove op.
fn event(op: &Op) -> Option<KvEvent> {
    match op {
        Op::Store {
            medium: m,
            parent,
            hashes,
            tokens,
            shape,
            lora,
        } => {
            let n = hashes.len() * BLOCK;
            let (token_ids, block_size) = match shape {
                Shape::Full => (tokens[..n].to_vec(), BLOCK as u32),
                Shape::Empty => (vec![], BLOCK as u32),
                Shape::Short => (tokens[..n.saturating_sub(1)].to_vec(), BLOCK as u32),
                Shape::ZeroBlockSize => (tokens[..n].to_vec(), 0),
            };
            Some(KvEvent::BlockStored {
                block_hashes: hashes.iter().map(|&i| hash(i)).collect(),
                parent_block_hash: parent.map(hash),
                token_ids,
                block_size,
                // With a name, the name decides the root.
                lora_id: lora.map(|_| 3),
                medium: medium(*m),
                lora_name: lora.map(str::to_owned),
                group_idx: None,
            })
        }
        Op::Remove { medium: m, hashes } => Some(KvEvent::BlockRemoved {
            block_hashes: hashes.iter().map(|&i| hash(i)).collect(),
            medium: medium(*m),
            group_idx: None,
        }),
        Op::Cleared => Some(KvEvent::AllBlocksCleared),
        Op::Unknown => Some(KvEvent::Unknown {
            type_name: "BlockMoved".into(),
        }),
        Op::Restart => None,
    }
}

fn tier(m: &Medium) -> usize {
    match m {
        Medium::Gpu => 0,
        Medium::Cpu => 1,
        Medium::Storage | Medium::Other(_) => 2,
    }
}

/// The index, written the plain way: residency counts per (tier, hash), and every key ever
/// given since the last restart (the index remembers removed blocks; sequences here stay far
/// below its limit).
#[derive(Default)]
struct Model {
    refs: HashMap<(usize, BlockHash), u32>,
    known: HashMap<BlockHash, u64>,
    stats: ApplyStats,
    generation: u32,
}

impl Model {
    fn apply(&mut self, event: &KvEvent) {
        let s = &mut self.stats;
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                ..
            } => {
                s.store_events += 1;
                s.other_medium += u64::from(matches!(medium, Medium::Other(_)));
                let t = tier(medium);
                let bs = *block_size as usize;
                let spans =
                    !token_ids.is_empty() && bs > 0 && token_ids.len() == block_hashes.len() * bs;
                if !token_ids.is_empty() && !spans {
                    s.malformed += 1;
                }
                let (mut parent, mut orphan) = match parent_block_hash {
                    None => (root_key(lora_name.as_deref()), false),
                    Some(p) => match self.known.get(p) {
                        Some(k) => (*k, false),
                        None => (hash_key(p), true),
                    },
                };
                for (i, h) in block_hashes.iter().enumerate() {
                    s.stored += 1;
                    let key = match self.known.get(h) {
                        Some(k) => {
                            orphan = false;
                            *k
                        }
                        None if spans => {
                            s.orphan_blocks += u64::from(orphan);
                            block_key(parent, &token_ids[i * bs..(i + 1) * bs])
                        }
                        None => {
                            s.hash_keyed += 1;
                            hash_key(h)
                        }
                    };
                    self.known.insert(*h, key);
                    *self.refs.entry((t, *h)).or_default() += 1;
                    parent = key;
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                s.remove_events += 1;
                s.other_medium += u64::from(matches!(medium, Medium::Other(_)));
                let t = tier(medium);
                for h in block_hashes {
                    match self.refs.get_mut(&(t, *h)) {
                        Some(n) if *n > 0 => {
                            *n -= 1;
                            s.removed += 1;
                            if *n == 0 {
                                self.refs.remove(&(t, *h));
                            }
                        }
                        _ => s.unknown_removals += 1,
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                s.cleared += 1;
                self.refs.clear();
                self.generation += 1;
            }
            KvEvent::Unknown { .. } => s.unknown_events += 1,
        }
    }

    fn restart(&mut self) {
        self.refs.clear();
        self.known.clear();
        self.generation += 1;
    }

    fn resident(&self, h: &BlockHash) -> bool {
        (0..3).any(|t| self.refs.contains_key(&(t, *h)))
    }
}

fn check(cache: &EndpointCache, model: &Model, stats: &ApplyStats) {
    // The counters; the first malformed / unknown event are descriptions for the log.
    let counters = ApplyStats {
        first_malformed: None,
        first_unknown: None,
        ..*stats
    };
    assert_eq!(counters, model.stats);
    assert_eq!(cache.generation(), model.generation);
    for (t, tier) in Tier::ALL.into_iter().enumerate() {
        let ours: HashSet<BlockHash> = cache.engine_hashes(tier).collect();
        let theirs: HashSet<BlockHash> = model
            .refs
            .keys()
            .filter(|(mt, _)| *mt == t)
            .map(|(_, h)| *h)
            .collect();
        assert_eq!(ours, theirs, "{tier:?} engine hashes");
        assert_eq!(cache.blocks(tier), theirs.len());
        let our_keys: HashSet<u64> = cache.keys(tier).collect();
        let their_keys: HashSet<u64> = theirs.iter().map(|h| model.known[h]).collect();
        assert_eq!(our_keys, their_keys, "{tier:?} keys");
        for k in &their_keys {
            assert!(cache.contains_key(*k, tier));
        }
        for i in 0..UNIVERSE {
            let h = hash(i);
            assert_eq!(cache.contains_engine_hash(&h, tier), theirs.contains(&h));
        }
    }
    for i in 0..UNIVERSE {
        let h = hash(i);
        let want = model.resident(&h).then(|| model.known[&h]);
        assert_eq!(cache.key_of(&h), want, "key of {h}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]
    #[test]
    fn index_agrees_with_the_reference_model(ops in proptest::collection::vec(op(), 1..80)) {
        let mut cache = EndpointCache::new();
        let mut model = Model::default();
        let mut stats = ApplyStats::default();
        for op in &ops {
            match event(op) {
                Some(e) => {
                    cache.apply(&e, &mut stats);
                    model.apply(&e);
                }
                None => {
                    cache.clear();
                    model.restart();
                }
            }
            check(&cache, &model, &stats);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (b) The simulator's engine, through the wire.

/// A tiny deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One request's tokens and the (engine hash, key) chain of its full blocks so far.
struct Tracked {
    tokens: Vec<u32>,
    chain: Vec<(u64, u64)>,
}

/// Engine hash -> key for every full block of every request seen.
struct Expected {
    block_size: usize,
    requests: HashMap<u64, Tracked>,
    keys: HashMap<u64, u64>,
}

impl Expected {
    fn extend(&mut self, id: u64, new_tokens: &[u32]) {
        let bs = self.block_size;
        let mut scratch = Vec::new();
        let r = self.requests.entry(id).or_insert(Tracked {
            tokens: Vec::new(),
            chain: Vec::new(),
        });
        r.tokens.extend_from_slice(new_tokens);
        while r.tokens.len() >= (r.chain.len() + 1) * bs {
            let i = r.chain.len();
            let span = &r.tokens[i * bs..(i + 1) * bs];
            let parent = r.chain.last();
            let engine = block_hash(&mut scratch, parent.map(|&(h, _)| h), span);
            let key = block_key(parent.map_or(root_key(None), |&(_, k)| k), span);
            if let Some(old) = self.keys.insert(engine, key) {
                assert_eq!(old, key, "one engine hash, two contents");
            }
            r.chain.push((engine, key));
        }
    }
}

/// Sends the engine's events through the wire (in `form`) into both caches.
fn publish(
    caches: &mut [EndpointCache; 2],
    events: Vec<kvoy_sim::engine::KvEvent>,
    ts: f64,
    form: WireForm,
) -> [ApplyStats; 2] {
    let batch = EventBatch {
        ts,
        events: kvoy_sim::events::to_wire(events),
        data_parallel_rank: None,
    };
    let payload = encode_batch(&batch, form);
    let decoded = decode_batch(&payload).unwrap();
    assert_eq!(decoded, batch);
    [
        caches[0].apply_batch(&decoded),
        caches[1].apply_batch(&decoded),
    ]
}

fn check_against_engine(cache: &EndpointCache, engine: &Engine, expected: &Expected) {
    let cached: HashSet<u64> = engine.cached_block_hashes().collect();
    let ours: HashSet<u64> = cache
        .engine_hashes(Tier::Gpu)
        .map(|h| h.as_u64().unwrap())
        .collect();
    assert_eq!(ours, cached);
    assert_eq!(cache.blocks(Tier::Gpu), engine.stats().num_cached_blocks);
    assert_eq!(cache.blocks(Tier::Cpu) + cache.blocks(Tier::Storage), 0);
    for h in &cached {
        let key = expected.keys[h];
        assert_eq!(cache.key_of(&BlockHash::from_u64(*h)), Some(key));
        assert!(cache.contains_key(key, Tier::Gpu));
    }
}

/// What one workload did.
#[derive(Debug, Default)]
struct Outcome {
    stats: ApplyStats,
    /// Orphan blocks seen by a twin cache that remembers no removed block.
    forgetful_orphans: u64,
    resets: usize,
    preemptions: u64,
    prefix_hits: u64,
}

/// Random prompts over six shared prefixes, under cache pressure (48 blocks of 4 tokens, six
/// sequences: evictions and preemptions), with idle spells that allow cache resets. Checks the
/// index against the engine after every step.
fn workload(seed: u64) -> Outcome {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let profile = Profile {
        name: "tiny".to_owned(),
        block_size: 4,
        num_gpu_blocks: 48,
        max_num_seqs: 6,
        max_num_batched_tokens: 48,
        ..Profile::llama_8b_h100()
    };
    let mut engine = Engine::new(&profile).unwrap();
    let mut caches = [
        EndpointCache::new(),
        EndpointCache::new().with_recent_removed(0),
    ];
    let mut expected = Expected {
        block_size: profile.block_size as usize,
        requests: HashMap::new(),
        keys: HashMap::new(),
    };
    let prefixes: Vec<Vec<u32>> = (0..6)
        .map(|_| {
            (0..8 + rng.below(40))
                .map(|_| rng.below(500) as u32)
                .collect()
        })
        .collect();
    let mut out = Outcome::default();
    let mut now = Duration::ZERO;
    let mut next_id = 0u64;
    for round in 0..2000u32 {
        let form = if round % 2 == 0 {
            WireForm::Map
        } else {
            WireForm::Array
        };
        // Now and then let the engine run dry, so that a cache reset is allowed.
        let draining = round % 400 >= 320;
        let applied = match rng.below(20) {
            0..=5 if !draining && engine.stats().waiting < 6 => {
                let mut prompt = prefixes[rng.below(prefixes.len() as u64) as usize].clone();
                prompt.extend((0..rng.below(24)).map(|_| rng.below(500) as u32));
                let request = EngineRequest {
                    id: next_id,
                    prompt: prompt.clone(),
                    max_tokens: 1 + rng.below(30) as u32,
                };
                if engine.submit(request, now).is_ok() {
                    expected.extend(next_id, &prompt);
                }
                next_id += 1;
                None
            }
            6 if !engine.has_work() && rng.below(4) == 0 => {
                engine.reset_cache().ok().map(|events| {
                    out.resets += 1;
                    publish(&mut caches, events, now.as_secs_f64(), form)
                })
            }
            _ => {
                let step = engine.step(now);
                now += step.duration;
                for o in &step.outputs {
                    if let OutputKind::FirstToken { token, .. } | OutputKind::Token { token, .. } =
                        o.kind
                    {
                        expected.extend(o.id, &[token]);
                    }
                }
                Some(publish(&mut caches, step.events, now.as_secs_f64(), form))
            }
        };
        if let Some([s, forgetful]) = applied {
            out.stats.add(&s);
            out.forgetful_orphans += forgetful.orphan_blocks;
        }
        check_against_engine(&caches[0], &engine, &expected);
    }
    assert_eq!(caches[0].generation() as usize, out.resets);
    out.preemptions = engine.stats().preemptions;
    out.prefix_hits = engine.stats().prefix_cache_hits;
    out
}

#[test]
fn index_follows_the_simulator_through_the_wire() {
    let mut forgetful_orphans = 0;
    for seed in [6, 10, 1, 2] {
        let out = workload(seed);
        let s = &out.stats;
        assert_eq!(
            (
                s.orphan_blocks,
                s.unknown_removals,
                s.malformed,
                s.hash_keyed
            ),
            (0, 0, 0, 0),
            "seed {seed}: {out:?}"
        );
        // The workload did what it is for: evictions, preemptions, resets, prefix hits.
        assert!(s.removed > 100, "seed {seed}: {out:?}");
        assert!(
            out.preemptions > 0 && out.resets > 0 && out.prefix_hits > 0,
            "seed {seed}: {out:?}"
        );
        forgetful_orphans += out.forgetful_orphans;
    }
    // Some sequence extended a chain whose parent had just been evicted (the engine keeps a
    // duplicate block uncached, so the parent's hash left the cache while the sequence ran):
    // only the memory of removed blocks keyed its continuation right.
    assert!(forgetful_orphans > 0);
}
