//! llm-d's shared-prefix benchmark: groups of prompts sharing a long system prompt.
//!
//! Published shape (llm-d's prefix-cache benchmarks, inference-perf's `shared_prefix` data):
//! 150 groups x 5 prompts, a 6,000-token system prompt per group, a 1,200-token question,
//! 1,000 output tokens. As inference-perf does, the pool of 750 prompts is sent in pool order
//! (group by group) and cycled for the length of the load stage, with Poisson arrivals; a
//! prompt sent again is a full-prompt repeat. `scale` multiplies every length (quick runs).

use super::text::{seed_of, Part};
use super::{poisson_arrivals, Count, Plan, Session};
use kvoy_shared::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SharedPrefix {
    pub groups: u32,
    pub per_group: u32,
    pub system_tokens: u32,
    pub question_tokens: u32,
    pub output_tokens: u32,
    pub count: Count,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        SharedPrefix {
            groups: 150,
            per_group: 5,
            system_tokens: 6000,
            question_tokens: 1200,
            output_tokens: 1000,
            count: Count::Duration(180.0),
        }
    }
}

fn scaled(n: u32, scale: f64) -> u32 {
    ((f64::from(n) * scale).round() as u32).max(1)
}

impl SharedPrefix {
    /// The published shape with every length multiplied by `scale`, sending `count` requests.
    pub fn new(scale: f64, count: Count) -> Self {
        let d = SharedPrefix::default();
        SharedPrefix {
            system_tokens: scaled(d.system_tokens, scale),
            question_tokens: scaled(d.question_tokens, scale),
            output_tokens: scaled(d.output_tokens, scale),
            count,
            ..d
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} groups x {} prompts, {}-token system prompt per group, {}-token question, \
             {} output tokens; the pool cycled in order, Poisson arrivals, {}",
            self.groups,
            self.per_group,
            self.system_tokens,
            self.question_tokens,
            self.output_tokens,
            self.count.describe()
        )
    }

    pub fn plan(&self, rate: f64, seed: u64) -> Plan {
        let pool = (self.groups * self.per_group).max(1) as usize;
        let per_group = self.per_group.max(1) as usize;
        let mut arrivals = Rng::derive(seed, "shared-prefix/arrivals", rate.to_bits());
        let times = poisson_arrivals(&mut arrivals, rate, self.count.requests(rate));
        let sessions = times
            .into_iter()
            .enumerate()
            .map(|(k, start)| {
                let slot = k % pool;
                ((slot / per_group) as u32, (slot % per_group) as u32, start)
            })
            .map(|(g, p, start)| {
                Session::single(
                    start,
                    "shared-prefix",
                    vec![
                        Part::Text {
                            seed: seed_of("sp/system", seed, u64::from(g)),
                            tokens: self.system_tokens,
                        },
                        Part::Text {
                            seed: seed_of("sp/question", seed, u64::from(g) << 32 | u64::from(p)),
                            tokens: self.question_tokens,
                        },
                    ],
                    self.output_tokens,
                )
            })
            .collect();
        Plan::finish(sessions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn published_shape() {
        let w = SharedPrefix {
            count: Count::Fixed(750),
            ..SharedPrefix::default()
        };
        let plan = w.plan(10.0, 1);
        assert_eq!(plan.requests(), 750);
        let mut groups: HashMap<u64, u32> = HashMap::new();
        let mut questions = std::collections::HashSet::new();
        for s in &plan.sessions {
            let t = &s.turns[0];
            assert_eq!(t.max_tokens, 1000);
            assert_eq!(t.append.iter().map(Part::tokens).sum::<u32>(), 7200);
            let Part::Text { seed, tokens } = t.append[0] else {
                panic!("system part");
            };
            assert_eq!(tokens, 6000);
            *groups.entry(seed).or_default() += 1;
            assert!(
                questions.insert(t.append[1].clone()),
                "750 distinct prompts"
            );
        }
        assert_eq!(groups.len(), 150);
        assert!(groups.values().all(|&n| n == 5));
        // In pool order: the first five requests are group 0.
        let first = &plan.sessions[0].turns[0].append[0];
        assert!(plan.sessions[..5]
            .iter()
            .all(|s| &s.turns[0].append[0] == first));
        assert_ne!(&plan.sessions[5].turns[0].append[0], first);
        // Arrivals are sorted and average about 10 per second.
        let last = plan.sessions.last().unwrap().start.as_secs_f64();
        assert!((last - 75.0).abs() < 10.0, "{last}");
    }

    #[test]
    fn scale_duration_and_cycling() {
        let w = SharedPrefix::new(0.1, Count::Duration(30.0));
        assert_eq!(
            (w.system_tokens, w.question_tokens, w.output_tokens),
            (600, 120, 100)
        );
        let plan = w.plan(40.0, 2);
        assert_eq!(plan.requests(), 1200);
        // Request 750 repeats request 0's prompt.
        assert_eq!(
            plan.sessions[750].turns[0].append,
            plan.sessions[0].turns[0].append
        );
    }
}
