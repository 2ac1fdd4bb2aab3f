//! The grid of runs: every (workload, rate, policy, seed), spread over a few threads, collected
//! in a fixed order so that the report does not depend on the thread count.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use kvoy_sim_engine::Profile;

use crate::fleet::FleetKind;
use crate::metrics::RunFigures;
use crate::policy::{PolicyKind, PolicyOptions};
use crate::report::{Report, WorkloadReport};
use crate::saturation::{fleet_capacity, measure};
use crate::sim::{self, SimConfig, SimError};
use crate::slo::Slo;
use crate::workload::Workload;

/// A rate on the command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rate {
    /// Requests per second.
    Absolute(f64),
    /// A multiple of the workload's estimated saturation rate (`1.5x`).
    Saturation(f64),
    /// A multiple of a trace's own rate (`2t`, trace replay only).
    Trace(f64),
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Grid {
    pub workloads: Vec<Workload>,
    pub policies: Vec<PolicyKind>,
    pub rates: Vec<Rate>,
    /// The base profile; `fleet` says which replicas run a slowed version of it.
    pub profile: Profile,
    pub replicas: usize,
    pub fleet: FleetKind,
    /// Every cell runs once per seed (which drives the plan and every random draw); the first is
    /// the nominal seed, whose plan gives the shape, the saturation estimate and the SLO.
    pub seeds: Vec<u64>,
    /// The TTFT SLO, seconds; `None`: the default rule of [`crate::slo`].
    pub slo_ttft_s: Option<f64>,
    pub threads: usize,
    pub sglang_tree_chars: Option<usize>,
    /// kvoy's `cost` fields set over the bench's (`--kvoy-cost`).
    pub kvoy_cost: crate::policy::kvoy::CostOverrides,
    /// kvoy's `disaggregation` fields set over the filter's.
    pub kvoy_disaggregation: crate::policy::kvoy::CostOverrides,
    /// Model the cache-blind baselines as Envoy runs them on this many worker threads (see
    /// [`crate::policy::basic`]); `None`: the textbook algorithms.
    pub envoy_workers: Option<usize>,
    /// How often the servers' figures are read (the reference picker's and kvoy-aggregator's
    /// scrape interval, 50 ms).
    pub scrape_interval: std::time::Duration,
    /// Put this share of each plan's sessions in the sheddable band and run every policy
    /// behind its admission stage (see [`crate::admission`]); `None`: no bands, no stage.
    pub sheddable: Option<f64>,
    /// kvoy's `flow` fields set over the bench's (`--kvoy-flow`).
    pub kvoy_flow: serde_json::Map<String, serde_json::Value>,
    /// Prefill/decode disaggregation: the first this many replicas only prefill, the others
    /// decode (`--prefill-replicas`; 0: the aggregated fleet).
    pub prefill_replicas: usize,
}

impl Grid {
    /// Each replica's role: [`Grid::prefill_replicas`] prefill ones first; empty for the
    /// aggregated fleet.
    pub fn roles(&self) -> Vec<kvoy_shared::Role> {
        if self.prefill_replicas == 0 {
            return Vec::new();
        }
        (0..self.replicas)
            .map(|i| {
                if i < self.prefill_replicas {
                    kvoy_shared::Role::Prefill
                } else {
                    kvoy_shared::Role::Decode
                }
            })
            .collect()
    }
}

/// Progress of the grid, for a progress line.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub workload: &'a str,
    pub policy: &'a str,
    pub load: f64,
    pub rate: f64,
    pub seed: u64,
    pub done: u64,
    pub total: u64,
    /// Runs finished so far, of `runs`.
    pub finished_runs: usize,
    pub runs: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(
        "workload {workload}: a `t` rate is a multiple of a trace's own rate; use `x` or req/s"
    )]
    TraceRate { workload: &'static str },
    #[error("{workload} / {policy} at {rate:.3} req/s: {source}")]
    Sim {
        workload: &'static str,
        policy: &'static str,
        rate: f64,
        source: SimError,
    },
    #[error("cannot build the {policy} policy: {source}")]
    Policy {
        policy: &'static str,
        source: kvoy_shared::prefix_affinity::ConfigError,
    },
    #[error("cannot build the {policy} policy's admission stage: {message}")]
    Gate {
        policy: &'static str,
        message: String,
    },
    #[error("a worker thread panicked")]
    Panicked,
    #[error("no seed to run")]
    NoSeed,
}

