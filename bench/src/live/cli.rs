//! `kvoy-bench live [options]`, parsed by hand like `sim`.

use std::path::PathBuf;
use std::time::Duration;

use kvoy_sim::engine::Profile;

use super::{Arrivals, LiveGrid, LivePolicy};
use crate::cli::CliError;
use crate::runner::Rate;
use crate::workload::{Agents, Count, NoSharing, SharedPrefix, Workload};

pub const USAGE: &str = "\
kvoy-bench live [options]

Real Envoy, kvoy-sim simulators (HTTP, SSE, ZMQ KV events) and kvoy-aggregator on 127.0.0.1;
the same seeded plan through Envoy's ROUND_ROBIN, LEAST_REQUEST and RANDOM, through the kvoy
filters (per-proxy index, then with the aggregator) and through the real peer routers, installed
with pip when missing: SGLang's model gateway (sglang-router==0.3.2, `smg`; policies
cache_aware and round_robin) and vLLM's router (vllm-router==0.1.17; cache_aware, and on
request kv_aware, its precise mode over the simulators' KV events), at their default settings. Every run gets a fresh proxy and empty simulator caches. Times are reported in
the modelled GPU's seconds (real time x --speedup).

  --workload LIST       comma-separated among shared-prefix, agents, no-sharing
                        (default: shared-prefix,agents)
  --policies LIST       comma-separated among round-robin, least-request, random, kvoy,
                        kvoy-aggregator, smg-cache-aware, smg-round-robin, vllm-router,
                        vllm-router-kv-aware (default: all but vllm-router-kv-aware, which
                        makes every simulator of the run tokenize with --tokenizer)
  --tokenizer PATH      the simulators tokenize with this tokenizer.json (kvoy-sim
                        --tokenizer; default: the stand-in, or testdata/tokenizer/tokenizer.json
                        when vllm-router-kv-aware runs)
  --replicas N          simulators, 1-64 (default 4)
  --profile NAME        llama-8b-h100 (default) or qwen-32b-h100-tp2
  --speedup F           simulators and arrivals this much faster than the model (default 2)
  --rates LIST          `1.5x` multiples of the estimated saturation rate, or requests/s of
                        the model's time (default 1x,2x,3x)
  --output-scale F      shared-prefix: multiply the 1,000 output tokens (default 0.1)
  --scale F             shared-prefix: multiply the prompt lengths too (default 1)
  --requests N          requests per run (default: 400 for shared-prefix and no-sharing, 800
                        for agents, whose closed-loop sessions need more to overlap)
  --closed N            closed loop at N sessions in flight instead of open-loop arrivals
  --run-deadline S      real seconds one run may take at most (default 180)
  --hop-probes N        tiny requests sent direct and through the proxy before each run, for
                        the proxy's added latency (default 20)
  --seed N              (default 1)
  --no-sim-check        skip simulating the same plan afterwards (sim-check.md: do the policies
                        rank the same, are kvoy's TTFT ratios within 25%?)
  --sim-check-only      no live runs: check DIR/results.json of an earlier run made with the
                        same options against the simulation
  --out DIR             output directory (default bench/results/live)
  --quiet               no progress lines
";

/// `kvoy-bench live` options.
#[derive(Clone, Debug)]
pub struct LiveArgs {
    pub grid: LiveGrid,
    pub out: PathBuf,
    pub quiet: bool,
    /// Simulate the same plan afterwards and compare (open-loop arrivals only).
    pub sim_check: bool,
    /// Skip the live runs and check the saved `out/results.json`.
    pub sim_check_only: bool,
}

/// The value after `flag`, or a `MissingValue` error naming it.
pub(crate) fn value<'a>(
    args: &mut impl Iterator<Item = &'a String>,
    flag: &'static str,
) -> Result<&'a str, CliError> {
    args.next()
        .map(String::as_str)
        .ok_or(CliError::MissingValue(flag))
}

fn number<T: std::str::FromStr>(
    v: &str,
    flag: &'static str,
    expected: &'static str,
) -> Result<T, CliError> {
    v.parse().map_err(|_| CliError::BadValue {
        flag,
        value: v.to_owned(),
        expected,
    })
}

fn rate(v: &str) -> Result<Rate, CliError> {
    let bad = || CliError::BadValue {
        flag: "--rates",
        value: v.to_owned(),
        expected: "a positive number, optionally followed by x",
    };
    let (n, multiple) = match v.strip_suffix('x') {
        Some(n) => (n, true),
        None => (v, false),
    };
    let n: f64 = n.parse().map_err(|_| bad())?;
    if !(n.is_finite() && n > 0.0) {
        return Err(bad());
    }
    Ok(if multiple {
        Rate::Saturation(n)
    } else {
        Rate::Absolute(n)
    })
}

