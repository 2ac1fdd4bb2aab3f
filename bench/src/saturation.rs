//! Saturation: the request rate a fleet sustains on a workload, estimated from the engine
//! profile's own cost model (no simulation).
//!
//! Each request of the workload's plan is costed with what one perfect cache would hit (its
//! ideal hit, see [`IdealCache`]): `n` uncached and `c` cached prompt tokens, `O` output tokens.
//! Averaged over the requests:
//! - a running request holds about `n + O` tokens of KV of its own (shared prefixes are held
//!   once), so the batch is `B = min(max_num_seqs, capacity_tokens / mean(n + O))`;
//! - a decode step of `B` sequences at the mean context `P + O/2` takes `s(B)` by the profile's
//!   [`Profile::step_duration`]; each request needs `O` such tokens, a share `O s(B) / B` of
//!   engine time;
//! - its prefill costs `n / prefill_tokens_per_s + attention * n (c + n/2)` (averaged per
//!   request, so long prompts weigh with their quadratic attention).
//!
//! Engine time per request `T = mean(O) s(B) / B + mean(prefill)`; a replica sustains `1 / T`
//! requests per second and the fleet `replicas / T`. Rates in `x` (e.g. `1x`) are multiples of
//! this. It assumes perfect reuse and a steady full batch, so real routers saturate somewhat
//! below it.
//!
//! A mixed fleet ([`fleet_capacity`]) sustains the sum of its replicas' rates. A replica slowed
//! by `f` (every duration of the step-time model times `f`, same geometry, see
//! [`crate::fleet::slowed`]) has the same batch and `f` times every term of `T`, so it sustains
//! `1 / (f T)`: the fleet `Σ 1/f_i / T`, so that `1x` means saturation on any fleet.

use serde::{Deserialize, Serialize};

use kvoy_sim_engine::{BatchItem, Profile};

use crate::ideal::IdealCache;
use crate::workload::text::render_all;
use crate::workload::Plan;

/// Mean request shape of a workload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    pub requests: usize,
    pub mean_prompt_tokens: f64,
    /// The median prompt (nearest rank), tokens (0 in reports written before it was kept).
    #[serde(default)]
    pub median_prompt_tokens: u64,
    pub mean_output_tokens: f64,
    /// Ideal hit rate with the sessions replayed one after the other.
    pub ideal_hit_rate: f64,
    /// Mean of `n + O` (uncached prompt plus output tokens).
    pub mean_footprint_tokens: f64,
    /// Mean prefill time of the uncached tokens, seconds.
    pub mean_prefill_s: f64,
    /// Prompt tokens of all requests, and what one infinite cache would hit of them.
    pub prompt_tokens: u64,
    pub ideal_hit_tokens: u64,
}

/// The shape of `plan` on `profile`, rendering every prompt once.
pub fn measure(plan: &Plan, profile: &Profile) -> Shape {
    let mut ideal = IdealCache::new(profile.block_size);
    let (mut prompt, mut output, mut footprint, mut prefill, mut n) = (0u64, 0u64, 0f64, 0f64, 0);
    let mut text = String::new();
    let mut prompts = Vec::with_capacity(plan.requests());
    for s in &plan.sessions {
        text.clear();
        for t in &s.turns {
            render_all(&t.append, &mut text);
            let hit = ideal.observe(&text, t.id, t.max_tokens) as f64;
            let tokens = text.len().div_ceil(4) as u64;
            let uncached = tokens as f64 - hit;
            prompt += tokens;
            prompts.push(tokens as f64);
            output += u64::from(t.max_tokens);
            footprint += uncached + f64::from(t.max_tokens);
            prefill += uncached / profile.prefill_tokens_per_s
                + profile.prefill_attention_s_per_token_pair * uncached * (hit + uncached / 2.0);
            n += 1;
        }
    }
    let d = n.max(1) as f64;
    prompts.sort_by(f64::total_cmp);
    Shape {
        requests: n,
        mean_prompt_tokens: prompt as f64 / d,
        median_prompt_tokens: crate::metrics::percentile(&prompts, 0.5) as u64,
        mean_output_tokens: output as f64 / d,
        ideal_hit_rate: ideal.hit_rate(),
        mean_footprint_tokens: footprint / d,
        mean_prefill_s: prefill / d,
        prompt_tokens: prompt,
        ideal_hit_tokens: ideal.totals().0,
    }
}

/// The estimate and its terms.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// Requests per second the fleet sustains.
    pub rate: f64,
    pub per_replica_rate: f64,
    /// Sequences decoding at once.
    pub batch: u32,
    /// One decode step at that batch, seconds.
    pub decode_step_s: f64,
    /// Prefill of one request's uncached tokens, seconds.
    pub prefill_s: f64,
    /// Output tokens per second the fleet sustains.
    pub output_tokens_per_s: f64,
}

