//! The prefix index (one trie of key chains) against the per-endpoint key sets it replaced,
//! side by side in one run: 16 endpoints of 31,250 blocks each, filled to capacity with
//! 256-key chains, requests of 256 keys. `cold`: every key of the request new (the index at
//! capacity, so recording evicts); `warm`: a chain every endpoint holds whole. `match16`
//! matches all 16 endpoints, `record` records the decision (what every other worker does
//! again when it replays it), `route` is both.

// A benchmark fails loudly on bad fixtures, like a test.
#![allow(clippy::expect_used)]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use std::hint::black_box;

use kvoy_shared::prefix::BlockKey;
use kvoy_shared::{EndpointId, LruSet, Match, PrefixIndex};

const ENDPOINTS: usize = 16;
const CAPACITY: usize = 31_250;
const KEYS: usize = 256;

/// The index before the trie: per endpoint an LRU set of keys.
struct KeySets {
    sets: Vec<LruSet>,
}

impl KeySets {
    fn new(endpoints: usize, capacity: usize, seed: u64) -> Self {
        KeySets {
            sets: (0..endpoints)
                .map(|i| LruSet::new(capacity, seed ^ i as u64))
                .collect(),
        }
    }

    fn matched(&self, endpoint: usize, keys: &[BlockKey]) -> usize {
        self.sets.get(endpoint).map_or(0, |set| {
            keys.iter().take_while(|k| set.contains(k.0)).count()
        })
    }

    fn record(&mut self, endpoint: usize, keys: &[BlockKey]) {
        if let Some(set) = self.sets.get_mut(endpoint) {
            for k in keys.iter().rev() {
                set.touch(k.0);
            }
        }
    }
}

/// What the router asks of either index.
trait Index {
    fn match_all(&self, keys: &[BlockKey], out: &mut Vec<Match>);
    fn record(&mut self, endpoint: usize, keys: &[BlockKey]);
}

impl Index for KeySets {
    fn match_all(&self, keys: &[BlockKey], out: &mut Vec<Match>) {
        out.clear();
        out.extend((0..self.sets.len()).map(|e| Match::on_gpu(self.matched(e, keys))));
    }

    fn record(&mut self, endpoint: usize, keys: &[BlockKey]) {
        KeySets::record(self, endpoint, keys);
    }
}

impl Index for PrefixIndex {
    fn match_all(&self, keys: &[BlockKey], out: &mut Vec<Match>) {
        self.matched_all(keys, out);
    }

    fn record(&mut self, endpoint: usize, keys: &[BlockKey]) {
        PrefixIndex::record(self, EndpointId(endpoint as u16), keys);
    }
}

/// Fresh chains: keys nobody has seen.
struct Fresh(kvoy_shared::Rng);

impl Fresh {
    fn chain(&mut self) -> Vec<BlockKey> {
        (0..KEYS).map(|_| BlockKey(self.0.next_u64())).collect()
    }
}

/// An index of each kind filled to capacity with fresh chains, every endpoint also holding
/// `shared` whole (the most recent chain of each).
fn filled<I: Index>(mut index: I, fresh: &mut Fresh, shared: &[BlockKey]) -> I {
    for e in 0..ENDPOINTS {
        for _ in 0..CAPACITY.div_ceil(KEYS) {
            index.record(e, &fresh.chain());
        }
        index.record(e, shared);
    }
    index
}

fn bench_kind<I: Index>(c: &mut Criterion, name: &str, index: I) {
    let mut fresh = Fresh(kvoy_shared::Rng::new(0x5EED));
    let shared = fresh.chain();
    let mut index = filled(index, &mut fresh, &shared);
    let mut out = Vec::with_capacity(ENDPOINTS);
    let mut g = c.benchmark_group("index");
    let mut e = 0;
    g.bench_function(format!("cold_match16/{name}"), |b| {
        b.iter_batched_ref(
            || fresh.chain(),
            |keys| index.match_all(black_box(keys), &mut out),
            BatchSize::SmallInput,
        )
    });
    g.bench_function(format!("cold_record/{name}"), |b| {
        b.iter_batched_ref(
            || fresh.chain(),
            |keys| {
                e = (e + 1) % ENDPOINTS;
                index.record(e, black_box(keys));
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function(format!("cold_route/{name}"), |b| {
        b.iter_batched_ref(
            || fresh.chain(),
            |keys| {
                index.match_all(black_box(keys), &mut out);
                e = (e + 1) % ENDPOINTS;
                index.record(e, keys);
            },
            BatchSize::SmallInput,
        )
    });
    // Every endpoint holds `shared` again, most recently.
    for e in 0..ENDPOINTS {
        index.record(e, &shared);
    }
    g.bench_function(format!("warm_match16/{name}"), |b| {
        b.iter(|| {
            index.match_all(black_box(&shared), &mut out);
            out[ENDPOINTS - 1]
        })
    });
    g.bench_function(format!("warm_record/{name}"), |b| {
        b.iter(|| {
            e = (e + 1) % ENDPOINTS;
            index.record(e, black_box(&shared));
        })
    });
    index.match_all(&shared, &mut out);
    assert_eq!(
        out,
        [Match::on_gpu(KEYS); ENDPOINTS],
        "{name}: every endpoint holds the chain"
    );
    g.finish();
}

fn bench(c: &mut Criterion) {
    // Each kind in turn, the same workload; criterion prints them under one group.
    bench_kind(c, "key_sets", KeySets::new(ENDPOINTS, CAPACITY, 3));
    bench_kind(c, "trie", PrefixIndex::new(ENDPOINTS, CAPACITY, 3));
}

criterion_group!(benches, bench);
criterion_main!(benches);
