//! Agents: bursty multi-turn agent sessions mixed with interactive single-turn chat.
//!
//! Half of the requests (in expectation) are agent turns, half chat:
//! - An orchestrator fans out a *burst* of 4-16 sub-agents within 0.5 s, all of one of 8 agent
//!   apps. Every sub-agent's context starts with the app's 2,000-token system prompt (tool
//!   definitions), then the burst's shared task context (1,000-3,000 tokens), then its own
//!   sub-task (100-300 tokens). Each session runs 4-12 turns: the model answers with a tool call
//!   (64-256 tokens), the tool runs (0.2-2 s after the answer completes) and its output
//!   (200-1,500 tokens) is appended with the answer to the context of the next turn. Contexts
//!   grow to about 10k tokens.
//! - Chat: one of 4 apps' 500-token system prompt, a 50-400-token question, a 50-300-token
//!   answer; Poisson arrivals.
//!
//! Bursts arrive as a Poisson process sized so that agent turns make half of the offered rate.

use std::time::Duration;

use super::text::{seed_of, Part};
use super::{poisson_arrivals, Count, Plan, Session, Turn};
use kvoy_shared::Rng;

const AGENT_APPS: u64 = 8;
const AGENT_SYSTEM_TOKENS: u32 = 2000;
const BURST_SESSIONS: (u32, u32) = (4, 16);
const BURST_SPREAD_S: f64 = 0.5;
const BURST_CONTEXT_TOKENS: (u32, u32) = (1000, 3000);
const SUBTASK_TOKENS: (u32, u32) = (100, 300);
const TURNS: (u32, u32) = (4, 12);
const ANSWER_TOKENS: (u32, u32) = (64, 256);
const TOOL_OUTPUT_TOKENS: (u32, u32) = (200, 1500);
const TOOL_LATENCY_MS: (u32, u32) = (200, 2000);
const CHAT_APPS: u64 = 4;
const CHAT_SYSTEM_TOKENS: u32 = 500;
const QUESTION_TOKENS: (u32, u32) = (50, 400);
const CHAT_ANSWER_TOKENS: (u32, u32) = (50, 300);

fn mean(range: (u32, u32)) -> f64 {
    (f64::from(range.0) + f64::from(range.1)) / 2.0
}

#[derive(Clone, Debug, PartialEq)]
pub struct Agents {
    /// Requests to send (about half agent turns, half chat).
    pub count: Count,
}

impl Agents {
    pub fn new(count: Count) -> Self {
        Agents { count }
    }

    pub fn describe(&self) -> String {
        format!(
            "half turns of agent sessions ({}-{} turns, contexts growing with tool output, \
             sub-agents fanned out in bursts of {}-{}), half single-turn chat, {}",
            TURNS.0,
            TURNS.1,
            BURST_SESSIONS.0,
            BURST_SESSIONS.1,
            self.count.describe()
        )
    }

