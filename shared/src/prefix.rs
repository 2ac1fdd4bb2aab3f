//! Prefix keys: the prompt cut into fixed-size byte blocks, each block's key chained to the
//! previous one, so a key stands for the whole prefix up to and including its block.
//!
//! `seed = xxh3(model || 0x1f || cache_salt)`, `key_i = xxh3_with_seed(block_i, key_{i-1})`
//! with `key_{-1} = seed`. Only whole blocks get keys: a model server caches whole blocks too,
//! and a trailing partial block would never match a longer continuation.
//!
//! ```
//! use kvoy_shared::prefix::PrefixHasher;
//! let mut h = PrefixHasher::new(4, 16);
//! let keys = h.hash("m", None, &[b"abcdefgh", b"ij"]);
//! assert_eq!(keys.len(), 2); // "abcd", "efgh"; "ij" is a partial block
//! ```

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// A chained prefix key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

/// Where the keys of a prompt end: the first `dense` keys cover one block each, then every
/// `group` keys the span doubles (2, 4, 8... blocks). A long prompt is thus keyed end to end
/// with a bounded number of keys (the index's work per request stays flat as prompts grow),
/// with a match precision that stays within a few percent of the matched length: 128 dense
/// 64-byte keys then groups of 64 cover 8 KB with 128 keys, 128 KB with 384 and 512 KB with 512.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySchedule {
    pub block_size: usize,
    /// Keys at most.
    pub max_keys: usize,
    /// Leading keys of one block each.
    pub dense: usize,
    /// Keys per doubling after the dense ones (at least 1).
    pub group: usize,
}

/// The span doubles at most this many times (a span of 64 KB at 64-byte blocks).
const MAX_SPAN_SHIFT: usize = 10;

impl KeySchedule {
    /// Every key one block, as the reference picker keys prompts.
    pub fn dense(block_size: usize, max_keys: usize) -> Self {
        KeySchedule {
            block_size,
            max_keys,
            dense: usize::MAX,
            group: 1,
        }
    }

    /// Bytes covered by key `i`.
    pub fn span(&self, i: usize) -> usize {
        if i < self.dense {
            return self.block_size;
        }
        let shift = ((i - self.dense) / self.group.max(1) + 1).min(MAX_SPAN_SHIFT);
        self.block_size << shift
    }
}

/// Cuts prompts into spans and keys them; keeps its buffers between requests.
#[derive(Debug)]
pub struct PrefixHasher {
    schedule: KeySchedule,
    partial: Vec<u8>,
    keys: Vec<BlockKey>,
    ends: Vec<u32>,
}

/// The seed every key chain of `model` (and `cache_salt`) starts from. A salt separates tenants
/// that must not share cache entries.
pub fn chain_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    match cache_salt {
        None => xxh3_64(model.as_bytes()),
        Some(salt) => {
            let mut buf = Vec::with_capacity(model.len() + 1 + salt.len());
            buf.extend_from_slice(model.as_bytes());
            buf.push(0x1f);
            buf.extend_from_slice(salt.as_bytes());
            xxh3_64(&buf)
        }
    }
}

impl PrefixHasher {
    /// One key per block, at most `max_blocks`. `block_size` and `max_blocks` must be at
    /// least 1 (the config checks this).
    pub fn new(block_size: usize, max_blocks: usize) -> Self {
        Self::with_schedule(KeySchedule::dense(block_size, max_blocks))
    }

    pub fn with_schedule(schedule: KeySchedule) -> Self {
        let schedule = KeySchedule {
            block_size: schedule.block_size.max(1),
            group: schedule.group.max(1),
            ..schedule
        };
        PrefixHasher {
            schedule,
            partial: Vec::with_capacity(schedule.block_size),
            keys: Vec::with_capacity(schedule.max_keys.min(4096)),
            ends: Vec::with_capacity(schedule.max_keys.min(4096)),
        }
    }

    pub fn block_size(&self) -> usize {
        self.schedule.block_size
    }

    /// Where this hasher's keys end (its schedule, as normalised when it was made).
    pub fn schedule(&self) -> KeySchedule {
        self.schedule
    }

    /// Where each key of the last [`PrefixHasher::hash`] ends, in prompt bytes.
    pub fn ends(&self) -> &[u32] {
        &self.ends
    }

