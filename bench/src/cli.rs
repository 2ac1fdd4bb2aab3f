//! The command line (clap derive): `kvoy-bench sim|live|overhead|report [options]`.

use std::path::PathBuf;
use std::sync::Arc;

use clap::builder::RangedU64ValueParser;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Args, Parser, Subcommand};

use kvoy_sim_engine::Profile;

use crate::fleet::FleetKind;
use crate::policy::PolicyKind;
use crate::runner::{Grid, Rate};
use crate::workload::{
    Agents, Count, LongPrompt, NoSharing, SharedPrefix, Trace, TraceError, Workload,
};

/// A command-line mistake, or an input that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("expected a command: `sim`, `live`, `overhead` or `report` (try --help)")]
    NoCommand,
    /// What clap refused, in one line that names the flag (the binary prints clap's own message).
    #[error("{}", usage_message(.0))]
    Usage(clap::Error),
    #[error(
        "unknown workload `{0}`; expected shared-prefix, agents, mooncake, no-sharing or long-prompt"
    )]
    UnknownWorkload(String),
    #[error("`--slow-factor` applies to `--fleet half-slow` only")]
    SlowFactorWithoutSlowReplicas,
    #[error(
        "`--fleet half-slow` needs at least 2 replicas (the odd-indexed ones are slow), got {0}"
    )]
    HalfSlowReplicas(usize),
    #[error("`--prefill-replicas {prefill}` leaves no decode replica of {replicas}")]
    PrefillReplicas { prefill: usize, replicas: usize },
    #[error("the mooncake workload needs the trace: --trace PATH")]
    MissingTrace,
    #[error(transparent)]
    Trace(#[from] TraceError),
}

/// One line for a clap error, in the words this crate's callers (and tests) read: the flag, and
/// what is wrong with it.
fn usage_message(e: &clap::Error) -> String {
    let context = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => s.as_str(),
        _ => "",
    };
    // "--rates <LIST>" -> "--rates".
    let flag = context(ContextKind::InvalidArg)
        .split([' ', '='])
        .next()
        .unwrap_or_default();
    match e.kind() {
        ErrorKind::UnknownArgument => match context(ContextKind::SuggestedArg) {
            "" => format!("unknown option `{flag}` (try --help)"),
            similar => format!("unknown option `{flag}`; did you mean `{similar}`?"),
        },
        ErrorKind::InvalidSubcommand => format!(
            "unknown command `{}` (the commands are `sim`, `live`, `overhead` and `report`)",
            context(ContextKind::InvalidSubcommand)
        ),
        ErrorKind::InvalidValue if context(ContextKind::InvalidValue).is_empty() => {
            format!("`{flag}` needs a value")
        }
        // clap's own first paragraph ("invalid value 'x' for '--flag <V>': why").
        _ => {
            let text = e.render().to_string();
            let text = text.strip_prefix("error: ").unwrap_or(&text);
            text.split("\n\n")
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        }
    }
}

/// A clap error as a [`CliError`]; `--help` has no `Command::Help` below the top level, so it
/// is an error there too.
pub(crate) fn usage(e: clap::Error) -> CliError {
    match e.kind() {
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            CliError::NoCommand
        }
        _ => CliError::Usage(e),
    }
}

/// `args` (the arguments after `program`, itself one or more words) as `C`'s flags.
pub(crate) fn parse_as<C: Parser>(program: &str, args: &[String]) -> Result<C, clap::Error> {
    C::try_parse_from(std::iter::once(program).chain(args.iter().map(String::as_str)))
}

/// The words of a command line, for the tests.
#[cfg(test)]
pub(crate) fn words(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_owned).collect()
}

/// For the tests: each command line of `cases` is refused by `parse` with a message that
/// contains its needle (the flag or value at fault).
#[cfg(test)]
pub(crate) fn assert_refused<T: std::fmt::Debug>(
    parse: impl Fn(&[String]) -> Result<T, CliError>,
    cases: &[(&str, &str)],
) {
    for (line, needle) in cases {
        let Err(e) = parse(&words(line)) else {
            panic!("{line}: accepted");
        };
        let e = e.to_string();
        assert!(e.contains(needle), "{line}: {e}");
    }
}