struct Job {
    workload: usize,
    rate: f64,
    load: f64,
    policy: PolicyKind,
    seed: u64,
    /// Shared by the runs with the same requests (open-loop workloads, same seed): the ideal
    /// hit tokens and prompt tokens, computed once by whichever run needs them first.
    ideal: Option<usize>,
    slo: Option<f64>,
}

/// Runs the grid; `progress` is called from the worker threads.
pub fn run(grid: &Grid, progress: &(dyn Fn(Progress<'_>) + Sync)) -> Result<Report, RunError> {
    let nominal = *grid.seeds.first().ok_or(RunError::NoSeed)?;
    let seeds = grid.seeds.len();
    let mut reports = Vec::new();
    let mut jobs = Vec::new();
    let mut ideals = 0usize;
    let mut known: Vec<(usize, (u64, u64))> = Vec::new();
    let slowdowns = grid.fleet.slowdowns(grid.replicas);
    let profiles = grid.fleet.profiles(&grid.profile, grid.replicas);
    for (wi, w) in grid.workloads.iter().enumerate() {
        // The shape can depend on the number of requests (a cycled pool repeats prompts): measure
        // it at a first estimate of saturation, then once more at that rate.
        let mut shape = measure(&w.plan(1.0, nominal), &grid.profile);
        let mut cap = fleet_capacity(&grid.profile, &shape, &slowdowns);
        if w.content_depends_on_rate() {
            shape = measure(&w.plan(cap.rate, nominal), &grid.profile);
            cap = fleet_capacity(&grid.profile, &shape, &slowdowns);
        }
        let mut rates = Vec::new();
        for r in &grid.rates {
            let rate = match *r {
                Rate::Absolute(x) => x,
                Rate::Saturation(m) => m * cap.rate,
                Rate::Trace(m) => match w.native_rate() {
                    Some(native) => m * native,
                    None => return Err(RunError::TraceRate { workload: w.name() }),
                },
            };
            rates.push(rate);
        }
        let slo = Slo::for_workload(&shape, &grid.profile, grid.slo_ttft_s);
        let shared_content = !w.content_depends_on_rate();
        let first_ideal = ideals;
        if shared_content && w.open_loop() {
            // The same requests at every rate: the shape's ideal is every nominal run's.
            known.push((
                ideals * seeds,
                (shape.ideal_hit_tokens, shape.prompt_tokens),
            ));
        }
        for &rate in &rates {
            // One ideal per rate and seed, or one per seed for all rates when only the timing
            // changes; seed `k`'s of slot `i` is cell `i * seeds + k`.
            let ideal = w.open_loop().then(|| {
                if !shared_content || ideals == first_ideal {
                    ideals += 1;
                }
                ideals - 1
            });
            for &policy in &grid.policies {
                for (k, &seed) in grid.seeds.iter().enumerate() {
                    jobs.push(Job {
                        workload: wi,
                        rate,
                        load: rate / cap.rate,
                        policy,
                        seed,
                        ideal: ideal.map(|i| i * seeds + k),
                        slo: slo.map(|s| s.ttft_s),
                    });
                }
            }
        }
        reports.push(WorkloadReport {
            name: w.name().to_owned(),
            description: w.describe(),
            shape,
            saturation: cap,
            rates,
            runs: Vec::new(),
            slo,
        });
    }

    // Heavier workloads first, so that the two threads finish together.
    let weight = |j: &Job| {
        let s = &reports[j.workload].shape;
        s.requests as f64 * (s.mean_prompt_tokens + 20.0 * s.mean_output_tokens)
    };
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| {
        weight(&jobs[b])
            .total_cmp(&weight(&jobs[a]))
            .then(a.cmp(&b))
    });

    let results: Mutex<Vec<Option<Result<RunFigures, RunError>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let ideal_cells: Vec<OnceLock<(u64, u64)>> =
        (0..ideals * seeds).map(|_| OnceLock::new()).collect();
    for (i, totals) in known {
        if let Some(cell) = ideal_cells.get(i) {
            let _ = cell.set(totals);
        }
    }
    let next = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let threads = grid.threads.clamp(1, jobs.len().max(1));
    let worker = || loop {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let Some(&j) = order.get(k) else {
            break;
        };
        let cell = jobs[j].ideal.and_then(|i| ideal_cells.get(i));
        let result = run_job(
            grid,
            &profiles,
            &jobs[j],
            cell,
            &finished,
            jobs.len(),
            progress,
        );
        finished.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut r) = results.lock() {
            r[j] = Some(result);
        }
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(worker)).collect();
        handles.into_iter().map(|h| h.join()).collect::<Vec<_>>()
    })
    .into_iter()
    .collect::<Result<Vec<()>, _>>()
    .map_err(|_| RunError::Panicked)?;

    let results = results.into_inner().map_err(|_| RunError::Panicked)?;
    for (job, result) in jobs.iter().zip(results) {
        let figures = result.ok_or(RunError::Panicked)??;
        reports[job.workload].runs.push(figures);
    }
    Ok(Report {
        tool: "kvoy-bench sim",
        profile: grid.profile.name.clone(),
        replicas: grid.replicas,
        fleet: grid.fleet,
        seed: nominal,
        scrape_interval_ms: grid.scrape_interval.as_millis() as u64,
        policies: grid.policies.iter().map(|p| p.name().to_owned()).collect(),
        workloads: reports,
        hops: Vec::new(),
        router_runs: Vec::new(),
        commands: Vec::new(),
        details: Vec::new(),
    })
}

