//! The engine: a vLLM v1-style scheduler over the KV cache.
//!
//! Each [`Engine::step`] builds one batch under a token budget (`max_num_batched_tokens`):
//! 1. Running sequences, oldest first, each take what they still need (the rest of a prompt
//!    being prefilled, capped by the remaining budget: chunked prefill; 1 token when decoding).
//!    When one needs a block and none is free, the newest running sequence is preempted
//!    (blocks freed, back to the front of the waiting queue, computed tokens forgotten) until
//!    the allocation fits or the sequence preempted itself.
//! 2. If nothing was preempted in this step, waiting requests are admitted in FIFO order while
//!    budget remains and fewer than `max_num_seqs` run: each looks up its longest cached prefix,
//!    then allocates blocks for the rest of its first chunk; the first one that does not fit
//!    stops admission. With a CPU offload tier, the lookup continues there after the GPU hits;
//!    the blocks found are loaded (counted as computed, not prefilled), and the step lasts
//!    `loaded tokens / offload_load_tokens_per_s` longer: its forward pass waits for the copy.
//!    vLLM loads asynchronously, so only the loading request waits there; charging the step
//!    also delays the sequences batched with it, by as much (milliseconds per thousand tokens).
//!
//! A request whose prompt was prefilled on another engine ([`Engine::submit_transferred`],
//! the decode side of prefill/decode disaggregation) has its prompt's full blocks beyond the
//! local hits written into its cache at its first admission, without computing them (its KV
//! arrived from the prefill engine; the caller waited for the transfer), and computes only the
//! rest, as vLLM's NixlConnector does. A preempted one recomputes it all.
//!
//! After the forward pass, a sequence whose tokens are all computed samples one token; after
//! `max_tokens` tokens it finishes and frees its blocks (they stay cached until evicted).

use std::collections::{HashMap, VecDeque};

use fnv::FnvHashMap;
use std::sync::Arc;
use std::time::Duration;

use super::kv_cache::{KvCache, SeqBlocks};
use super::output::OutputVocab;
use super::profile::{BatchItem, Profile, ProfileError};
use super::tokenizer::generated_token;
use super::types::{
    EngineRequest, EngineStats, Output, OutputKind, ResetError, Step, SubmitError, Usage,
};
use super::KvEvent;

#[derive(Debug, Clone)]
struct Seq {
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: u32,
    generated: u32,
    /// Tokens whose KV is in the cache for this sequence.
    num_computed: usize,
    blocks: SeqBlocks,
    cached_tokens: u32,
    arrival: Duration,
    /// Start of the step that first scheduled it (kept through preemptions, as vLLM's
    /// `scheduled_ts`).
    first_scheduled: Option<Duration>,
    /// What it generates; `None`: the stand-in tokenizer's words.
    output: Option<Arc<OutputVocab>>,
    /// Its prompt's KV came from a prefill engine (until its first admission).
    transferred: bool,
}

