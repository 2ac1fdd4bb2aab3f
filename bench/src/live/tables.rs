//! The live report's own sections of `summary.md` (after the shared ones): the real routers'
//! exact command lines, every cell over its repeats (medians and the spread of TTFT p90), the
//! decode placement, and the running-sequence plots of kvoy and the best real router.
//!
//! Medians come from [`crate::report::seeds`], the helpers the simulation's seeds use, so a
//! cell's figures here are the ones its verdicts are read from.

use std::fmt::Write;

use super::{is_real_router, RunDetail};
use crate::metrics::RunFigures;
use crate::report::seeds::{self, median_of};
use crate::report::svg::{Chart, Series, PALETTE};
use crate::report::{table, Report, WorkloadReport};

/// A load multiple with at most two decimals and no trailing zeros: `1`, `1.5`.
fn load(x: f64) -> String {
    let s = format!("{x:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn secs(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

/// The median of `values` (0 for none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    median_of(&mut values.collect::<Vec<_>>())
}

/// One cell's figures over its repeats.
#[derive(Clone, Debug, PartialEq)]
pub struct CellFigures {
    pub policy: String,
    pub runs: usize,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    /// The lowest and the highest TTFT p90 of the repeats.
    pub ttft_p90_min_s: f64,
    pub ttft_p90_max_s: f64,
    pub output_tokens_per_s: f64,
    pub errors: f64,
    pub preemptions: f64,
}

impl CellFigures {
    /// The medians of one cell's runs (all of one policy and rate); `None` for none.
    pub fn of(runs: &[&RunFigures]) -> Option<CellFigures> {
        let first = runs.first()?;
        let m = |f: &dyn Fn(&RunFigures) -> f64| median(runs.iter().map(|r| f(r)));
        let p90 = runs.iter().map(|r| r.ttft_s.p90);
        Some(CellFigures {
            policy: first.policy.clone(),
            runs: runs.len(),
            ttft_p50_s: m(&|r| r.ttft_s.p50),
            ttft_p90_s: m(&|r| r.ttft_s.p90),
            ttft_p99_s: m(&|r| r.ttft_s.p99),
            ttft_p90_min_s: p90.clone().fold(f64::INFINITY, f64::min),
            ttft_p90_max_s: p90.fold(f64::NEG_INFINITY, f64::max),
            output_tokens_per_s: m(&|r| r.output_tokens_per_s),
            errors: m(&|r| r.rejected as f64),
            preemptions: m(&|r| r.preemptions as f64),
        })
    }
}

/// The runs' details of (`workload`, `policy`, `rate`).
fn details_of<'a: 'b, 'b>(
    report: &'a Report,
    workload: &'b str,
    policy: &'b str,
    rate: f64,
) -> impl Iterator<Item = &'a RunDetail> + 'b {
    report
        .details
        .iter()
        .filter(move |d| d.workload == workload && d.policy == policy && d.rate == rate)
}

/// The live sections of `summary.md` (empty for a report without live details).
pub fn sections(report: &Report) -> String {
    let mut s = String::new();
    commands(&mut s, report);
    if report.details.is_empty() {
        return s;
    }
    for w in &report.workloads {
        repeats(&mut s, report, w);
        placement(&mut s, report, w);
    }
    s
}

fn commands(s: &mut String, report: &Report) {
    if report.commands.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "## The real routers' command lines\n\n\
         Exactly what each run started, with the ports and the simulators' addresses as \
         placeholders (`<worker-url>...`: one `http://127.0.0.1:P` per simulator). Every \
         setting not on the line is the router's default. `exit` is the time from SIGTERM to \
         the process's exit after each run (median / longest, real seconds; killed after {} s).\n",
        super::routers::STOP_GRACE.as_secs()
    );
    let _ = writeln!(
        s,
        "{}",
        table::head(
            &["policy", "package", "command line", "exit s", "killed"],
            3
        )
    );
    for c in &report.commands {
        let stops: Vec<f64> = report
            .details
            .iter()
            .filter(|d| d.policy == c.policy)
            .filter_map(|d| d.stop_s)
            .collect();
        let killed = report
            .details
            .iter()
            .filter(|d| d.policy == c.policy && d.killed)
            .count();
        let exit = if stops.is_empty() {
            "-".to_owned()
        } else {
            format!(
                "{:.1} / {:.1}",
                median(stops.iter().copied()),
                stops.iter().copied().fold(0.0, f64::max)
            )
        };
        let _ = writeln!(
            s,
            "| {} | {} | `{}` | {exit} | {killed} |",
            c.policy, c.requirement, c.command
        );
    }
    s.push('\n');
}

