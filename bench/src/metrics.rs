//! What one run measures, and its summary figures.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Raw measurements of one run, filled by the simulation.
#[derive(Debug, Default, Clone)]
pub struct Recorder {
    /// Per request, seconds.
    pub ttft: Vec<f64>,
    pub e2e: Vec<f64>,
    /// Gaps between consecutive tokens of a request, seconds, pooled over all requests.
    pub itl: Vec<f32>,
    /// TTFT per request class.
    pub class_ttft: BTreeMap<&'static str, Vec<f64>>,
    /// Every request that produced its first token, for the SLO figures.
    pub served: Vec<Served>,
    /// Refused requests per class (they miss any SLO).
    pub class_rejected: BTreeMap<&'static str, u64>,
    pub per_endpoint: Vec<u64>,
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache at a request's first admission (see `RunFigures`).
    pub cached_tokens: u64,
    /// What the engine reports (`usage.cached_tokens`).
    pub reported_cached_tokens: u64,
    /// What the endpoint held of each prompt when it arrived.
    pub arrival_cached_tokens: u64,
    /// Requests whose hit is the arrival estimate (preempted before their first token).
    pub estimated_hit_requests: u64,
    pub output_tokens: u64,
    pub completed: u64,
    pub rejected: u64,
    pub preemptions: u64,
    /// Requests split between a prefill and a decode engine.
    pub disaggregated: u64,
    /// Ids of the completed requests, in completion order.
    pub finished: Vec<u64>,
    /// Ids of the requests the engines refused (too long for the model).
    pub refused: Vec<u64>,
    pub first_arrival: Option<Duration>,
    pub last_completion: Duration,
    /// The last open-loop arrival (session start): the end of the load stage.
    pub window_end: Duration,
    /// Tokens generated and requests completed up to `window_end`.
    pub window_output_tokens: u64,
    pub window_completed: u64,
    /// Ideal (infinite single cache) hit tokens and the prompt tokens they count against.
    pub ideal_hit_tokens: u64,
    pub ideal_prompt_tokens: u64,
    /// The admission stage: requests it held, shed at arrival (429), let expire in its queue
    /// (429), and the seconds the released ones waited in all.
    pub held: u64,
    pub shed: u64,
    pub expired: u64,
    pub held_s: f64,
}

/// One request that produced its first token: what the SLO figures need of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Served {
    pub class: &'static str,
    /// Its TTFT, seconds.
    pub ttft_s: f64,
    /// Every output token it generated.
    pub output_tokens: u64,
    /// The ones generated up to `Recorder::window_end` (what `window_output_tokens` counts).
    pub window_output_tokens: u64,
}

/// How a run (or a class) did against a TTFT SLO.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SloFigures {
    /// The SLO: a request meets it when its TTFT is at most this, seconds.
    pub ttft_s: f64,
    /// Requests counted: those that produced a first token plus the refused ones (which miss).
    pub requests: u64,
    pub met_requests: u64,
    /// `met_requests / requests`.
    pub met: f64,
    /// Output tokens per second of the requests that met the SLO, over the same window as
    /// `RunFigures::output_tokens_per_s`.
    pub goodput_tokens_per_s: f64,
}

/// p50 / p90 / p99 of a sample, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// Nearest-rank percentile of a sorted sample (0 for an empty one).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Percentiles {
    pub fn of(values: &[f64]) -> Self {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        Percentiles {
            p50: percentile(&v, 0.50),
            p90: percentile(&v, 0.90),
            p99: percentile(&v, 0.99),
        }
    }
}

/// Figures of one request class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassFigures {
    pub requests: usize,
    pub ttft_s: Percentiles,
    /// The class's SLO figures (absent in reports written before they existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloFigures>,
}

/// How evenly requests spread over the endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub requests: Vec<u64>,
    /// Busiest endpoint's requests / mean.
    pub max_over_mean: f64,
    /// Standard deviation / mean.
    pub cv: f64,
}

