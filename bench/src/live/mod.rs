//! The live benchmark: real Envoy, kvoy-sim simulators (real HTTP, SSE, ZMQ KV events) and
//! kvoy-aggregator on 127.0.0.1, the same seeded plan sent through each policy in turn.
//!
//! Policies: Envoy's own `ROUND_ROBIN`, `LEAST_REQUEST` and `RANDOM` over a STATIC cluster of
//! the simulators (`bench/envoy/baseline.yaml`, no kvoy filter), `envoy/kvoy.yaml` with the
//! kvoy filters, once with the per-proxy index only (`kvoy`) and once polling the aggregator
//! (`kvoy-aggregator`), and the real peer routers as processes of their own ([`routers`]):
//! SGLang's model gateway with its `cache_aware` and `round_robin` policies, its 1.13 release
//! with `cache_aware` (plain, and with dispatch bookings and overlap decay) and `least_load`,
//! and vLLM's router with `cache_aware`, at their published defaults but for the flags a
//! variant names ([`LivePolicy::command_line`]), and, when asked for, vLLM's router in its
//! precise mode (`kv_aware`, fed by the simulators' KV events; the simulators then tokenize
//! with a real tokenizer, `LiveGrid::tokenizer`). Every run starts a fresh proxy (no routing
//! state left from an earlier run), measures its hop ([`hop`]), then empties the simulators'
//! prefix caches once the fleet is idle, and sends the plan, sampling where the decodes run
//! ([`placement`]). Each cell runs every policy `repeats` times in a rotating order
//! ([`rotation`]); the report reads each cell's median ([`tables`]).
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
pub mod placement;
pub mod routers;
pub mod tables;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvoy_sim_engine::Profile;

use placement::PlacementStats;

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
    /// smg 1.13.0, policy `cache_aware`, every setting at its default.
    Smg113CacheAware,
    /// smg 1.13.0, `cache_aware` with optimistic dispatch bookings (2 s) and the anti-hotspot
    /// overlap decay on (1.0).
    Smg113CacheAwareBookings,
    /// smg 1.13.0, policy `least_load`.
    Smg113LeastLoad,
    /// vLLM's router in its precise mode: policy `kv_aware` over the simulators' KV events.
    VllmRouterKvAware,
}

/// A real router's policy as the live run starts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterPolicy {
    pub kind: RouterKind,
    /// `--policy`.
    pub policy: &'static str,
    /// Flags set on top of the router's defaults (after `--worker-urls`).
    pub flags: &'static [&'static str],
}

/// smg 1.13's bookings variant: `--selection-accounting-ttl-ms` charges each pick's predicted
/// prefill and prefix to the chosen worker until the engine reports it (2 s: "a little above
/// the engine's KV-event lag", which smg over HTTP never sees, so the booking lives out its
/// TTL), and `--overlap-decay 1.0` divides a candidate's overlap by 1 + its waiting-prefill
/// backlog per request block (it needs the loads smg polls from `/metrics`).
const SMG_BOOKINGS: &[&str] = &[
    "--selection-accounting-ttl-ms",
    "2000",
    "--overlap-decay",
    "1.0",
];

