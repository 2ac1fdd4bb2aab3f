//! Where the decodes ran: every simulator's running and waiting sequences
//! (`vllm:num_requests_running`, `vllm:num_requests_waiting` on its `/metrics`), sampled every
//! [`SAMPLE_EVERY`] while a run goes, and its preemptions (`vllm:num_preemptions_total`, the
//! run's increase). A policy can match prefixes well and still pile the decodes on one server
//! while another idles; the TTFT percentiles show that only indirectly.
//!
//! The statistics ([`PlacementStats::of`]) are pure functions of the samples, so they are
//! tested on made-up series; the sampler is a thread of its own, bounded by a sample count and
//! stopped when the run ends.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvoy_testkit::http;

/// How often the sampler reads every simulator's `/metrics`, real time.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// Bound on one `/metrics` read: a late answer is a missed sample, not a stalled sampler.
const READ_TIMEOUT: Duration = Duration::from_millis(500);

/// Every simulator's sequences at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Since the run's start, in the modelled GPU's seconds (real seconds x the speedup).
    pub at_s: f64,
    /// Running sequences, by endpoint (the fleet's address order).
    pub running: Vec<u32>,
    /// Waiting sequences, by endpoint.
    pub waiting: Vec<u32>,
}

/// The gauges and the counter of one `/metrics` answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    pub running: u32,
    pub waiting: u32,
    pub preemptions: u64,
}

impl Gauges {
    /// The three series of a Prometheus exposition; `None` without the running or the waiting
    /// gauge (then the answer is not a simulator's).
    pub fn from_metrics(text: &str) -> Option<Gauges> {
        let (mut running, mut waiting, mut preemptions) = (None, None, 0u64);
        for line in text.lines() {
            let Some((name, _, value)) = super::routers::sample(line) else {
                continue;
            };
            let gauge = u32::try_from(value).unwrap_or(u32::MAX);
            match name {
                "vllm:num_requests_running" => running = Some(gauge),
                "vllm:num_requests_waiting" => waiting = Some(gauge),
                "vllm:num_preemptions_total" => preemptions = value,
                _ => {}
            }
        }
        Some(Gauges {
            running: running?,
            waiting: waiting?,
            preemptions,
        })
    }
}

/// One read of every endpoint; `None` if any of them did not answer with its gauges.
fn read_all(endpoints: &[SocketAddr]) -> Option<Vec<Gauges>> {
    endpoints
        .iter()
        .map(|addr| {
            let r = http::send(*addr, "GET", "/metrics", &[], b"", READ_TIMEOUT).ok()?;
            (r.status == 200).then(|| Gauges::from_metrics(&r.text()))?
        })
        .collect()
}

/// Samples a fleet's sequences on a thread of its own until [`Sampler::finish`].
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Sample>>>,
    endpoints: Vec<SocketAddr>,
    /// Each endpoint's preemption counter when sampling started (`None`: unreadable then).
    preemptions_before: Option<Vec<u64>>,
}

/// What a run's sampling gathered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampled {
    pub samples: Vec<Sample>,
    /// The preemptions during the run, over every endpoint (`None`: a counter was unreadable).
    pub preemptions: Option<u64>,
}