    /// Keys of the whole spans of the concatenated `segments`, at most `max_keys`.
    pub fn hash(
        &mut self,
        model: &str,
        cache_salt: Option<&str>,
        segments: &[&[u8]],
    ) -> &[BlockKey] {
        self.keys.clear();
        self.ends.clear();
        self.partial.clear();
        let mut prev = chain_seed(model, cache_salt);
        let mut offset = 0usize;
        let max = self.schedule.max_keys;
        let mut span = self.schedule.span(0);
        'outer: for seg in segments {
            let mut seg: &[u8] = seg;
            if max == 0 {
                break;
            }
            if !self.partial.is_empty() {
                let take = (span - self.partial.len()).min(seg.len());
                self.partial.extend_from_slice(&seg[..take]);
                seg = &seg[take..];
                if self.partial.len() < span {
                    continue;
                }
                prev = xxh3_64_with_seed(&self.partial, prev);
                offset += span;
                self.push(prev, offset);
                self.partial.clear();
                if self.keys.len() >= max {
                    break 'outer;
                }
                span = self.schedule.span(self.keys.len());
            }
            while seg.len() >= span {
                let (block, rest) = seg.split_at(span);
                prev = xxh3_64_with_seed(block, prev);
                offset += span;
                self.push(prev, offset);
                seg = rest;
                if self.keys.len() >= max {
                    break 'outer;
                }
                span = self.schedule.span(self.keys.len());
            }
            self.partial.extend_from_slice(seg);
        }
        &self.keys
    }

    fn push(&mut self, key: u64, end: usize) {
        self.keys.push(BlockKey(key));
        self.ends.push(u32::try_from(end).unwrap_or(u32::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segmentation_does_not_change_keys() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let mut h = PrefixHasher::new(64, 256);
        let whole = h.hash("m", None, &[&text]).to_vec();
        assert_eq!(whole.len(), 1000 / 64);
        for cut in [1usize, 63, 64, 65, 500, 999] {
            let (a, b) = text.split_at(cut);
            let (b1, b2) = b.split_at(b.len() / 2);
            assert_eq!(h.hash("m", None, &[a, b1, b2]), &whole[..], "cut {cut}");
        }
    }

    #[test]
    fn keys_chain_and_seed() {
        let mut h = PrefixHasher::new(4, 100);
        let a = h.hash("m", None, &[b"aaaabbbbcccc"]).to_vec();
        let b = h.hash("m", None, &[b"aaaaXbbbcccc"]).to_vec();
        assert_eq!(a[0], b[0]);
        // a change in block 1 changes every later key, even where the block text is equal
        assert_ne!(a[1], b[1]);
        assert_ne!(a[2], b[2]);
        let other_model = h.hash("n", None, &[b"aaaabbbbcccc"]).to_vec();
        assert_ne!(a[0], other_model[0]);
        let salted = h.hash("m", Some("tenant"), &[b"aaaabbbbcccc"]).to_vec();
        assert_ne!(a[0], salted[0]);
    }

    #[test]
    fn sparse_schedule_keys_long_prompts_with_few_keys() {
        let sched = KeySchedule {
            block_size: 4,
            max_keys: 100,
            dense: 3,
            group: 2,
        };
        // spans: 4 4 4 | 8 8 | 16 16 | 32 32 ...
        assert_eq!(
            (0..9).map(|i| sched.span(i)).collect::<Vec<_>>(),
            vec![4, 4, 4, 8, 8, 16, 16, 32, 32]
        );
        let text: Vec<u8> = (0..200u32).map(|i| (i % 251) as u8).collect();
        let mut h = PrefixHasher::with_schedule(sched);
        let whole = h.hash("m", None, &[&text]).to_vec();
        assert_eq!(h.ends(), &[4, 8, 12, 20, 28, 44, 60, 92, 124, 188]);
        assert_eq!(whole.len(), 10);
        // Segment boundaries anywhere give the same keys.
        for cut in [1usize, 5, 13, 50, 100, 199] {
            let (a, b) = text.split_at(cut);
            let (b1, b2) = b.split_at(b.len() / 3);
            assert_eq!(h.hash("m", None, &[a, b1, b2]), &whole[..], "cut {cut}");
        }
        // The dense head agrees with a dense hasher; a prompt extending another shares keys.
        let mut dense = PrefixHasher::new(4, 100);
        assert_eq!(&dense.hash("m", None, &[&text])[..3], &whole[..3]);
        let longer: Vec<u8> = text.iter().copied().chain(0..100u8).collect();
        let k = h.hash("m", None, &[&longer]).to_vec();
        assert_eq!(&k[..whole.len()], &whole[..]);
        // A change at byte 100 keeps the keys ending at or before it.
        let mut changed = text.clone();
        changed[100] ^= 1;
        let k = h.hash("m", None, &[&changed]).to_vec();
        let same = k.iter().zip(&whole).take_while(|(a, b)| a == b).count();
        assert_eq!(
            same, 8,
            "keys ending at 92 and before match, the one ending at 124 not"
        );
    }

    #[test]
    fn capped_at_max_blocks() {
        let mut h = PrefixHasher::new(4, 3);
        assert_eq!(h.hash("m", None, &[&[7u8; 400]]).len(), 3);
        assert_eq!(
            h.hash("m", None, &[b"ab", b"cd", b"efgh", b"ijkl", b"mnop"])
                .len(),
            3
        );
    }
}
