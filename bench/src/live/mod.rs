//! The live benchmark: real Envoy, kvoy-sim simulators (real HTTP, SSE, ZMQ KV events) and
//! kvoy-aggregator on 127.0.0.1, the same seeded plan sent through each policy in turn.
//!
//! Policies: Envoy's own `ROUND_ROBIN`, `LEAST_REQUEST` and `RANDOM` over a STATIC cluster of
//! the simulators (`bench/envoy/baseline.yaml`, no kvoy filter), and `envoy/kvoy.yaml` with the
//! kvoy filters, once with the per-proxy index only (`kvoy`) and once polling the aggregator
//! (`kvoy-aggregator`). Before every run the simulators' prefix caches are reset and the fleet
//! is idle.
//!
//! Time: the simulators run `speedup` times faster than the modelled GPU, and the plan is sent
//! `speedup` times faster too (arrival times and delays divided by it); every duration
//! measured is multiplied back, so figures are in the modelled GPU's seconds and compare
//! directly with the fleet-scale simulation (`crate::sim`) on the same plan. Proxy and network
//! overhead are multiplied as well: keep `speedup` modest (the default 2 makes 1 ms of real
//! overhead 2 ms of reported time, small next to the prefills the benchmark measures).

pub mod cli;
pub mod compare;
pub mod driver;
mod fleet;

use std::path::PathBuf;
use std::time::Duration;

use kvoy_sim::engine::Profile;

pub use driver::{Arrivals, Outcome};
pub use fleet::{baseline_proxy, Fleet, Proxy};

use crate::metrics::Recorder;
use crate::report::{Report, WorkloadReport};
use crate::runner::Rate;
use crate::saturation::{capacity, measure};
use crate::workload::{Plan, Workload};

/// A routing policy of the live run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LivePolicy {
    RoundRobin,
    LeastRequest,
    Random,
    /// kvoy's filters with the per-proxy index (no aggregator).
    Kvoy,
    /// kvoy's filters polling the aggregator.
    KvoyAggregator,
}

impl LivePolicy {
    pub const ALL: [LivePolicy; 5] = [
        LivePolicy::RoundRobin,
        LivePolicy::LeastRequest,
        LivePolicy::Random,
        LivePolicy::Kvoy,
        LivePolicy::KvoyAggregator,
    ];

    /// The name in reports (the simulation's names where the policies are the same).
    pub fn name(self) -> &'static str {
        match self {
            LivePolicy::RoundRobin => "round-robin",
            LivePolicy::LeastRequest => "least-request",
            LivePolicy::Random => "random",
            LivePolicy::Kvoy => "kvoy",
            LivePolicy::KvoyAggregator => "kvoy-aggregator",
        }
    }

    pub fn parse(name: &str) -> Option<LivePolicy> {
        LivePolicy::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Envoy's load balancer for the cache-blind baselines.
    fn envoy_lb(self) -> Option<&'static str> {
        match self {
            LivePolicy::RoundRobin => Some("ROUND_ROBIN"),
            LivePolicy::LeastRequest => Some("LEAST_REQUEST"),
            LivePolicy::Random => Some("RANDOM"),
            LivePolicy::Kvoy | LivePolicy::KvoyAggregator => None,
        }
    }
}

/// What to run live.
#[derive(Clone, Debug)]
pub struct LiveGrid {
    pub workload: Workload,
    pub policies: Vec<LivePolicy>,
    pub rates: Vec<Rate>,
    pub profile: Profile,
    pub replicas: usize,
    pub speedup: f64,
    pub seed: u64,
    pub arrivals: Arrivals,
    /// Bound on each run, real time (requests still running then count as errors).
    pub run_deadline: Duration,
    /// Envoy's configuration and logs, the aggregator's configuration.
    pub run_dir: PathBuf,
}

/// Progress of the live grid, for a progress line.
#[derive(Clone, Copy, Debug)]
pub struct LiveProgress<'a> {
    pub policy: &'a str,
    pub rate: f64,
    pub done: usize,
    pub total: usize,
    pub finished_runs: usize,
    pub runs: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error("setting up the live fleet: {0}")]
    Setup(String),
    #[error("{policy}: {message}")]
    Proxy {
        policy: &'static str,
        message: String,
    },
    #[error("a `t` rate is a multiple of a trace's own rate; use `x` or req/s")]
    TraceRate,
    #[error("{policy} at {rate:.2} req/s: no request completed (first error: {error})")]
    NothingCompleted {
        policy: &'static str,
        rate: f64,
        error: String,
    },
}

