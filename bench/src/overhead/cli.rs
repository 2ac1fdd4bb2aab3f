//! `kvoy-bench overhead [options]` (clap derive, like `sim` and `live`).

use std::path::PathBuf;

use clap::Parser;

use super::{OverheadGrid, Stages};
use crate::cli::{parse_as, usage, CliError};

/// The latency the kvoy filters add
///
/// The latency the kvoy filters add: Envoy with the filters against plain Envoy (ROUND_ROBIN,
/// no filter) in front of the same echo backends on 127.0.0.1, alternating in one run;
/// keep-alive clients, non-streamed completions, one-token replies. Also the external
/// picker's architecture: the same picker behind Envoy's ext_proc filter (gRPC, body BUFFERED).
#[derive(Debug, Parser)]
// Negative numbers reach the value parsers, whose errors name the flag.
#[command(name = "kvoy-bench overhead", allow_negative_numbers = true)]
pub struct OverheadCli {
    /// Prompt sizes in tokens, `8k` = 8000 [default: 1k,8k,32k,100k]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = count(1, 2_000_000))]
    pub prompts: Vec<usize>,
    /// Clients in flight [default: 1,32,150]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = count(1, 1000))]
    pub concurrency: Vec<usize>,
    /// Requests per row and proxy, at least 8 per client [default: 400]
    #[arg(long, value_name = "N", value_parser = count(1, 1_000_000))]
    pub requests: Option<usize>,
    /// Alternations of the proxies per row [default: 2]
    #[arg(long, value_name = "N", value_parser = count(1, 100))]
    pub rounds: Option<usize>,
    /// Echo backends [default: 4]
    // kvoy-sim and the other benches count their servers with `--replicas`.
    #[arg(long, visible_alias = "replicas", value_name = "N", value_parser = count(1, 64))]
    pub backends: Option<usize>,
    /// Skip the no-proxy baseline
    #[arg(long)]
    pub no_direct: bool,
    /// The kvoy filter's stages, among session, admission, prefix-affinity (default all three;
    /// prefix-affinity must be in it): a stage's cost is the difference between two runs
    #[arg(long, value_name = "LIST", value_parser = stages)]
    pub stages: Option<Stages>,
    /// Skip the wasm floor (kvoy's bootstrap with the minimal filter kvoy_floor.wasm: buffer,
    /// copy, hash, set the destination)
    #[arg(long)]
    pub no_floor: bool,
    /// Skip the external picker (Envoy's ext_proc filter and kvoy's picker as a gRPC server on
    /// 127.0.0.1)
    #[arg(long)]
    pub no_ext_proc: bool,
    /// Also run the floor making N more host calls per request (clock reads, and shared-data
    /// reads) and report what one costs (default: not run)
    #[arg(long, value_name = "N", value_parser = count(1, 10_000))]
    pub host_calls: Option<usize>,
    /// Seed of every random draw [default: 1]
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Output directory
    #[arg(long, value_name = "DIR", default_value = "bench/results/overhead")]
    pub out: PathBuf,
    /// No progress lines
    #[arg(long)]
    pub quiet: bool,
}

/// `kvoy-bench overhead` options.
#[derive(Clone, Debug, PartialEq)]
pub struct OverheadArgs {
    pub grid: OverheadGrid,
    pub out: PathBuf,
    pub quiet: bool,
}

/// A value parser for a count in `lo..=hi`, `k` meaning thousands.
fn count(lo: usize, hi: usize) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |v: &str| {
        let v = v.trim();
        let (digits, factor) = match v.strip_suffix(['k', 'K']) {
            Some(d) => (d, 1000),
            None => (v, 1),
        };
        digits
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_mul(factor))
            .filter(|n| (lo..=hi).contains(n))
            .ok_or_else(|| format!("expected a whole number in {lo}..={hi} (`k` = 1000)"))
    }
}

fn stages(v: &str) -> Result<Stages, String> {
    Stages::parse(v).ok_or_else(|| {
        "expected a comma-separated list among session, admission, prefix-affinity (which must \
         be in it)"
            .to_owned()
    })
}

impl OverheadCli {
    /// The grid: the standard one with the flags' changes.
    pub fn into_args(self) -> OverheadArgs {
        let run_dir =
            std::env::temp_dir().join(format!("kvoy-bench-overhead-{}", std::process::id()));
        let mut grid = OverheadGrid::standard(run_dir);
        if !self.prompts.is_empty() {
            grid.prompt_tokens = self.prompts.iter().map(|&n| n as u32).collect();
        }
        if !self.concurrency.is_empty() {
            grid.concurrency = self.concurrency;
        }
        grid.requests = self.requests.unwrap_or(grid.requests);
        grid.rounds = self.rounds.unwrap_or(grid.rounds);
        grid.backends = self.backends.unwrap_or(grid.backends);
        grid.direct = !self.no_direct;
        grid.ext_proc = !self.no_ext_proc;
        grid.floor = !self.no_floor;
        grid.host_calls = self.host_calls.map_or(grid.host_calls, |n| n as u32);
        grid.stages = self.stages.unwrap_or(grid.stages);
        grid.seed = self.seed.unwrap_or(grid.seed);
        OverheadArgs {
            grid,
            out: self.out,
            quiet: self.quiet,
        }
    }
}

/// Parses the options after `overhead`.
pub fn parse(args: &[String]) -> Result<OverheadArgs, CliError> {
    Ok(parse_as::<OverheadCli>("kvoy-bench overhead", args)
        .map_err(usage)?
        .into_args())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::cli::{assert_refused, words};

    #[test]
    fn defaults_are_the_issue_grid_and_flags_override_them() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.grid.prompt_tokens, vec![1000, 8000, 32000, 100000]);
        assert_eq!(a.grid.concurrency, vec![1, 32, 150]);
        let a = parse(&words(
            "--prompts 2k,500 --concurrency 4 --no-direct --no-ext-proc --no-floor --rounds 3",
        ))
        .unwrap();
        assert_eq!(a.grid.prompt_tokens, vec![2000, 500]);
        assert_eq!(a.grid.concurrency, vec![4]);
        assert!(!a.grid.direct);
        assert!(!a.grid.ext_proc);
        assert!(!a.grid.floor);
        assert_eq!(a.grid.rounds, 3);
        assert_eq!(a.grid.stages, Stages::ALL);
        let a = parse(&words("--stages prefix-affinity,session")).unwrap();
        assert_eq!(
            a.grid.stages,
            Stages {
                session: true,
                admission: false
            }
        );
        assert_eq!(a.grid.host_calls, 0);
        assert_eq!(
            parse(&words("--host-calls 32")).unwrap().grid.host_calls,
            32
        );
        assert!(parse(&words("--stages session")).is_err());
        assert!(parse(&words("--stages prefix-affinity,cache")).is_err());
    }

    #[test]
    fn mistakes_name_the_flag() {
        assert_refused(
            parse,
            &[
                ("--prompts 8q", "--prompts"),
                ("--concurrency 0", "--concurrency"),
                ("--requests", "--requests"),
                ("--backends 100", "--backends"),
                ("--host-calls 0", "--host-calls"),
                ("--bogus", "--bogus"),
            ],
        );
    }
}
