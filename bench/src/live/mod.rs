//! The live benchmark: real Envoy, kvoy-sim simulators (real HTTP, SSE, ZMQ KV events) and
//! kvoy-aggregator on 127.0.0.1, the same seeded plan sent through each policy in turn.
//!
//! Policies: Envoy's own `ROUND_ROBIN`, `LEAST_REQUEST` and `RANDOM` over a STATIC cluster of
//! the simulators (`bench/envoy/baseline.yaml`, no kvoy filter), `envoy/kvoy.yaml` with the
//! kvoy filters, once with the per-proxy index only (`kvoy`) and once polling the aggregator
//! (`kvoy-aggregator`), and the real peer routers as processes of their own ([`routers`]):
//! SGLang's model gateway with its `cache_aware` and `round_robin` policies and vLLM's router
//! with `cache_aware`, at their published defaults, and, when asked for, vLLM's router in its
//! precise mode (`kv_aware`, fed by the simulators' KV events; the simulators then tokenize
//! with a real tokenizer, `LiveGrid::tokenizer`). Every run starts a fresh proxy (no routing
//! state left from an earlier run), measures its hop ([`hop`]), then empties the simulators'
//! prefix caches once the fleet is idle, and sends the plan.
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
pub mod hop;
pub mod routers;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use kvoy_sim_engine::Profile;

pub use driver::{Arrivals, Outcome};
pub use fleet::{baseline_proxy, Fleet, Proxy, ProxyKind};
pub use routers::{RouterCounters, RouterKind};

use crate::metrics::{Recorder, RunFigures};
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
    /// SGLang's model gateway (`smg`), policy `cache_aware`.
    SmgCacheAware,
    /// SGLang's model gateway, policy `round_robin`.
    SmgRoundRobin,
    /// vLLM's router, policy `cache_aware`.
    VllmRouter,
    /// vLLM's router in its precise mode: policy `kv_aware` over the simulators' KV events.
    VllmRouterKvAware,
}

impl LivePolicy {
    /// Every policy `--policies` accepts.
    pub const ALL: [LivePolicy; 9] = [
        LivePolicy::RoundRobin,
        LivePolicy::LeastRequest,
        LivePolicy::Random,
        LivePolicy::Kvoy,
        LivePolicy::KvoyAggregator,
        LivePolicy::SmgCacheAware,
        LivePolicy::SmgRoundRobin,
        LivePolicy::VllmRouter,
        LivePolicy::VllmRouterKvAware,
    ];

    /// The default run (`make bench`): all but the precise mode (last in [`Self::ALL`]), which
    /// needs simulators with a real tokenizer (its own run, `bench/results/live/precise.md`).
    pub const DEFAULT: &'static [LivePolicy] = Self::ALL.split_at(Self::ALL.len() - 1).0;

    /// The name in reports (the simulation's names where the policies are the same).
    pub fn name(self) -> &'static str {
        match self {
            LivePolicy::RoundRobin => "round-robin",
            LivePolicy::LeastRequest => "least-request",
            LivePolicy::Random => "random",
            LivePolicy::Kvoy => "kvoy",
            LivePolicy::KvoyAggregator => "kvoy-aggregator",
            LivePolicy::SmgCacheAware => "smg-cache-aware",
            LivePolicy::SmgRoundRobin => "smg-round-robin",
            LivePolicy::VllmRouter => "vllm-router",
            LivePolicy::VllmRouterKvAware => "vllm-router-kv-aware",
        }
    }

    pub fn parse(name: &str) -> Option<LivePolicy> {
        LivePolicy::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The real router and its policy name, for the peer routers.
    pub fn router(self) -> Option<(RouterKind, &'static str)> {
        match self {
            LivePolicy::SmgCacheAware => Some((RouterKind::Smg, "cache_aware")),
            LivePolicy::SmgRoundRobin => Some((RouterKind::Smg, "round_robin")),
            LivePolicy::VllmRouter => Some((RouterKind::VllmRouter, "cache_aware")),
            LivePolicy::VllmRouterKvAware => Some((RouterKind::VllmRouter, "kv_aware")),
            _ => None,
        }
    }

    /// Envoy's load balancer for the cache-blind baselines.
    fn envoy_lb(self) -> Option<&'static str> {
        match self {
            LivePolicy::RoundRobin => Some("ROUND_ROBIN"),
            LivePolicy::LeastRequest => Some("LEAST_REQUEST"),
            LivePolicy::Random => Some("RANDOM"),
            _ => None,
        }
    }

    /// What runs this policy; `binaries` holds the installed routers' commands.
    fn proxy_kind(self, binaries: &BTreeMap<&'static str, PathBuf>) -> Result<ProxyKind, String> {
        if let Some(lb) = self.envoy_lb() {
            return Ok(ProxyKind::Envoy(lb));
        }
        match self.router() {
            Some((kind, policy)) => binaries
                .get(kind.package())
                .map(|binary| ProxyKind::Router {
                    kind,
                    policy,
                    binary: binary.clone(),
                    kv_events: self.needs_kv_events(),
                })
                .ok_or_else(|| format!("{} is not installed", kind.requirement())),
            None => Ok(ProxyKind::Kvoy {
                aggregator: self == LivePolicy::KvoyAggregator,
            }),
        }
    }
}

