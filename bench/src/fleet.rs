//! The fleet's make-up in the simulation: which engine profile each replica runs (the live
//! benchmark's running simulators are [`crate::live::Fleet`]).
//!
//! - [`FleetKind::Uniform`]: every replica runs the base profile.
//! - [`FleetKind::HalfSlow`]: the odd-indexed replicas (1, 3, 5, ...) run the base profile slowed
//!   down by `slow_factor` ([`slowed`]: every duration of the step-time model multiplied, the
//!   KV geometry and scheduler limits unchanged), the even ones the base profile. Interleaved
//!   rather than the upper half, so that a policy breaking ties by the lowest index favours
//!   neither kind. With an odd replica count the fast ones are one more than the slow ones.
//!
//! ```
//! use kvoy_bench::fleet::FleetKind;
//! use kvoy_sim_engine::Profile;
//!
//! let fleet = FleetKind::HalfSlow { slow_factor: 2.0 };
//! assert_eq!(fleet.slowdowns(4), [1.0, 2.0, 1.0, 2.0]);
//! let profiles = fleet.profiles(&Profile::llama_8b_h100(), 4);
//! assert_eq!(profiles[1].prefill_tokens_per_s, 12_500.0);
//! assert_eq!(profiles[1].num_gpu_blocks, profiles[0].num_gpu_blocks);
//! ```

use serde::{Deserialize, Serialize};

use kvoy_sim_engine::Profile;

/// Which replicas run slower than the base profile (in `results.json`:
/// `{"kind": "uniform"}` or `{"kind": "half-slow", "slow_factor": 2.0}`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum FleetKind {
    /// Every replica runs the base profile.
    #[default]
    Uniform,
    /// The odd-indexed replicas take `slow_factor` times as long for every step.
    HalfSlow { slow_factor: f64 },
}

impl FleetKind {
    /// Names accepted by `--fleet`.
    pub const NAMES: [&'static str; 2] = ["uniform", "half-slow"];

    /// The slow factor of `--fleet half-slow` unless `--slow-factor` says otherwise.
    pub const DEFAULT_SLOW_FACTOR: f64 = 2.0;

    /// The fleet named `name` (`half-slow` with `slow_factor`).
    pub fn by_name(name: &str, slow_factor: f64) -> Option<FleetKind> {
        match name {
            "uniform" => Some(FleetKind::Uniform),
            "half-slow" => Some(FleetKind::HalfSlow { slow_factor }),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FleetKind::Uniform => "uniform",
            FleetKind::HalfSlow { .. } => "half-slow",
        }
    }

    /// Replica `i`'s time multiplier: 1 for a replica running the base profile.
    pub fn slowdown(self, i: usize) -> f64 {
        match self {
            FleetKind::HalfSlow { slow_factor } if i % 2 == 1 => slow_factor,
            _ => 1.0,
        }
    }

    /// Every replica's time multiplier, by endpoint index.
    pub fn slowdowns(self, replicas: usize) -> Vec<f64> {
        (0..replicas).map(|i| self.slowdown(i)).collect()
    }

    /// Every replica's profile, by endpoint index.
    pub fn profiles(self, base: &Profile, replicas: usize) -> Vec<Profile> {
        (0..replicas)
            .map(|i| slowed(base, self.slowdown(i)))
            .collect()
    }

    /// One line for the report: what runs where.
    pub fn describe(self, replicas: usize) -> String {
        match self {
            FleetKind::Uniform => "uniform fleet (every replica runs the profile)".to_owned(),
            FleetKind::HalfSlow { slow_factor } => format!(
                "half-slow fleet: the {} odd-indexed replicas (1, 3, 5, ...) run the profile \
                 {slow_factor}x slower (every step-time duration x{slow_factor}, same KV \
                 geometry)",
                replicas / 2
            ),
        }
    }
}

/// `profile` with every duration of its step-time model multiplied by `factor`: prefill
/// throughput divided, step costs and attention cost multiplied; cache geometry and scheduler
/// limits unchanged. `factor` 1 returns the profile as it is (same name); otherwise the name
/// gains `-slow{factor}x`.
pub fn slowed(profile: &Profile, factor: f64) -> Profile {
    if factor == 1.0 {
        return profile.clone();
    }
    Profile {
        name: format!("{}-slow{factor}x", profile.name),
        prefill_tokens_per_s: profile.prefill_tokens_per_s / factor,
        prefill_attention_s_per_token_pair: profile.prefill_attention_s_per_token_pair * factor,
        step_base_s: profile.step_base_s * factor,
        step_per_seq_s: profile.step_per_seq_s * factor,
        step_per_context_token_s: profile.step_per_context_token_s * factor,
        ..profile.clone()
    }
}

#[cfg(test)]
mod tests {
    use kvoy_sim_engine::BatchItem;

    use super::*;

    #[test]
    fn slow_replicas_are_the_odd_ones() {
        assert_eq!(FleetKind::Uniform.slowdowns(3), [1.0; 3]);
        let f = FleetKind::HalfSlow { slow_factor: 3.0 };
        assert_eq!(f.slowdowns(5), [1.0, 3.0, 1.0, 3.0, 1.0]);
        let base = Profile::llama_8b_h100();
        let p = f.profiles(&base, 2);
        assert_eq!(p[0], base);
        assert_eq!(p[1].name, "llama-8b-h100-slow3x");
        for name in FleetKind::NAMES {
            assert_eq!(
                FleetKind::by_name(name, 2.0).map(FleetKind::name),
                Some(name)
            );
        }
        assert_eq!(FleetKind::by_name("mixed", 2.0), None);
    }

    #[test]
    fn a_slowed_profile_takes_factor_times_as_long_for_every_step() {
        let base = Profile::llama_8b_h100();
        let slow = slowed(&base, 2.0);
        slow.validate().unwrap();
        assert_eq!(slow.capacity_tokens(), base.capacity_tokens());
        assert_eq!(
            (slow.max_num_seqs, slow.max_num_batched_tokens),
            (base.max_num_seqs, base.max_num_batched_tokens)
        );
        let batches = [
            vec![BatchItem {
                context_tokens: 1000,
                new_tokens: 1,
            }],
            vec![
                BatchItem {
                    context_tokens: 0,
                    new_tokens: 8192,
                };
                1
            ],
            vec![
                BatchItem {
                    context_tokens: 4000,
                    new_tokens: 1,
                },
                BatchItem {
                    context_tokens: 2048,
                    new_tokens: 512,
                },
            ],
        ];
        for b in &batches {
            let (f, s) = (base.step_duration(b), slow.step_duration(b));
            let ratio = s.as_secs_f64() / f.as_secs_f64();
            assert!((ratio - 2.0).abs() < 1e-6, "{ratio} for {b:?}");
        }
    }

    #[test]
    fn the_fleet_reads_back_from_json() {
        for f in [FleetKind::Uniform, FleetKind::HalfSlow { slow_factor: 2.0 }] {
            let json = serde_json::to_string(&f).unwrap();
            assert_eq!(serde_json::from_str::<FleetKind>(&json).unwrap(), f);
        }
        assert_eq!(
            serde_json::to_string(&FleetKind::HalfSlow { slow_factor: 2.0 }).unwrap(),
            r#"{"kind":"half-slow","slow_factor":2.0}"#
        );
    }
}
