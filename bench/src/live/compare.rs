//! The simulation checked against the live run: the fleet-scale simulation ([`crate::runner`])
//! on the very plan the live run sent (same workloads, seed, absolute rates, replicas and
//! profile), compared run by run. The simulation models the live setup where it differs from
//! the fleet-scale defaults: Envoy's baselines as Envoy runs them on two workers, and servers'
//! figures as old as the live filter sees them (an aggregator scrape plus a filter poll). Two
//! checks, from the issue: the policies rank the same by TTFT p90, and kvoy's TTFT p90 ratio
//! against each other policy stays within 25% between the two.
//!
//! Only policies the simulation models are compared. The real routers are not: the simulation's
//! `sglang` policy is the original SGLang router's `cache_aware` (a low prefix match goes to the
//! worker with the smallest tree, whose size is bounded by the replica's KV capacity), while
//! `smg` 0.3.2 and vLLM's router send it to the worker with the fewest open requests (first
//! such worker on ties) and bound their trees at 2^26 / 2^25 characters per worker, so mapping
//! them onto `sglang` would check a different algorithm. They are listed as not simulated.

use std::fmt::Write;

use serde::Serialize;

use super::fleet::{AGGREGATOR_SCRAPE_MS, FILTER_POLL_MS};
use super::LiveGrid;
use crate::policy::PolicyKind;
use crate::report::{table, Report};
use crate::runner::{self, Grid, Rate, RunError};

/// Ratios may differ by this fraction (live ratio / simulated ratio - 1).
pub const RATIO_TOLERANCE: f64 = 0.25;
/// Two TTFTs within this fraction of each other are a tie in that run: their order is noise.
pub const TIE: f64 = 0.10;

/// One policy at one rate.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyCheck {
    pub policy: String,
    pub live_ttft_p90_s: f64,
    pub sim_ttft_p90_s: f64,
    pub live_hit_rate: f64,
    pub sim_hit_rate: f64,
    /// kvoy's TTFT p90 / this policy's (absent for kvoy itself).
    pub live_ratio: Option<f64>,
    pub sim_ratio: Option<f64>,
    /// live ratio / simulated ratio - 1.
    pub deviation: Option<f64>,
}

/// One rate of one workload.
#[derive(Clone, Debug, Serialize)]
pub struct RateCheck {
    pub workload: String,
    pub rate: f64,
    pub load: f64,
    /// Policies from the lowest TTFT p90 to the highest.
    pub live_ranking: Vec<String>,
    pub sim_ranking: Vec<String>,
    /// Pairs ordered one way live and the other in the simulation, neither a tie.
    pub swapped: Vec<(String, String)>,
    pub policies: Vec<PolicyCheck>,
}

/// The whole check.
#[derive(Clone, Debug, Serialize)]
pub struct SimCheck {
    pub rates: Vec<RateCheck>,
    pub ranking_agrees: bool,
    pub ratios_within: bool,
    pub worst_deviation: f64,
    /// Live policies the simulation does not model (left out of the check).
    pub not_simulated: Vec<String>,
}

/// The simulation's policies for the live ones it models.
fn simulated_policies(grid: &LiveGrid) -> Vec<PolicyKind> {
    grid.policies
        .iter()
        .filter_map(|p| PolicyKind::from_name(p.name()))
        .collect()
}

/// The rates a live report ran, by workload name.
pub fn live_rates(live: &Report) -> Vec<(String, Vec<f64>)> {
    live.workloads
        .iter()
        .map(|w| (w.name.clone(), w.rates.clone()))
        .collect()
}

