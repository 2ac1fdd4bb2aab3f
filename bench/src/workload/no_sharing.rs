//! The control: every prompt is unique random text, so no routing can find a cache hit, and
//! prefix-aware routing must do no harm.

use super::text::{seed_of, Part};
use super::{poisson_arrivals, Count, Plan, Session};
use kvoy_shared::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct NoSharing {
    pub count: Count,
    /// Prompt tokens, uniform in this range.
    pub prompt_tokens: (u32, u32),
    /// Output tokens, uniform in this range.
    pub output_tokens: (u32, u32),
}

impl NoSharing {
    pub fn new(count: Count) -> Self {
        NoSharing {
            count,
            prompt_tokens: (500, 3000),
            output_tokens: (100, 400),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "unique random prompts of {}-{} tokens, {}-{} output tokens, Poisson arrivals, {}",
            self.prompt_tokens.0,
            self.prompt_tokens.1,
            self.output_tokens.0,
            self.output_tokens.1,
            self.count.describe()
        )
    }

    pub fn plan(&self, rate: f64, seed: u64) -> Plan {
        let mut lengths = Rng::derive(seed, "no-sharing/lengths", 0);
        let mut arrivals = Rng::derive(seed, "no-sharing/arrivals", rate.to_bits());
        let times = poisson_arrivals(&mut arrivals, rate, self.count.requests(rate));
        let sessions = times
            .into_iter()
            .enumerate()
            .map(|(i, start)| {
                Session::single(
                    start,
                    "single",
                    vec![Part::Text {
                        seed: seed_of("ns/prompt", seed, i as u64),
                        tokens: lengths.range(self.prompt_tokens.0, self.prompt_tokens.1),
                    }],
                    lengths.range(self.output_tokens.0, self.output_tokens.1),
                )
            })
            .collect();
        Plan::finish(sessions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_prompts_in_range() {
        let plan = NoSharing::new(Count::Fixed(200)).plan(5.0, 3);
        assert_eq!(plan.requests(), 200);
        let mut seeds = std::collections::HashSet::new();
        for s in &plan.sessions {
            let t = &s.turns[0];
            let Part::Text { seed, tokens } = t.append[0] else {
                panic!("text");
            };
            assert!(seeds.insert(seed));
            assert!((500..=3000).contains(&tokens));
            assert!((100..=400).contains(&t.max_tokens));
        }
    }
}