impl LivePolicy {
    /// Whether the policy routes on the servers' KV events and their real token ids (the
    /// simulators must then run a real tokenizer).
    pub fn needs_kv_events(self) -> bool {
        self == LivePolicy::VllmRouterKvAware
    }
}

/// The small trained tokenizer of the repository (`testdata/tokenizer/tokenizer.json`), which
/// the simulators run when a policy needs real token ids.
pub fn default_tokenizer() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/tokenizer/tokenizer.json"
    ))
}

/// Whether the policy named `policy` is one of the real peer routers (for the reports).
pub fn is_real_router(policy: &str) -> bool {
    LivePolicy::parse(policy).is_some_and(|p| p.router().is_some())
}

/// What to run live.
#[derive(Clone, Debug)]
pub struct LiveGrid {
    pub workloads: Vec<Workload>,
    pub policies: Vec<LivePolicy>,
    pub rates: Vec<Rate>,
    pub profile: Profile,
    pub replicas: usize,
    pub speedup: f64,
    pub seed: u64,
    pub arrivals: Arrivals,
    /// Bound on each run, real time (requests still running then count as errors).
    pub run_deadline: Duration,
    /// Tiny requests sent direct and through the proxy before each run, for its hop.
    pub hop_probes: usize,
    /// Envoy's configuration and logs, the aggregator's configuration, the routers' logs.
    pub run_dir: PathBuf,
    /// A `tokenizer.json` the simulators tokenize with (kvoy-sim `--tokenizer`); `None`: the
    /// stand-in. Every policy of the run sees the same simulators.
    pub tokenizer: Option<PathBuf>,
}

/// Progress of the live grid, for a progress line.
#[derive(Clone, Copy, Debug)]
pub struct LiveProgress<'a> {
    pub workload: &'a str,
    pub policy: &'a str,
    pub rate: f64,
    /// `rate` / the workload's estimated saturation rate.
    pub load: f64,
    pub done: usize,
    pub total: usize,
    pub finished_runs: usize,
    pub runs: usize,
    /// The run's figures, once it has finished (then `finished_runs` counts it).
    pub finished: Option<&'a RunFigures>,
}

#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error("setting up the live fleet: {0}")]
    Setup(String),
    #[error("installing the real routers: {0}")]
    Install(#[from] routers::InstallError),
    #[error("{policy}: {message}")]
    Proxy {
        policy: &'static str,
        message: String,
    },
    #[error("a `t` rate is a multiple of a trace's own rate; use `x` or req/s")]
    TraceRate,
    #[error(
        "{workload} / {policy} at {rate:.2} req/s: no request completed (first error: {error})"
    )]
    NothingCompleted {
        workload: &'static str,
        policy: &'static str,
        rate: f64,
        error: String,
    },
}