/// A whole number at least 1, for counts.
pub(crate) fn positive_usize() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::<usize>::new().range(1..)
}

/// kvoy-bench: routing policies on a simulated fleet of kvoy-sim engines (virtual time), live
/// through Envoy, and the filters' added latency
#[derive(Debug, Parser)]
#[command(name = "kvoy-bench", arg_required_else_help = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: CliCommand,
}

#[derive(Debug, Subcommand)]
pub enum CliCommand {
    /// Routing policies on a simulated fleet of kvoy-sim engines (virtual time)
    Sim(Box<SimCli>),
    /// Real Envoy, kvoy-sim simulators and kvoy-aggregator on 127.0.0.1: the same plan
    /// through every router
    Live(crate::live::cli::LiveCli),
    /// The latency the kvoy filters add, against plain Envoy
    Overhead(crate::overhead::cli::OverheadCli),
    /// summary.md and the plots again from a results.json
    Report {
        /// A results.json
        #[arg(long, value_name = "FILE")]
        from: PathBuf,
        /// Output directory (default: the file's directory)
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
}

impl CliCommand {
    /// The checks clap cannot make (flags that go together, files the grid needs).
    pub fn into_command(self) -> Result<Command, CliError> {
        Ok(match self {
            CliCommand::Sim(a) => Command::Sim(Box::new(a.into_args()?)),
            CliCommand::Live(a) => Command::Live(Box::new(a.into_args()?)),
            CliCommand::Overhead(a) => Command::Overhead(Box::new(a.into_args())),
            CliCommand::Report { from, out } => Command::Report { from, out },
        })
    }
}

/// `kvoy-bench sim`'s flags.
#[derive(Debug, Args)]
#[command(
    // Negative numbers reach the value parsers, whose errors name the flag.
    allow_negative_numbers = true,
    after_help = "Fleets (--fleet KIND): uniform: every replica runs the profile; half-slow: the \
                  odd-indexed replicas (1, 3, 5, ...) run it --slow-factor times slower (every \
                  step-time duration multiplied, same KV geometry). Loads in `x` are multiples \
                  of that fleet's own saturation estimate."
)]
pub struct SimCli {
    /// shared-prefix, agents, mooncake, no-sharing or long-prompt; repeat or separate with
    /// commas [default: shared-prefix]
    #[arg(long, visible_alias = "workloads", value_name = "NAME", value_delimiter = ',',
          value_parser = workload)]
    pub workload: Vec<String>,
    /// Every workload (mooncake needs --trace)
    #[arg(long)]
    pub all: bool,
    /// Comma-separated among round-robin, least-request, random, kvoy, kvoy-aggregator,
    /// kvoy-weighted, llm-d, sglang, llm-d-1.0, llm-d-1.0-calibrated, dynamo, and the P/D
    /// references llm-d-pd, dynamo-pd [default: all; the P/D ones with --prefill-replicas]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = policy)]
    pub policies: Vec<PolicyKind>,
    /// Engines in the fleet
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = RangedU64ValueParser::<usize>::new()
              .range(1..=kvoy_shared::MAX_ENDPOINTS as u64))]
    pub replicas: usize,
    /// llama-8b-h100 or qwen-32b-h100-tp2
    #[arg(long, value_name = "NAME", default_value = "llama-8b-h100",
          value_parser = kvoy_sim::cli::profile)]
    pub profile: Profile,
    /// Every replica offloads its KV cache to a CPU tier of N blocks (kvoy-sim's
    /// --cpu-offload-blocks; default 0: none)
    #[arg(long, value_name = "N")]
    pub cpu_offload_blocks: Option<u32>,
    /// uniform or half-slow (see below)
    #[arg(long, value_name = "KIND", default_value = "uniform", value_parser = fleet)]
    pub fleet: FleetKind,
    /// half-slow: how much slower the slow replicas are, at least 1 [default: 2]
    #[arg(long, value_name = "F", value_parser = at_least_one)]
    pub slow_factor: Option<f64>,
    /// Comma-separated offered loads: `1.5x` is a multiple of the workload's estimated
    /// saturation rate, `2t` a multiple of the trace's own rate (mooncake), a plain number is
    /// requests/s
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = sim_rate,
          default_values = ["0.5x", "1x", "2x", "3x"])]
    pub rates: Vec<Rate>,
    /// shared-prefix, long-prompt: multiply prompt and output lengths
    #[arg(long, value_name = "F", default_value_t = 1.0,
          value_parser = kvoy_sim::cli::positive_f64)]
    pub scale: f64,
    /// shared-prefix: multiply the output lengths again, after --scale (the live bench's
    /// 0.1 reproduces its plan)
    #[arg(long, value_name = "F", default_value_t = 1.0,
          value_parser = kvoy_sim::cli::positive_f64)]
    pub output_scale: f64,
    /// Prefill/decode disaggregation: the first N replicas only prefill, the others decode (a
    /// policy that knows no roles sends them nothing but what it routes; kvoy splits by its
    /// `disaggregation` settings) [default: 0, every replica serves whole requests]
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub prefill_replicas: usize,
    /// shared-prefix, agents, no-sharing, long-prompt: load stages of S seconds of arrivals,
    /// rate x S requests (defaults 180, 60, 60 and 60 s)
    #[arg(long, value_name = "S", value_parser = kvoy_sim::cli::positive_f64)]
    pub duration: Option<f64>,
    /// shared-prefix, agents, no-sharing, long-prompt: exactly N requests per run instead
    #[arg(long, value_name = "N", conflicts_with = "duration", value_parser = positive_usize())]
    pub requests: Option<usize>,
    /// The Mooncake conversation trace (JSONL) for the mooncake workload
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// mooncake: replay only the first N requests
    #[arg(long, value_name = "N", value_parser = positive_usize())]
    pub limit: Option<usize>,
    /// Seed of every random draw (one seed; see --seeds)
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Run every cell once per seed: a comma-separated list of seeds and ranges, `1,2,3,4,5`
    /// or `1-5`; the summary gives each cell's median and worst over them, `results.json`
    /// every run. The first seed's plan sets the saturation estimate and the SLO
    #[arg(long, value_name = "LIST", conflicts_with = "seed", value_parser = seed_list)]
    pub seeds: Option<SeedList>,
    /// The TTFT SLO in seconds of model time that the "SLO met" share and goodput count
    /// against [default: 5 x the idle TTFT of each workload's median prompt]
    #[arg(long, value_name = "S", value_parser = kvoy_sim::cli::positive_f64)]
    pub slo_ttft: Option<f64>,
    /// Runs in parallel
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive_usize())]
    pub threads: usize,
    /// sglang: per-worker tree bound in characters (default: the replica's KV capacity in
    /// characters)
    #[arg(long, value_name = "N", value_parser = positive_usize())]
    pub sglang_tree_chars: Option<usize>,
    /// kvoy, kvoy-aggregator, kvoy-weighted: fields set in their `cost` configuration, a JSON
    /// object with the filter's field names, e.g. '{"uncached_weight": 2}' (default: the
    /// filter's defaults)
    #[arg(long, value_name = "JSON")]
    pub kvoy_cost: Option<crate::policy::kvoy::CostOverrides>,
    /// kvoy: fields set in its `disaggregation` configuration (fleets with --prefill-replicas),
    /// e.g. '{"prefill_uncached_weight": 1}' (default: the filter's defaults)
    #[arg(long, value_name = "JSON")]
    pub kvoy_disaggregation: Option<crate::policy::kvoy::CostOverrides>,
    /// Put this share (0-1, exclusive) of each plan's sessions in a sheddable band (objective
    /// `sheddable`, priority -1; the rest `interactive`, priority 0) and run each policy behind
    /// its admission stage: kvoy's own, llm-d's legacy admission controller, none for the
    /// routers without bands. Figures come per class (the band is class `sheddable`)
    #[arg(long, value_name = "SHARE", value_parser = open_unit)]
    pub sheddable: Option<f64>,
    /// kvoy, kvoy-aggregator, kvoy-weighted with --sheddable: fields set in their admission
    /// stage's `flow` configuration, a JSON object with the filter's field names, e.g.
    /// '{"queue_sheddable": true}' (default: the filter's defaults)
    #[arg(long, value_name = "JSON", requires = "sheddable", value_parser = json_object)]
    pub kvoy_flow: Option<serde_json::Map<String, serde_json::Value>>,
    /// Output directory
    #[arg(long, value_name = "DIR", default_value = "bench/results/sim")]
    pub out: PathBuf,
    /// No progress lines on stderr
    #[arg(long)]
    pub quiet: bool,
}

