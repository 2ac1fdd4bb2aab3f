//! The typed events: what the wire forms decode into and encode from.

use std::slice::ChunksExact;

use crate::BlockHash;

/// Where a cached block lives (vLLM's `medium`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Accelerator memory: `"GPU"`. Also what an absent or `nil` medium means (servers that
    /// predate the field only published GPU blocks).
    Gpu,
    /// Host memory (offloading connectors): `"CPU"`.
    Cpu,
    /// Disk or remote storage: `"STORAGE"`.
    Storage,
    /// Any other name, kept as sent.
    Other(String),
}

impl Medium {
    /// Parses a wire name; the three known names match ASCII case-insensitively.
    pub fn from_wire(name: &str) -> Self {
        if name.eq_ignore_ascii_case("GPU") {
            Self::Gpu
        } else if name.eq_ignore_ascii_case("CPU") {
            Self::Cpu
        } else if name.eq_ignore_ascii_case("STORAGE") {
            Self::Storage
        } else {
            Self::Other(name.to_owned())
        }
    }

    /// The wire name (vLLM's spelling).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Gpu => "GPU",
            Self::Cpu => "CPU",
            Self::Storage => "STORAGE",
            Self::Other(name) => name,
        }
    }
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks entered the cache: a chain of `block_hashes.len()` full blocks whose first block
    /// follows `parent_block_hash` (`None` for a chain that starts a prompt).
    BlockStored {
        /// One hash per stored block, in chain order.
        block_hashes: Vec<BlockHash>,
        /// The block before the first stored one.
        parent_block_hash: Option<BlockHash>,
        /// The tokens of all stored blocks (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// vLLM's deprecated LoRA id.
        lora_id: Option<i64>,
        /// Where the blocks are.
        medium: Medium,
        /// The LoRA adapter's name, if any.
        lora_name: Option<String>,
        /// KV-cache group (hybrid models); `None` when absent.
        group_idx: Option<i64>,
    },
    /// Blocks left the cache.
    BlockRemoved {
        /// The removed blocks.
        block_hashes: Vec<BlockHash>,
        /// Where they were.
        medium: Medium,
        /// KV-cache group; `None` when absent.
        group_idx: Option<i64>,
    },
    /// The whole cache was dropped (vLLM's `reset_prefix_cache`).
    AllBlocksCleared,
    /// An event type this crate does not know: callers count it and skip it.
    Unknown {
        /// The event's tag as sent.
        type_name: String,
    },
}

impl KvEvent {
    /// The wire tag of this event (vLLM's class name).
    pub fn type_name(&self) -> &str {
        match self {
            Self::BlockStored { .. } => "BlockStored",
            Self::BlockRemoved { .. } => "BlockRemoved",
            Self::AllBlocksCleared => "AllBlocksCleared",
            Self::Unknown { type_name } => type_name,
        }
    }

    /// A `BlockStored`'s tokens, one `block_size` run per block hash in chain order: what a
    /// block's content key is computed from. `None` for other events and for a store whose
    /// `token_ids` do not give every block exactly `block_size` tokens (none at all, too few,
    /// too many, or `block_size` 0), which names its blocks but not their content.
    pub fn block_tokens(&self) -> Option<ChunksExact<'_, u32>> {
        let Self::BlockStored {
            block_hashes,
            token_ids,
            block_size,
            ..
        } = self
        else {
            return None;
        };
        let size = usize::try_from(*block_size).ok().filter(|&s| s > 0)?;
        let spans =
            !token_ids.is_empty() && block_hashes.len().checked_mul(size) == Some(token_ids.len());
        spans.then(|| token_ids.chunks_exact(size))
    }
}

/// One published batch (vLLM's `KVEventBatch`): the payload of one ZMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock time of the batch, seconds since the Unix epoch.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank of the engine that produced the batch, when sent.
    pub data_parallel_rank: Option<i64>,
}

impl EventBatch {
    /// How many events have a type this crate does not know.
    pub fn unknown_count(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, KvEvent::Unknown { .. }))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_names() {
        for (name, medium) in [
            ("GPU", Medium::Gpu),
            ("cpu", Medium::Cpu),
            ("Storage", Medium::Storage),
            ("NVME", Medium::Other("NVME".into())),
        ] {
            assert_eq!(Medium::from_wire(name), medium);
        }
        assert_eq!(Medium::Storage.as_str(), "STORAGE");
        assert_eq!(Medium::Other("x".into()).as_str(), "x");
    }

    #[test]
    fn block_tokens_split_a_store_only_when_every_block_has_its_tokens() {
        let stored = |blocks: u64, tokens: u32, block_size: u32| KvEvent::BlockStored {
            block_hashes: (0..blocks).map(BlockHash::from_u64).collect(),
            parent_block_hash: None,
            token_ids: (0..tokens).collect(),
            block_size,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            group_idx: None,
        };
        let two_blocks = stored(2, 8, 4);
        let spans: Vec<&[u32]> = two_blocks.block_tokens().unwrap().collect();
        assert_eq!(spans, [&[0, 1, 2, 3][..], &[4, 5, 6, 7][..]]);
        for (blocks, tokens, block_size) in [(2, 0, 4), (2, 7, 4), (2, 9, 4), (0, 4, 4), (2, 0, 0)]
        {
            assert!(
                stored(blocks, tokens, block_size).block_tokens().is_none(),
                "{blocks} blocks, {tokens} tokens of {block_size}"
            );
        }
        assert!(KvEvent::AllBlocksCleared.block_tokens().is_none());
    }
}