/// Installs (if needed) every real router that `policies` use; returns their commands by
/// package.
pub fn install_routers(
    policies: &[LivePolicy],
) -> Result<BTreeMap<&'static str, PathBuf>, routers::InstallError> {
    let mut binaries = BTreeMap::new();
    for (kind, _) in policies.iter().filter_map(|p| p.router()) {
        if !binaries.contains_key(kind.package()) {
            binaries.insert(kind.package(), routers::ensure_installed(kind)?);
        }
    }
    Ok(binaries)
}

/// A workload's saturation estimate and absolute rates.
fn workload_rates(
    w: &Workload,
    grid: &LiveGrid,
) -> Result<
    (
        crate::saturation::Shape,
        crate::saturation::Capacity,
        Vec<f64>,
    ),
    LiveError,
> {
    let mut shape = measure(&w.plan(1.0, grid.seed), &grid.profile);
    let mut cap = capacity(&grid.profile, &shape, grid.replicas);
    if w.content_depends_on_rate() {
        shape = measure(&w.plan(cap.rate, grid.seed), &grid.profile);
        cap = capacity(&grid.profile, &shape, grid.replicas);
    }
    let rates = grid
        .rates
        .iter()
        .map(|r| match *r {
            Rate::Absolute(x) => Ok(x),
            Rate::Saturation(m) => Ok(m * cap.rate),
            Rate::Trace(m) => w.native_rate().map(|n| m * n).ok_or(LiveError::TraceRate),
        })
        .collect::<Result<_, _>>()?;
    Ok((shape, cap, rates))
}

