//! Several seeds per cell: each (workload, rate, policy) cell's median and worst over the seeds
//! it ran with. The summary and the plots read these; `results.json` keeps every seed's run.
//!
//! The median of every figure is taken on its own (so a median run's TTFT p90 and throughput
//! may come from different seeds); with an even number of seeds it is the mean of the two middle
//! values. The worst takes, figure by figure, the worst seed's value: the highest of the
//! latencies, errors and preemptions, the lowest of the throughputs, hit rates, SLO shares and
//! goodputs; the figures with no better or worse (the window, token counts) stay medians. A cell
//! of one seed is that run, unchanged, in both.

use std::collections::BTreeMap;

use super::{Report, WorkloadReport};
use crate::metrics::{AdmissionFigures, ClassFigures, Percentiles, RunFigures, SloFigures, Spread};

/// How the seeds of a cell are folded into one figure each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fold {
    Median,
    Worst,
}

/// The median of `values` (the mean of the two middle ones for an even count; 0 for none).
pub fn median_of(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

impl Fold {
    /// A figure where higher is worse (latency, errors).
    fn high_bad(self, mut v: Vec<f64>) -> f64 {
        match self {
            Fold::Median => median_of(&mut v),
            Fold::Worst => v.into_iter().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    /// A figure where lower is worse (throughput, hit rate, SLO share, goodput).
    fn low_bad(self, mut v: Vec<f64>) -> f64 {
        match self {
            Fold::Median => median_of(&mut v),
            Fold::Worst => v.into_iter().fold(f64::INFINITY, f64::min),
        }
    }
}

fn neutral(mut v: Vec<f64>) -> f64 {
    median_of(&mut v)
}

fn count(x: f64) -> u64 {
    x.round() as u64
}

/// Each cell's runs (every seed), cells in the order their first run appears.
pub fn cells(w: &WorkloadReport) -> Vec<Vec<&RunFigures>> {
    let mut cells: Vec<Vec<&RunFigures>> = Vec::new();
    for r in &w.runs {
        match cells
            .iter_mut()
            .find(|c| c[0].policy == r.policy && c[0].rate == r.rate)
        {
            Some(c) => c.push(r),
            None => cells.push(vec![r]),
        }
    }
    cells
}

/// `report` with each workload's runs replaced by its cells folded by `how`.
pub fn folded(report: &Report, how: Fold) -> Report {
    let mut out = report.clone();
    for (w, src) in out.workloads.iter_mut().zip(&report.workloads) {
        w.runs = cells(src).iter().filter_map(|c| fold(c, how)).collect();
    }
    out
}

/// Every cell's median over its seeds.
pub fn medians(report: &Report) -> Report {
    folded(report, Fold::Median)
}

/// Every cell's worst seed, figure by figure.
pub fn worst(report: &Report) -> Report {
    folded(report, Fold::Worst)
}

fn fold_percentiles(v: &[Percentiles], how: Fold) -> Percentiles {
    Percentiles {
        p50: how.high_bad(v.iter().map(|p| p.p50).collect()),
        p90: how.high_bad(v.iter().map(|p| p.p90).collect()),
        p99: how.high_bad(v.iter().map(|p| p.p99).collect()),
    }
}

fn fold_slo(v: &[SloFigures], how: Fold) -> Option<SloFigures> {
    let first = v.first()?;
    Some(SloFigures {
        ttft_s: first.ttft_s,
        requests: count(neutral(v.iter().map(|s| s.requests as f64).collect())),
        met_requests: count(how.low_bad(v.iter().map(|s| s.met_requests as f64).collect())),
        met: how.low_bad(v.iter().map(|s| s.met).collect()),
        goodput_tokens_per_s: how.low_bad(v.iter().map(|s| s.goodput_tokens_per_s).collect()),
    })
}

fn fold_class(v: &[&ClassFigures], how: Fold) -> ClassFigures {
    let ttft: Vec<Percentiles> = v.iter().map(|c| c.ttft_s).collect();
    let slo: Vec<SloFigures> = v.iter().filter_map(|c| c.slo).collect();
    ClassFigures {
        requests: count(neutral(v.iter().map(|c| c.requests as f64).collect())) as usize,
        ttft_s: fold_percentiles(&ttft, how),
        slo: fold_slo(&slo, how),
    }
}

/// One cell's runs folded into one (`None` for no runs).
pub fn fold(runs: &[&RunFigures], how: Fold) -> Option<RunFigures> {
    let first = *runs.first()?;
    if runs.len() == 1 {
        return Some(first.clone());
    }
    let v = |f: &dyn Fn(&RunFigures) -> f64| -> Vec<f64> { runs.iter().map(|r| f(r)).collect() };
    let hi = |f: &dyn Fn(&RunFigures) -> f64| how.high_bad(v(f));
    let lo = |f: &dyn Fn(&RunFigures) -> f64| how.low_bad(v(f));
    let mid = |f: &dyn Fn(&RunFigures) -> f64| neutral(v(f));
    let pcts = |f: &dyn Fn(&RunFigures) -> Percentiles| {
        fold_percentiles(&runs.iter().map(|r| f(r)).collect::<Vec<_>>(), how)
    };
    let endpoints = first.spread.requests.len();
    let requests = if runs.iter().all(|r| r.spread.requests.len() == endpoints) {
        (0..endpoints)
            .map(|i| count(mid(&|r| r.spread.requests[i] as f64)))
            .collect()
    } else {
        first.spread.requests.clone()
    };
    let mut classes: BTreeMap<String, Vec<&ClassFigures>> = BTreeMap::new();
    for r in runs {
        for (name, c) in &r.classes {
            classes.entry(name.clone()).or_default().push(c);
        }
    }
    let slo: Vec<SloFigures> = runs.iter().filter_map(|r| r.slo).collect();
    Some(RunFigures {
        workload: first.workload.clone(),
        policy: first.policy.clone(),
        seed: None,
        rate: first.rate,
        load: first.load,
        requests: count(mid(&|r| r.requests as f64)),
        completed: count(lo(&|r| r.completed as f64)),
        rejected: count(hi(&|r| r.rejected as f64)),
        preemptions: count(hi(&|r| r.preemptions as f64)),
        ttft_s: pcts(&|r| r.ttft_s),
        itl_s: pcts(&|r| r.itl_s),
        e2e_s: pcts(&|r| r.e2e_s),
        output_tokens_per_s: lo(&|r| r.output_tokens_per_s),
        requests_per_s: lo(&|r| r.requests_per_s),
        window_s: mid(&|r| r.window_s),
        overall_output_tokens_per_s: lo(&|r| r.overall_output_tokens_per_s),
        makespan_s: hi(&|r| r.makespan_s),
        hit_rate: lo(&|r| r.hit_rate),
        reported_hit_rate: lo(&|r| r.reported_hit_rate),
        arrival_hit_rate: lo(&|r| r.arrival_hit_rate),
        estimated_hit_requests: count(mid(&|r| r.estimated_hit_requests as f64)),
        ideal_hit_rate: mid(&|r| r.ideal_hit_rate),
        prompt_tokens: count(mid(&|r| r.prompt_tokens as f64)),
        cached_tokens: count(lo(&|r| r.cached_tokens as f64)),
        output_tokens: count(mid(&|r| r.output_tokens as f64)),
        spread: Spread {
            requests,
            max_over_mean: hi(&|r| r.spread.max_over_mean),
            cv: hi(&|r| r.spread.cv),
        },
        classes: classes
            .into_iter()
            .map(|(name, v)| (name, fold_class(&v, how)))
            .collect(),
        slo: fold_slo(&slo, how),
        admission: fold_admission(runs, how),
    })
}

fn fold_admission(runs: &[&RunFigures], how: Fold) -> Option<AdmissionFigures> {
    let a: Vec<AdmissionFigures> = runs.iter().filter_map(|r| r.admission).collect();
    if a.is_empty() {
        return None;
    }
    let v = |f: &dyn Fn(&AdmissionFigures) -> f64| -> Vec<f64> { a.iter().map(f).collect() };
    Some(AdmissionFigures {
        held: count(neutral(v(&|x| x.held as f64))),
        shed: count(how.high_bad(v(&|x| x.shed as f64))),
        expired: count(how.high_bad(v(&|x| x.expired as f64))),
        mean_held_s: how.high_bad(v(&|x| x.mean_held_s)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(seed: u64, ttft_p90: f64, tput: f64, met: f64, goodput: f64) -> RunFigures {
        let slo = SloFigures {
            ttft_s: 2.0,
            requests: 10,
            met_requests: (met * 10.0) as u64,
            met,
            goodput_tokens_per_s: goodput,
        };
        RunFigures {
            workload: "w".into(),
            policy: "kvoy".into(),
            seed: Some(seed),
            rate: 4.0,
            load: 1.0,
            requests: 10,
            completed: 10,
            rejected: seed % 2,
            preemptions: 0,
            ttft_s: Percentiles {
                p50: ttft_p90 / 2.0,
                p90: ttft_p90,
                p99: ttft_p90 * 2.0,
            },
            itl_s: Percentiles::default(),
            e2e_s: Percentiles::default(),
            output_tokens_per_s: tput,
            requests_per_s: tput / 100.0,
            window_s: 60.0,
            overall_output_tokens_per_s: tput,
            makespan_s: 70.0,
            hit_rate: 0.5,
            reported_hit_rate: 0.5,
            arrival_hit_rate: 0.5,
            estimated_hit_requests: 0,
            ideal_hit_rate: 0.9,
            prompt_tokens: 1000,
            cached_tokens: 500,
            output_tokens: 100,
            spread: Spread {
                requests: vec![seed, 10 - seed],
                max_over_mean: 1.0,
                cv: 0.0,
            },
            classes: BTreeMap::from([(
                "chat".to_owned(),
                ClassFigures {
                    requests: 10,
                    ttft_s: Percentiles {
                        p50: 0.0,
                        p90: ttft_p90 + 1.0,
                        p99: 0.0,
                    },
                    slo: Some(slo),
                },
            )]),
            slo: Some(slo),
            admission: None,
        }
    }

    #[test]
    fn median_and_worst_of_known_numbers() {
        assert_eq!(median_of(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_of(&mut [10.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median_of(&mut []), 0.0);
        let runs = [
            run(1, 3.0, 100.0, 0.9, 80.0),
            run(2, 1.0, 300.0, 0.5, 120.0),
            run(3, 2.0, 200.0, 0.7, 90.0),
        ];
        let refs: Vec<&RunFigures> = runs.iter().collect();
        let m = fold(&refs, Fold::Median).unwrap();
        assert_eq!(m.seed, None);
        assert_eq!((m.ttft_s.p50, m.ttft_s.p90, m.ttft_s.p99), (1.0, 2.0, 4.0));
        assert_eq!(m.output_tokens_per_s, 200.0);
        assert_eq!(m.rejected, 1);
        let slo = m.slo.unwrap();
        assert_eq!(
            (slo.met, slo.goodput_tokens_per_s, slo.met_requests),
            (0.7, 90.0, 7)
        );
        assert_eq!(m.classes["chat"].ttft_s.p90, 3.0);
        assert_eq!(m.spread.requests, [2, 8]);
        let w = fold(&refs, Fold::Worst).unwrap();
        assert_eq!(w.ttft_s.p90, 3.0);
        assert_eq!(w.output_tokens_per_s, 100.0);
        assert_eq!(w.rejected, 1);
        let slo = w.slo.unwrap();
        assert_eq!((slo.met, slo.goodput_tokens_per_s), (0.5, 80.0));
        assert_eq!(w.classes["chat"].ttft_s.p90, 4.0);
        assert_eq!(w.classes["chat"].slo.unwrap().met, 0.5);
        // Neutral figures stay medians in the worst view.
        assert_eq!(w.window_s, 60.0);
        // One seed: the run itself.
        assert_eq!(fold(&refs[..1], Fold::Worst).unwrap(), runs[0]);
        assert_eq!(fold(&[], Fold::Median), None);
    }

    #[test]
    fn cells_group_the_seeds_of_each_policy_and_rate() {
        let mut other = run(1, 9.0, 1.0, 0.1, 1.0);
        other.policy = "llm-d".into();
        let w = WorkloadReport {
            name: "w".into(),
            description: String::new(),
            shape: crate::saturation::Shape {
                requests: 0,
                mean_prompt_tokens: 0.0,
                median_prompt_tokens: 0,
                mean_output_tokens: 0.0,
                ideal_hit_rate: 0.0,
                mean_footprint_tokens: 0.0,
                mean_prefill_s: 0.0,
                prompt_tokens: 0,
                ideal_hit_tokens: 0,
            },
            saturation: crate::saturation::capacity(
                &kvoy_sim_engine::Profile::llama_8b_h100(),
                &crate::saturation::Shape {
                    requests: 1,
                    mean_prompt_tokens: 100.0,
                    median_prompt_tokens: 100,
                    mean_output_tokens: 10.0,
                    ideal_hit_rate: 0.0,
                    mean_footprint_tokens: 110.0,
                    mean_prefill_s: 0.01,
                    prompt_tokens: 100,
                    ideal_hit_tokens: 0,
                },
                1,
            ),
            rates: vec![4.0],
            runs: vec![
                run(1, 3.0, 100.0, 0.9, 80.0),
                run(2, 1.0, 300.0, 0.5, 120.0),
                other,
                run(3, 2.0, 200.0, 0.7, 90.0),
            ],
            slo: None,
        };
        let c = cells(&w);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].len(), 3);
        assert_eq!((c[1].len(), c[1][0].policy.as_str()), (1, "llm-d"));
    }
}
