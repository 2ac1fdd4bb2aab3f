//! `kvoy-bench live [options]` (clap derive, like `sim`).

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::RangedU64ValueParser;
use clap::Parser;

use kvoy_sim::cli::positive_f64;
use kvoy_sim_engine::Profile;

use super::{Arrivals, LiveGrid, LivePolicy};
use crate::cli::{parse_as, positive_usize, usage, CliError};
use crate::runner::Rate;
use crate::workload::{Agents, Count, NoSharing, SharedPrefix, Workload};

/// Real Envoy, kvoy-sim simulators (HTTP, SSE, ZMQ KV events) and kvoy-aggregator on 127.0.0.1
///
/// Real Envoy, kvoy-sim simulators (HTTP, SSE, ZMQ KV events) and kvoy-aggregator on
/// 127.0.0.1; the same seeded plan through Envoy's ROUND_ROBIN, LEAST_REQUEST and RANDOM,
/// through the kvoy filters (per-proxy index, then with the aggregator) and through the real
/// peer routers, installed with pip when missing: SGLang's model gateway (sglang-router==0.3.2,
/// `smg`; policies cache_aware and round_robin; and smg==1.13.0 in a virtual environment of its
/// own under ~/.cache/kvoy-bench: cache_aware, cache_aware with dispatch bookings and overlap
/// decay, least_load) and vLLM's router (vllm-router==0.1.17; cache_aware, and on request
/// kv_aware, its precise mode over the simulators' KV events), at their default settings. Each
/// cell runs every policy --repeats times, the order rotating. Every run gets a fresh proxy and
/// empty simulator caches. Times are reported in the modelled GPU's seconds (real time x
/// --speedup).
#[derive(Debug, Parser)]
// Negative numbers reach the value parsers, whose errors name the flag.
#[command(name = "kvoy-bench live", allow_negative_numbers = true)]
pub struct LiveCli {
    /// Comma-separated among shared-prefix, agents, no-sharing
    #[arg(long, visible_alias = "workloads", value_name = "LIST", value_delimiter = ',',
          default_values = ["shared-prefix", "agents"], value_parser = workload)]
    pub workload: Vec<String>,
    /// Comma-separated among round-robin, least-request, random, kvoy, kvoy-aggregator,
    /// smg-cache-aware, smg-round-robin, vllm-router, smg-1.13-cache-aware,
    /// smg-1.13-cache-aware-bookings, smg-1.13-least-load, vllm-router-kv-aware (default: all
    /// but vllm-router-kv-aware, which makes every simulator of the run tokenize with
    /// --tokenizer)
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = policy)]
    pub policies: Vec<LivePolicy>,
    /// The simulators tokenize with this tokenizer.json (kvoy-sim --tokenizer; default: the
    /// stand-in, or testdata/tokenizer/tokenizer.json when vllm-router-kv-aware runs)
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// Simulators
    #[arg(long, value_name = "N", default_value_t = 4,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub replicas: usize,
    /// llama-8b-h100 or qwen-32b-h100-tp2
    #[arg(long, value_name = "NAME", default_value = "llama-8b-h100",
          value_parser = kvoy_sim::cli::profile)]
    pub profile: Profile,
    /// Simulators and arrivals this much faster than the model
    #[arg(long, value_name = "F", default_value_t = 2.0, value_parser = positive_f64)]
    pub speedup: f64,
    /// `1.5x` multiples of the estimated saturation rate, or requests/s of the model's time
    #[arg(long, visible_alias = "loads", value_name = "LIST", value_delimiter = ',',
          value_parser = rate, default_values = ["1x", "1.5x"])]
    pub rates: Vec<Rate>,
    /// Runs of every policy in each (workload, load) cell; repeat r starts with policy r mod
    /// the number of policies, and the report gives each cell's median
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=100))]
    pub repeats: usize,
    /// shared-prefix: multiply the 1,000 output tokens
    #[arg(long, value_name = "F", default_value_t = 0.1, value_parser = positive_f64)]
    pub output_scale: f64,
    /// shared-prefix: multiply the prompt lengths too
    #[arg(long, value_name = "F", default_value_t = 1.0, value_parser = positive_f64)]
    pub scale: f64,
    /// Requests per run (default: 400 for shared-prefix and no-sharing, 800 for agents, whose
    /// closed-loop sessions need more to overlap)
    #[arg(long, value_name = "N", value_parser = positive_usize())]
    pub requests: Option<usize>,
    /// Closed loop at N sessions in flight instead of open-loop arrivals
    #[arg(long, value_name = "N", value_parser = positive_usize())]
    pub closed: Option<usize>,
    /// Real seconds one run may take at most
    #[arg(long, value_name = "S", default_value_t = 180,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub run_deadline: u64,
    /// Tiny requests sent direct and through the proxy before each run, for the proxy's added
    /// latency
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub hop_probes: usize,
    /// Seed of every random draw
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Skip simulating the same plan afterwards (sim-check.md: do the policies rank the same,
    /// are kvoy's TTFT ratios within 25%?)
    #[arg(long)]
    pub no_sim_check: bool,
    /// No live runs: check DIR/results.json of an earlier run made with the same options
    /// against the simulation
    #[arg(long)]
    pub sim_check_only: bool,
    /// Output directory
    #[arg(long, value_name = "DIR", default_value = "bench/results/live")]
    pub out: PathBuf,
    /// No progress lines
    #[arg(long)]
    pub quiet: bool,
}

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