/// A simulated vLLM engine. Deterministic: the same calls give the same results.
#[derive(Debug, Clone)]
pub struct Engine {
    profile: Profile,
    max_model_len: u64,
    cache: KvCache,
    seqs: FnvHashMap<u64, Seq>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    external_prefix_cache_queries: u64,
    external_prefix_cache_hits: u64,
    preemptions: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Engine {
    /// An idle engine with an empty cache. Fails when a profile field is out of range.
    pub fn new(profile: &Profile) -> Result<Engine, ProfileError> {
        profile.validate()?;
        Ok(Engine {
            max_model_len: u64::from(profile.max_model_len).min(profile.capacity_tokens()),
            cache: KvCache::new(
                profile.num_gpu_blocks,
                profile.block_size,
                profile.cpu_offload_blocks,
            ),
            profile: profile.clone(),
            seqs: FnvHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            external_prefix_cache_queries: 0,
            external_prefix_cache_hits: 0,
            preemptions: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
        })
    }

    /// The profile the engine runs.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The longest prompt + `max_tokens` accepted: `min(max_model_len, cache capacity)`.
    pub fn max_model_len(&self) -> u64 {
        self.max_model_len
    }

    /// Queues a request at simulated time `now` (used only to report TTFT and latency). It
    /// generates the stand-in tokenizer's words
    /// ([`generated_token`](super::tokenizer::generated_token)).
    pub fn submit(&mut self, request: EngineRequest, now: Duration) -> Result<(), SubmitError> {
        self.submit_inner(request, None, now, false)
    }

    /// [`Engine::submit`] for a request that generates words of `output` (a real tokenizer's,
    /// so that its output blocks hold ids of that vocabulary):
    /// [`OutputVocab::pick`]`(id, index)` is its `index`-th token.
    pub fn submit_with_output(
        &mut self,
        request: EngineRequest,
        output: Arc<OutputVocab>,
        now: Duration,
    ) -> Result<(), SubmitError> {
        self.submit_inner(request, Some(output), now, false)
    }

    /// [`Engine::submit_with_output`] for a request whose prompt another engine prefilled and
    /// whose KV blocks it received: only what those blocks do not cover (at least the last
    /// token) is computed here.
    pub fn submit_transferred(
        &mut self,
        request: EngineRequest,
        output: Option<Arc<OutputVocab>>,
        now: Duration,
    ) -> Result<(), SubmitError> {
        self.submit_inner(request, output, now, true)
    }

    fn submit_inner(
        &mut self,
        request: EngineRequest,
        output: Option<Arc<OutputVocab>>,
        now: Duration,
        transferred: bool,
    ) -> Result<(), SubmitError> {
        if request.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if request.max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        let prompt_tokens = request.prompt.len() as u64;
        let requested = prompt_tokens + u64::from(request.max_tokens);
        if requested > self.max_model_len {
            return Err(SubmitError::TooLong {
                requested,
                prompt_tokens,
                max_model_len: self.max_model_len,
            });
        }
        if self.seqs.contains_key(&request.id) {
            return Err(SubmitError::DuplicateId(request.id));
        }
        let mut tokens = request.prompt;
        tokens.reserve(request.max_tokens as usize);
        self.seqs.insert(
            request.id,
            Seq {
                prompt_len: tokens.len(),
                tokens,
                max_tokens: request.max_tokens,
                generated: 0,
                num_computed: 0,
                blocks: SeqBlocks::default(),
                cached_tokens: 0,
                arrival: now,
                first_scheduled: None,
                output,
                transferred,
            },
        );
        self.waiting.push_back(request.id);
        Ok(())
    }

    /// Drops a request wherever it is, freeing its blocks (no output, no event: freed blocks stay
    /// cached). False when the id is unknown.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(mut seq) = self.seqs.remove(&id) else {
            return false;
        };
        self.cache.free(&mut seq.blocks);
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        true
    }

    /// True while any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Drops the whole prefix cache (vLLM's `reset_prefix_cache`): only when no request runs;
    /// returns the `AllBlocksCleared` event to publish (plus any still-unpublished events).
    pub fn reset_cache(&mut self) -> Result<Vec<KvEvent>, ResetError> {
        if !self.running.is_empty() || !self.cache.reset() {
            return Err(ResetError::Busy {
                running: self.running.len(),
            });
        }
        Ok(self.cache.take_events())
    }

    /// Counters and gauges, as `/metrics` reports them.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_cache_usage: self.cache.usage(),
            num_gpu_blocks: self.profile.num_gpu_blocks,
            block_size: self.profile.block_size,
            num_cached_blocks: self.cache.num_cached_blocks(),
            prefix_cache_queries: self.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits,
            external_prefix_cache_queries: self.external_prefix_cache_queries,
            external_prefix_cache_hits: self.external_prefix_cache_hits,
            num_cpu_cached_blocks: self.cache.num_cpu_blocks(),
            preemptions: self.preemptions,
            prompt_tokens: self.prompt_tokens,
            generation_tokens: self.generation_tokens,
        }
    }

    /// The GPU hashes a subscriber replaying every published event holds.
    pub fn cached_block_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.cache.cached_block_hashes()
    }

    /// The CPU-tier hashes a subscriber replaying every published event holds (none without
    /// `cpu_offload_blocks`).
    pub fn cpu_cached_block_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.cache.cpu_block_hashes()
    }

    /// Runs one step starting at simulated time `now`; see the module doc. The caller advances
    /// its clock by the returned `duration`; an empty engine returns an empty step.
    pub fn step(&mut self, now: Duration) -> Step {
        let mut budget = self.profile.max_num_batched_tokens as usize;
        let mut batch: Vec<(u64, BatchItem)> = Vec::new();
        let mut outputs = Vec::new();
        let preempted = self.schedule_running(&mut budget, &mut batch, &mut outputs);
        let loaded_tokens = if preempted {
            0
        } else {
            self.schedule_waiting(&mut budget, &mut batch, now)
        };
        let items: Vec<BatchItem> = batch.iter().map(|(_, item)| *item).collect();
        let duration = self
            .profile
            .step_duration(&items)
            .saturating_add(self.profile.load_duration(loaded_tokens as u64));
        let end = now.saturating_add(duration);
        for (id, item) in &batch {
            self.advance(*id, item.new_tokens as usize, end, &mut outputs);
        }
        Step {
            duration,
            outputs,
            events: self.cache.take_events(),
            num_scheduled: batch.len(),
            num_batched_tokens: items.iter().map(|i| i.new_tokens as usize).sum(),
        }
    }

    /// Schedules running sequences; true when any was preempted.
    fn schedule_running(
        &mut self,
        budget: &mut usize,
        batch: &mut Vec<(u64, BatchItem)>,
        outputs: &mut Vec<Output>,
    ) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (seq.tokens.len() - seq.num_computed).min(*budget);
            if n == 0 {
                i += 1;
                continue;
            }
            if self
                .cache
                .allocate_slots(&mut seq.blocks, &seq.tokens, seq.num_computed, &[], 0, n)
            {
                batch.push((id, item(seq.num_computed, n)));
                *budget -= n;
                i += 1;
                continue;
            }
            // No free block: preempt the newest running sequence (perhaps this one) and retry.
            let Some(victim) = self.running.pop() else {
                break;
            };
            self.preempt(victim);
            outputs.push(Output {
                id: victim,
                kind: OutputKind::Preempted,
            });
            preempted = true;
        }
        preempted
    }

    fn preempt(&mut self, id: u64) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            self.cache.free(&mut seq.blocks);
            seq.num_computed = 0;
        }
        self.waiting.push_front(id);
        self.preemptions += 1;
    }

    /// Admits waiting requests in FIFO order into the step starting at `now`; returns the tokens
    /// they load from the CPU tier.
    fn schedule_waiting(
        &mut self,
        budget: &mut usize,
        batch: &mut Vec<(u64, BatchItem)>,
        now: Duration,
    ) -> usize {
        let bs = self.cache.block_size();
        let offload = self.cache.offload_enabled();
        let mut loaded_tokens = 0;
        while *budget > 0 && self.running.len() < self.profile.max_num_seqs as usize {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let hits = self.cache.computed_blocks(&mut seq.blocks, &seq.tokens);
            let hit_tokens = hits.len() * bs;
            let loaded = self
                .cache
                .loadable_blocks(&seq.blocks, &seq.tokens, hits.len());
            // The transferred blocks: the prompt's full blocks up to its last token.
            let transferred = if seq.transferred {
                ((seq.prompt_len - 1) / bs).saturating_sub(hits.len() + loaded)
            } else {
                0
            };
            let computed = hit_tokens + (loaded + transferred) * bs;
            // Never 0: the lookups stop before the last token.
            let n = (seq.tokens.len() - computed).min(*budget);
            if !self.cache.allocate_slots(
                &mut seq.blocks,
                &seq.tokens,
                0,
                &hits,
                loaded + transferred,
                n,
            ) {
                break;
            }
            // A preempted sequence lost them: it recomputes.
            seq.transferred = false;
            self.prefix_cache_queries += seq.tokens.len() as u64;
            self.prefix_cache_hits += hit_tokens as u64;
            if offload {
                // vLLM counts the connector's lookup over the whole request, as the GPU one.
                self.external_prefix_cache_queries += seq.tokens.len() as u64;
                self.external_prefix_cache_hits += (loaded * bs) as u64;
            }
            loaded_tokens += loaded * bs;
            seq.num_computed = computed;
            seq.first_scheduled.get_or_insert(now);
            if seq.generated == 0 {
                // vLLM counts tokens loaded by a connector as cached.
                seq.cached_tokens = to_u32(computed);
            }
            batch.push((id, item(computed, n)));
            *budget -= n;
            self.waiting.pop_front();
            self.running.push(id);
        }
        loaded_tokens
    }

    /// Applies a computed chunk of `n` tokens; samples when the sequence caught up.
    fn advance(&mut self, id: u64, n: usize, end: Duration, outputs: &mut Vec<Output>) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        seq.num_computed += n;
        if seq.num_computed < seq.tokens.len() {
            return; // a prefill chunk that did not reach the end
        }
        let index = seq.generated;
        let token = match &seq.output {
            Some(vocab) => vocab.pick(id, index).id,
            None => generated_token(id, index),
        };
        seq.tokens.push(token);
        seq.generated += 1;
        self.generation_tokens += 1;
        let kind = if index == 0 {
            self.prompt_tokens += seq.prompt_len as u64;
            // A step may start before `submit`'s `now` (the real-time runtime starts the step
            // at the request's HTTP arrival, before it was parsed): the queue time is then 0
            // and the prefill time still the whole steps'.
            let scheduled = seq.first_scheduled.unwrap_or(seq.arrival);
            OutputKind::FirstToken {
                token,
                cached_tokens: seq.cached_tokens,
                ttft: end.saturating_sub(seq.arrival),
                queue_time: scheduled.saturating_sub(seq.arrival),
                prefill_time: end.saturating_sub(scheduled),
            }
        } else {
            OutputKind::Token { token, index }
        };
        outputs.push(Output { id, kind });
        if seq.generated < seq.max_tokens {
            return;
        }
        let usage = Usage {
            prompt_tokens: to_u32(seq.prompt_len),
            completion_tokens: seq.generated,
            cached_tokens: seq.cached_tokens,
        };
        let latency = end.saturating_sub(seq.arrival);
        self.cache.free(&mut seq.blocks);
        self.seqs.remove(&id);
        self.running.retain(|&r| r != id);
        outputs.push(Output {
            id,
            kind: OutputKind::Finished { usage, latency },
        });
    }

    /// Checks the cache's invariants and that each block's reference count equals the number of
    /// sequences holding it (so no block is both free and referenced, no count underflows).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.cache.check()?;
        let mut refs: HashMap<u32, u32> = HashMap::new();
        for seq in self.seqs.values() {
            for &b in &seq.blocks.blocks {
                *refs.entry(b).or_default() += 1;
            }
        }
        for b in 0..to_u32(self.cache.num_blocks()) {
            let expected = refs.get(&b).copied().unwrap_or(0);
            if self.cache.ref_cnt(b) != expected {
                return Err(format!(
                    "block {b}: ref_cnt {} but held by {expected} sequences",
                    self.cache.ref_cnt(b)
                ));
            }
        }
        for id in &self.waiting {
            if self
                .seqs
                .get(id)
                .is_some_and(|s| !s.blocks.blocks.is_empty())
            {
                return Err(format!("waiting request {id} holds blocks"));
            }
        }
        if self.running.len() + self.waiting.len() != self.seqs.len() {
            return Err("a request is lost or listed twice".to_owned());
        }
        Ok(())
    }
}

fn item(context: usize, new: usize) -> BatchItem {
    BatchItem {
        context_tokens: context as u64,
        new_tokens: new as u64,
    }
}
