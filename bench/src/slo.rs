//! The TTFT SLO a run is judged by: given (`--slo-ttft`), or by default a multiple of what the
//! workload's median prompt takes on an idle engine.
//!
//! The idle TTFT is measured, not re-derived: one request of the median prompt length, nothing
//! cached, nothing else running, on a fresh [`Engine`] of the profile, stepped until its first
//! token (so chunked prefill, the step base and the attention term all count exactly as in the
//! runs).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use kvoy_sim_engine::{Engine, EngineRequest, OutputKind, Profile};

use crate::saturation::Shape;

/// The default SLO is this many times the idle TTFT of the workload's median prompt.
pub const IDLE_MULTIPLE: f64 = 5.0;

/// The SLO of one workload's runs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// A request meets the SLO when its TTFT is at most this, seconds of model time.
    pub ttft_s: f64,
    /// Set by `--slo-ttft` rather than by the default rule.
    pub from_flag: bool,
    /// The workload's median prompt (nearest rank), tokens.
    pub median_prompt_tokens: u64,
    /// That prompt's TTFT on an idle engine of the profile, seconds (0 if it could not run).
    pub idle_ttft_s: f64,
}

impl Slo {
    /// `flag` if given, else [`IDLE_MULTIPLE`] x the idle TTFT of `shape`'s median prompt on
    /// `profile`; `None` when there is no flag and the idle request cannot run (an invalid
    /// profile, or a median prompt longer than the model accepts).
    pub fn for_workload(shape: &Shape, profile: &Profile, flag: Option<f64>) -> Option<Slo> {
        let idle = idle_ttft(profile, shape.median_prompt_tokens);
        let ttft_s = match flag {
            Some(s) => s,
            None => IDLE_MULTIPLE * idle?,
        };
        Some(Slo {
            ttft_s,
            from_flag: flag.is_some(),
            median_prompt_tokens: shape.median_prompt_tokens,
            idle_ttft_s: idle.unwrap_or(0.0),
        })
    }
}

/// The TTFT, seconds, of one `prompt_tokens`-token request (one output token) on a fresh,
/// otherwise idle engine of `profile`. `None` if the profile is invalid or the engine refuses
/// the request.
pub fn idle_ttft(profile: &Profile, prompt_tokens: u64) -> Option<f64> {
    let mut engine = Engine::new(profile).ok()?;
    let tokens = u32::try_from(prompt_tokens.max(1)).ok()?;
    let request = EngineRequest {
        id: 0,
        prompt: (0..tokens).collect(),
        max_tokens: 1,
    };
    let mut now = Duration::ZERO;
    engine.submit(request, now).ok()?;
    while engine.has_work() {
        let step = engine.step(now);
        for out in &step.outputs {
            if let OutputKind::FirstToken { ttft, .. } = out.kind {
                return Some(ttft.as_secs_f64());
            }
        }
        if step.duration.is_zero() && step.outputs.is_empty() {
            return None;
        }
        now += step.duration;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step-time model by hand: prefill in chunks of the token budget, each chunk one step
    /// of base + one sequence + linear + attention against what the earlier chunks hold.
    fn by_hand(p: &Profile, tokens: u64) -> f64 {
        let (mut done, mut t) = (0u64, 0.0);
        while done < tokens {
            let n = (tokens - done).min(u64::from(p.max_num_batched_tokens)) as f64;
            let c = done as f64;
            t += p.step_base_s
                + p.step_per_seq_s
                + n / p.prefill_tokens_per_s
                + p.prefill_attention_s_per_token_pair * n * (c + n / 2.0);
            done += n as u64;
        }
        t
    }

    #[test]
    fn idle_ttft_is_the_step_time_model_of_a_cold_prefill() {
        let p = Profile::llama_8b_h100();
        // 1,000 tokens, one step: 6.9 + 0.06 + 40 + 0.65 ms.
        let one = idle_ttft(&p, 1000).unwrap();
        assert!((one - 0.04761).abs() < 1e-6, "{one}");
        assert!((one - by_hand(&p, 1000)).abs() < 1e-8);
        // 20,000 tokens: chunks of 8,192, 8,192 and 3,616.
        let three = idle_ttft(&p, 20_000).unwrap();
        assert!((three - by_hand(&p, 20_000)).abs() < 1e-8, "{three}");
        let q = Profile::qwen_32b_h100_tp2();
        assert!((idle_ttft(&q, 3000).unwrap() - by_hand(&q, 3000)).abs() < 1e-8);
    }

    #[test]
    fn the_default_is_five_idle_ttfts_of_the_median_prompt() {
        use crate::workload::{Count, NoSharing};
        let p = Profile::llama_8b_h100();
        let shape = crate::saturation::measure(&NoSharing::new(Count::Fixed(50)).plan(5.0, 1), &p);
        let slo = Slo::for_workload(&shape, &p, None).unwrap();
        assert!(shape.median_prompt_tokens > 0);
        assert!(!slo.from_flag);
        assert!((slo.idle_ttft_s - by_hand(&p, shape.median_prompt_tokens)).abs() < 1e-8);
        assert!((slo.ttft_s - 5.0 * slo.idle_ttft_s).abs() < 1e-12);
        let given = Slo::for_workload(&shape, &p, Some(2.5)).unwrap();
        assert_eq!((given.ttft_s, given.from_flag), (2.5, true));
        assert_eq!(given.idle_ttft_s, slo.idle_ttft_s);
        // Longer than the model accepts: no default, but a given SLO still holds.
        let long = Shape {
            median_prompt_tokens: 1 << 20,
            ..shape
        };
        assert_eq!(Slo::for_workload(&long, &p, None), None);
        assert_eq!(Slo::for_workload(&long, &p, Some(1.0)).unwrap().ttft_s, 1.0);
    }
}
