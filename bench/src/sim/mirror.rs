//! A mirror of each engine's prefix cache, kept from its KV events (what kvoy-aggregator sees),
//! to tell how much of a prompt an engine holds when the request arrives.
//!
//! Block hashes are the engine's own ([`kvoy_sim_engine::block_hash`], the hashes its
//! `BlockStored` events carry).

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use kvoy_sim_engine::{block_hash, KvEvent, MEDIUM_GPU};

use crate::ideal::PassThrough;

/// The chained hashes of the full blocks of `tokens`, at most `max_blocks`, into `out`.
pub fn block_hashes(tokens: &[u32], block_size: usize, max_blocks: usize, out: &mut Vec<u64>) {
    let mut scratch = Vec::with_capacity(9 + 4 * block_size);
    block_hashes_into(tokens, block_size, max_blocks, out, &mut scratch);
}

/// [`block_hashes`] with a caller-owned scratch buffer (for callers that hash every request).
pub fn block_hashes_into(
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
    scratch: &mut Vec<u8>,
) {
    out.clear();
    let mut parent: Option<u64> = None;
    for block in tokens.chunks_exact(block_size.max(1)).take(max_blocks) {
        let h = block_hash(scratch, parent, block);
        out.push(h);
        parent = Some(h);
    }
}

/// The cached block hashes of one engine: on its GPU, and on its CPU offload tier.
#[derive(Default)]
pub struct CacheMirror {
    blocks: HashSet<u64, BuildHasherDefault<PassThrough>>,
    host: HashSet<u64, BuildHasherDefault<PassThrough>>,
}

impl CacheMirror {
    pub fn apply(&mut self, events: &[KvEvent]) {
        for e in events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } => self.tier(medium).extend(block_hashes.iter().copied()),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    let set = self.tier(medium);
                    for h in block_hashes {
                        set.remove(h);
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.blocks.clear();
                    self.host.clear();
                }
            }
        }
    }

    /// The blocks of the tier an event's `medium` names.
    fn tier(&mut self, medium: &str) -> &mut HashSet<u64, BuildHasherDefault<PassThrough>> {
        if medium == MEDIUM_GPU {
            &mut self.blocks
        } else {
            &mut self.host
        }
    }

    /// Leading `hashes` held on the GPU.
    pub fn matched(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains(h))
            .count()
    }

    /// Leading `hashes` after the first `from` held on the CPU tier (what the engine would
    /// load after its GPU hits).
    pub fn matched_host(&self, hashes: &[u64], from: usize) -> usize {
        hashes
            .iter()
            .skip(from)
            .take_while(|h| self.host.contains(h))
            .count()
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvoy_sim_engine::{tokenizer, Engine, EngineRequest, Profile};
    use std::time::Duration;

    #[test]
    fn mirrors_the_engine_cache_and_its_hashes() {
        let mut engine = Engine::new(&Profile::llama_8b_h100()).unwrap();
        let prompt = tokenizer::tokenize(&"abcd".repeat(100));
        engine
            .submit(
                EngineRequest {
                    id: 1,
                    prompt: prompt.clone(),
                    max_tokens: 2,
                },
                Duration::ZERO,
            )
            .unwrap();
        let mut mirror = CacheMirror::default();
        let mut now = Duration::ZERO;
        while engine.has_work() {
            let step = engine.step(now);
            mirror.apply(&step.events);
            now += step.duration;
        }
        let mut cached: Vec<u64> = engine.cached_block_hashes().collect();
        cached.sort_unstable();
        let mut mirrored: Vec<u64> = mirror.blocks.iter().copied().collect();
        mirrored.sort_unstable();
        assert_eq!(cached, mirrored);
        let mut hashes = Vec::new();
        block_hashes(&prompt, 16, usize::MAX, &mut hashes);
        assert_eq!(hashes.len(), 6);
        assert_eq!(mirror.matched(&hashes), 6, "our chain is the engine's");
        assert!(!mirror.is_empty() && mirror.len() >= 6);
    }
}