/// The simulation of `grid`'s plans at `rates` (absolute, by workload name: the live run's).
pub fn simulate(grid: &LiveGrid, rates: &[(String, Vec<f64>)]) -> Result<Report, RunError> {
    let mut out: Option<Report> = None;
    for (name, rates) in rates {
        let Some(workload) = grid.workloads.iter().find(|w| w.name() == name) else {
            continue;
        };
        let sim = Grid {
            workloads: vec![workload.clone()],
            policies: simulated_policies(grid),
            rates: rates.iter().map(|&r| Rate::Absolute(r)).collect(),
            profile: grid.profile.clone(),
            replicas: grid.replicas,
            fleet: crate::fleet::FleetKind::Uniform,
            seeds: vec![grid.seed],
            slo_ttft_s: None,
            threads: 2,
            sglang_tree_chars: None,
            kvoy_cost: Default::default(),
            kvoy_disaggregation: Default::default(),
            // The live baselines are Envoy's own balancers on two workers.
            envoy_workers: Some(2),
            // What the live filter's loads lag by: an aggregator scrape plus a poll, in real
            // time, which is `speedup` times as much of the modelled GPU's time.
            scrape_interval: std::time::Duration::from_secs_f64(
                grid.speedup * (AGGREGATOR_SCRAPE_MS + FILTER_POLL_MS) as f64 / 1000.0,
            ),
            sheddable: None,
            kvoy_flow: Default::default(),
            prefill_replicas: 0,
        };
        let report = runner::run(&sim, &|_| {})?;
        match &mut out {
            Some(all) => all.workloads.extend(report.workloads),
            None => out = Some(report),
        }
    }
    Ok(out.unwrap_or_else(|| Report {
        tool: "kvoy-bench sim",
        profile: grid.profile.name.clone(),
        replicas: grid.replicas,
        fleet: crate::fleet::FleetKind::Uniform,
        seed: grid.seed,
        scrape_interval_ms: 0,
        policies: Vec::new(),
        workloads: Vec::new(),
        hops: Vec::new(),
        router_runs: Vec::new(),
        commands: Vec::new(),
        details: Vec::new(),
    }))
}

fn ranking(ttft: &[(String, f64)]) -> Vec<String> {
    let mut sorted = ttft.to_vec();
    sorted.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    sorted.into_iter().map(|(p, _)| p).collect()
}

/// -1, 0 (a tie) or 1: how `a` compares with `b`.
fn order(a: f64, b: f64) -> i8 {
    let lo = a.min(b).max(1e-12);
    if (a - b).abs() / lo <= TIE {
        0
    } else if a < b {
        -1
    } else {
        1
    }
}

/// Compares the live report with the simulation of the same plan: each live cell's median over
/// its repeats ([`crate::report::seeds::medians`]) with the simulated run.
pub fn compare(live: &Report, sim: &Report) -> SimCheck {
    let live = &crate::report::seeds::medians(live);
    let mut rates = Vec::new();
    let mut worst: f64 = 0.0;
    for lw in &live.workloads {
        let Some(sw) = sim.workloads.iter().find(|w| w.name == lw.name) else {
            continue;
        };
        for &rate in &lw.rates {
            let pairs: Vec<(String, f64, f64, f64, f64)> = live
                .policies
                .iter()
                .filter_map(|p| {
                    let l = lw.run(p, rate)?;
                    let s = sw.run(p, rate)?;
                    Some((
                        p.clone(),
                        l.ttft_s.p90,
                        s.ttft_s.p90,
                        l.hit_rate,
                        s.hit_rate,
                    ))
                })
                .collect();
            let kvoy = pairs.iter().find(|p| p.0 == "kvoy").cloned();
            let mut policies = Vec::new();
            for (p, l, s, lh, sh) in &pairs {
                let (live_ratio, sim_ratio) = match &kvoy {
                    Some(k) if *p != "kvoy" && *l > 0.0 && *s > 0.0 => {
                        (Some(k.1 / l), Some(k.2 / s))
                    }
                    _ => (None, None),
                };
                let deviation = live_ratio.zip(sim_ratio).map(|(a, b)| a / b - 1.0);
                if let Some(d) = deviation {
                    worst = worst.max(d.abs());
                }
                policies.push(PolicyCheck {
                    policy: p.clone(),
                    live_ttft_p90_s: *l,
                    sim_ttft_p90_s: *s,
                    live_hit_rate: *lh,
                    sim_hit_rate: *sh,
                    live_ratio,
                    sim_ratio,
                    deviation,
                });
            }
            let mut swapped = Vec::new();
            for (i, a) in pairs.iter().enumerate() {
                for b in &pairs[i + 1..] {
                    let (lo, so) = (order(a.1, b.1), order(a.2, b.2));
                    if lo != 0 && so != 0 && lo != so {
                        swapped.push((a.0.clone(), b.0.clone()));
                    }
                }
            }
            let live_ttft: Vec<(String, f64)> = pairs.iter().map(|p| (p.0.clone(), p.1)).collect();
            let sim_ttft: Vec<(String, f64)> = pairs.iter().map(|p| (p.0.clone(), p.2)).collect();
            rates.push(RateCheck {
                workload: lw.name.clone(),
                rate,
                load: rate / lw.saturation.rate,
                live_ranking: ranking(&live_ttft),
                sim_ranking: ranking(&sim_ttft),
                swapped,
                policies,
            });
        }
    }
    SimCheck {
        ranking_agrees: rates.iter().all(|r| r.swapped.is_empty()),
        ratios_within: worst <= RATIO_TOLERANCE,
        worst_deviation: worst,
        rates,
        not_simulated: live
            .policies
            .iter()
            .filter(|p| !sim.policies.contains(p))
            .cloned()
            .collect(),
    }
}