impl Sampler {
    /// Starts sampling `endpoints` every [`SAMPLE_EVERY`], at most `max_samples` times;
    /// times are multiplied by `speedup` (to the modelled GPU's seconds).
    pub fn start(endpoints: &[SocketAddr], speedup: f64, max_samples: usize) -> Sampler {
        let preemptions_before =
            read_all(endpoints).map(|g| g.iter().map(|g| g.preemptions).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, endpoints) = (Arc::clone(&stop), endpoints.to_vec());
            std::thread::Builder::new()
                .name("kvoy-bench-placement".into())
                .spawn(move || sample_until(&endpoints, speedup, max_samples, &stop))
                .map_err(|e| log::error!("kvoy-bench: cannot start the placement sampler: {e}"))
                .ok()
        };
        Sampler {
            stop,
            thread,
            endpoints: endpoints.to_vec(),
            preemptions_before,
        }
    }

    /// Stops sampling; returns the samples and the preemptions since [`Sampler::start`].
    pub fn finish(mut self) -> Sampled {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self
            .thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        let after = read_all(&self.endpoints);
        let preemptions = self.preemptions_before.as_ref().zip(after).map(|(b, a)| {
            a.iter()
                .zip(b)
                .map(|(a, b)| a.preemptions.saturating_sub(*b))
                .sum()
        });
        Sampled {
            samples,
            preemptions,
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn sample_until(
    endpoints: &[SocketAddr],
    speedup: f64,
    max_samples: usize,
    stop: &AtomicBool,
) -> Vec<Sample> {
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut tick = 0u32;
    while !stop.load(Ordering::Relaxed) && samples.len() < max_samples {
        let at = start.elapsed();
        if let Some(gauges) = read_all(endpoints) {
            samples.push(Sample {
                at_s: at.as_secs_f64() * speedup,
                running: gauges.iter().map(|g| g.running).collect(),
                waiting: gauges.iter().map(|g| g.waiting).collect(),
            });
        }
        // On a fixed grid, so a slow read does not shift every later sample; in short sleeps,
        // so that a stop is seen within 50 ms.
        tick += 1;
        let next = SAMPLE_EVERY * tick;
        while !stop.load(Ordering::Relaxed) {
            let left = next.saturating_sub(start.elapsed());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }
    samples
}

/// How evenly a run's decodes were spread, from its samples.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlacementStats {
    pub samples: usize,
    /// Each endpoint's mean running sequences over the samples.
    pub mean_running: Vec<f64>,
    /// The busiest endpoint's mean running over the endpoints' mean of it (1: even).
    pub max_over_mean: f64,
    /// The same ratio taken in each sample (where anything ran), averaged: an imbalance that
    /// moves between endpoints evens out in the means but not here.
    pub sample_max_over_mean: f64,
    /// Share of the samples in which some endpoint was idle (nothing running or waiting) while
    /// another had requests waiting: capacity left unused by the placement.
    pub idle_while_waiting: f64,
}

impl PlacementStats {
    /// The statistics of `samples` (all of one fleet; empty: all zero).
    pub fn of(samples: &[Sample]) -> PlacementStats {
        let endpoints = samples.first().map_or(0, |s| s.running.len());
        let samples: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.running.len() == endpoints && s.waiting.len() == endpoints)
            .collect();
        if samples.is_empty() || endpoints == 0 {
            return PlacementStats::default();
        }
        let n = samples.len() as f64;
        let mean_running: Vec<f64> = (0..endpoints)
            .map(|i| samples.iter().map(|s| f64::from(s.running[i])).sum::<f64>() / n)
            .collect();
        let (mut ratios, mut busy) = (0.0, 0usize);
        let mut idle_while_waiting = 0usize;
        for s in &samples {
            if let Some(r) = max_over_mean(s.running.iter().map(|&r| f64::from(r))) {
                ratios += r;
                busy += 1;
            }
            let idle = s.running.iter().zip(&s.waiting).any(|(&r, &w)| r + w == 0);
            if idle && s.waiting.iter().any(|&w| w > 0) {
                idle_while_waiting += 1;
            }
        }
        PlacementStats {
            samples: samples.len(),
            max_over_mean: max_over_mean(mean_running.iter().copied()).unwrap_or(0.0),
            mean_running,
            sample_max_over_mean: if busy > 0 { ratios / busy as f64 } else { 0.0 },
            idle_while_waiting: idle_while_waiting as f64 / n,
        }
    }
}

/// The largest value over the mean of the values; `None` when their mean is 0.
fn max_over_mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (mut sum, mut max, mut n) = (0.0, f64::NEG_INFINITY, 0usize);
    for v in values {
        sum += v;
        max = max.max(v);
        n += 1;
    }
    let mean = sum / n.max(1) as f64;
    (mean > 0.0).then(|| max / mean)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sample(at_s: f64, running: &[u32], waiting: &[u32]) -> Sample {
        Sample {
            at_s,
            running: running.to_vec(),
            waiting: waiting.to_vec(),
        }
    }

    #[test]
    fn imbalance_of_known_series() {
        // Endpoint 0 runs 4 throughout; endpoint 1 runs 0 then 4, with 2 waiting on 0 at first.
        let samples = [
            sample(0.0, &[4, 0], &[2, 0]),
            sample(0.5, &[4, 0], &[2, 0]),
            sample(1.0, &[4, 4], &[0, 0]),
            sample(1.5, &[4, 4], &[0, 0]),
        ];
        let s = PlacementStats::of(&samples);
        assert_eq!(s.samples, 4);
        assert_eq!(s.mean_running, [4.0, 2.0]);
        // Means 4 and 2: mean 3, max 4.
        assert!((s.max_over_mean - 4.0 / 3.0).abs() < 1e-12, "{s:?}");
        // Per sample: 4 / 2 twice, then 1 twice.
        assert!((s.sample_max_over_mean - 1.5).abs() < 1e-12, "{s:?}");
        // Endpoint 1 idle while endpoint 0 had 2 waiting: half the samples.
        assert_eq!(s.idle_while_waiting, 0.5);
    }

    #[test]
    fn idle_needs_nothing_waiting_on_the_idle_endpoint_and_something_waiting_elsewhere() {
        // Endpoint 1 runs nothing but has one waiting (admitting it): not idle.
        let s = PlacementStats::of(&[sample(0.0, &[3, 0], &[1, 1])]);
        assert_eq!(s.idle_while_waiting, 0.0);
        // An idle endpoint while nothing waits anywhere: even enough.
        let s = PlacementStats::of(&[sample(0.0, &[3, 0], &[0, 0])]);
        assert_eq!(s.idle_while_waiting, 0.0);
        // An empty fleet: no ratio, no idle share.
        let s = PlacementStats::of(&[sample(0.0, &[0, 0], &[0, 0])]);
        assert_eq!((s.max_over_mean, s.sample_max_over_mean), (0.0, 0.0));
        assert_eq!(PlacementStats::of(&[]), PlacementStats::default());
        // A sample of another width (a reading that went wrong) is left out.
        let s = PlacementStats::of(&[sample(0.0, &[2, 2], &[0, 0]), sample(1.0, &[9], &[0])]);
        assert_eq!((s.samples, s.max_over_mean), (1, 1.0));
    }

    #[test]
    fn gauges_read_from_the_simulators_exposition() {
        let text =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"kvoy-bench\"} 7\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"kvoy-bench\"} 3\n\
            vllm:num_preemptions_total{engine=\"0\",model_name=\"kvoy-bench\"} 12\n";
        assert_eq!(
            Gauges::from_metrics(text),
            Some(Gauges {
                running: 7,
                waiting: 3,
                preemptions: 12
            })
        );
        assert_eq!(Gauges::from_metrics("vllm:num_requests_running 1\n"), None);
        assert_eq!(Gauges::from_metrics("garbage"), None);
    }
}