/// The seeds of `--seeds`, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedList(pub Vec<u64>);

/// The most seeds `--seeds` takes (each is a whole grid of runs).
pub const MAX_SEEDS: usize = 1000;

fn seed_list(v: &str) -> Result<SeedList, String> {
    let number = |s: &str| {
        s.trim()
            .parse::<u64>()
            .map_err(|_| format!("`{}` is not a seed (a whole number)", s.trim()))
    };
    let mut seeds = Vec::new();
    for item in v.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err("expected seeds like 1,2,3 or 1-5; an item is empty".to_owned());
        }
        match item.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if a > b {
                    return Err(format!("the range `{item}` ends before it starts"));
                }
                if b - a >= MAX_SEEDS as u64 {
                    return Err(format!("at most {MAX_SEEDS} seeds"));
                }
                seeds.extend(a..=b);
            }
            None => seeds.push(number(item)?),
        }
        if seeds.len() > MAX_SEEDS {
            return Err(format!("at most {MAX_SEEDS} seeds"));
        }
    }
    for (i, s) in seeds.iter().enumerate() {
        if seeds[..i].contains(s) {
            return Err(format!("seed {s} is given twice"));
        }
    }
    Ok(SeedList(seeds))
}

fn workload(name: &str) -> Result<String, CliError> {
    let name = name.trim();
    if Workload::NAMES.contains(&name) {
        Ok(name.to_owned())
    } else {
        Err(CliError::UnknownWorkload(name.to_owned()))
    }
}