/// Parses the options after `live`.
pub fn parse(args: &[String]) -> Result<LiveArgs, CliError> {
    let mut workloads = "shared-prefix,agents".to_owned();
    let mut policies = LivePolicy::DEFAULT.to_vec();
    let mut tokenizer: Option<PathBuf> = None;
    let mut replicas = 4usize;
    let mut profile = Profile::llama_8b_h100();
    let mut speedup = 2.0f64;
    let mut rates = vec![
        Rate::Saturation(1.0),
        Rate::Saturation(2.0),
        Rate::Saturation(3.0),
    ];
    let (mut output_scale, mut scale) = (0.1f64, 1.0f64);
    let mut requests: Option<usize> = None;
    let mut hop_probes = 20usize;
    let mut arrivals = Arrivals::Open;
    let mut deadline = 180u64;
    let mut seed = 1u64;
    let mut out = PathBuf::from("bench/results/live");
    let mut quiet = false;
    let mut sim_check = true;
    let mut sim_check_only = false;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--workload" | "--workloads" => {
                workloads = value(&mut it, "--workload")?.to_owned();
            }
            "--policies" => {
                policies = value(&mut it, "--policies")?
                    .split(',')
                    .map(|p| {
                        LivePolicy::parse(p.trim())
                            .ok_or_else(|| CliError::UnknownPolicy(p.to_owned()))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--replicas" => {
                replicas = number(value(&mut it, "--replicas")?, "--replicas", "1-64")?;
                if !(1..=64).contains(&replicas) {
                    return Err(CliError::BadValue {
                        flag: "--replicas",
                        value: replicas.to_string(),
                        expected: "1-64",
                    });
                }
            }
            "--profile" => {
                let name = value(&mut it, "--profile")?;
                profile = Profile::by_name(name)
                    .ok_or_else(|| CliError::UnknownProfile(name.to_owned()))?;
            }
            "--speedup" => {
                speedup = number(value(&mut it, "--speedup")?, "--speedup", "a number > 0")?;
                if !(speedup.is_finite() && speedup > 0.0) {
                    return Err(CliError::BadValue {
                        flag: "--speedup",
                        value: speedup.to_string(),
                        expected: "a number > 0",
                    });
                }
            }
            "--rates" => {
                rates = value(&mut it, "--rates")?
                    .split(',')
                    .map(|r| rate(r.trim()))
                    .collect::<Result<_, _>>()?;
            }
            "--output-scale" => {
                output_scale = number(
                    value(&mut it, "--output-scale")?,
                    "--output-scale",
                    "a number > 0",
                )?;
            }
            "--scale" => scale = number(value(&mut it, "--scale")?, "--scale", "a number > 0")?,
            "--requests" => {
                requests = Some(number(
                    value(&mut it, "--requests")?,
                    "--requests",
                    "a count",
                )?);
            }
            "--closed" => {
                let n: usize = number(value(&mut it, "--closed")?, "--closed", "a count > 0")?;
                arrivals = Arrivals::Closed(n.max(1));
            }
            "--run-deadline" => {
                deadline = number(
                    value(&mut it, "--run-deadline")?,
                    "--run-deadline",
                    "seconds",
                )?;
            }
            "--hop-probes" => {
                hop_probes = number(value(&mut it, "--hop-probes")?, "--hop-probes", "a count")?;
            }
            "--seed" => seed = number(value(&mut it, "--seed")?, "--seed", "an integer")?,
            "--out" => out = PathBuf::from(value(&mut it, "--out")?),
            "--tokenizer" => tokenizer = Some(PathBuf::from(value(&mut it, "--tokenizer")?)),
            "--quiet" => quiet = true,
            "--no-sim-check" => sim_check = false,
            "--sim-check-only" => sim_check_only = true,
            other => return Err(CliError::UnknownFlag(other.to_owned())),
        }
    }
    for (flag, v) in [("--output-scale", output_scale), ("--scale", scale)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(CliError::BadValue {
                flag,
                value: v.to_string(),
                expected: "a number > 0",
            });
        }
    }
    let count = |default: usize| Count::Fixed(requests.unwrap_or(default).max(1));
    let workloads = workloads
        .split(',')
        .map(|name| match name.trim() {
            "shared-prefix" => {
                let mut w = SharedPrefix::new(scale, count(400));
                let full = SharedPrefix::default();
                w.output_tokens =
                    ((f64::from(full.output_tokens) * output_scale).round() as u32).max(1);
                Ok(Workload::SharedPrefix(w))
            }
            "agents" => Ok(Workload::Agents(Agents::new(count(800)))),
            "no-sharing" => Ok(Workload::NoSharing(NoSharing::new(count(400)))),
            other => Err(CliError::UnknownWorkload(other.to_owned())),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let run_dir = std::env::temp_dir().join(format!("kvoy-bench-live-{}", std::process::id()));
    if tokenizer.is_none() && policies.iter().any(|p| p.needs_kv_events()) {
        tokenizer = Some(super::default_tokenizer());
    }
    Ok(LiveArgs {
        grid: LiveGrid {
            workloads,
            policies,
            rates,
            profile,
            replicas,
            speedup,
            seed,
            arrivals,
            run_deadline: Duration::from_secs(deadline.max(1)),
            hop_probes,
            run_dir,
            tokenizer,
        },
        out,
        quiet,
        sim_check,
        sim_check_only,
    })
}

/// For `cli::Command`'s equality in tests: the grid holds workloads that are not `PartialEq`
/// (a trace behind an `Arc`), so compare what the options print as.
impl PartialEq for LiveArgs {
    fn eq(&self, other: &Self) -> bool {
        self.out == other.out
            && self.quiet == other.quiet
            && self.sim_check == other.sim_check
            && self.sim_check_only == other.sim_check_only
            && format!("{:?}", self.grid) == format!("{:?}", other.grid)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn defaults_and_flags() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.grid.policies.len(), 8);
        assert_eq!(a.grid.replicas, 4);
        assert_eq!(a.grid.workloads.len(), 2);
        match &a.grid.workloads[0] {
            Workload::SharedPrefix(w) => {
                assert_eq!(
                    (w.system_tokens, w.question_tokens, w.output_tokens),
                    (6000, 1200, 100)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            a.grid.workloads[1],
            Workload::Agents(Agents {
                count: Count::Fixed(800)
            })
        ));
        assert_eq!(a.grid.rates.len(), 3);
        let a = parse(&args(
            "--workload agents --policies smg-cache-aware,vllm-router",
        ))
        .unwrap();
        assert_eq!(a.grid.workloads.len(), 1);
        assert_eq!(
            a.grid.policies,
            vec![LivePolicy::SmgCacheAware, LivePolicy::VllmRouter]
        );
        let a = parse(&args(
            "--policies kvoy,random --rates 1x,20 --closed 8 --replicas 2",
        ))
        .unwrap();
        assert_eq!(a.grid.policies, vec![LivePolicy::Kvoy, LivePolicy::Random]);
        assert_eq!(
            a.grid.rates,
            vec![Rate::Saturation(1.0), Rate::Absolute(20.0)]
        );
        assert_eq!(a.grid.arrivals, Arrivals::Closed(8));
        assert!(a.sim_check && !a.sim_check_only);
        let a = parse(&args("--no-sim-check")).unwrap();
        assert!(!a.sim_check);
        assert!(parse(&args("--sim-check-only")).unwrap().sim_check_only);
        assert_eq!(parse(&[]).unwrap().grid.tokenizer, None);
        let a = parse(&args("--policies kvoy,vllm-router-kv-aware")).unwrap();
        assert_eq!(
            a.grid.policies,
            vec![LivePolicy::Kvoy, LivePolicy::VllmRouterKvAware]
        );
        assert_eq!(a.grid.tokenizer, Some(crate::live::default_tokenizer()));
        assert!(crate::live::default_tokenizer().is_file());
        let a = parse(&args("--tokenizer /t.json")).unwrap();
        assert_eq!(a.grid.tokenizer, Some(PathBuf::from("/t.json")));
    }

    #[test]
    fn mistakes_name_the_flag() {
        for (line, needle) in [
            ("--replicas 0", "--replicas"),
            ("--speedup -1", "--speedup"),
            ("--rates 1y", "--rates"),
            ("--policies llm-d", "llm-d"),
            ("--workload mooncake", "mooncake"),
            ("--workload agents,nope", "nope"),
            ("--hop-probes x", "--hop-probes"),
            ("--bogus", "--bogus"),
            ("--seed", "--seed"),
        ] {
            let e = parse(&args(line)).unwrap_err().to_string();
            assert!(e.contains(needle), "{line}: {e}");
        }
    }
}