fn run_job(
    grid: &Grid,
    profiles: &[Profile],
    job: &Job,
    ideal: Option<&OnceLock<(u64, u64)>>,
    finished: &AtomicUsize,
    runs: usize,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Result<RunFigures, RunError> {
    let w = &grid.workloads[job.workload];
    let mut plan = w.plan(job.rate, job.seed);
    let mut gate = match grid.sheddable {
        Some(share) => {
            plan.mark_sheddable(share, job.seed);
            crate::admission::for_policy(job.policy, grid.replicas, &grid.kvoy_flow).map_err(
                |message| RunError::Gate {
                    policy: job.policy.name(),
                    message,
                },
            )?
        }
        None => None,
    };
    let mut policy = job
        .policy
        .build(&PolicyOptions {
            replicas: grid.replicas,
            seed: job.seed,
            profile: grid.profile.clone(),
            replica_profiles: profiles.to_vec(),
            sglang_tree_chars: grid.sglang_tree_chars,
            kvoy_cost: grid.kvoy_cost.clone(),
            kvoy_disaggregation: grid.kvoy_disaggregation.clone(),
            envoy_workers: grid.envoy_workers,
            roles: grid.roles(),
        })
        .map_err(|source| RunError::Policy {
            policy: job.policy.name(),
            source,
        })?;
    let mut cfg = SimConfig::with_profiles(profiles.to_vec());
    cfg.scrape_interval = grid.scrape_interval;
    cfg.roles = grid.roles();
    let ideal = ideal.map(|cell| {
        *cell.get_or_init(|| {
            let shape = measure(&plan, &grid.profile);
            (shape.ideal_hit_tokens, shape.prompt_tokens)
        })
    });
    cfg.track_ideal = ideal.is_none();
    let report = |done, total| {
        progress(Progress {
            workload: w.name(),
            policy: job.policy.name(),
            load: job.load,
            rate: job.rate,
            seed: job.seed,
            done,
            total,
            finished_runs: finished.load(Ordering::Relaxed),
            runs,
        })
    };
    let mut last = 0u64;
    let mut on_progress = |done: u64, total: u64| {
        // Report each tenth of the run once.
        let tenth = done * 10 / total.max(1);
        if tenth > last {
            last = tenth;
            report(done, total);
        }
    };
    let gate = gate
        .as_deref_mut()
        .map(|g| g as &mut dyn crate::admission::Gate);
    let mut recorder = sim::run_gated(&plan, policy.as_mut(), gate, &cfg, &mut on_progress)
        .map_err(|source| RunError::Sim {
            workload: w.name(),
            policy: job.policy.name(),
            rate: job.rate,
            source,
        })?;
    if let Some((hit, prompt)) = ideal {
        (recorder.ideal_hit_tokens, recorder.ideal_prompt_tokens) = (hit, prompt);
    }
    let mut figures = recorder.figures(w.name(), job.policy.name(), job.rate, job.load, job.slo);
    figures.seed = Some(job.seed);
    Ok(figures)
}