fn policy(name: &str) -> Result<PolicyKind, String> {
    PolicyKind::from_name(name.trim()).ok_or_else(|| {
        format!(
            "unknown policy `{}`; expected round-robin, least-request, random, kvoy, \
             kvoy-aggregator, llm-d, sglang, llm-d-1.0, llm-d-1.0-calibrated or dynamo",
            name.trim()
        )
    })
}

fn fleet(name: &str) -> Result<FleetKind, String> {
    let name = name.trim();
    FleetKind::by_name(name, FleetKind::DEFAULT_SLOW_FACTOR)
        .ok_or_else(|| format!("unknown fleet `{name}`; expected uniform or half-slow"))
}

fn at_least_one(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 1.0 => Ok(f),
        _ => Err("expected a number at least 1".to_owned()),
    }
}

fn sim_rate(item: &str) -> Result<Rate, String> {
    let item = item.trim();
    let (number, kind): (&str, fn(f64) -> Rate) = if let Some(n) = item.strip_suffix('x') {
        (n, Rate::Saturation)
    } else if let Some(n) = item.strip_suffix('t') {
        (n, Rate::Trace)
    } else {
        (item, Rate::Absolute)
    };
    match number.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(kind(x)),
        _ => Err(
            "expected rates like 1.5x (x saturation), 2t (x the trace's rate) or 12 (req/s)"
                .to_owned(),
        ),
    }
}

/// `kvoy-bench sim` options.
#[derive(Clone, Debug, PartialEq)]
pub struct SimArgs {
    pub workloads: Vec<String>,
    pub policies: Vec<PolicyKind>,
    pub replicas: usize,
    pub profile: Profile,
    /// Overrides the profile's CPU offload tier (blocks), whatever the flags' order.
    pub cpu_offload_blocks: Option<u32>,
    pub fleet: FleetKind,
    pub rates: Vec<Rate>,
    pub scale: f64,
    /// shared-prefix: a further factor on the output lengths.
    pub output_scale: f64,
    /// The first this many replicas only prefill (0: none).
    pub prefill_replicas: usize,
    /// `None`: each workload's default stage.
    pub count: Option<Count>,
    pub trace: Option<PathBuf>,
    pub limit: Option<usize>,
    /// Every cell runs once per seed; the first is the nominal one.
    pub seeds: Vec<u64>,
    /// `--slo-ttft`, seconds; `None`: the default rule.
    pub slo_ttft_s: Option<f64>,
    pub threads: usize,
    pub sglang_tree_chars: Option<usize>,
    pub kvoy_cost: crate::policy::kvoy::CostOverrides,
    pub kvoy_disaggregation: crate::policy::kvoy::CostOverrides,
    pub sheddable: Option<f64>,
    pub kvoy_flow: serde_json::Map<String, serde_json::Value>,
    pub out: PathBuf,
    pub quiet: bool,
}

