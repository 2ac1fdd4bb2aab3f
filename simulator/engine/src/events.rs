//! KV cache events, in the shape vLLM publishes them (`vllm/distributed/kv_events.py`).
//!
//! A separate crate encodes these to msgpack; the engine only produces them, in the order a
//! subscriber must apply them.

/// The `medium` of the events of the simulated GPU cache.
pub const MEDIUM_GPU: &str = "GPU";
/// The `medium` of the events of the CPU offload tier (vLLM's OffloadingConnector).
pub const MEDIUM_CPU: &str = "CPU";

/// One KV cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks of one sequence became cached. `token_ids` holds the tokens of
    /// all of them (`block_size` per block); `parent_block_hash` is the hash of the block before
    /// the first one, `None` for the first block of a sequence.
    BlockStored {
        /// Chained block hashes, in sequence order.
        block_hashes: Vec<u64>,
        /// Hash of the preceding block of the sequence.
        parent_block_hash: Option<u64>,
        /// The token ids of the stored blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// [`MEDIUM_GPU`] or [`MEDIUM_CPU`].
        medium: &'static str,
    },
    /// Cached blocks were evicted (one event per evicted block, as vLLM does).
    BlockRemoved {
        /// The evicted hashes.
        block_hashes: Vec<u64>,
        /// [`MEDIUM_GPU`] or [`MEDIUM_CPU`].
        medium: &'static str,
    },
    /// The whole prefix cache was dropped (admin reset), both tiers.
    AllBlocksCleared,
}
