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

/// Cuts prompts into blocks and keys them; keeps its buffers between requests.
#[derive(Debug)]
pub struct PrefixHasher {
    block_size: usize,
    max_blocks: usize,
    partial: Vec<u8>,
    keys: Vec<BlockKey>,
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
    /// `block_size` and `max_blocks` must be at least 1 (the config checks this).
    pub fn new(block_size: usize, max_blocks: usize) -> Self {
        let block_size = block_size.max(1);
        PrefixHasher {
            block_size,
            max_blocks,
            partial: Vec::with_capacity(block_size),
            keys: Vec::with_capacity(max_blocks.min(4096)),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Keys of the whole blocks of the concatenated `segments`, at most `max_blocks`.
    pub fn hash(
        &mut self,
        model: &str,
        cache_salt: Option<&str>,
        segments: &[&[u8]],
    ) -> &[BlockKey] {
        self.keys.clear();
        self.partial.clear();
        let mut prev = chain_seed(model, cache_salt);
        let bs = self.block_size;
        'outer: for seg in segments {
            let mut seg: &[u8] = seg;
            if !self.partial.is_empty() {
                let take = (bs - self.partial.len()).min(seg.len());
                self.partial.extend_from_slice(&seg[..take]);
                seg = &seg[take..];
                if self.partial.len() < bs {
                    continue;
                }
                prev = xxh3_64_with_seed(&self.partial, prev);
                self.keys.push(BlockKey(prev));
                self.partial.clear();
                if self.keys.len() >= self.max_blocks {
                    break 'outer;
                }
            }
            let mut chunks = seg.chunks_exact(bs);
            for block in &mut chunks {
                prev = xxh3_64_with_seed(block, prev);
                self.keys.push(BlockKey(prev));
                if self.keys.len() >= self.max_blocks {
                    break 'outer;
                }
            }
            self.partial.extend_from_slice(chunks.remainder());
        }
        &self.keys
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