    pub fn plan(&self, rate: f64, seed: u64) -> Plan {
        let mut sessions = Vec::new();
        let requests = self.count.requests(rate);
        let chats = requests / 2;
        let mut rng = Rng::derive(seed, "agents/chat", rate.to_bits());
        let mut shapes = Rng::derive(seed, "agents/chat-shape", 0);
        for (i, start) in poisson_arrivals(&mut rng, rate / 2.0, chats)
            .into_iter()
            .enumerate()
        {
            let app = shapes.below(CHAT_APPS as usize) as u64;
            sessions.push(Session::single(
                start,
                "chat",
                vec![
                    Part::Text {
                        seed: seed_of("agents/chat-system", seed, app),
                        tokens: CHAT_SYSTEM_TOKENS,
                    },
                    Part::Text {
                        seed: seed_of("agents/question", seed, i as u64),
                        tokens: shapes.range(QUESTION_TOKENS.0, QUESTION_TOKENS.1),
                    },
                ],
                shapes.range(CHAT_ANSWER_TOKENS.0, CHAT_ANSWER_TOKENS.1),
            ));
        }

        let turns_per_burst = mean(BURST_SESSIONS) * mean(TURNS);
        let burst_rate = rate / 2.0 / turns_per_burst;
        let mut arrivals = Rng::derive(seed, "agents/bursts", rate.to_bits());
        let mut shapes = Rng::derive(seed, "agents/burst-shape", 0);
        let agent_turns = requests - chats;
        let (mut sent, mut t, mut burst) = (0usize, 0.0f64, 0u64);
        while sent < agent_turns {
            let app = shapes.below(AGENT_APPS as usize) as u64;
            let context = Part::Text {
                seed: seed_of("agents/burst-context", seed, burst),
                tokens: shapes.range(BURST_CONTEXT_TOKENS.0, BURST_CONTEXT_TOKENS.1),
            };
            let size = shapes.range(BURST_SESSIONS.0, BURST_SESSIONS.1);
            for member in 0..size {
                if sent >= agent_turns {
                    break;
                }
                let n = shapes
                    .range(TURNS.0, TURNS.1)
                    .min((agent_turns - sent) as u32);
                let offset = shapes.unit() * BURST_SPREAD_S;
                let mut turns = Vec::with_capacity(n as usize);
                let mut previous_answer = 0;
                for k in 0..n {
                    let answer = shapes.range(ANSWER_TOKENS.0, ANSWER_TOKENS.1);
                    let append = if k == 0 {
                        vec![
                            Part::Text {
                                seed: seed_of("agents/system", seed, app),
                                tokens: AGENT_SYSTEM_TOKENS,
                            },
                            context.clone(),
                            Part::Text {
                                seed: seed_of(
                                    "agents/subtask",
                                    seed,
                                    burst << 16 | u64::from(member),
                                ),
                                tokens: shapes.range(SUBTASK_TOKENS.0, SUBTASK_TOKENS.1),
                            },
                        ]
                    } else {
                        vec![
                            // Turn index; `Plan::finish` makes it the request id.
                            Part::Output {
                                request: u64::from(k - 1),
                                tokens: previous_answer,
                            },
                            Part::Text {
                                seed: seed_of(
                                    "agents/tool",
                                    seed,
                                    burst << 24 | u64::from(member) << 8 | u64::from(k),
                                ),
                                tokens: shapes.range(TOOL_OUTPUT_TOKENS.0, TOOL_OUTPUT_TOKENS.1),
                            },
                        ]
                    };
                    let delay = if k == 0 {
                        Duration::ZERO
                    } else {
                        Duration::from_millis(u64::from(
                            shapes.range(TOOL_LATENCY_MS.0, TOOL_LATENCY_MS.1),
                        ))
                    };
                    turns.push(Turn {
                        id: 0,
                        append,
                        max_tokens: answer,
                        delay,
                    });
                    previous_answer = answer;
                }
                sent += turns.len();
                sessions.push(Session {
                    start: Duration::from_secs_f64((t + offset).min(1e9)),
                    class: "agent",
                    sheddable: false,
                    turns,
                });
            }
            burst += 1;
            t += arrivals.exp(burst_rate);
        }
        Plan::finish(sessions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_and_growing_contexts() {
        let plan = Agents::new(Count::Fixed(600)).plan(20.0, 5);
        assert_eq!(plan.requests(), 600);
        let chat: usize = plan
            .sessions
            .iter()
            .filter(|s| s.class == "chat")
            .map(|s| s.turns.len())
            .sum();
        assert_eq!(chat, 300);
        let agent = plan
            .sessions
            .iter()
            .find(|s| s.class == "agent" && s.turns.len() > 2)
            .unwrap();
        let second = &agent.turns[1];
        assert_eq!(
            second.append[0],
            Part::Output {
                request: agent.turns[0].id,
                tokens: agent.turns[0].max_tokens
            }
        );
        assert!(second.delay >= Duration::from_millis(200));
    }
}
