//! `kvoy-bench sim|live|overhead|report`: runs the routing simulation grid (or the live and
//! overhead benches) and writes its report. See `--help`.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use kvoy_bench::cli::{Cli, CliCommand, Command};
use kvoy_bench::runner::{self, Progress};

fn main() -> ExitCode {
    // clap prints --help and usage errors itself (exit 0 and 2).
    let command = Cli::parse().command;
    match run(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvoy-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: CliCommand) -> Result<(), Box<dyn std::error::Error>> {
    let options = match command.into_command()? {
        // Only `cli::parse` answers --help with this; clap has printed the help already.
        Command::Help => return Ok(()),
        Command::Sim(options) => options,
        Command::Live(options) => return run_live(*options),
        Command::Overhead(options) => return run_overhead(*options),
        Command::Report { from, out } => {
            let report = kvoy_bench::Report::load(&from)?;
            let dir = out
                .or_else(|| from.parent().map(Path::to_path_buf))
                .unwrap_or_default();
            for path in report.write_views(&dir)? {
                println!("{}", path.display());
            }
            return Ok(());
        }
    };
    let grid = options.grid()?;
    // Wall time is only for the progress line; the simulation never reads it.
    let started = Instant::now();
    let quiet = options.quiet;
    let progress = move |p: Progress<'_>| {
        if quiet {
            return;
        }
        let pct = p.done * 100 / p.total.max(1);
        let mut err = std::io::stderr().lock();
        let _ = writeln!(
            err,
            "[{:>6.1}s] run {:>3}/{} done | {} {} at {:.2}x ({:.2} req/s) seed {}: {pct}% ({}/{})",
            started.elapsed().as_secs_f64(),
            p.finished_runs,
            p.runs,
            p.workload,
            p.policy,
            p.load,
            p.rate,
            p.seed,
            p.done,
            p.total
        );
    };
    let report = runner::run(&grid, &progress)?;
    let written = report.write_all(&options.out)?;
    eprintln!(
        "kvoy-bench: {} runs in {:.1} s wall time",
        report.workloads.iter().map(|w| w.runs.len()).sum::<usize>(),
        started.elapsed().as_secs_f64()
    );
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}

fn run_live(options: kvoy_bench::live::cli::LiveArgs) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let quiet = options.quiet;
    let mut last_line = Instant::now();
    let mut progress = |p: kvoy_bench::live::LiveProgress<'_>| {
        if quiet {
            return;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let what = format!(
            "{} | {} at {:.2}x ({:.1} req/s), repeat {}",
            p.workload,
            p.policy,
            p.load,
            p.rate,
            p.repeat + 1
        );
        if let Some(f) = p.finished {
            // One line per finished run, with its result and the time left.
            let left = elapsed / p.finished_runs.max(1) as f64
                * (p.runs.saturating_sub(p.finished_runs)) as f64;
            eprintln!(
                "[{elapsed:>6.1}s] run {:>2}/{} done | {what}: {}/{} completed, TTFT p90 {:.2} s, \
                 hit {:.1}% | about {:.0} min left",
                p.finished_runs,
                p.runs,
                f.completed,
                f.requests,
                f.ttft_s.p90,
                f.hit_rate * 100.0,
                left / 60.0
            );
            last_line = Instant::now();
            return;
        }
        // While a run goes: at most a line every 5 s.
        if last_line.elapsed().as_secs() < 5 {
            return;
        }
        last_line = Instant::now();
        eprintln!(
            "[{elapsed:>6.1}s] run {:>2}/{}      | {what}: {}% ({}/{})",
            p.finished_runs + 1,
            p.runs,
            p.done * 100 / p.total.max(1),
            p.done,
            p.total
        );
    };
    let (report, mut written) = if options.sim_check_only {
        let from = options.out.join("results.json");
        (kvoy_bench::Report::load(&from)?, Vec::new())
    } else {
        let report = kvoy_bench::live::run(&options.grid, &mut progress)?;
        let written = report.write_all(&options.out)?;
        (report, written)
    };
    let open_loop = options.grid.arrivals == kvoy_bench::live::Arrivals::Open;
    // The simulation tokenizes with the stand-in: a run whose simulators ran a real tokenizer
    // sent other token counts than it would simulate.
    let stand_in = options.grid.tokenizer.is_none();
    if (options.sim_check || options.sim_check_only) && open_loop && !stand_in {
        eprintln!("kvoy-bench live: no simulation check: the simulators ran --tokenizer");
    }
    if (options.sim_check || options.sim_check_only) && open_loop && stand_in {
        use kvoy_bench::live::compare;
        eprintln!(
            "[{:>6.1}s] simulating the same plans for the check",
            started.elapsed().as_secs_f64()
        );
        let sim = compare::simulate(&options.grid, &compare::live_rates(&report))?;
        let check = compare::compare(&report, &sim);
        eprintln!(
            "kvoy-bench live: the simulation of the same plan: rankings agree: {}, kvoy's TTFT \
             ratios within {:.0}%: {} (largest deviation {:+.1}%){}",
            check.ranking_agrees,
            compare::RATIO_TOLERANCE * 100.0,
            check.ratios_within,
            check.worst_deviation * 100.0,
            if check.not_simulated.is_empty() {
                String::new()
            } else {
                format!("; not simulated: {}", check.not_simulated.join(", "))
            }
        );
        let md = options.out.join("sim-check.md");
        std::fs::write(&md, compare::markdown(&check))?;
        let json = options.out.join("sim-check.json");
        std::fs::write(&json, serde_json::to_string_pretty(&check)? + "\n")?;
        written.extend([md, json]);
    }
    eprintln!(
        "kvoy-bench live: {} runs in {:.1} s wall time",
        report.workloads.iter().map(|w| w.runs.len()).sum::<usize>(),
        started.elapsed().as_secs_f64()
    );
    for path in written {
        println!("{}", path.display());
    }
    let _ = std::fs::remove_dir_all(&options.grid.run_dir);
    Ok(())
}

fn run_overhead(
    options: kvoy_bench::overhead::cli::OverheadArgs,
) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let quiet = options.quiet;
    let progress = |p: kvoy_bench::overhead::OverheadProgress<'_>| {
        if quiet {
            return;
        }
        eprintln!(
            "[{:>6.1}s] row {:>2}/{} | {} tokens at concurrency {} | {}: {}/{}",
            started.elapsed().as_secs_f64(),
            p.cell,
            p.cells,
            p.prompt_tokens,
            p.concurrency,
            p.proxy,
            p.done,
            p.total
        );
    };
    let report = kvoy_bench::overhead::run(&options.grid, &progress)?;
    let written = report.write_all(&options.out)?;
    eprintln!(
        "kvoy-bench overhead: {} rows in {:.1} s wall time",
        report.grid().len(),
        started.elapsed().as_secs_f64()
    );
    print!("{}", kvoy_bench::overhead::summary(&report));
    for path in written {
        println!("{}", path.display());
    }
    let _ = std::fs::remove_dir_all(&options.grid.run_dir);
    Ok(())
}