/// Runs every (rate, policy) of `grid` on one fleet and returns the report (same shape as the
/// simulation's, `tool: "kvoy-bench live"`).
pub fn run(
    grid: &LiveGrid,
    progress: &mut dyn FnMut(LiveProgress<'_>),
) -> Result<Report, LiveError> {
    let speedup = grid.speedup.max(1e-3);
    let w = &grid.workload;
    let mut shape = measure(&w.plan(1.0, grid.seed), &grid.profile);
    let mut cap = capacity(&grid.profile, &shape, grid.replicas);
    if w.content_depends_on_rate() {
        shape = measure(&w.plan(cap.rate, grid.seed), &grid.profile);
        cap = capacity(&grid.profile, &shape, grid.replicas);
    }
    let rates: Vec<f64> = grid
        .rates
        .iter()
        .map(|r| match *r {
            Rate::Absolute(x) => Ok(x),
            Rate::Saturation(m) => Ok(m * cap.rate),
            Rate::Trace(m) => w.native_rate().map(|n| m * n).ok_or(LiveError::TraceRate),
        })
        .collect::<Result<_, _>>()?;

    let fleet = Fleet::start(grid.replicas, &grid.profile.name, speedup, &grid.run_dir)
        .map_err(|e| LiveError::Setup(format!("{e:#}")))?;
    let runs = rates.len() * grid.policies.len();
    let mut figures = Vec::with_capacity(runs);
    let mut finished_runs = 0;
    for &policy in &grid.policies {
        let proxy = fleet
            .proxy(policy.envoy_lb(), policy == LivePolicy::KvoyAggregator)
            .map_err(|e| LiveError::Proxy {
                policy: policy.name(),
                message: format!("{e:#}"),
            })?;
        for &rate in &rates {
            fleet.reset().map_err(|e| LiveError::Proxy {
                policy: policy.name(),
                message: format!("resetting the simulators: {e:#}"),
            })?;
            let plan = w.plan(rate, grid.seed);
            let ideal = measure(&plan, &grid.profile);
            let plan = scale_plan(&plan, 1.0 / speedup);
            let drive = driver::Drive {
                proxy: proxy.listen(),
                model: fleet::MODEL.to_owned(),
                arrivals: grid.arrivals,
                request_timeout: Duration::from_secs(120),
                deadline: grid.run_deadline,
            };
            let outcomes = driver::run(&plan, &drive, &mut |done, total| {
                progress(LiveProgress {
                    policy: policy.name(),
                    rate,
                    done,
                    total,
                    finished_runs,
                    runs,
                });
            });
            let mut recorder = Recorder::new(grid.replicas);
            driver::record(&outcomes, fleet.addrs(), &mut recorder);
            if recorder.completed == 0 {
                return Err(LiveError::NothingCompleted {
                    policy: policy.name(),
                    rate,
                    error: driver::first_error(&outcomes).unwrap_or_else(|| "none".into()),
                });
            }
            scale_recorder(&mut recorder, speedup);
            recorder.ideal_hit_tokens = ideal.ideal_hit_tokens;
            recorder.ideal_prompt_tokens = ideal.prompt_tokens;
            figures.push(recorder.figures(w.name(), policy.name(), rate, rate / cap.rate));
            finished_runs += 1;
        }
        drop(proxy);
    }
    Ok(Report {
        tool: "kvoy-bench live",
        profile: grid.profile.name.clone(),
        replicas: grid.replicas,
        fleet: crate::fleet::FleetKind::Uniform,
        seed: grid.seed,
        scrape_interval_ms: fleet::AGGREGATOR_SCRAPE_MS,
        policies: grid.policies.iter().map(|p| p.name().to_owned()).collect(),
        workloads: vec![WorkloadReport {
            name: w.name().to_owned(),
            description: w.describe(),
            shape,
            saturation: cap,
            rates,
            runs: figures,
        }],
    })
}

/// `plan` with every arrival time and delay multiplied by `factor`.
fn scale_plan(plan: &Plan, factor: f64) -> Plan {
    let mut plan = plan.clone();
    for s in &mut plan.sessions {
        s.start = s.start.mul_f64(factor);
        for t in &mut s.turns {
            t.delay = t.delay.mul_f64(factor);
        }
    }
    plan
}

/// Every duration of `r` multiplied by `factor` (real seconds to the modelled GPU's).
fn scale_recorder(r: &mut Recorder, factor: f64) {
    for v in r.ttft.iter_mut().chain(r.e2e.iter_mut()) {
        *v *= factor;
    }
    for v in r.class_ttft.values_mut().flatten() {
        *v *= factor;
    }
    for v in &mut r.itl {
        *v *= factor as f32;
    }
    r.first_arrival = r.first_arrival.map(|d| d.mul_f64(factor));
    r.last_completion = r.last_completion.mul_f64(factor);
    r.window_end = r.window_end.mul_f64(factor);
}