/// The summary of one (workload, rate, policy) run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunFigures {
    pub workload: String,
    pub policy: String,
    /// The seed of the run (absent in reports written before several seeds ran: the report's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Offered load, requests per second.
    pub rate: f64,
    /// `rate` / the workload's estimated saturation rate.
    pub load: f64,
    pub requests: u64,
    pub completed: u64,
    pub rejected: u64,
    pub preemptions: u64,
    pub ttft_s: Percentiles,
    pub itl_s: Percentiles,
    pub e2e_s: Percentiles,
    /// Output tokens generated per second while the load was offered (first arrival to the last
    /// session start): the fleet's throughput under this load.
    pub output_tokens_per_s: f64,
    /// Requests completed per second over the same window.
    pub requests_per_s: f64,
    /// First arrival to last session start, virtual seconds.
    pub window_s: f64,
    /// All output tokens over the makespan (includes the drain after the last arrival).
    pub overall_output_tokens_per_s: f64,
    /// First arrival to last completion, virtual seconds.
    pub makespan_s: f64,
    /// Cached prompt tokens / prompt tokens, over the fleet, counting each request's hit at its
    /// first admission: the engine's `usage.cached_tokens`, except for requests preempted before
    /// their first token, whose reported hit includes their own recomputed blocks; for those the
    /// endpoint's holding at arrival is used (`estimated_hit_requests`).
    pub hit_rate: f64,
    /// The engine's `usage.cached_tokens` / prompt tokens, as reported.
    pub reported_hit_rate: f64,
    /// What the chosen endpoints held of the prompts when they arrived / prompt tokens.
    pub arrival_hit_rate: f64,
    pub estimated_hit_requests: u64,
    /// What one infinite cache would hit on the same requests.
    pub ideal_hit_rate: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    pub spread: Spread,
    pub classes: BTreeMap<String, ClassFigures>,
    /// The run against its TTFT SLO (absent in reports written before SLOs existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloFigures>,
    /// What the admission stage did (absent when nothing met one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionFigures>,
}

/// What the admission stage did in one run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdmissionFigures {
    /// Requests held for a while before they were routed (or expired).
    pub held: u64,
    /// Refused at arrival (429: saturated and sheddable).
    pub shed: u64,
    /// Held longer than the queue's TTL (429).
    pub expired: u64,
    /// Mean wait of the held requests that were routed, seconds.
    pub mean_held_s: f64,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

impl Recorder {
    pub fn new(replicas: usize) -> Self {
        Recorder {
            per_endpoint: vec![0; replicas],
            ..Recorder::default()
        }
    }

    /// The window throughput is measured over, seconds, and whether it is the load stage
    /// (`window_end` after the first arrival) rather than the makespan.
    fn window(&self) -> (f64, bool) {
        let first = self.first_arrival.unwrap_or_default();
        let window = self.window_end.saturating_sub(first).as_secs_f64();
        if window > 0.0 {
            (window, true)
        } else {
            (
                self.last_completion.saturating_sub(first).as_secs_f64(),
                false,
            )
        }
    }

    /// The requests of `class` (all when `None`) against a TTFT SLO of `slo` seconds: a
    /// request meets it when its TTFT is at most `slo`; refused requests miss it. Goodput counts
    /// the met requests' output tokens over the window `output_tokens_per_s` uses (their tokens
    /// up to `window_end` over the load stage; all their tokens over the makespan when there is
    /// no stage).
    pub fn slo_figures(&self, slo: f64, class: Option<&str>) -> SloFigures {
        let (window, stage) = self.window();
        let (mut served, mut met, mut tokens) = (0u64, 0u64, 0u64);
        for s in self
            .served
            .iter()
            .filter(|s| class.is_none_or(|c| c == s.class))
        {
            served += 1;
            if s.ttft_s <= slo {
                met += 1;
                tokens += if stage {
                    s.window_output_tokens
                } else {
                    s.output_tokens
                };
            }
        }
        let refused = match class {
            None => self.rejected,
            Some(c) => self.class_rejected.get(c).copied().unwrap_or(0),
        };
        let requests = served + refused;
        SloFigures {
            ttft_s: slo,
            requests,
            met_requests: met,
            met: ratio(met as f64, requests as f64),
            goodput_tokens_per_s: ratio(tokens as f64, window),
        }
    }