/// A share strictly between 0 and 1.
fn open_unit(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x < 1.0 => Ok(x),
        _ => Err(format!(
            "expected a share between 0 and 1 (exclusive), got `{s}`"
        )),
    }
}

/// A JSON object.
fn json_object(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err("expected a JSON object".to_owned()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

impl SimCli {
    /// The options, with the flags that go together checked.
    pub fn into_args(self) -> Result<SimArgs, CliError> {
        let mut workloads = if self.all {
            Workload::NAMES.iter().map(|w| (*w).to_owned()).collect()
        } else if self.workload.is_empty() {
            vec!["shared-prefix".to_owned()]
        } else {
            self.workload
        };
        workloads.dedup();
        let mut fleet = self.fleet;
        match &mut fleet {
            FleetKind::Uniform if self.slow_factor.is_some() => {
                return Err(CliError::SlowFactorWithoutSlowReplicas)
            }
            FleetKind::Uniform => {}
            FleetKind::HalfSlow { .. } if self.replicas < 2 => {
                return Err(CliError::HalfSlowReplicas(self.replicas))
            }
            FleetKind::HalfSlow { slow_factor: f } => *f = self.slow_factor.unwrap_or(*f),
        }
        if self.prefill_replicas >= self.replicas {
            return Err(CliError::PrefillReplicas {
                prefill: self.prefill_replicas,
                replicas: self.replicas,
            });
        }
        if workloads.iter().any(|w| w == "mooncake") && self.trace.is_none() {
            return Err(CliError::MissingTrace);
        }
        let count = match (self.requests, self.duration) {
            (Some(n), _) => Some(Count::Fixed(n)),
            (None, Some(s)) => Some(Count::Duration(s)),
            (None, None) => None,
        };
        Ok(SimArgs {
            workloads,
            policies: if self.policies.is_empty() && self.prefill_replicas > 0 {
                PolicyKind::ALL.into_iter().chain(PolicyKind::PD).collect()
            } else if self.policies.is_empty() {
                PolicyKind::ALL.to_vec()
            } else {
                self.policies
            },
            replicas: self.replicas,
            profile: self.profile,
            cpu_offload_blocks: self.cpu_offload_blocks,
            fleet,
            rates: self.rates,
            scale: self.scale,
            output_scale: self.output_scale,
            prefill_replicas: self.prefill_replicas,
            count,
            trace: self.trace,
            limit: self.limit,
            seeds: self.seeds.map_or_else(|| vec![self.seed], |s| s.0),
            slo_ttft_s: self.slo_ttft,
            threads: self.threads,
            sglang_tree_chars: self.sglang_tree_chars,
            kvoy_cost: self.kvoy_cost.unwrap_or_default(),
            kvoy_disaggregation: self.kvoy_disaggregation.unwrap_or_default(),
            sheddable: self.sheddable,
            kvoy_flow: self.kvoy_flow.unwrap_or_default(),
            out: self.out,
            quiet: self.quiet,
        })
    }
}

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Help,
    Sim(Box<SimArgs>),
    /// `kvoy-bench live`: real Envoy and simulators (see [`crate::live`]).
    Live(Box<crate::live::cli::LiveArgs>),
    /// `kvoy-bench overhead`: the filters' added latency (see [`crate::overhead`]).
    Overhead(Box<crate::overhead::cli::OverheadArgs>),
    /// Render `summary.md` and the plots again from a saved `results.json` into `out` (default:
    /// the file's directory).
    Report {
        from: PathBuf,
        out: Option<PathBuf>,
    },
}

/// Parses the arguments after the program name; `--help` (of any command) is
/// [`Command::Help`], which the caller prints with clap.
pub fn parse(args: &[String]) -> Result<Command, CliError> {
    match parse_as::<Cli>("kvoy-bench", args) {
        Ok(cli) => cli.command.into_command(),
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            Ok(Command::Help)
        }
        Err(e) => Err(usage(e)),
    }
}

