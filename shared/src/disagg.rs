//! Prefill/decode disaggregation: whether a request's prompt is computed on a prefill endpoint
//! and its tokens generated on a decode endpoint, in llm-d's protocol.
//!
//! The router picks the decode endpoint first (llm-d's "decode-first" order), then asks
//! [`DisaggParams::splits`]: llm-d's `prefix-based-pd-decider` (llm-d/llm-d-router at
//! ebab687, `pkg/epp/framework/plugins/scheduling/profilehandler/disagg/
//! prefix_based_pd_decider.go`) splits only when the prompt tokens the decode endpoint does
//! not hold reach `nonCachedTokens` (0 disables it) and the prompt reaches `promptTokens` when
//! that is set. A split request goes to the decode endpoint with the prefill endpoint named in
//! [`crate::protocol::PREFILLER_HEADER`]; the decode side's sidecar (llm-d's routing proxy)
//! asks that endpoint to prefill and pulls the KV blocks.

use serde::Deserialize;

use crate::config::{within, OutOfRange};

/// The largest token threshold accepted (a prompt longer than any model's context).
pub const MAX_THRESHOLD_TOKENS: i64 = 1 << 24;

/// When and how requests are split (`disaggregation` in the filter configuration).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggParams {
    /// Split only when the chosen decode endpoint would compute at least this many prompt
    /// tokens itself (llm-d's `nonCachedTokens`); 0 never splits.
    pub non_cached_tokens: u32,
    /// ... and the prompt has at least this many tokens (llm-d's `promptTokens`; 0: any).
    pub prompt_tokens: u32,
    /// How much more the prefill choice weighs a prompt token it would compute than the cost
    /// model's weight: a prefill endpoint does nothing but prefill, so a prefix computed on a
    /// second one is capacity every later request waits for. At 1 a group of requests sharing
    /// a prefix, arriving while the first one's prefill is queued, spread over the prefill
    /// endpoints (hit rate 34% of an ideal 83% in the fleet simulation); at 2 it stays
    /// (bench/README.md, "Prefill/decode disaggregation").
    pub prefill_uncached_weight: f64,
    /// KV-cache tokens per second a decode endpoint receives from a prefill endpoint: a split
    /// request's decode endpoint is chosen by the transfer of the blocks it lacks and its
    /// decode load ([`crate::prefix_affinity::cost::decode_terms`]), not by a prefill it does
    /// not run.
    pub kv_transfer_tokens_per_s: f64,
}

impl Default for DisaggParams {
    fn default() -> Self {
        DisaggParams {
            // llm-d's sample configurations (deploy/config/pd-epp-config.yaml).
            non_cached_tokens: 16,
            prompt_tokens: 0,
            prefill_uncached_weight: 2.0,
            // NIXL over RDMA at about 25 GB/s, 128 KiB of KV per token (an 8B model): what
            // kvoy-sim's `--kv-transfer-tokens-per-s` defaults to.
            kv_transfer_tokens_per_s: 200_000.0,
        }
    }
}

impl DisaggParams {
    /// Whether a request of `prompt_tokens` whose chosen decode endpoint would compute
    /// `uncached_at_decode` of them is split. A prompt below either threshold never is.
    pub fn splits(&self, prompt_tokens: f64, uncached_at_decode: f64) -> bool {
        self.non_cached_tokens > 0
            && prompt_tokens >= f64::from(self.prompt_tokens)
            && uncached_at_decode >= f64::from(self.non_cached_tokens)
    }
}

/// `disaggregation` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawDisagg {
    #[serde(default)]
    non_cached_tokens: Option<i64>,
    #[serde(default)]
    prompt_tokens: Option<i64>,
    #[serde(default)]
    prefill_uncached_weight: Option<f64>,
    #[serde(default)]
    kv_transfer_tokens_per_s: Option<f64>,
}

impl TryFrom<RawDisagg> for DisaggParams {
    type Error = OutOfRange;