/// Runs every (workload, rate, policy) of `grid` on one fleet, in that order (all policies of
/// one load run back to back, so that they see the machine in the same state), and returns the
/// report (same shape as the simulation's, `tool: "kvoy-bench live"`, plus every proxy's hop).
pub fn run(
    grid: &LiveGrid,
    progress: &mut dyn FnMut(LiveProgress<'_>),
) -> Result<Report, LiveError> {
    let speedup = grid.speedup.max(1e-3);
    let binaries = install_routers(&grid.policies)?;
    let mut reports = Vec::with_capacity(grid.workloads.len());
    for w in &grid.workloads {
        let (shape, saturation, rates) = workload_rates(w, grid)?;
        reports.push(WorkloadReport {
            name: w.name().to_owned(),
            description: w.describe(),
            slo: crate::slo::Slo::for_workload(&shape, &grid.profile, None),
            shape,
            saturation,
            rates,
            runs: Vec::new(),
        });
    }
    let fleet = Fleet::start(
        grid.replicas,
        &grid.profile,
        speedup,
        grid.tokenizer.as_deref(),
        &grid.run_dir,
    )
    .map_err(|e| LiveError::Setup(format!("{e:#}")))?;
    let mut router_runs = Vec::new();
    let runs = reports.iter().map(|r| r.rates.len()).sum::<usize>() * grid.policies.len();
    let mut hops: BTreeMap<&'static str, hop::HopSamples> = BTreeMap::new();
    let mut finished_runs = 0;
    for (w, report) in grid.workloads.iter().zip(&mut reports) {
        for &rate in &report.rates.clone() {
            let load = rate / report.saturation.rate;
            let plan = w.plan(rate, grid.seed);
            let ideal = measure(&plan, &grid.profile);
            let plan = scale_plan(&plan, 1.0 / speedup);
            for &policy in &grid.policies {
                let failed = |message: String| LiveError::Proxy {
                    policy: policy.name(),
                    message,
                };
                let kind = policy.proxy_kind(&binaries).map_err(failed)?;
                let proxy = fleet
                    .proxy(&kind, policy.name())
                    .map_err(|e| failed(format!("{e:#}")))?;
                hops.entry(policy.name()).or_default().extend(hop::probe(
                    proxy.listen(),
                    fleet.addrs(),
                    fleet::MODEL,
                    finished_runs,
                    grid.hop_probes,
                ));
                fleet
                    .reset()
                    .map_err(|e| failed(format!("resetting the simulators: {e:#}")))?;
                // vLLM's router's counters before the run (the hop's probes went through it).
                let vllm_router = match (&proxy, policy.router()) {
                    (Proxy::Router(r), Some((RouterKind::VllmRouter, _))) => Some(r),
                    _ => None,
                };
                let counters_before = vllm_router.and_then(|r| r.counters().ok());
                let drive = driver::Drive {
                    proxy: proxy.listen(),
                    model: fleet::MODEL.to_owned(),
                    arrivals: grid.arrivals,
                    request_timeout: Duration::from_secs(120),
                    deadline: grid.run_deadline,
                };
                let mut tick = |done, total, finished_runs, finished| {
                    progress(LiveProgress {
                        workload: w.name(),
                        policy: policy.name(),
                        rate,
                        load,
                        done,
                        total,
                        finished_runs,
                        runs,
                        finished,
                    })
                };
                let outcomes = driver::run(&plan, &drive, &mut |done, total| {
                    tick(done, total, finished_runs, None);
                });
                // vLLM's router's own count of its renders and prefix lookups, before it stops.
                if let Some(router) = vllm_router {
                    match router.counters() {
                        Ok(counters) => router_runs.push(RouterRun {
                            workload: w.name().to_owned(),
                            policy: policy.name().to_owned(),
                            rate,
                            requests: plan.requests() as u64,
                            counters: counters.since(&counters_before.clone().unwrap_or_default()),
                        }),
                        Err(e) => eprintln!(
                            "kvoy-bench live: {}: cannot read the router's metrics: {e:#}",
                            policy.name()
                        ),
                    }
                }
                drop(proxy);
                let mut recorder = Recorder::new(grid.replicas);
                driver::record(&outcomes, fleet.addrs(), &mut recorder);
                if recorder.completed == 0 {
                    return Err(LiveError::NothingCompleted {
                        workload: w.name(),
                        policy: policy.name(),
                        rate,
                        error: driver::first_error(&outcomes).unwrap_or_else(|| "none".into()),
                    });
                }
                // Every planned request that did not complete is an error: refused, failed,
                // abandoned at the deadline, or never sent because its session broke off.
                recorder.rejected = (plan.requests() as u64).saturating_sub(recorder.completed);
                scale_recorder(&mut recorder, speedup);
                recorder.ideal_hit_tokens = ideal.ideal_hit_tokens;
                recorder.ideal_prompt_tokens = ideal.prompt_tokens;
                let slo = report.slo.map(|s| s.ttft_s);
                let figures = recorder.figures(w.name(), policy.name(), rate, load, slo);
                finished_runs += 1;
                tick(
                    figures.completed as usize,
                    plan.requests(),
                    finished_runs,
                    Some(&figures),
                );
                report.runs.push(figures);
            }
        }
    }
    Ok(Report {
        tool: "kvoy-bench live",
        profile: grid.profile.name.clone(),
        replicas: grid.replicas,
        fleet: crate::fleet::FleetKind::Uniform,
        seed: grid.seed,
        scrape_interval_ms: fleet::AGGREGATOR_SCRAPE_MS,
        policies: grid.policies.iter().map(|p| p.name().to_owned()).collect(),
        workloads: reports,
        hops: grid
            .policies
            .iter()
            .filter_map(|p| hops.get(p.name()).map(|h| h.figures(p.name())))
            .collect(),
        router_runs,
    })
}

/// What vLLM's router counted in one run (its tokenization on the request path, its lookups).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RouterRun {
    pub workload: String,
    pub policy: String,
    pub rate: f64,
    /// Requests planned in the run.
    pub requests: u64,
    /// Counted during the run only (the hop's probes before it left out).
    pub counters: RouterCounters,
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
    for s in &mut r.served {
        s.ttft_s *= factor;
    }
    for v in &mut r.itl {
        *v *= factor as f32;
    }
    r.first_arrival = r.first_arrival.map(|d| d.mul_f64(factor));
    r.last_completion = r.last_completion.mul_f64(factor);
    r.window_end = r.window_end.mul_f64(factor);
}