impl SimArgs {
    /// The grid of runs; loads the trace when the mooncake workload is asked for.
    pub fn grid(&self) -> Result<Grid, CliError> {
        let mut workloads = Vec::new();
        for name in &self.workloads {
            let w = match name.as_str() {
                "shared-prefix" => {
                    let count = self.count.unwrap_or(Count::Duration(180.0));
                    let mut w = SharedPrefix::new(self.scale, count);
                    w.output_tokens =
                        ((f64::from(w.output_tokens) * self.output_scale).round() as u32).max(1);
                    Workload::SharedPrefix(w)
                }
                "agents" => {
                    Workload::Agents(Agents::new(self.count.unwrap_or(Count::Duration(60.0))))
                }
                "no-sharing" => {
                    Workload::NoSharing(NoSharing::new(self.count.unwrap_or(Count::Duration(60.0))))
                }
                "long-prompt" => Workload::LongPrompt(LongPrompt::new(
                    self.scale,
                    self.count.unwrap_or(Count::Duration(60.0)),
                )),
                "mooncake" => {
                    let path = self.trace.as_ref().ok_or(CliError::MissingTrace)?;
                    Workload::mooncake(Arc::new(Trace::load(path)?), self.limit)
                }
                other => return Err(CliError::UnknownWorkload(other.to_owned())),
            };
            workloads.push(w);
        }
        Ok(Grid {
            workloads,
            policies: self.policies.clone(),
            rates: self.rates.clone(),
            profile: {
                let mut p = self.profile.clone();
                if let Some(n) = self.cpu_offload_blocks {
                    p.cpu_offload_blocks = n;
                }
                p
            },
            replicas: self.replicas,
            fleet: self.fleet,
            seeds: self.seeds.clone(),
            slo_ttft_s: self.slo_ttft_s,
            threads: self.threads,
            sglang_tree_chars: self.sglang_tree_chars,
            kvoy_cost: self.kvoy_cost.clone(),
            kvoy_disaggregation: self.kvoy_disaggregation.clone(),
            envoy_workers: None,
            scrape_interval: std::time::Duration::from_millis(50),
            sheddable: self.sheddable,
            kvoy_flow: self.kvoy_flow.clone(),
            prefill_replicas: self.prefill_replicas,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim(s: &str) -> SimArgs {
        match parse(&words(s)) {
            Ok(Command::Sim(a)) => *a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn defaults_and_flags() {
        let a = sim("sim");
        assert_eq!(a.workloads, ["shared-prefix"]);
        assert_eq!(a.policies.len(), PolicyKind::ALL.len());
        assert_eq!(
            (a.replicas, a.threads, a.seeds.as_slice()),
            (16, 2, &[1][..])
        );
        assert_eq!(a.slo_ttft_s, None);
        let a = sim("sim --workload agents,no-sharing --rates 0.5x,2t,12 --replicas 8 --policies kvoy,round-robin --requests 40 --scale 0.1");
        assert_eq!(a.workloads, ["agents", "no-sharing"]);
        assert_eq!(
            a.rates,
            [
                Rate::Saturation(0.5),
                Rate::Trace(2.0),
                Rate::Absolute(12.0)
            ]
        );
        assert_eq!(a.policies, [PolicyKind::Kvoy, PolicyKind::RoundRobin]);
        assert_eq!(
            (a.replicas, a.count, a.scale),
            (8, Some(Count::Fixed(40)), 0.1)
        );
        assert_eq!(sim("sim --duration 30").count, Some(Count::Duration(30.0)));
        assert_eq!(parse(&words("--help")).unwrap(), Command::Help);
        let a = sim("sim --all --trace /t.jsonl");
        assert_eq!(a.workloads.len(), 5);
        assert_eq!(a.fleet, FleetKind::Uniform);
        let a = sim("sim --fleet half-slow");
        assert_eq!(a.fleet, FleetKind::HalfSlow { slow_factor: 2.0 });
        let a = sim("sim --slow-factor 3 --fleet half-slow --replicas 4");
        assert_eq!(a.fleet, FleetKind::HalfSlow { slow_factor: 3.0 });
        assert_eq!(a.grid().unwrap().fleet, a.fleet);
        // The live bench's shared-prefix plan: 100-token outputs.
        let a = sim("sim --output-scale 0.1");
        match &a.grid().unwrap().workloads[0] {
            Workload::SharedPrefix(w) => assert_eq!(w.output_tokens, 100),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn seeds_and_the_slo() {
        assert_eq!(sim("sim --seed 7").seeds, [7]);
        assert_eq!(sim("sim --seeds 1,2,3,4,5").seeds, [1, 2, 3, 4, 5]);
        assert_eq!(sim("sim --seeds 1-5").seeds, [1, 2, 3, 4, 5]);
        assert_eq!(sim("sim --seeds 9,1-3").seeds, [9, 1, 2, 3]);
        assert_eq!(sim("sim --seeds 4").seeds, [4]);
        let a = sim("sim --seeds 3-4 --slo-ttft 2.5");
        assert_eq!(
            (a.slo_ttft_s, a.grid().unwrap().seeds),
            (Some(2.5), vec![3, 4])
        );
        let err = |s: &str| parse(&words(s)).unwrap_err().to_string();
        for (args, why) in [
            ("sim --seeds 5-1", "ends before it starts"),
            ("sim --seeds 1,x", "`x` is not a seed"),
            ("sim --seeds 1,,2", "empty"),
            ("sim --seeds 1-", "is not a seed"),
            ("sim --seeds 2,1-3", "seed 2 is given twice"),
            ("sim --seeds 0-5000", "at most 1000 seeds"),
            ("sim --seeds -1", "is not a seed"),
        ] {
            let e = err(args);
            assert!(e.contains("--seeds") && e.contains(why), "{args}: {e}");
        }
        assert!(err("sim --seeds").contains("needs a value"));
        let e = err("sim --seed 1 --seeds 1-3");
        assert!(e.contains("--seed") && e.contains("--seeds"), "{e}");
        for bad in ["0", "-1", "x"] {
            let e = err(&format!("sim --slo-ttft {bad}"));
            assert!(e.contains("--slo-ttft"), "{bad}: {e}");
        }
    }

    #[test]
    fn mistakes_are_named() {
        let err = |s: &str| parse(&words(s)).unwrap_err().to_string();
        assert!(err("sim --replicas 0").contains("--replicas"));
        assert!(err("sim --replicas x").contains("--replicas"));
        assert!(err("sim --rates 1x,-2").contains("--rates"));
        assert!(err("sim --rates").contains("needs a value"));
        assert!(err("sim --workload foo").contains("unknown workload `foo`"));
        assert!(err("sim --policies kvoy,rr").contains("unknown policy `rr`"));
        assert!(err("sim --profile gpt").contains("unknown profile"));
        let e = err("sim --fleet mixed");
        assert!(
            e.contains("`mixed`") && e.contains("uniform") && e.contains("half-slow"),
            "{e}"
        );
        assert!(err("sim --fleet").contains("needs a value"));
        assert!(err("sim --fleet half-slow --slow-factor 0.5").contains("at least 1"));
        assert!(err("sim --fleet half-slow --slow-factor x").contains("--slow-factor"));
        assert!(err("sim --slow-factor 2").contains("--fleet half-slow"));
        assert!(err("sim --fleet half-slow --replicas 1").contains("at least 2 replicas"));
        assert!(err("sim --bogus").contains("unknown option"));
        assert!(err("sim --workload mooncake").contains("--trace"));
        assert!(err("bench").contains("unknown command"));
        assert!(err("report").contains("--from"));
        assert_eq!(
            parse(&words("report --from r/results.json")).unwrap(),
            Command::Report {
                from: "r/results.json".into(),
                out: None
            }
        );
        let a = sim("sim --workload mooncake --trace /nonexistent/x.jsonl");
        assert!(a
            .grid()
            .unwrap_err()
            .to_string()
            .contains("cannot read the trace"));
    }
}