fn repeats(s: &mut String, report: &Report, w: &WorkloadReport) {
    let cells = seeds::cells(w);
    let most = cells.iter().map(Vec::len).max().unwrap_or(0);
    let _ = writeln!(
        s,
        "## {}: every policy over its repeats\n\n\
         Each cell ran every policy {most} time(s), the order rotating from one repeat to the \
         next (repeat r starts with policy r mod {}); every figure is the median over the \
         repeats (the one the verdicts above read), `TTFT p90 range` the lowest and highest \
         repeat's. TTFT in the modelled GPU's seconds; errors are planned requests that did \
         not complete; preemptions are the simulators' own count during the run.\n",
        w.name,
        report.policies.len()
    );
    let columns = [
        "load",
        "policy",
        "runs",
        "TTFT p50 s",
        "TTFT p90 s",
        "TTFT p99 s",
        "TTFT p90 range s",
        "output tok/s",
        "errors",
        "preemptions",
    ];
    let _ = writeln!(s, "{}", table::head(&columns, 2));
    for &rate in &w.rates {
        for p in &report.policies {
            let Some(cell) = cells
                .iter()
                .find(|c| c[0].policy == *p && c[0].rate == rate)
            else {
                continue;
            };
            let Some(f) = CellFigures::of(cell) else {
                continue;
            };
            let _ = writeln!(
                s,
                "| {}x | {} | {} | {} | {} | {} | {}–{} | {:.0} | {} | {} |",
                load(rate / w.saturation.rate),
                f.policy,
                f.runs,
                secs(f.ttft_p50_s),
                secs(f.ttft_p90_s),
                secs(f.ttft_p99_s),
                secs(f.ttft_p90_min_s),
                secs(f.ttft_p90_max_s),
                f.output_tokens_per_s,
                f.errors,
                f.preemptions
            );
        }
    }
    s.push('\n');
}

fn placement(s: &mut String, report: &Report, w: &WorkloadReport) {
    let _ = writeln!(
        s,
        "## {}: decode placement\n\n\
         Every simulator's running and waiting sequences (`vllm:num_requests_running`, \
         `_waiting` on its `/metrics`), sampled every {} ms of real time during each run; each \
         figure is the median over the repeats. `mean running` lists each simulator's mean; \
         `max/mean` is the busiest one's mean over the simulators' mean (1: even); `per-sample \
         max/mean` takes that ratio in each sample and averages it (an imbalance that moves \
         from one simulator to another evens out in the means, not here); `idle while waiting` \
         is the share of the samples in which a simulator ran nothing and had nothing waiting \
         while another had requests waiting.\n",
        w.name,
        super::placement::SAMPLE_EVERY.as_millis()
    );
    let columns = [
        "load",
        "policy",
        "samples",
        "mean running",
        "max/mean",
        "per-sample max/mean",
        "idle while waiting",
    ];
    let _ = writeln!(s, "{}", table::head(&columns, 2));
    for &rate in &w.rates {
        for p in &report.policies {
            let runs: Vec<&RunDetail> = details_of(report, &w.name, p, rate).collect();
            if runs.is_empty() {
                continue;
            }
            let endpoints = runs[0].placement.mean_running.len();
            let means: Vec<String> = (0..endpoints)
                .map(|i| {
                    let m = median(
                        runs.iter()
                            .filter_map(|d| d.placement.mean_running.get(i).copied()),
                    );
                    format!("{m:.1}")
                })
                .collect();
            let m = |f: &dyn Fn(&RunDetail) -> f64| median(runs.iter().map(|d| f(d)));
            let _ = writeln!(
                s,
                "| {}x | {p} | {:.0} | {} | {:.2} | {:.2} | {:.1}% |",
                load(rate / w.saturation.rate),
                m(&|d| d.placement.samples as f64),
                means.join(" / "),
                m(&|d| d.placement.max_over_mean),
                m(&|d| d.placement.sample_max_over_mean),
                m(&|d| d.placement.idle_while_waiting) * 100.0
            );
        }
    }
    let plots: Vec<String> = running_chart_names(report, w)
        .into_iter()
        .map(|(name, _)| format!("`{name}`"))
        .collect();
    if !plots.is_empty() {
        let _ = writeln!(
            s,
            "\nRunning sequences over time, kvoy and the best real router (lowest median TTFT \
             p90) of each load, in the repeat nearest the median: {}.",
            plots.join(", ")
        );
    }
    s.push('\n');
}