/// The saturation estimate for `shape` on `replicas` engines of `profile`.
pub fn capacity(profile: &Profile, shape: &Shape, replicas: usize) -> Capacity {
    let p = shape.mean_prompt_tokens.max(1.0);
    let o = shape.mean_output_tokens.max(1.0);
    let footprint = shape.mean_footprint_tokens.max(1.0);
    let batch = ((profile.capacity_tokens() as f64 / footprint).floor() as u32)
        .clamp(1, profile.max_num_seqs.max(1));
    let item = BatchItem {
        context_tokens: (p + o / 2.0) as u64,
        new_tokens: 1,
    };
    let step = profile
        .step_duration(&vec![item; batch as usize])
        .as_secs_f64();
    let prefill = shape.mean_prefill_s.max(0.0);
    let per_request = o * step / f64::from(batch) + prefill;
    let per_replica_rate = if per_request > 0.0 {
        1.0 / per_request
    } else {
        0.0
    };
    let rate = per_replica_rate * replicas as f64;
    Capacity {
        rate,
        per_replica_rate,
        batch,
        decode_step_s: step,
        prefill_s: prefill,
        output_tokens_per_s: rate * o,
    }
}

/// The saturation estimate for `shape` on a fleet of `profile` whose replica `i` takes
/// `slowdowns[i]` times as long for every step ([`crate::fleet::FleetKind::slowdowns`]): the sum of
/// the replicas' rates. `per_replica_rate` and the step terms stay those of one replica of
/// `profile`; with every slowdown 1 this is exactly [`capacity`] on `slowdowns.len()` replicas.
pub fn fleet_capacity(profile: &Profile, shape: &Shape, slowdowns: &[f64]) -> Capacity {
    let one = capacity(profile, shape, 1);
    // Summing reciprocals of 1.0 counts the replicas exactly, so a uniform fleet's rate is
    // bit-for-bit `capacity`'s.
    let replicas: f64 = slowdowns
        .iter()
        .filter(|f| f.is_finite() && **f > 0.0)
        .map(|f| 1.0 / f)
        .sum();
    let rate = one.per_replica_rate * replicas;
    Capacity {
        rate,
        output_tokens_per_s: rate * shape.mean_output_tokens.max(1.0),
        ..one
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{slowed, FleetKind};

    #[test]
    fn shared_prefix_estimate_is_plausible() {
        use crate::workload::{Count, SharedPrefix};
        let profile = Profile::llama_8b_h100();
        let plan = SharedPrefix {
            count: Count::Fixed(750),
            ..SharedPrefix::default()
        }
        .plan(1.0, 1);
        let shape = measure(&plan, &profile);
        assert_eq!(shape.requests, 750);
        assert_eq!(shape.mean_prompt_tokens, 7200.0);
        assert!((shape.ideal_hit_rate - 2.0 / 3.0).abs() < 1e-9, "{shape:?}");
        let c = capacity(&profile, &shape, 16);
        assert_eq!(c.batch, 120);
        assert!((c.per_replica_rate - 1.85).abs() < 0.1, "{c:?}");
        assert!((c.rate - 16.0 * c.per_replica_rate).abs() < 1e-9);
        // No reuse: more prefill, a smaller batch, a lower rate.
        let cold = capacity(
            &profile,
            &Shape {
                mean_footprint_tokens: 8200.0,
                mean_prefill_s: 0.3 + 1.3e-9 * 7200.0 * 3600.0,
                ..shape
            },
            16,
        );
        assert!(cold.rate < c.rate);
    }

    #[test]
    fn a_half_slow_fleet_sums_its_replicas_capacities() {
        use crate::workload::{Agents, Count};
        let base = Profile::llama_8b_h100();
        let plan = Agents::new(Count::Fixed(300)).plan(10.0, 2);
        let shape = measure(&plan, &base);
        let uniform = capacity(&base, &shape, 16);
        assert_eq!(
            fleet_capacity(&base, &shape, &FleetKind::Uniform.slowdowns(16)),
            uniform
        );
        let fleet = FleetKind::HalfSlow { slow_factor: 2.0 };
        let mixed = fleet_capacity(&base, &shape, &fleet.slowdowns(16));
        // 8 full-speed replicas and 8 at half speed: 12 replicas' worth.
        assert!(
            (mixed.rate / uniform.rate - 0.75).abs() < 1e-12,
            "{mixed:?}"
        );
        assert_eq!(mixed.per_replica_rate, uniform.per_replica_rate);
        // The slow half really has half the capacity: the estimate costed on the slowed profile
        // itself (its own prefill times, its own step times) gives half the rate.
        let slow = slowed(&base, 2.0);
        let slow_half = capacity(&slow, &measure(&plan, &slow), 8);
        let fast_half = capacity(&base, &shape, 8);
        assert!((slow_half.rate / fast_half.rate - 0.5).abs() < 1e-6);
        assert_eq!(slow_half.batch, fast_half.batch);
        assert!((mixed.rate - (slow_half.rate + fast_half.rate)).abs() < 1e-6 * mixed.rate);
        // An odd count: 3 fast and 2 slow.
        let five = fleet_capacity(&base, &shape, &fleet.slowdowns(5));
        assert!((five.rate / uniform.per_replica_rate - 4.0).abs() < 1e-12);
    }
}
