//! The typed events: what the wire forms decode into and encode from.

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
}