    fn try_from(raw: RawDisagg) -> Result<Self, OutOfRange> {
        let d = DisaggParams::default();
        let tokens = |field, v: Option<i64>, default: u32| -> Result<u32, OutOfRange> {
            match v {
                None => Ok(default),
                Some(v) => within(field, 0..=MAX_THRESHOLD_TOKENS, v).map(|v| v as u32),
            }
        };
        let prefill_uncached_weight = match raw.prefill_uncached_weight {
            None => d.prefill_uncached_weight,
            Some(v) => within("disaggregation.prefill_uncached_weight", 1.0..=100.0, v)?,
        };
        let kv_transfer_tokens_per_s = match raw.kv_transfer_tokens_per_s {
            None => d.kv_transfer_tokens_per_s,
            Some(v) => within("disaggregation.kv_transfer_tokens_per_s", 1.0..=1e10, v)?,
        };
        Ok(DisaggParams {
            non_cached_tokens: tokens(
                "disaggregation.non_cached_tokens",
                raw.non_cached_tokens,
                d.non_cached_tokens,
            )?,
            prompt_tokens: tokens(
                "disaggregation.prompt_tokens",
                raw.prompt_tokens,
                d.prompt_tokens,
            )?,
            prefill_uncached_weight,
            kv_transfer_tokens_per_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<DisaggParams, String> {
        let raw: RawDisagg = serde_json::from_str(json).map_err(|e| e.to_string())?;
        DisaggParams::try_from(raw).map_err(|e| e.to_string())
    }

    #[test]
    fn a_prompt_below_a_threshold_is_never_split() {
        let p = DisaggParams {
            non_cached_tokens: 16,
            prompt_tokens: 100,
            ..DisaggParams::default()
        };
        assert!(p.splits(100.0, 16.0));
        assert!(
            !p.splits(100.0, 15.9),
            "too few tokens to compute at decode"
        );
        assert!(!p.splits(99.0, 99.0), "prompt too short");
        // Any prompt, any split, never with 0.
        let off = DisaggParams {
            non_cached_tokens: 0,
            prompt_tokens: 0,
            ..p
        };
        assert!(!off.splits(1e6, 1e6));
        for prompt in 0..200 {
            for uncached in 0..=prompt {
                let (prompt, uncached) = (f64::from(prompt), f64::from(uncached));
                if p.splits(prompt, uncached) {
                    assert!(prompt >= 100.0 && uncached >= 16.0);
                }
            }
        }
    }

    #[test]
    fn thresholds_are_validated_and_named() {
        assert_eq!(parse("{}"), Ok(DisaggParams::default()));
        assert_eq!(
            parse(r#"{"non_cached_tokens":0,"prompt_tokens":2048}"#)
                .map(|p| (p.non_cached_tokens, p.prompt_tokens)),
            Ok((0, 2048))
        );
        let e = parse(r#"{"non_cached_tokens":-1}"#).unwrap_err();
        assert!(e.contains("`disaggregation.non_cached_tokens`"), "{e}");
        let e = parse(r#"{"prompt_tokens":99999999999}"#).unwrap_err();
        assert!(e.contains("`disaggregation.prompt_tokens`"), "{e}");
        let e = parse(r#"{"prefill_uncached_weight":0.5}"#).unwrap_err();
        assert!(
            e.contains("`disaggregation.prefill_uncached_weight`"),
            "{e}"
        );
        assert_eq!(
            parse(r#"{"prefill_uncached_weight":3}"#).map(|p| p.prefill_uncached_weight),
            Ok(3.0)
        );
        let e = parse(r#"{"kv_transfer_tokens_per_s":0}"#).unwrap_err();
        assert!(
            e.contains("`disaggregation.kv_transfer_tokens_per_s`"),
            "{e}"
        );
        assert_eq!(
            parse(r#"{"kv_transfer_tokens_per_s":50000}"#).map(|p| p.kv_transfer_tokens_per_s),
            Ok(50_000.0)
        );
        let e = parse(r#"{"noncached":1}"#).unwrap_err();
        assert!(e.contains("noncached"), "{e}");
    }
}
