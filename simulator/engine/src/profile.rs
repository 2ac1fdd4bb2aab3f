//! Server profiles: cache geometry, scheduler limits and the step-time model.
//!
//! # Step-time model
//! One engine step runs one forward pass over a batch of sequences. For each scheduled sequence
//! with `c` tokens already in its KV cache and `n` tokens computed in this step:
//! ```text
//! step = step_base_s
//!      + Σ step_per_seq_s                                          (every sequence)
//!      + Σ_decode  step_per_context_token_s · c                    (n == 1: a decode)
//!      + Σ_prefill n / prefill_tokens_per_s
//!                  + prefill_attention_s_per_token_pair · n · (c + n/2)   (n > 1: a prefill chunk)
//! ```
//! `base + per_seq` is a batch-1 decode (weights read once per step); the per-context term is the
//! KV read of decode attention; the prefill terms are the linear layers (throughput
//! `prefill_tokens_per_s`) plus attention, which grows with the context each new token attends
//! to. Cached tokens cost nothing but their attention reads, so prefill costs time only for
//! uncached tokens. A sequence scheduled for exactly one token is costed as a decode.
//!
//! # Calibration (published figures, see issue 3)
//! `llama-8b-h100` (Llama-3.1-8B, one H100): ~25k prefill tok/s, ~7 ms per decode step at batch
//! 1, 25,600 blocks of 16 = 409,600 tokens of KV. Attention per token pair = 4·layers·hidden
//! FLOPs (4·32·4096) at the FLOP rate implied by 25k tok/s of 2·8e9 FLOPs = 1.3e-9 s. Model:
//! - batch-1 decode at 1k context: 6.9 + 0.06 + 0.04 = 7.0 ms;
//! - 8,192-token prompt cold (one step, budget 8,192): 6.96 + 327.7 + 43.6 = 378 ms;
//! - the same prompt warm: 8,176 tokens hit (whole blocks, the last token is always recomputed),
//!   16 computed: 6.96 + 0.64 + 0.17 = 7.8 ms; cold/warm ≈ 49.
//!
//! `qwen-32b-h100-tp2` (Qwen2.5-32B, two H100s, tensor parallel): ~13k prefill tok/s, 11-14 ms
//! per decode step at light load rising to ~60 ms with ~110 running sequences of 7.6k context,
//! 19,200 blocks = 307,200 tokens. Attention per pair = 4·64·5120 FLOPs at the rate implied by
//! 13k tok/s of 2·32.5e9 FLOPs = 1.55e-9 s. Model:
//! - batch-1 decode at 1k context: 10.9 + 0.14 + 0.04 = 11.1 ms; 8 sequences of 4k: 13.3 ms;
//! - 110 sequences of 7.6k context: 10.9 + 15.4 + 33.4 = 59.7 ms;
//! - 10k-token prompt in isolation: cold 869 ms (chunks of 8,192 + 1,808), warm 12.5 ms.
//!
//! The published "10k tokens: 4.3 s cold vs 0.6 s warm" was measured on a loaded server: both
//! include queueing behind other requests and sharing steps with ~100 decoding sequences (whose
//! ~60 ms steps the prefill chunks ride on). The model reproduces the isolated physics (prefill
//! throughput, attention growth with context, decode cost growing with batch and context) and
//! lets queueing and batching come out of the scheduler, instead of baking a loaded-server
//! latency into the profile: under load both TTFTs grow by the queueing and step sharing the
//! scheduler produces, and the cold/warm ratio shrinks from the isolated ~70 towards the
//! published ~7 (not calibrated: the published load is not specified precisely enough).

use std::time::Duration;

/// A server profile. Every field is public so command-line flags can override each one; check
/// the result with [`Profile::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Profile name, e.g. `llama-8b-h100`.
    pub name: String,
    /// Tokens per KV block (vLLM: 16).
    pub block_size: u32,
    /// KV blocks on the GPU (`vllm:cache_config_info{num_gpu_blocks}`).
    pub num_gpu_blocks: u32,
    /// Most sequences running at once (vLLM `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Token budget per step (vLLM `--max-num-batched-tokens`); longer prompts prefill in chunks.
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output accepted (vLLM `--max-model-len`); the engine also caps it at the
    /// cache capacity `num_gpu_blocks · block_size`.
    pub max_model_len: u32,
    /// Prefill throughput of the linear layers, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Prefill attention cost per (new token, attended token) pair, seconds.
    pub prefill_attention_s_per_token_pair: f64,
    /// Fixed cost of one step, seconds.
    pub step_base_s: f64,
    /// Cost per scheduled sequence, seconds.
    pub step_per_seq_s: f64,
    /// Decode cost per context token of each decoding sequence (KV read), seconds.
    pub step_per_context_token_s: f64,
    /// Blocks of the CPU offload tier (vLLM's `--kv-offloading-size`, in blocks); 0: no tier.
    pub cpu_offload_blocks: u32,
    /// How fast a prefix found on the CPU tier loads back into GPU memory, tokens per second.
    pub offload_load_tokens_per_s: f64,
}