/// The plots of `w`: for each load, kvoy's and the best real router's run nearest its median
/// TTFT p90, as (file name, run). Only runs that still hold their samples.
fn running_chart_names<'a>(report: &'a Report, w: &WorkloadReport) -> Vec<(String, &'a RunDetail)> {
    let cells = seeds::cells(w);
    let median_p90 = |policy: &str, rate: f64| {
        cells
            .iter()
            .find(|c| c[0].policy == policy && c[0].rate == rate)
            .and_then(|c| CellFigures::of(c))
            .map(|f| f.ttft_p90_s)
    };
    let mut out = Vec::new();
    for &rate in &w.rates {
        let best_router = report
            .policies
            .iter()
            .filter(|p| is_real_router(p))
            .filter_map(|p| Some((p.as_str(), median_p90(p, rate)?)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let kvoy = median_p90("kvoy", rate).map(|m| ("kvoy", m));
        for (policy, median) in kvoy.into_iter().chain(best_router) {
            let nearest = details_of(report, &w.name, policy, rate)
                .filter(|d| !d.samples.is_empty())
                .min_by(|a, b| {
                    (a.ttft_p90_s - median)
                        .abs()
                        .total_cmp(&(b.ttft_p90_s - median).abs())
                });
            if let Some(d) = nearest {
                let name = format!(
                    "{}-{}x-running-{policy}.svg",
                    w.name,
                    load(rate / w.saturation.rate)
                );
                out.push((name, d));
            }
        }
    }
    out
}

/// Every running-sequence plot of a live report, as (file name, SVG).
pub fn running_charts(report: &Report) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for w in &report.workloads {
        for (name, d) in running_chart_names(report, w) {
            out.push((name, running_chart(w, d)));
        }
    }
    out
}

/// One run's running sequences per simulator (solid) and the fleet's waiting ones (dashed).
fn running_chart(w: &WorkloadReport, d: &RunDetail) -> String {
    let endpoints = d.samples.first().map_or(0, |s| s.running.len());
    let mut series: Vec<Series> = (0..endpoints)
        .map(|i| Series {
            label: format!("simulator {i} running"),
            color: PALETTE[(i + 1) % PALETTE.len()],
            dashed: false,
            bold: false,
            points: d
                .samples
                .iter()
                .filter_map(|s| Some((s.at_s, f64::from(*s.running.get(i)?))))
                .collect(),
        })
        .collect();
    series.push(Series {
        label: "waiting, all".into(),
        color: "#000000",
        dashed: true,
        bold: false,
        points: d
            .samples
            .iter()
            .map(|s| (s.at_s, s.waiting.iter().map(|&w| f64::from(w)).sum()))
            .collect(),
    });
    Chart {
        title: format!(
            "{} at {}x: {} (repeat {}), running sequences",
            w.name,
            load(d.rate / w.saturation.rate),
            d.policy,
            d.repeat + 1
        ),
        x_label: "time since the run's start, modelled seconds".into(),
        y_label: "sequences".into(),
        log_y: false,
        y_max: None,
        series,
    }
    .render()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn run(policy: &str, p90: f64, tput: f64, errors: u64) -> RunFigures {
        let mut r: RunFigures = serde_json::from_value(serde_json::json!({
            "workload": "w", "policy": policy, "rate": 2.0, "load": 1.0, "requests": 10,
            "completed": 10, "rejected": errors, "preemptions": errors * 2,
            "ttft_s": {"p50": p90 / 2.0, "p90": p90, "p99": p90 * 2.0},
            "itl_s": {"p50": 0.0, "p90": 0.0, "p99": 0.0},
            "e2e_s": {"p50": 0.0, "p90": 0.0, "p99": 0.0},
            "output_tokens_per_s": tput, "requests_per_s": 1.0, "window_s": 1.0,
            "overall_output_tokens_per_s": tput, "makespan_s": 1.0, "hit_rate": 0.5,
            "reported_hit_rate": 0.5, "arrival_hit_rate": 0.5, "estimated_hit_requests": 0,
            "ideal_hit_rate": 0.9, "prompt_tokens": 1, "cached_tokens": 1, "output_tokens": 1,
            "spread": {"requests": [5, 5], "max_over_mean": 1.0, "cv": 0.0},
            "classes": {}
        }))
        .unwrap();
        r.seed = None;
        r
    }

    #[test]
    fn medians_and_the_spread_of_ttft_p90() {
        let runs = [
            run("kvoy", 3.0, 100.0, 0),
            run("kvoy", 1.0, 300.0, 4),
            run("kvoy", 2.0, 200.0, 1),
        ];
        let refs: Vec<&RunFigures> = runs.iter().collect();
        let f = CellFigures::of(&refs).unwrap();
        assert_eq!(f.runs, 3);
        assert_eq!((f.ttft_p50_s, f.ttft_p90_s, f.ttft_p99_s), (1.0, 2.0, 4.0));
        assert_eq!((f.ttft_p90_min_s, f.ttft_p90_max_s), (1.0, 3.0));
        assert_eq!(f.output_tokens_per_s, 200.0);
        assert_eq!((f.errors, f.preemptions), (1.0, 2.0));
        // The same medians as the seeds' fold, which the verdicts read.
        let folded = seeds::fold(&refs, seeds::Fold::Median).unwrap();
        assert_eq!(folded.ttft_s.p90, f.ttft_p90_s);
        assert_eq!(folded.output_tokens_per_s, f.output_tokens_per_s);
        // Two repeats: the mean of the two.
        let f = CellFigures::of(&refs[..2]).unwrap();
        assert_eq!(
            (f.ttft_p90_s, f.ttft_p90_min_s, f.ttft_p90_max_s),
            (2.0, 1.0, 3.0)
        );
        assert_eq!(CellFigures::of(&[]), None);
    }
}
