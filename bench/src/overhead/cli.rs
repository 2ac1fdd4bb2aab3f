//! `kvoy-bench overhead [options]`, parsed by hand like `sim` and `live`.

use std::path::PathBuf;

use super::{OverheadGrid, Stages};
use crate::cli::CliError;
use crate::live::cli::value;

pub const USAGE: &str = "\
kvoy-bench overhead [options]

The latency the kvoy filters add: Envoy with the filters against plain Envoy (ROUND_ROBIN, no
filter) in front of the same echo backends on 127.0.0.1, alternating in one run; keep-alive
clients, non-streamed completions, one-token replies. Also the external picker's architecture:
the same picker behind Envoy's ext_proc filter (gRPC, body BUFFERED).

  --prompts LIST        prompt sizes in tokens, `8k` = 8000 (default 1k,8k,32k,100k)
  --concurrency LIST    clients in flight (default 1,32,150)
  --requests N          requests per row and proxy, at least 8 per client (default 400)
  --rounds N            alternations of the proxies per row (default 2)
  --backends N          echo backends (default 4)
  --no-direct           skip the no-proxy baseline
  --stages LIST         the kvoy filter's stages, among session, admission, prefix-affinity
                        (default all three; prefix-affinity must be in it): a stage's cost is
                        the difference between two runs
  --no-floor            skip the wasm floor (kvoy's bootstrap with the minimal filter
                        kvoy_floor.wasm: buffer, copy, hash, set the destination)
  --no-ext-proc         skip the external picker (Envoy's ext_proc filter and kvoy's picker
                        as a gRPC server on 127.0.0.1)
  --host-calls N        also run the floor making N more host calls per request (clock
                        reads, and shared-data reads) and report what one costs (default:
                        not run)
  --seed N              (default 1)
  --out DIR             output directory (default bench/results/overhead)
  --quiet               no progress lines
";

/// `kvoy-bench overhead` options.
#[derive(Clone, Debug, PartialEq)]
pub struct OverheadArgs {
    pub grid: OverheadGrid,
    pub out: PathBuf,
    pub quiet: bool,
}

fn count(v: &str, flag: &'static str, lo: usize, hi: usize) -> Result<usize, CliError> {
    let bad = || CliError::BadValue {
        flag,
        value: v.to_owned(),
        expected: "a whole number in range",
    };
    let (digits, factor) = match v.strip_suffix(['k', 'K']) {
        Some(d) => (d, 1000),
        None => (v, 1),
    };
    let n = digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(factor))
        .ok_or_else(bad)?;
    if (lo..=hi).contains(&n) {
        Ok(n)
    } else {
        Err(bad())
    }
}

fn list(v: &str, flag: &'static str, lo: usize, hi: usize) -> Result<Vec<usize>, CliError> {
    v.split(',')
        .map(|x| count(x.trim(), flag, lo, hi))
        .collect()
}

/// Parses the options after `overhead`.
pub fn parse(args: &[String]) -> Result<OverheadArgs, CliError> {
    let run_dir = std::env::temp_dir().join(format!("kvoy-bench-overhead-{}", std::process::id()));
    let mut grid = OverheadGrid::standard(run_dir);
    let mut out = PathBuf::from("bench/results/overhead");
    let mut quiet = false;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--prompts" => {
                grid.prompt_tokens = list(value(&mut it, "--prompts")?, "--prompts", 1, 2_000_000)?
                    .into_iter()
                    .map(|n| n as u32)
                    .collect();
            }
            "--concurrency" => {
                grid.concurrency =
                    list(value(&mut it, "--concurrency")?, "--concurrency", 1, 1000)?;
            }
            "--requests" => {
                grid.requests = count(value(&mut it, "--requests")?, "--requests", 1, 1_000_000)?;
            }
            "--rounds" => grid.rounds = count(value(&mut it, "--rounds")?, "--rounds", 1, 100)?,
            "--backends" => {
                grid.backends = count(value(&mut it, "--backends")?, "--backends", 1, 64)?;
            }
            "--no-direct" => grid.direct = false,
            "--no-ext-proc" => grid.ext_proc = false,
            "--no-floor" => grid.floor = false,
            "--host-calls" => {
                grid.host_calls =
                    count(value(&mut it, "--host-calls")?, "--host-calls", 1, 10_000)? as u32;
            }
            "--stages" => {
                let v = value(&mut it, "--stages")?;
                grid.stages = Stages::parse(v).ok_or_else(|| CliError::BadValue {
                    flag: "--stages",
                    value: v.to_owned(),
                    expected: "a comma-separated list among session, admission, prefix-affinity \
                               (which must be in it)",
                })?;
            }
            "--seed" => {
                let v = value(&mut it, "--seed")?;
                grid.seed = v.parse().map_err(|_| CliError::BadValue {
                    flag: "--seed",
                    value: v.to_owned(),
                    expected: "an integer",
                })?;
            }
            "--out" => out = PathBuf::from(value(&mut it, "--out")?),
            "--quiet" => quiet = true,
            other => return Err(CliError::UnknownFlag(other.to_owned())),
        }
    }
    Ok(OverheadArgs { grid, out, quiet })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn defaults_are_the_issue_grid_and_flags_override_them() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.grid.prompt_tokens, vec![1000, 8000, 32000, 100000]);
        assert_eq!(a.grid.concurrency, vec![1, 32, 150]);
        let a = parse(&args(
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
        let a = parse(&args("--stages prefix-affinity,session")).unwrap();
        assert_eq!(
            a.grid.stages,
            Stages {
                session: true,
                admission: false
            }
        );
        assert_eq!(a.grid.host_calls, 0);
        assert_eq!(parse(&args("--host-calls 32")).unwrap().grid.host_calls, 32);
        assert!(parse(&args("--stages session")).is_err());
        assert!(parse(&args("--stages prefix-affinity,cache")).is_err());
    }

    #[test]
    fn mistakes_name_the_flag() {
        for (line, needle) in [
            ("--prompts 8q", "--prompts"),
            ("--concurrency 0", "--concurrency"),
            ("--requests", "--requests"),
            ("--backends 100", "--backends"),
            ("--host-calls 0", "--host-calls"),
            ("--bogus", "--bogus"),
        ] {
            let e = parse(&args(line)).unwrap_err().to_string();
            assert!(e.contains(needle), "{line}: {e}");
        }
    }
}