    /// The run's summary; `slo`: the TTFT SLO in seconds, if the run is judged by one.
    pub fn figures(
        &self,
        workload: &str,
        policy: &str,
        rate: f64,
        load: f64,
        slo: Option<f64>,
    ) -> RunFigures {
        let first = self.first_arrival.unwrap_or_default();
        let makespan = self.last_completion.saturating_sub(first).as_secs_f64();
        let window = self.window_end.saturating_sub(first).as_secs_f64();
        let (tokens_per_s, requests_per_s) = if window > 0.0 {
            (
                self.window_output_tokens as f64 / window,
                self.window_completed as f64 / window,
            )
        } else {
            (
                ratio(self.output_tokens as f64, makespan),
                ratio(self.completed as f64, makespan),
            )
        };
        let itl: Vec<f64> = self.itl.iter().map(|&x| f64::from(x)).collect();
        let n = self.per_endpoint.len().max(1) as f64;
        let mean = self.per_endpoint.iter().sum::<u64>() as f64 / n;
        let max = self.per_endpoint.iter().copied().max().unwrap_or(0) as f64;
        let var = self
            .per_endpoint
            .iter()
            .map(|&c| (c as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        RunFigures {
            workload: workload.to_owned(),
            policy: policy.to_owned(),
            seed: None,
            rate,
            load,
            requests: self.completed + self.rejected,
            completed: self.completed,
            rejected: self.rejected,
            preemptions: self.preemptions,
            ttft_s: Percentiles::of(&self.ttft),
            itl_s: Percentiles::of(&itl),
            e2e_s: Percentiles::of(&self.e2e),
            output_tokens_per_s: tokens_per_s,
            requests_per_s,
            window_s: window,
            overall_output_tokens_per_s: ratio(self.output_tokens as f64, makespan),
            makespan_s: makespan,
            hit_rate: ratio(self.cached_tokens as f64, self.prompt_tokens as f64),
            reported_hit_rate: ratio(
                self.reported_cached_tokens as f64,
                self.prompt_tokens as f64,
            ),
            arrival_hit_rate: ratio(self.arrival_cached_tokens as f64, self.prompt_tokens as f64),
            estimated_hit_requests: self.estimated_hit_requests,
            ideal_hit_rate: ratio(
                self.ideal_hit_tokens as f64,
                self.ideal_prompt_tokens as f64,
            ),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            output_tokens: self.output_tokens,
            spread: Spread {
                requests: self.per_endpoint.clone(),
                max_over_mean: ratio(max, mean),
                cv: ratio(var.sqrt(), mean),
            },
            classes: self
                .class_ttft
                .keys()
                .chain(self.class_rejected.keys())
                .map(|&class| {
                    let v = self.class_ttft.get(class).map_or(&[][..], Vec::as_slice);
                    (
                        class.to_owned(),
                        ClassFigures {
                            requests: v.len(),
                            ttft_s: Percentiles::of(v),
                            slo: slo.map(|t| self.slo_figures(t, Some(class))),
                        },
                    )
                })
                .collect(),
            slo: slo.map(|t| self.slo_figures(t, None)),
            admission: (self.held + self.shed + self.expired > 0).then(|| AdmissionFigures {
                held: self.held,
                shed: self.shed,
                expired: self.expired,
                mean_held_s: ratio(self.held_s, self.held.saturating_sub(self.expired) as f64),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(Percentiles::of(&[]).p90, 0.0);
        assert_eq!(Percentiles::of(&[3.0]).p99, 3.0);
    }

    #[test]
    fn spread_and_rates() {
        let mut r = Recorder::new(2);
        r.per_endpoint = vec![3, 1];
        r.completed = 4;
        r.output_tokens = 40;
        r.first_arrival = Some(Duration::from_secs(1));
        r.last_completion = Duration::from_secs(5);
        let f = r.figures("w", "p", 1.0, 0.5, None);
        assert_eq!(f.spread.max_over_mean, 1.5);
        assert!((f.spread.cv - 0.5).abs() < 1e-12);
        // No window (one arrival): over the makespan.
        assert_eq!((f.output_tokens_per_s, f.requests_per_s), (10.0, 1.0));
        r.window_end = Duration::from_secs(3);
        r.window_output_tokens = 30;
        r.window_completed = 3;
        let f = r.figures("w", "p", 1.0, 0.5, None);
        assert_eq!((f.output_tokens_per_s, f.requests_per_s), (15.0, 1.5));
        assert_eq!(f.overall_output_tokens_per_s, 10.0);
        assert_eq!(f.hit_rate, 0.0);
    }

    #[test]
    fn goodput_counts_the_requests_that_met_the_slo() {
        let served = |class, ttft_s, output_tokens, window_output_tokens| Served {
            class,
            ttft_s,
            output_tokens,
            window_output_tokens,
        };
        let mut r = Recorder::new(1);
        r.served = vec![
            served("chat", 1.0, 40, 30),
            served("chat", 2.0, 20, 20), // exactly at the SLO: met
            served("agent", 2.5, 50, 50),
            served("agent", 0.5, 15, 10),
        ];
        r.completed = 4;
        r.rejected = 1;
        r.class_rejected.insert("agent", 1);
        for s in &r.served {
            r.class_ttft.entry(s.class).or_default().push(s.ttft_s);
        }
        r.first_arrival = Some(Duration::ZERO);
        r.window_end = Duration::from_secs(10);
        r.last_completion = Duration::from_secs(20);
        let all = r.slo_figures(2.0, None);
        assert_eq!((all.requests, all.met_requests), (5, 3));
        assert_eq!(all.met, 0.6);
        // (30 + 20 + 10) tokens of the met requests in the 10 s stage.
        assert_eq!(all.goodput_tokens_per_s, 6.0);
        let chat = r.slo_figures(2.0, Some("chat"));
        assert_eq!((chat.requests, chat.met_requests, chat.met), (2, 2, 1.0));
        assert_eq!(chat.goodput_tokens_per_s, 5.0);
        let agent = r.slo_figures(2.0, Some("agent"));
        assert_eq!((agent.requests, agent.met_requests), (3, 1));
        assert!((agent.met - 1.0 / 3.0).abs() < 1e-15);
        assert_eq!(agent.goodput_tokens_per_s, 1.0);
        // A tighter SLO: only the 0.5 s request.
        let tight = r.slo_figures(0.5, None);
        assert_eq!((tight.met_requests, tight.goodput_tokens_per_s), (1, 1.0));
        // In the figures, for the run and each class; none without an SLO.
        let f = r.figures("w", "p", 1.0, 1.0, Some(2.0));
        assert_eq!(f.slo, Some(all));
        assert_eq!(f.classes["agent"].slo, Some(agent));
        let f = r.figures("w", "p", 1.0, 1.0, None);
        assert_eq!((f.slo, f.classes["chat"].slo), (None, None));
        // No stage (one arrival): all their tokens over the makespan, as throughput does.
        r.window_end = Duration::ZERO;
        let f = r.figures("w", "p", 1.0, 1.0, Some(2.0));
        assert_eq!(
            f.slo.unwrap().goodput_tokens_per_s,
            (40.0 + 20.0 + 15.0) / 20.0
        );
    }
}