fn ratio(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.3}"))
}

/// The check as Markdown.
pub fn markdown(check: &SimCheck) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# The simulation against the live run\n");
    let _ = writeln!(
        s,
        "The fleet-scale simulation (`kvoy-bench sim`) of the very plan the live run sent: same \
         workload, seed, rates, replicas and profile. TTFT in the modelled GPU's seconds; ratio \
         = kvoy's TTFT p90 / the policy's; deviation = live ratio / simulated ratio - 1 \
         (tolerance {:.0}%). Policies whose TTFT p90 are within {:.0}% of each other count as \
         tied in a ranking.\n",
        RATIO_TOLERANCE * 100.0,
        TIE * 100.0
    );
    let verdict = |ok: bool| if ok { "yes" } else { "**no**" };
    let _ = writeln!(
        s,
        "- Rankings agree: {}\n- Ratios within {:.0}%: {} (largest deviation {:+.1}%)",
        verdict(check.ranking_agrees),
        RATIO_TOLERANCE * 100.0,
        verdict(check.ratios_within),
        check.worst_deviation * 100.0
    );
    if !check.not_simulated.is_empty() {
        let _ = writeln!(
            s,
            "- Not simulated, left out: {} (the simulation's `sglang` is the original SGLang \
             router's algorithm, not these routers': see `src/live/compare.rs`)",
            check.not_simulated.join(", ")
        );
    }
    let _ = writeln!(s);
    for r in &check.rates {
        let _ = writeln!(
            s,
            "## {}: {:.2} req/s ({:.2}x saturation)\n",
            r.workload, r.rate, r.load
        );
        let _ = writeln!(s, "- live ranking: {}", r.live_ranking.join(" < "));
        let _ = writeln!(s, "- simulated ranking: {}", r.sim_ranking.join(" < "));
        if !r.swapped.is_empty() {
            let pairs: Vec<String> = r
                .swapped
                .iter()
                .map(|(a, b)| format!("{a} / {b}"))
                .collect();
            let _ = writeln!(s, "- swapped (not ties): {}", pairs.join(", "));
        }
        let columns = [
            "policy",
            "TTFT p90 live",
            "TTFT p90 sim",
            "ratio live",
            "ratio sim",
            "deviation",
            "hit live",
            "hit sim",
        ];
        let _ = writeln!(s, "\n{}", table::head(&columns, 1));
        for p in &r.policies {
            let _ = writeln!(
                s,
                "| {} | {:.3} | {:.3} | {} | {} | {} | {:.1}% | {:.1}% |",
                p.policy,
                p.live_ttft_p90_s,
                p.sim_ttft_p90_s,
                ratio(p.live_ratio),
                ratio(p.sim_ratio),
                p.deviation
                    .map_or("-".into(), |d| format!("{:+.1}%", d * 100.0)),
                p.live_hit_rate * 100.0,
                p.sim_hit_rate * 100.0
            );
        }
        let _ = writeln!(s);
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    use crate::live::{Arrivals, LivePolicy};
    use crate::workload::{Count, SharedPrefix, Workload};
    use kvoy_sim_engine::Profile;

    fn tiny_grid() -> LiveGrid {
        LiveGrid {
            workloads: vec![Workload::SharedPrefix(SharedPrefix::new(
                0.05,
                Count::Fixed(40),
            ))],
            policies: vec![LivePolicy::RoundRobin, LivePolicy::Kvoy],
            rates: vec![],
            profile: Profile::llama_8b_h100(),
            replicas: 2,
            speedup: 1.0,
            seed: 3,
            repeats: 1,
            arrivals: Arrivals::Open,
            run_deadline: std::time::Duration::from_secs(1),
            hop_probes: 0,
            run_dir: std::env::temp_dir(),
            tokenizer: None,
        }
    }

    #[test]
    fn a_report_agrees_with_itself_and_a_distorted_copy_fails_the_ratio_check() {
        let sim = simulate(&tiny_grid(), &[("shared-prefix".into(), vec![20.0, 60.0])]).unwrap();
        let same = compare(&sim, &sim);
        assert!(same.ranking_agrees && same.ratios_within, "{same:?}");
        assert_eq!(same.worst_deviation, 0.0);
        assert_eq!(same.rates.len(), 2);
        assert_eq!(same.rates[0].policies.len(), 2);

        // kvoy 1.5x slower live than simulated: its ratios are 50% off.
        let mut live = sim.clone();
        for run in &mut live.workloads[0].runs {
            if run.policy == "kvoy" {
                run.ttft_s.p90 *= 1.5;
            }
        }
        let off = compare(&live, &sim);
        assert!(!off.ratios_within);
        assert!(
            (off.worst_deviation - 0.5).abs() < 1e-9,
            "{}",
            off.worst_deviation
        );
        assert!(markdown(&off).contains("Ratios within 25%: **no** (largest deviation +50.0%)"));

        // Round-robin far faster than kvoy live, far slower in the simulation: a swap.
        let (mut live, mut simulated) = (sim.clone(), sim.clone());
        for (report, rr) in [(&mut live, 1e-3), (&mut simulated, 1.0)] {
            for run in &mut report.workloads[0].runs {
                run.ttft_s.p90 = if run.policy == "round-robin" { rr } else { 0.1 };
            }
        }
        let swapped = compare(&live, &simulated);
        assert!(!swapped.ranking_agrees);
        assert_eq!(
            swapped.rates[0].swapped,
            vec![("round-robin".into(), "kvoy".into())]
        );
        assert_eq!(swapped.rates[0].live_ranking, vec!["round-robin", "kvoy"]);
    }

    #[test]
    fn policies_the_simulation_does_not_model_are_left_out() {
        let mut grid = tiny_grid();
        grid.policies.push(LivePolicy::SmgCacheAware);
        let sim = simulate(&grid, &[("shared-prefix".into(), vec![20.0])]).unwrap();
        assert_eq!(sim.policies, vec!["round-robin", "kvoy"]);
        // A live report with the router's runs (here: kvoy's figures under its name).
        let mut live = sim.clone();
        live.policies.push("smg-cache-aware".into());
        let mut smg = live.workloads[0].runs[1].clone();
        smg.policy = "smg-cache-aware".into();
        smg.ttft_s.p90 *= 100.0;
        live.workloads[0].runs.push(smg);
        let check = compare(&live, &sim);
        assert!(check.ranking_agrees && check.ratios_within, "{check:?}");
        assert_eq!(check.not_simulated, vec!["smg-cache-aware"]);
        assert_eq!(check.rates[0].policies.len(), 2);
        assert!(markdown(&check).contains("Not simulated, left out: smg-cache-aware"));
    }

    #[test]
    fn ties_are_not_swaps() {
        assert_eq!(order(1.0, 1.05), 0);
        assert_eq!(order(1.0, 2.0), -1);
        assert_eq!(order(2.0, 1.0), 1);
        assert_eq!(
            ranking(&[("b".into(), 2.0), ("a".into(), 1.0)]),
            vec!["a".to_string(), "b".to_string()]
        );
    }
}
