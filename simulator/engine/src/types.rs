//! The values that cross the engine's API.

use std::time::Duration;

use super::events::KvEvent;

/// A request for the engine: already tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    /// Caller-chosen id, unique among the requests the engine holds.
    pub id: u64,
    /// Prompt token ids (see `tokenizer`).
    pub prompt: Vec<u32>,
    /// Tokens to generate; the simulated model never stops early (finish reason `length`).
    pub max_tokens: u32,
}

/// Token counts of a finished request, as in OpenAI's `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens (always `max_tokens`).
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache (`prompt_tokens_details.cached_tokens`): GPU
    /// hits and blocks loaded from the CPU offload tier.
    pub cached_tokens: u32,
}

/// What happened to one request in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputKind {
    /// The first generated token. `cached_tokens` counts the prompt tokens served from the cache
    /// at the admission that produced it (after a preemption, the re-admission counts); `ttft`
    /// runs from `submit`'s `now` to the end of this step, split as vLLM's metrics split it
    /// into `queue_time` (to the start of the step that first scheduled the request) and
    /// `prefill_time` (from there to the end of this step, preemptions included).
    FirstToken {
        /// Token id (`tokenizer::generated_token(id, 0)`, or the request's `OutputVocab::pick`).
        token: u32,
        /// Prompt tokens hit in the prefix cache or loaded from the CPU offload tier.
        cached_tokens: u32,
        /// Time to first token.
        ttft: Duration,
        /// From `submit`'s `now` to the first scheduling (`vllm:request_queue_time_seconds`;
        /// a server takes new requests between steps, so it misses the end of the step in
        /// progress when the request arrived, as vLLM's does).
        queue_time: Duration,
        /// First scheduling to first token (`vllm:request_prefill_time_seconds`).
        prefill_time: Duration,
    },
    /// A later generated token.
    Token {
        /// Token id (`tokenizer::generated_token(id, index)`, or the request's
        /// `OutputVocab::pick`).
        token: u32,
        /// Position among the generated tokens (the first token is 0).
        index: u32,
    },
    /// The request generated `max_tokens` tokens and left the engine; follows its last token in
    /// the same step.
    Finished {
        /// Token counts.
        usage: Usage,
        /// From `submit`'s `now` to the end of this step.
        latency: Duration,
    },
    /// The request lost its blocks (recompute preemption) and went back to the front of the
    /// waiting queue; it will prefill again, hitting whatever of its blocks stayed cached.
    Preempted,
}

/// One output of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The request id.
    pub id: u64,
    /// What happened.
    pub kind: OutputKind,
}

/// The result of one engine step. Outputs take effect at `now + duration`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// Simulated time the step's forward pass takes (zero when nothing was scheduled).
    pub duration: Duration,
    /// Per-request outputs, in scheduling order.
    pub outputs: Vec<Output>,
    /// KV events of the step, in the order to apply them.
    pub events: Vec<KvEvent>,
    /// Sequences in this step's batch.
    pub num_scheduled: usize,
    /// Tokens computed in this step.
    pub num_batched_tokens: usize,
}

/// A snapshot of the engine's counters, as vLLM's `/metrics` reports them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineStats {
    /// `vllm:num_requests_running`.
    pub running: usize,
    /// `vllm:num_requests_waiting`.
    pub waiting: usize,
    /// `vllm:kv_cache_usage_perc` (0-1): blocks referenced by requests / `num_gpu_blocks`;
    /// cached blocks no request holds are not counted.
    pub kv_cache_usage: f64,
    /// `vllm:cache_config_info{num_gpu_blocks}`.
    pub num_gpu_blocks: u32,
    /// `vllm:cache_config_info{block_size}`.
    pub block_size: u32,
    /// Blocks currently holding a cached hash (referenced or not).
    pub num_cached_blocks: usize,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up, once per admission.
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total`: of those, tokens found in the cache.
    pub prefix_cache_hits: u64,
    /// `vllm:external_prefix_cache_queries_total`: prompt tokens looked up on the CPU offload
    /// tier (vLLM's KV connector), once per admission; 0 without the tier.
    pub external_prefix_cache_queries: u64,
    /// `vllm:external_prefix_cache_hits_total`: of those, tokens loaded from the tier.
    pub external_prefix_cache_hits: u64,
    /// Blocks on the CPU offload tier.
    pub num_cpu_cached_blocks: usize,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// `vllm:prompt_tokens_total`: prompt tokens of the requests that produced their first
    /// token (counted then, once per request, cached tokens included, as vLLM counts them).
    pub prompt_tokens: u64,
    /// `vllm:generation_tokens_total`: tokens generated.
    pub generation_tokens: u64,
}

/// Why `submit` refused a request (vLLM refuses the same at validation, HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The prompt has no token.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is 0.
    #[error("max_tokens must be at least 1, got 0")]
    ZeroMaxTokens,
    /// Prompt plus `max_tokens` exceeds the context the engine can hold.
    #[error(
        "this model's maximum context length is {max_model_len} tokens, but {requested} were \
         requested ({prompt_tokens} in the prompt)"
    )]
    TooLong {
        /// Prompt tokens plus `max_tokens`.
        requested: u64,
        /// Prompt tokens.
        prompt_tokens: u64,
        /// The effective limit: `min(max_model_len, num_gpu_blocks · block_size)`.
        max_model_len: u64,
    },
    /// The id is already in use.
    #[error("request id {0} is already in use")]
    DuplicateId(u64),
}

/// Why `reset_cache` did nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ResetError {
    /// Requests hold blocks (vLLM's `reset_prefix_cache` fails the same way).
    #[error("cannot reset the prefix cache while {running} requests are running")]
    Busy {
        /// Running requests.
        running: usize,
    },
}