impl LivePolicy {
    /// Every policy `--policies` accepts.
    pub const ALL: [LivePolicy; 12] = [
        LivePolicy::RoundRobin,
        LivePolicy::LeastRequest,
        LivePolicy::Random,
        LivePolicy::Kvoy,
        LivePolicy::KvoyAggregator,
        LivePolicy::SmgCacheAware,
        LivePolicy::SmgRoundRobin,
        LivePolicy::VllmRouter,
        LivePolicy::Smg113CacheAware,
        LivePolicy::Smg113CacheAwareBookings,
        LivePolicy::Smg113LeastLoad,
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
            LivePolicy::Smg113CacheAware => "smg-1.13-cache-aware",
            LivePolicy::Smg113CacheAwareBookings => "smg-1.13-cache-aware-bookings",
            LivePolicy::Smg113LeastLoad => "smg-1.13-least-load",
            LivePolicy::VllmRouterKvAware => "vllm-router-kv-aware",
        }
    }

    pub fn parse(name: &str) -> Option<LivePolicy> {
        LivePolicy::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The real router, its policy and flags, for the peer routers.
    pub fn router(self) -> Option<RouterPolicy> {
        let (kind, policy, flags) = match self {
            LivePolicy::SmgCacheAware => (RouterKind::Smg, "cache_aware", &[][..]),
            LivePolicy::SmgRoundRobin => (RouterKind::Smg, "round_robin", &[][..]),
            LivePolicy::VllmRouter => (RouterKind::VllmRouter, "cache_aware", &[][..]),
            LivePolicy::VllmRouterKvAware => (RouterKind::VllmRouter, "kv_aware", &[][..]),
            LivePolicy::Smg113CacheAware => (RouterKind::Smg113, "cache_aware", &[][..]),
            LivePolicy::Smg113CacheAwareBookings => {
                (RouterKind::Smg113, "cache_aware", SMG_BOOKINGS)
            }
            LivePolicy::Smg113LeastLoad => (RouterKind::Smg113, "least_load", &[][..]),
            _ => return None,
        };
        Some(RouterPolicy {
            kind,
            policy,
            flags,
        })
    }

    /// The exact command line a real router's runs start, addresses as placeholders
    /// ([`RouterKind::command_template`]); `block_size`: the simulators' (for the precise mode).
    pub fn command_line(self, block_size: u32) -> Option<String> {
        let r = self.router()?;
        let kv_events = self.needs_kv_events().then_some((fleet::MODEL, block_size));
        Some(r.kind.command_template(r.policy, r.flags, kv_events))
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
            Some(r) => binaries
                .get(r.kind.package())
                .map(|binary| ProxyKind::Router {
                    kind: r.kind,
                    policy: r.policy,
                    flags: r.flags,
                    binary: binary.clone(),
                    kv_events: self.needs_kv_events(),
                })
                .ok_or_else(|| format!("{} is not installed", r.kind.requirement())),
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
    /// Runs of every policy in each (workload, rate) cell, the order rotating ([`rotation`]).
    pub repeats: usize,
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
    /// 0-based repeat of the cell.
    pub repeat: usize,
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
    for kind in policies.iter().filter_map(|p| p.router()).map(|r| r.kind) {
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

/// The order of `policies` in repeat `repeat`: rotated to start at policy `repeat mod P`, so
/// that over `P` repeats each policy runs once in every position (first after the fleet's
/// start or a new load, last before the next), and what a run leaves behind on the machine
/// (warm page caches, a router still exiting) does not always favour the same policy.
pub fn rotation<T: Copy>(policies: &[T], repeat: usize) -> Vec<T> {
    if policies.is_empty() {
        return Vec::new();
    }
    let start = repeat % policies.len();
    policies[start..]
        .iter()
        .chain(&policies[..start])
        .copied()
        .collect()
}

/// Runs every (workload, rate) of `grid` on one fleet, each with every policy `grid.repeats`
/// times, the policies' order rotating from one repeat to the next ([`rotation`]): all runs of
/// one load back to back, so that they see the machine in the same state. Returns the report
/// (same shape as the simulation's, `tool: "kvoy-bench live"`, one run per repeat in each
/// cell, plus every proxy's hop, the real routers' command lines and each run's placement).
pub fn run(
    grid: &LiveGrid,
    progress: &mut dyn FnMut(LiveProgress<'_>),
) -> Result<Report, LiveError> {
    let speedup = grid.speedup.max(1e-3);
    let repeats = grid.repeats.max(1);
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
    let mut details = Vec::new();
    let runs = reports.iter().map(|r| r.rates.len()).sum::<usize>() * grid.policies.len() * repeats;
    let mut hops: BTreeMap<&'static str, hop::HopSamples> = BTreeMap::new();
    let mut finished_runs = 0;
    // A run's samples: the deadline's worth of them, and a margin for the wait on stragglers.
    let max_samples =
        (grid.run_deadline.as_millis() / placement::SAMPLE_EVERY.as_millis().max(1)) as usize + 40;
    for (w, report) in grid.workloads.iter().zip(&mut reports) {
        for &rate in &report.rates.clone() {
            let load = rate / report.saturation.rate;
            let plan = w.plan(rate, grid.seed);
            let ideal = measure(&plan, &grid.profile);
            let plan = scale_plan(&plan, 1.0 / speedup);
            for repeat in 0..repeats {
                for (position, policy) in rotation(&grid.policies, repeat).into_iter().enumerate() {
                    let failed = |message: String| LiveError::Proxy {
                        policy: policy.name(),
                        message,
                    };
                    let started = Instant::now();
                    let kind = policy.proxy_kind(&binaries).map_err(failed)?;
                    let mut proxy = fleet
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
                    let is_vllm_router =
                        policy.router().map(|r| r.kind) == Some(RouterKind::VllmRouter);
                    let counters_before = match &proxy {
                        Proxy::Router(r) if is_vllm_router => r.counters().ok(),
                        _ => None,
                    };
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
                            repeat,
                            done,
                            total,
                            finished_runs,
                            runs,
                            finished,
                        })
                    };
                    let setup = started.elapsed();
                    let sampler = placement::Sampler::start(fleet.addrs(), speedup, max_samples);
                    let driving = Instant::now();
                    let outcomes = driver::run(&plan, &drive, &mut |done, total| {
                        tick(done, total, finished_runs, None);
                    });
                    let drive_time = driving.elapsed();
                    let sampled = sampler.finish();
                    // vLLM's router's own count of its renders and prefix lookups, before it
                    // stops.
                    if let Proxy::Router(router) = &proxy {
                        if is_vllm_router {
                            match router.counters() {
                                Ok(counters) => router_runs.push(RouterRun {
                                    workload: w.name().to_owned(),
                                    policy: policy.name().to_owned(),
                                    rate,
                                    requests: plan.requests() as u64,
                                    counters: counters
                                        .since(&counters_before.clone().unwrap_or_default()),
                                }),
                                Err(e) => eprintln!(
                                    "kvoy-bench live: {}: cannot read the router's metrics: {e:#}",
                                    policy.name()
                                ),
                            }
                        }
                    }
                    let stopped = match &mut proxy {
                        Proxy::Router(router) => router.stop(),
                        _ => None,
                    };
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
                    recorder.preemptions = sampled.preemptions.unwrap_or(0);
                    scale_recorder(&mut recorder, speedup);
                    recorder.ideal_hit_tokens = ideal.ideal_hit_tokens;
                    recorder.ideal_prompt_tokens = ideal.prompt_tokens;
                    let slo = report.slo.map(|s| s.ttft_s);
                    let figures = recorder.figures(w.name(), policy.name(), rate, load, slo);
                    details.push(RunDetail {
                        workload: w.name().to_owned(),
                        policy: policy.name().to_owned(),
                        rate,
                        repeat,
                        position,
                        ttft_p90_s: figures.ttft_s.p90,
                        preemptions: sampled.preemptions,
                        placement: PlacementStats::of(&sampled.samples),
                        setup_s: setup.as_secs_f64(),
                        drive_s: drive_time.as_secs_f64(),
                        stop_s: stopped.map(|s| s.took.as_secs_f64()),
                        killed: stopped.is_some_and(|s| s.killed),
                        samples: sampled.samples,
                    });
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
        commands: grid
            .policies
            .iter()
            .filter_map(|p| {
                let r = p.router()?;
                Some(RouterCommand {
                    policy: p.name().to_owned(),
                    requirement: r.kind.requirement(),
                    command: p.command_line(grid.profile.block_size)?,
                })
            })
            .collect(),
        details,
    })
}

/// A real router's exact command line, for the report.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RouterCommand {
    pub policy: String,
    /// `package==version`.
    pub requirement: String,
    /// [`LivePolicy::command_line`]: addresses and ports as placeholders.
    pub command: String,
}

/// What one live run saw besides its figures: where it ran in the rotation, how its decodes
/// were spread, and how long its parts took (real seconds).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunDetail {
    pub workload: String,
    pub policy: String,
    pub rate: f64,
    /// 0-based repeat of the cell.
    pub repeat: usize,
    /// 0-based position of the policy in that repeat's order.
    pub position: usize,
    /// The run's TTFT p90 (modelled seconds), to pick a cell's median run.
    pub ttft_p90_s: f64,
    /// Preemptions over every simulator during the run (`None`: a counter was unreadable).
    pub preemptions: Option<u64>,
    pub placement: PlacementStats,
    /// Starting the proxy, its hop probes and the caches' reset.
    pub setup_s: f64,
    /// Sending the plan until the last answer (or the deadline).
    pub drive_s: f64,
    /// A real router's exit on SIGTERM (killed after [`routers::STOP_GRACE`]: `killed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_s: Option<f64>,
    #[serde(default)]
    pub killed: bool,
    /// Every simulator's running and waiting sequences during the run (plots only; not saved).
    #[serde(skip)]
    pub samples: Vec<placement::Sample>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotation_starts_each_repeat_one_policy_later() {
        let p = ["a", "b", "c"];
        assert_eq!(rotation(&p, 0), ["a", "b", "c"]);
        assert_eq!(rotation(&p, 1), ["b", "c", "a"]);
        assert_eq!(rotation(&p, 2), ["c", "a", "b"]);
        assert_eq!(rotation(&p, 3), ["a", "b", "c"]);
        // Over P repeats every policy runs once in every position.
        for (i, policy) in p.iter().enumerate() {
            let positions: Vec<usize> = (0..p.len())
                .map(|r| {
                    rotation(&p, r)
                        .iter()
                        .position(|x| x == policy)
                        .unwrap_or(usize::MAX)
                })
                .collect();
            let mut sorted = positions.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, [0, 1, 2], "{policy} ({i}): {positions:?}");
        }
        assert!(rotation::<u8>(&[], 5).is_empty());
    }

    #[test]
    fn every_real_router_policy_has_its_exact_command_line() {
        let line = |p: LivePolicy| p.command_line(16).unwrap_or_default();
        let head = "launch --host 127.0.0.1 --port <port> --prometheus-host 127.0.0.1 \
                    --prometheus-port <metrics-port> --policy";
        assert_eq!(
            line(LivePolicy::Smg113CacheAware),
            format!("smg {head} cache_aware --worker-urls <worker-url>...")
        );
        assert_eq!(
            line(LivePolicy::Smg113CacheAwareBookings),
            format!(
                "smg {head} cache_aware --worker-urls <worker-url>... \
                 --selection-accounting-ttl-ms 2000 --overlap-decay 1.0"
            )
        );
        assert_eq!(
            line(LivePolicy::Smg113LeastLoad),
            format!("smg {head} least_load --worker-urls <worker-url>...")
        );
        assert_eq!(
            line(LivePolicy::SmgCacheAware),
            format!("smg {head} cache_aware --worker-urls <worker-url>...")
        );
        assert_eq!(
            line(LivePolicy::SmgRoundRobin),
            format!("smg {head} round_robin --worker-urls <worker-url>...")
        );
        assert_eq!(
            line(LivePolicy::VllmRouter),
            "vllm-router --host 127.0.0.1 --port <port> --prometheus-host 127.0.0.1 \
             --prometheus-port <metrics-port> --policy cache_aware --worker-urls <worker-url>..."
        );
        assert!(line(LivePolicy::VllmRouterKvAware)
            .ends_with("--kv-event-model kvoy-bench --kv-event-block-size 16"));
        for p in [
            LivePolicy::Kvoy,
            LivePolicy::RoundRobin,
            LivePolicy::KvoyAggregator,
        ] {
            assert_eq!(p.command_line(16), None);
        }
        // The 1.13 policies install the 1.13 package, apart from 0.3.2's.
        for p in [
            LivePolicy::Smg113CacheAware,
            LivePolicy::Smg113CacheAwareBookings,
            LivePolicy::Smg113LeastLoad,
        ] {
            assert_eq!(p.router().map(|r| r.kind), Some(RouterKind::Smg113));
            assert!(is_real_router(p.name()));
            assert_eq!(LivePolicy::parse(p.name()), Some(p));
        }
        assert_ne!(
            RouterKind::Smg113.package(),
            RouterKind::Smg.package(),
            "install_routers keys the binaries by package"
        );
    }
}
