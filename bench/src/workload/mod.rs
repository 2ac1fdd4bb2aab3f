//! Workloads: seeded generators of timed sessions of requests.
//!
//! A [`Plan`] is a list of [`Session`]s sorted by start time. A session is one or more turns;
//! the first arrives at the session's start, each later one `delay` after the previous turn
//! completed (closed loop, like an agent waiting for its tool), and its prompt is the previous
//! prompt plus the turn's [`Part`]s (which usually begin with the previous turn's output).
//! Single-turn sessions are open-loop requests.
//!
//! - [`SharedPrefix`]: llm-d's shared-prefix benchmark shape.
//! - [`Agents`]: bursty multi-turn agent sessions mixed with interactive chat.
//! - [`Mooncake`]: replay of the Mooncake conversation trace.
//! - [`NoSharing`]: unique random prompts, the control.
//! - [`LongPrompt`]: 8k-token prompts, half sharing a document (prefill/decode disaggregation).

mod agents;
mod long_prompt;
mod mooncake;
mod no_sharing;
mod shared_prefix;
pub mod text;

use std::sync::Arc;
use std::time::Duration;

pub use agents::Agents;
pub use long_prompt::LongPrompt;
pub use mooncake::{Mooncake, Trace, TraceError, TraceRecord};
pub use no_sharing::NoSharing;
pub use shared_prefix::SharedPrefix;
pub use text::Part;

/// How many requests a synthetic workload sends at a given rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Count {
    /// Exactly this many.
    Fixed(usize),
    /// As many as arrive in a load stage of this many seconds (`rate * seconds`, at least 1).
    Duration(f64),
}

impl Count {
    pub fn requests(self, rate: f64) -> usize {
        match self {
            Count::Fixed(n) => n,
            Count::Duration(s) => ((rate * s).round() as usize).max(1),
        }
    }

    pub fn describe(self) -> String {
        match self {
            Count::Fixed(n) => format!("{n} requests per run"),
            Count::Duration(s) => format!("load stages of {s:.0} s"),
        }
    }
}

/// Request ids are `session * TURN_SLOTS + turn`: unique and independent of the routing.
pub const TURN_SLOTS: u64 = 1024;

/// One request of a session.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// Request id (also the engine's id, which seeds its generated tokens).
    pub id: u64,
    /// Appended to the session's context before this turn is sent.
    pub append: Vec<Part>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Wait after the previous turn completed (ignored for the first turn).
    pub delay: Duration,
}

/// A sequence of turns sharing a growing context.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    /// Arrival of the first turn.
    pub start: Duration,
    /// A label for per-class figures (`chat`, `agent`, ...; [`SHEDDABLE_CLASS`] for the
    /// sheddable band).
    pub class: &'static str,
    /// In the sheddable band (objective `sheddable`, priority -1): set by
    /// [`Plan::mark_sheddable`].
    pub sheddable: bool,
    pub turns: Vec<Turn>,
}

impl Session {
    /// An open-loop request: a session of one turn (numbered by [`Plan::finish`]).
    fn single(start: Duration, class: &'static str, append: Vec<Part>, max_tokens: u32) -> Self {
        Session {
            start,
            class,
            sheddable: false,
            turns: vec![Turn {
                id: 0,
                append,
                max_tokens,
                delay: Duration::ZERO,
            }],
        }
    }
}

/// Everything one run sends.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Plan {
    /// Sorted by `start`.
    pub sessions: Vec<Session>,
}

impl Plan {
    /// Requests in the plan.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// Sorts sessions by start (stable) and numbers their turns (`id = session * TURN_SLOTS +
    /// turn`), fixing up `Part::Output` references to the previous turn.
    fn finish(mut sessions: Vec<Session>) -> Plan {
        sessions.sort_by_key(|s| s.start);
        for (si, s) in sessions.iter_mut().enumerate() {
            let base = si as u64 * TURN_SLOTS;
            for (ti, t) in s.turns.iter_mut().enumerate() {
                t.id = base + ti as u64;
                for p in &mut t.append {
                    if let Part::Output { request, .. } = p {
                        // Generators write the turn index of the output's request.
                        *request += base;
                    }
                }
            }
        }
        Plan { sessions }
    }
}

/// The class label of the sheddable band's sessions.
pub const SHEDDABLE_CLASS: &str = "sheddable";