fn workload(name: &str) -> Result<String, String> {
    match name.trim() {
        w @ ("shared-prefix" | "agents" | "no-sharing") => Ok(w.to_owned()),
        other => Err(format!(
            "unknown workload `{other}`; expected shared-prefix, agents or no-sharing"
        )),
    }
}

fn policy(name: &str) -> Result<LivePolicy, String> {
    LivePolicy::parse(name.trim()).ok_or_else(|| {
        let known: Vec<&str> = LivePolicy::ALL.iter().map(|p| p.name()).collect();
        format!(
            "unknown policy `{}`; expected {}",
            name.trim(),
            known.join(", ")
        )
    })
}

fn rate(v: &str) -> Result<Rate, String> {
    let v = v.trim();
    let (n, multiple) = match v.strip_suffix('x') {
        Some(n) => (n, true),
        None => (v, false),
    };
    match n.parse::<f64>() {
        Ok(n) if n.is_finite() && n > 0.0 => Ok(if multiple {
            Rate::Saturation(n)
        } else {
            Rate::Absolute(n)
        }),
        _ => Err("expected a positive number, optionally followed by x".to_owned()),
    }
}

impl LiveCli {
    /// The grid of the runs.
    pub fn into_args(self) -> Result<LiveArgs, CliError> {
        let requests = self.requests;
        let count = |default: usize| Count::Fixed(requests.unwrap_or(default));
        let workloads = self
            .workload
            .iter()
            .map(|name| match name.as_str() {
                "shared-prefix" => {
                    let mut w = SharedPrefix::new(self.scale, count(400));
                    let full = SharedPrefix::default();
                    w.output_tokens =
                        ((f64::from(full.output_tokens) * self.output_scale).round() as u32).max(1);
                    Ok(Workload::SharedPrefix(w))
                }
                "agents" => Ok(Workload::Agents(Agents::new(count(800)))),
                "no-sharing" => Ok(Workload::NoSharing(NoSharing::new(count(400)))),
                other => Err(CliError::UnknownWorkload(other.to_owned())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let policies = if self.policies.is_empty() {
            LivePolicy::DEFAULT.to_vec()
        } else {
            self.policies
        };
        let mut tokenizer = self.tokenizer;
        if tokenizer.is_none() && policies.iter().any(|p| p.needs_kv_events()) {
            tokenizer = Some(super::default_tokenizer());
        }
        let run_dir = std::env::temp_dir().join(format!("kvoy-bench-live-{}", std::process::id()));
        Ok(LiveArgs {
            grid: LiveGrid {
                workloads,
                policies,
                rates: self.rates,
                profile: self.profile,
                replicas: self.replicas,
                speedup: self.speedup,
                seed: self.seed,
                repeats: self.repeats,
                arrivals: self.closed.map_or(Arrivals::Open, Arrivals::Closed),
                run_deadline: Duration::from_secs(self.run_deadline),
                hop_probes: self.hop_probes,
                run_dir,
                tokenizer,
            },
            out: self.out,
            quiet: self.quiet,
            sim_check: !self.no_sim_check,
            sim_check_only: self.sim_check_only,
        })
    }
}

/// Parses the options after `live`.
pub fn parse(args: &[String]) -> Result<LiveArgs, CliError> {
    parse_as::<LiveCli>("kvoy-bench live", args)
        .map_err(usage)?
        .into_args()
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
    use crate::cli::{assert_refused, words};

    #[test]
    fn defaults_and_flags() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.grid.policies.len(), 11);
        assert_eq!(a.grid.policies, LivePolicy::DEFAULT);
        assert!(a
            .grid
            .policies
            .contains(&LivePolicy::Smg113CacheAwareBookings));
        assert!(!a.grid.policies.contains(&LivePolicy::VllmRouterKvAware));
        assert_eq!(a.grid.repeats, 3);
        assert_eq!(parse(&words("--repeats 1")).unwrap().grid.repeats, 1);
        assert_eq!(
            parse(&words("--loads 1.5x")).unwrap().grid.rates,
            vec![Rate::Saturation(1.5)]
        );
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
        assert_eq!(
            a.grid.rates,
            vec![Rate::Saturation(1.0), Rate::Saturation(1.5)]
        );
        let a = parse(&words(
            "--workload agents --policies smg-cache-aware,vllm-router",
        ))
        .unwrap();
        assert_eq!(a.grid.workloads.len(), 1);
        assert_eq!(
            a.grid.policies,
            vec![LivePolicy::SmgCacheAware, LivePolicy::VllmRouter]
        );
        let a = parse(&words(
            "--policies smg-1.13-cache-aware,smg-1.13-cache-aware-bookings,smg-1.13-least-load",
        ))
        .unwrap();
        assert_eq!(
            a.grid.policies,
            vec![
                LivePolicy::Smg113CacheAware,
                LivePolicy::Smg113CacheAwareBookings,
                LivePolicy::Smg113LeastLoad
            ]
        );
        let a = parse(&words(
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
        let a = parse(&words("--no-sim-check")).unwrap();
        assert!(!a.sim_check);
        assert!(parse(&words("--sim-check-only")).unwrap().sim_check_only);
        assert_eq!(parse(&[]).unwrap().grid.tokenizer, None);
        let a = parse(&words("--policies kvoy,vllm-router-kv-aware")).unwrap();
        assert_eq!(
            a.grid.policies,
            vec![LivePolicy::Kvoy, LivePolicy::VllmRouterKvAware]
        );
        assert_eq!(a.grid.tokenizer, Some(crate::live::default_tokenizer()));
        assert!(crate::live::default_tokenizer().is_file());
        let a = parse(&words("--tokenizer /t.json")).unwrap();
        assert_eq!(a.grid.tokenizer, Some(PathBuf::from("/t.json")));
    }

    #[test]
    fn mistakes_name_the_flag() {
        assert_refused(
            parse,
            &[
                ("--replicas 0", "--replicas"),
                ("--speedup -1", "--speedup"),
                ("--rates 1y", "--rates"),
                ("--policies llm-d", "llm-d"),
                ("--workload mooncake", "mooncake"),
                ("--workload agents,nope", "nope"),
                ("--hop-probes x", "--hop-probes"),
                ("--bogus", "--bogus"),
                ("--seed", "--seed"),
                ("--repeats 0", "--repeats"),
                ("--repeats x", "--repeats"),
            ],
        );
    }
}