/// CPU→GPU load rate of both built-in profiles: ~25 GB/s of PCIe 5 host-to-device copy over
/// 128 KiB of KV per token (Llama-3.1-8B: 32 layers · 8 KV heads · 128 dims · 2 (K, V) · 2 bytes)
/// = 25e9 / 131,072 ≈ 190,000 tokens/s, rounded to 200,000. Qwen2.5-32B has 256 KiB per token
/// (64 layers) but its two GPUs load their halves over two links, so the rate is about the same.
const OFFLOAD_LOAD_TOKENS_PER_S: f64 = 200_000.0;

/// The cost of one sequence in a step, for [`Profile::step_duration`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchItem {
    /// Tokens already in the KV cache before this step (cached or computed earlier).
    pub context_tokens: u64,
    /// Tokens computed in this step.
    pub new_tokens: u64,
}

/// A profile field out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid profile field `{field}`: {reason}")]
pub struct ProfileError {
    /// The field name.
    pub field: &'static str,
    /// What is allowed.
    pub reason: &'static str,
}

impl Profile {
    /// Names accepted by [`Profile::by_name`].
    pub const NAMES: [&'static str; 2] = ["llama-8b-h100", "qwen-32b-h100-tp2"];

    /// A built-in profile by name.
    pub fn by_name(name: &str) -> Option<Profile> {
        match name {
            "llama-8b-h100" => Some(Self::llama_8b_h100()),
            "qwen-32b-h100-tp2" => Some(Self::qwen_32b_h100_tp2()),
            _ => None,
        }
    }

    /// Llama-3.1-8B on one H100 (see the module doc for the calibration).
    pub fn llama_8b_h100() -> Profile {
        Profile {
            name: "llama-8b-h100".to_owned(),
            block_size: 16,
            num_gpu_blocks: 25_600,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 131_072,
            prefill_tokens_per_s: 25_000.0,
            prefill_attention_s_per_token_pair: 1.3e-9,
            step_base_s: 6.9e-3,
            step_per_seq_s: 6.0e-5,
            step_per_context_token_s: 4.0e-8,
            cpu_offload_blocks: 0,
            offload_load_tokens_per_s: OFFLOAD_LOAD_TOKENS_PER_S,
        }
    }

    /// Qwen2.5-32B on two H100s with tensor parallelism 2 (see the module doc).
    pub fn qwen_32b_h100_tp2() -> Profile {
        Profile {
            name: "qwen-32b-h100-tp2".to_owned(),
            block_size: 16,
            num_gpu_blocks: 19_200,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32_768,
            prefill_tokens_per_s: 13_000.0,
            prefill_attention_s_per_token_pair: 1.55e-9,
            step_base_s: 10.9e-3,
            step_per_seq_s: 1.4e-4,
            step_per_context_token_s: 4.0e-8,
            cpu_offload_blocks: 0,
            offload_load_tokens_per_s: OFFLOAD_LOAD_TOKENS_PER_S,
        }
    }

    /// Checks every field: counts must be positive, rates positive and finite, costs finite and
    /// not negative.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let positive = [
            ("block_size", self.block_size),
            ("num_gpu_blocks", self.num_gpu_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ProfileError {
                    field,
                    reason: "must be at least 1",
                });
            }
        }
        let rates = [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("offload_load_tokens_per_s", self.offload_load_tokens_per_s),
        ];
        for (field, value) in rates {
            if !(value.is_finite() && value > 0.0) {
                return Err(ProfileError {
                    field,
                    reason: "must be a finite number above 0",
                });
            }
        }
        let costs = [
            (
                "prefill_attention_s_per_token_pair",
                self.prefill_attention_s_per_token_pair,
            ),
            ("step_base_s", self.step_base_s),
            ("step_per_seq_s", self.step_per_seq_s),
            ("step_per_context_token_s", self.step_per_context_token_s),
        ];
        for (field, value) in costs {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ProfileError {
                    field,
                    reason: "must be a finite number of seconds, at least 0",
                });
            }
        }
        Ok(())
    }

    /// The time to load `tokens` from the CPU offload tier into GPU memory; saturates.
    pub fn load_duration(&self, tokens: u64) -> Duration {
        if tokens == 0 {
            return Duration::ZERO;
        }
        let secs = tokens as f64 / self.offload_load_tokens_per_s;
        Duration::try_from_secs_f64(secs).unwrap_or(if secs > 0.0 {
            Duration::MAX
        } else {
            Duration::ZERO
        })
    }

    /// Cache capacity in tokens.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.num_gpu_blocks) * u64::from(self.block_size)
    }

    /// The simulated duration of one step over `batch` (see the module doc); zero for an empty
    /// batch. Saturates at [`Duration::MAX`] instead of panicking on absurd inputs.
    pub fn step_duration(&self, batch: &[BatchItem]) -> Duration {
        if batch.is_empty() {
            return Duration::ZERO;
        }
        let mut secs = self.step_base_s;
        for item in batch {
            let c = item.context_tokens as f64;
            let n = item.new_tokens as f64;
            secs += self.step_per_seq_s;
            if item.new_tokens <= 1 {
                secs += self.step_per_context_token_s * c;
            } else {
                secs += n / self.prefill_tokens_per_s
                    + self.prefill_attention_s_per_token_pair * n * (c + n / 2.0);
            }
        }
        Duration::try_from_secs_f64(secs).unwrap_or(if secs > 0.0 {
            Duration::MAX
        } else {
            Duration::ZERO
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    fn decode(n: usize, ctx: u64) -> Vec<BatchItem> {
        vec![
            BatchItem {
                context_tokens: ctx,
                new_tokens: 1
            };
            n
        ]
    }

    #[test]
    fn llama_decode_batch_one_is_about_7ms() {
        let p = Profile::llama_8b_h100();
        let t = ms(p.step_duration(&decode(1, 1000)));
        assert!((t - 7.0).abs() < 7.0 * 0.2, "{t}");
    }

    #[test]
    fn qwen_decode_light_and_heavy_load() {
        let p = Profile::qwen_32b_h100_tp2();
        let light = ms(p.step_duration(&decode(1, 1000)));
        assert!((11.0..=14.0).contains(&light), "{light}");
        let eight = ms(p.step_duration(&decode(8, 4000)));
        assert!((11.0..=14.0).contains(&eight), "{eight}");
        let heavy = ms(p.step_duration(&decode(110, 7600)));
        assert!((heavy - 60.0).abs() < 60.0 * 0.1, "{heavy}");
    }

    #[test]
    fn llama_prefill_rate_is_about_25k_tokens_per_second() {
        let p = Profile::llama_8b_h100();
        let one_k = p.step_duration(&[BatchItem {
            context_tokens: 0,
            new_tokens: 1024,
        }]);
        let rate = 1024.0 / one_k.as_secs_f64();
        assert!((rate - 25_000.0).abs() < 25_000.0 * 0.2, "{rate}");
    }

    #[test]
    fn built_in_profiles_validate_and_geometry_matches() {
        for name in Profile::NAMES {
            let p = Profile::by_name(name).unwrap();
            assert_eq!(p.name, name);
            p.validate().unwrap();
            assert_eq!(p.cpu_offload_blocks, 0, "offload is off unless asked");
        }
        assert_eq!(Profile::llama_8b_h100().capacity_tokens(), 409_600);
        assert_eq!(Profile::qwen_32b_h100_tp2().capacity_tokens(), 307_200);
        assert!(Profile::by_name("nope").is_none());
    }

    #[test]
    fn invalid_fields_are_named() {
        let mut p = Profile::llama_8b_h100();
        p.block_size = 0;
        assert_eq!(p.validate().unwrap_err().field, "block_size");
        let mut p = Profile::llama_8b_h100();
        p.prefill_tokens_per_s = f64::NAN;
        assert_eq!(p.validate().unwrap_err().field, "prefill_tokens_per_s");
        let mut p = Profile::llama_8b_h100();
        p.step_base_s = -1.0;
        assert_eq!(p.validate().unwrap_err().field, "step_base_s");
        let mut p = Profile::llama_8b_h100();
        p.offload_load_tokens_per_s = 0.0;
        assert_eq!(p.validate().unwrap_err().field, "offload_load_tokens_per_s");
    }

    #[test]
    fn absurd_batches_saturate() {
        let p = Profile::llama_8b_h100();
        assert_eq!(p.step_duration(&[]), Duration::ZERO);
        let huge = [BatchItem {
            context_tokens: u64::MAX,
            new_tokens: u64::MAX,
        }];
        assert_eq!(p.step_duration(&huge), Duration::MAX);
    }
}