impl Plan {
    /// Puts about `share` (0-1) of the sessions, drawn with `seed` independently of the plan's
    /// own draws, in the sheddable band: their class becomes [`SHEDDABLE_CLASS`], so that the
    /// per-class figures give the interactive classes and the band apart.
    pub fn mark_sheddable(&mut self, share: f64, seed: u64) {
        let mut rng = kvoy_shared::Rng::derive(seed, "sheddable", 0);
        for s in &mut self.sessions {
            if rng.unit() < share {
                s.sheddable = true;
                s.class = SHEDDABLE_CLASS;
            }
        }
    }
}

/// A workload generator.
#[derive(Clone, Debug)]
pub enum Workload {
    SharedPrefix(SharedPrefix),
    Agents(Agents),
    Mooncake(Mooncake),
    NoSharing(NoSharing),
    LongPrompt(LongPrompt),
}

impl Workload {
    /// Names accepted on the command line.
    pub const NAMES: [&'static str; 5] = [
        "shared-prefix",
        "agents",
        "mooncake",
        "no-sharing",
        "long-prompt",
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Workload::SharedPrefix(_) => "shared-prefix",
            Workload::Agents(_) => "agents",
            Workload::Mooncake(_) => "mooncake",
            Workload::NoSharing(_) => "no-sharing",
            Workload::LongPrompt(_) => "long-prompt",
        }
    }

    /// One line on the shape, for the reports.
    pub fn describe(&self) -> String {
        match self {
            Workload::SharedPrefix(w) => w.describe(),
            Workload::Agents(w) => w.describe(),
            Workload::Mooncake(w) => w.describe(),
            Workload::NoSharing(w) => w.describe(),
            Workload::LongPrompt(w) => w.describe(),
        }
    }

    /// The plan at `rate` requests per second (mean offered load), drawn from `seed`.
    pub fn plan(&self, rate: f64, seed: u64) -> Plan {
        match self {
            Workload::SharedPrefix(w) => w.plan(rate, seed),
            Workload::Agents(w) => w.plan(rate, seed),
            Workload::Mooncake(w) => w.plan(rate),
            Workload::NoSharing(w) => w.plan(rate, seed),
            Workload::LongPrompt(w) => w.plan(rate, seed),
        }
    }

    /// True when every request arrives on its own schedule (no turn waits for another), so the
    /// requests and their order do not depend on the routing.
    pub fn open_loop(&self) -> bool {
        !matches!(self, Workload::Agents(_))
    }

    /// True when the plan's content (not only its timing) changes with the rate.
    pub fn content_depends_on_rate(&self) -> bool {
        !matches!(self, Workload::Mooncake(_))
    }

    /// The trace's own request rate, for `t`-suffixed rates (trace replay only).
    pub fn native_rate(&self) -> Option<f64> {
        match self {
            Workload::Mooncake(w) => Some(w.native_rate()),
            _ => None,
        }
    }

    /// A mooncake workload over `trace`, first `limit` requests.
    pub fn mooncake(trace: Arc<Trace>, limit: Option<usize>) -> Workload {
        Workload::Mooncake(Mooncake::new(trace, limit))
    }
}

/// Poisson arrival times at `rate` per second for `n` requests.
pub(crate) fn poisson_arrivals(rng: &mut kvoy_shared::Rng, rate: f64, n: usize) -> Vec<Duration> {
    let mut t = 0.0f64;
    (0..n)
        .map(|_| {
            let at = t;
            t += rng.exp(rate);
            Duration::from_secs_f64(at.min(1e9))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_number_turns_and_outputs() {
        let plan = Plan::finish(vec![
            Session {
                start: Duration::from_secs(2),
                class: "a",
                sheddable: false,
                turns: vec![
                    Turn {
                        id: 0,
                        append: vec![Part::Text { seed: 1, tokens: 4 }],
                        max_tokens: 3,
                        delay: Duration::ZERO,
                    },
                    Turn {
                        id: 0,
                        append: vec![Part::Output {
                            request: 0,
                            tokens: 3,
                        }],
                        max_tokens: 3,
                        delay: Duration::from_secs(1),
                    },
                ],
            },
            Session {
                start: Duration::from_secs(1),
                class: "b",
                sheddable: false,
                turns: vec![Turn {
                    id: 0,
                    append: vec![],
                    max_tokens: 1,
                    delay: Duration::ZERO,
                }],
            },
        ]);
        assert_eq!(plan.requests(), 3);
        assert_eq!(plan.sessions[0].class, "b");
        assert_eq!(plan.sessions[1].turns[1].id, TURN_SLOTS + 1);
        assert_eq!(
            plan.sessions[1].turns[1].append[0],
            Part::Output {
                request: TURN_SLOTS,
                tokens: 3
            }
        );
    }
}
