//! The ideal prefix-cache hit rate: what one infinite cache serving every request would hit.
//!
//! Blocks are the engine's KV blocks (`block_size` tokens of 4 bytes, i.e. 64 bytes of prompt
//! text for a block size of 16), chained like the engine's hashes, so a block stands for the
//! whole prefix up to it. A request hits its longest run of leading blocks already seen, capped
//! like the engine so that at least one prompt token is computed; then its prompt blocks and the
//! blocks of its output (appended to the prompt) are remembered.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use kvoy_sim_engine::tokenizer::{generated_word, BYTES_PER_TOKEN};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A hasher for keys that are already hashes: passes them through. Not `fnv`: on these keys
/// (xxh3 block hashes; 2M keys inserted, looked up and removed) FNV-1a took 1.6-2.2x the time
/// of this pass-through, three runs side by side. The keys come from the benchmark's own
/// workloads, so no seed is needed either.
#[derive(Default)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = k;
    }
}

/// An infinite prefix cache.
#[derive(Default)]
pub struct IdealCache {
    seen: HashSet<u64, BuildHasherDefault<PassThrough>>,
    block_bytes: usize,
    block_tokens: usize,
    scratch: Vec<u8>,
    hit_tokens: u64,
    prompt_tokens: u64,
}

const ROOT: u64 = 0x6b76_6f79_6964_6561;

impl IdealCache {
    /// A cache of blocks of `block_tokens` tokens.
    pub fn new(block_tokens: u32) -> Self {
        let block_tokens = (block_tokens as usize).max(1);
        IdealCache {
            block_bytes: block_tokens * BYTES_PER_TOKEN,
            block_tokens,
            ..IdealCache::default()
        }
    }

    /// Counts the hit of a prompt (`prompt`, tokenized at 4 bytes a token) and remembers it and
    /// the `output_tokens` that request `request` generates. Returns the hit tokens.
    pub fn observe(&mut self, prompt: &str, request: u64, output_tokens: u32) -> u64 {
        let bytes = prompt.as_bytes();
        let prompt_tokens = bytes.len().div_ceil(BYTES_PER_TOKEN);
        let max_hit_blocks = prompt_tokens.saturating_sub(1) / self.block_tokens;
        let mut prev = ROOT;
        let mut hit_blocks = 0;
        let mut still_hitting = true;
        let mut chunks = bytes.chunks_exact(self.block_bytes);
        for block in &mut chunks {
            prev = xxh3_64_with_seed(block, prev);
            let known = !self.seen.insert(prev);
            if still_hitting && known && hit_blocks < max_hit_blocks {
                hit_blocks += 1;
            } else {
                still_hitting = false;
            }
        }
        // The output continues the prompt's last partial block. The last generated token is
        // never computed (the request finishes when it is sampled), so it is not cached.
        self.scratch.clear();
        self.scratch.extend_from_slice(chunks.remainder());
        for i in 0..output_tokens.saturating_sub(1) {
            self.scratch
                .extend_from_slice(generated_word(request, i).as_bytes());
        }
        for block in self.scratch.chunks_exact(self.block_bytes) {
            prev = xxh3_64_with_seed(block, prev);
            self.seen.insert(prev);
        }
        let hit = (hit_blocks * self.block_tokens) as u64;
        self.hit_tokens += hit;
        self.prompt_tokens += prompt_tokens as u64;
        hit
    }

    /// Hit tokens and prompt tokens so far.
    pub fn totals(&self) -> (u64, u64) {
        (self.hit_tokens, self.prompt_tokens)
    }

    /// Hit tokens / prompt tokens so far (0 when nothing was observed).
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_hits_whole_blocks_only() {
        let mut c = IdealCache::new(16);
        let system = "abc ".repeat(160); // 160 tokens = 10 blocks
        assert_eq!(
            c.observe(&format!("{system}{}", "q1q ".repeat(20)), 1, 1),
            0
        );
        assert_eq!(
            c.observe(&format!("{system}{}", "q2q ".repeat(20)), 2, 1),
            160
        );
        // The same prompt again: all but the block holding the last token.
        let p = "xyz ".repeat(32);
        c.observe(&p, 3, 1);
        assert_eq!(c.observe(&p, 4, 1), 16);
        assert!(c.hit_rate() > 0.0);
    }

    #[test]
    fn outputs_feed_the_next_turn() {
        let mut c = IdealCache::new(16);
        let first = "abcd".repeat(16);
        c.observe(&first, 9, 40);
        let mut next = first.clone();
        for i in 0..40 {
            next.push_str(generated_word(9, i));
        }
        next.push_str(&"tool".repeat(30));
        // 16 prompt tokens + 39 computed output tokens = 55 tokens: 3 full blocks.
        assert_eq!(c.observe(&next, 10, 1), 48);
    }
}
