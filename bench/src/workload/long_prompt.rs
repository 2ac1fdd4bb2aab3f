//! Long prompts, the shape prefill/decode disaggregation is for (issue 39's acceptance
//! workload): prompts around 8,000 tokens, outputs around 500, half of them sharing a prefix.
//!
//! Each request is, with probability `shared`, one of `documents` long documents
//! (`document_tokens`, drawn uniformly) followed by a question of its own, else a prompt of
//! its own throughout; every prompt's total is uniform in `prompt_tokens`, every output in
//! `output_tokens`. Open loop, Poisson arrivals. `scale` multiplies every length (quick runs).

use super::text::{seed_of, Part};
use super::{poisson_arrivals, Count, Plan, Session};
use kvoy_shared::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct LongPrompt {
    pub count: Count,
    /// Prompt tokens, uniform in this range.
    pub prompt_tokens: (u32, u32),
    /// Output tokens, uniform in this range.
    pub output_tokens: (u32, u32),
    /// The share of requests that begin with a shared document.
    pub shared: f64,
    /// Shared documents.
    pub documents: u32,
    /// A shared document's tokens (at most the prompt's).
    pub document_tokens: u32,
}

fn scaled(n: u32, scale: f64) -> u32 {
    ((f64::from(n) * scale).round() as u32).max(1)
}

impl LongPrompt {
    pub fn new(scale: f64, count: Count) -> Self {
        LongPrompt {
            count,
            prompt_tokens: (scaled(7_000, scale), scaled(9_000, scale)),
            output_tokens: (scaled(400, scale), scaled(600, scale)),
            shared: 0.5,
            documents: 32,
            document_tokens: scaled(6_000, scale),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "prompts of {}-{} tokens, {:.0}% of them opening with one of {} shared \
             {}-token documents, {}-{} output tokens, Poisson arrivals, {}",
            self.prompt_tokens.0,
            self.prompt_tokens.1,
            100.0 * self.shared,
            self.documents,
            self.document_tokens,
            self.output_tokens.0,
            self.output_tokens.1,
            self.count.describe()
        )
    }

    pub fn plan(&self, rate: f64, seed: u64) -> Plan {
        let mut draws = Rng::derive(seed, "long-prompt/draws", 0);
        let mut arrivals = Rng::derive(seed, "long-prompt/arrivals", rate.to_bits());
        let times = poisson_arrivals(&mut arrivals, rate, self.count.requests(rate));
        let documents = self.documents.max(1);
        let sessions = times
            .into_iter()
            .enumerate()
            .map(|(i, start)| {
                let total = draws.range(self.prompt_tokens.0, self.prompt_tokens.1);
                let output = draws.range(self.output_tokens.0, self.output_tokens.1);
                let own = |tokens| Part::Text {
                    seed: seed_of("lp/own", seed, i as u64),
                    tokens,
                };
                let parts = if draws.unit() < self.shared {
                    let doc = draws.below(documents as usize) as u64;
                    let document = self.document_tokens.min(total);
                    let mut parts = vec![Part::Text {
                        seed: seed_of("lp/document", seed, doc),
                        tokens: document,
                    }];
                    if total > document {
                        parts.push(own(total - document));
                    }
                    parts
                } else {
                    vec![own(total)]
                };
                Session::single(start, "long-prompt", parts, output)
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
    fn long_prompts_half_of_them_sharing_a_document() {
        let w = LongPrompt::new(1.0, Count::Fixed(1000));
        let plan = w.plan(10.0, 7);
        assert_eq!(plan.requests(), 1000);
        let mut documents: HashMap<u64, u32> = HashMap::new();
        let mut own = std::collections::HashSet::new();
        for s in &plan.sessions {
            let t = &s.turns[0];
            let total: u32 = t.append.iter().map(Part::tokens).sum();
            assert!((7_000..=9_000).contains(&total), "{total}");
            assert!((400..=600).contains(&t.max_tokens));
            match t.append.as_slice() {
                [Part::Text {
                    seed,
                    tokens: 6_000,
                }, tail] => {
                    *documents.entry(*seed).or_default() += 1;
                    assert!(own.insert(tail.clone()), "a question of its own");
                }
                [alone] => assert!(own.insert(alone.clone()), "a prompt of its own"),
                other => panic!("{other:?}"),
            }
        }
        let shared: u32 = documents.values().sum();
        assert!((430..=570).contains(&shared), "{shared}");
        assert_eq!(documents.len(), 32);
    }
}
