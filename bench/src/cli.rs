//! The command line, parsed by hand: `kvoy-bench sim [options]`.

use std::path::PathBuf;
use std::sync::Arc;

use kvoy_sim::engine::Profile;

use crate::fleet::FleetKind;
use crate::policy::PolicyKind;
use crate::runner::{Grid, Rate};
use crate::workload::{Agents, Count, NoSharing, SharedPrefix, Trace, TraceError, Workload};

pub const USAGE: &str = "\
kvoy-bench: routing policies on a simulated fleet of kvoy-sim engines (virtual time)

usage: kvoy-bench sim [options]      (this page)
       kvoy-bench live [options]     (below)
       kvoy-bench overhead [options] (below)
       kvoy-bench report --from results.json [--out DIR]
       kvoy-bench report --from FILE [--out DIR]   summary.md and plots again from a results.json

  --workload NAME       shared-prefix, agents, mooncake or no-sharing; repeat or separate
                        with commas (default shared-prefix)
  --all                 every workload (mooncake needs --trace)
  --policies LIST       comma-separated among round-robin, least-request, random, kvoy,
                        kvoy-aggregator, llm-d, sglang, llm-d-1.0, llm-d-1.0-calibrated,
                        dynamo (default: all)
  --replicas N          engines in the fleet, 1-4096 (default 16)
  --profile NAME        llama-8b-h100 (default) or qwen-32b-h100-tp2
  --cpu-offload-blocks N  every replica offloads its KV cache to a CPU tier of N blocks
                        (kvoy-sim's --cpu-offload-blocks; default 0: none)
  --fleet KIND          uniform (default): every replica runs the profile; half-slow: the
                        odd-indexed replicas (1, 3, 5, ...) run it --slow-factor times slower
                        (every step-time duration multiplied, same KV geometry); loads in `x`
                        are multiples of that fleet's own saturation estimate
  --slow-factor F       half-slow: how much slower the slow replicas are, at least 1
                        (default 2)
  --rates LIST          comma-separated offered loads: `1.5x` is a multiple of the workload's
                        estimated saturation rate, `2t` a multiple of the trace's own rate
                        (mooncake), a plain number is requests/s
                        (default 0.5x,1x,2x,3x)
  --scale F             shared-prefix: multiply prompt and output lengths (default 1)
  --duration S          shared-prefix, agents, no-sharing: load stages of S seconds of
                        arrivals, rate x S requests (defaults 180, 60 and 60 s)
  --requests N          shared-prefix, agents, no-sharing: exactly N requests per run instead
  --trace PATH          the Mooncake conversation trace (JSONL) for the mooncake workload
  --limit N             mooncake: replay only the first N requests
  --seed N              seed of every random draw (default 1)
  --threads N           runs in parallel (default 2)
  --sglang-tree-chars N sglang: per-worker tree bound in characters (default: the replica's
                        KV capacity in characters)
  --out DIR             output directory (default bench/results/sim)
  --quiet               no progress lines on stderr
  -h, --help
";

/// A command-line mistake, or an input that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("expected a command: `sim`, `live`, `overhead` or `report` (try --help)")]
    NoCommand,
    #[error("unknown command `{0}` (the commands are `sim`, `live`, `overhead` and `report`)")]
    UnknownCommand(String),
    #[error("`report` needs --from FILE (a results.json)")]
    MissingFrom,
    #[error("unknown option `{0}` (try --help)")]
    UnknownFlag(String),
    #[error("`{0}` needs a value")]
    MissingValue(&'static str),
    #[error("`{flag}` {value:?}: expected {expected}")]
    BadValue {
        flag: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("unknown workload `{0}`; expected shared-prefix, agents, mooncake or no-sharing")]
    UnknownWorkload(String),
    #[error(
        "unknown policy `{0}`; expected round-robin, least-request, random, kvoy, \
         kvoy-aggregator, llm-d or sglang"
    )]
    UnknownPolicy(String),
    #[error("unknown profile `{0}`; expected llama-8b-h100 or qwen-32b-h100-tp2")]
    UnknownProfile(String),
    #[error("unknown fleet `{0}`; expected uniform or half-slow")]
    UnknownFleet(String),
    #[error("`--slow-factor` applies to `--fleet half-slow` only")]
    SlowFactorWithoutSlowReplicas,
    #[error(
        "`--fleet half-slow` needs at least 2 replicas (the odd-indexed ones are slow), got {0}"
    )]
    HalfSlowReplicas(usize),
    #[error("the mooncake workload needs the trace: --trace PATH")]
    MissingTrace,
    #[error(transparent)]
    Trace(#[from] TraceError),
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
    /// `None`: each workload's default stage.
    pub count: Option<Count>,
    pub trace: Option<PathBuf>,
    pub limit: Option<usize>,
    pub seed: u64,
    pub threads: usize,
    pub sglang_tree_chars: Option<usize>,
    pub out: PathBuf,
    pub quiet: bool,
}

impl Default for SimArgs {
    fn default() -> Self {
        SimArgs {
            workloads: Vec::new(),
            policies: PolicyKind::ALL.to_vec(),
            replicas: 16,
            profile: Profile::llama_8b_h100(),
            cpu_offload_blocks: None,
            fleet: FleetKind::Uniform,
            rates: [0.5, 1.0, 2.0, 3.0]
                .into_iter()
                .map(Rate::Saturation)
                .collect(),
            scale: 1.0,
            count: None,
            trace: None,
            limit: None,
            seed: 1,
            threads: 2,
            sglang_tree_chars: None,
            out: PathBuf::from("bench/results/sim"),
            quiet: false,
        }
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

fn bad(flag: &'static str, value: &str, expected: &'static str) -> CliError {
    CliError::BadValue {
        flag,
        value: value.to_owned(),
        expected,
    }
}

fn number<T: std::str::FromStr>(
    flag: &'static str,
    v: &str,
    expected: &'static str,
) -> Result<T, CliError> {
    v.trim().parse().map_err(|_| bad(flag, v, expected))
}

fn positive_f64(flag: &'static str, v: &str) -> Result<f64, CliError> {
    let x: f64 = number(flag, v, "a number above 0")?;
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(bad(flag, v, "a number above 0"))
    }
}

fn positive_usize(flag: &'static str, v: &str) -> Result<usize, CliError> {
    match number::<usize>(flag, v, "a whole number above 0")? {
        0 => Err(bad(flag, v, "a whole number above 0")),
        n => Ok(n),
    }
}

fn parse_rate(item: &str) -> Result<Rate, CliError> {
    const EXPECTED: &str = "rates like 1.5x (x saturation), 2t (x the trace's rate) or 12 (req/s)";
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
        _ => Err(bad("--rates", item, EXPECTED)),
    }
}

/// Parses the arguments after the program name.
pub fn parse(args: &[String]) -> Result<Command, CliError> {
    let mut it = args.iter();
    let Some(cmd) = it.next() else {
        return Err(CliError::NoCommand);
    };
    match cmd.as_str() {
        "-h" | "--help" | "help" => return Ok(Command::Help),
        "sim" => {}
        "report" => return parse_report(it),
        "overhead" => {
            let rest: Vec<String> = it.cloned().collect();
            if rest.iter().any(|a| a == "-h" || a == "--help") {
                return Ok(Command::Help);
            }
            return crate::overhead::cli::parse(&rest).map(|a| Command::Overhead(Box::new(a)));
        }
        "live" => {
            let rest: Vec<String> = it.cloned().collect();
            if rest.iter().any(|a| a == "-h" || a == "--help") {
                return Ok(Command::Help);
            }
            return crate::live::cli::parse(&rest).map(|a| Command::Live(Box::new(a)));
        }
        other => return Err(CliError::UnknownCommand(other.to_owned())),
    }
    let mut a = SimArgs::default();
    let mut all = false;
    let mut slow_factor = None;
    while let Some(flag) = it.next() {
        let mut value = |name: &'static str| -> Result<&String, CliError> {
            it.next().ok_or(CliError::MissingValue(name))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--all" => all = true,
            "--quiet" => a.quiet = true,
            "--workload" => {
                for w in value("--workload")?.split(',') {
                    let w = w.trim();
                    if !Workload::NAMES.contains(&w) {
                        return Err(CliError::UnknownWorkload(w.to_owned()));
                    }
                    a.workloads.push(w.to_owned());
                }
            }
            "--policies" => {
                a.policies = value("--policies")?
                    .split(',')
                    .map(|p| {
                        PolicyKind::from_name(p.trim())
                            .ok_or_else(|| CliError::UnknownPolicy(p.trim().to_owned()))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--replicas" => {
                let v = value("--replicas")?;
                a.replicas = positive_usize("--replicas", v)?;
                if a.replicas > kvoy_shared::MAX_ENDPOINTS {
                    return Err(bad("--replicas", v, "at most 4096"));
                }
            }
            "--profile" => {
                let v = value("--profile")?;
                a.profile =
                    Profile::by_name(v).ok_or_else(|| CliError::UnknownProfile(v.to_owned()))?;
            }
            "--cpu-offload-blocks" => {
                let v = value("--cpu-offload-blocks")?;
                a.cpu_offload_blocks = Some(number("--cpu-offload-blocks", v, "a block count")?);
            }
            "--fleet" => {
                let v = value("--fleet")?.trim();
                a.fleet = FleetKind::by_name(v, FleetKind::DEFAULT_SLOW_FACTOR)
                    .ok_or_else(|| CliError::UnknownFleet(v.to_owned()))?;
            }
            "--slow-factor" => {
                let v = value("--slow-factor")?;
                match number::<f64>("--slow-factor", v, "a number at least 1")? {
                    f if f.is_finite() && f >= 1.0 => slow_factor = Some(f),
                    _ => return Err(bad("--slow-factor", v, "a number at least 1")),
                }
            }
            "--rates" => {
                a.rates = value("--rates")?
                    .split(',')
                    .map(parse_rate)
                    .collect::<Result<_, _>>()?;
            }
            "--scale" => a.scale = positive_f64("--scale", value("--scale")?)?,
            "--requests" => {
                a.count = Some(Count::Fixed(positive_usize(
                    "--requests",
                    value("--requests")?,
                )?))
            }
            "--duration" => {
                a.count = Some(Count::Duration(positive_f64(
                    "--duration",
                    value("--duration")?,
                )?))
            }
            "--trace" => a.trace = Some(PathBuf::from(value("--trace")?)),
            "--limit" => a.limit = Some(positive_usize("--limit", value("--limit")?)?),
            "--seed" => a.seed = number("--seed", value("--seed")?, "a whole number")?,
            "--threads" => a.threads = positive_usize("--threads", value("--threads")?)?,
            "--sglang-tree-chars" => {
                a.sglang_tree_chars = Some(positive_usize(
                    "--sglang-tree-chars",
                    value("--sglang-tree-chars")?,
                )?)
            }
            "--out" => a.out = PathBuf::from(value("--out")?),
            other => return Err(CliError::UnknownFlag(other.to_owned())),
        }
    }
    if all {
        a.workloads = Workload::NAMES.iter().map(|w| (*w).to_owned()).collect();
    } else if a.workloads.is_empty() {
        a.workloads.push("shared-prefix".into());
    }
    a.workloads.dedup();
    match &mut a.fleet {
        FleetKind::Uniform if slow_factor.is_some() => {
            return Err(CliError::SlowFactorWithoutSlowReplicas)
        }
        FleetKind::Uniform => {}
        FleetKind::HalfSlow { .. } if a.replicas < 2 => {
            return Err(CliError::HalfSlowReplicas(a.replicas))
        }
        FleetKind::HalfSlow { slow_factor: f } => *f = slow_factor.unwrap_or(*f),
    }
    if a.workloads.iter().any(|w| w == "mooncake") && a.trace.is_none() {
        return Err(CliError::MissingTrace);
    }
    Ok(Command::Sim(Box::new(a)))
}

fn parse_report<'a>(mut it: impl Iterator<Item = &'a String>) -> Result<Command, CliError> {
    let (mut from, mut out) = (None, None);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--from" => {
                from = Some(PathBuf::from(
                    it.next().ok_or(CliError::MissingValue("--from"))?,
                ))
            }
            "--out" => {
                out = Some(PathBuf::from(
                    it.next().ok_or(CliError::MissingValue("--out"))?,
                ))
            }
            other => return Err(CliError::UnknownFlag(other.to_owned())),
        }
    }
    let from = from.ok_or(CliError::MissingFrom)?;
    Ok(Command::Report { from, out })
}

impl SimArgs {
    /// The grid of runs; loads the trace when the mooncake workload is asked for.
    pub fn grid(&self) -> Result<Grid, CliError> {
        let mut workloads = Vec::new();
        for name in &self.workloads {
            let w = match name.as_str() {
                "shared-prefix" => {
                    let count = self.count.unwrap_or(Count::Duration(180.0));
                    Workload::SharedPrefix(SharedPrefix::new(self.scale, count))
                }
                "agents" => {
                    Workload::Agents(Agents::new(self.count.unwrap_or(Count::Duration(60.0))))
                }
                "no-sharing" => {
                    Workload::NoSharing(NoSharing::new(self.count.unwrap_or(Count::Duration(60.0))))
                }
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
            seed: self.seed,
            threads: self.threads,
            sglang_tree_chars: self.sglang_tree_chars,
            envoy_workers: None,
            scrape_interval: std::time::Duration::from_millis(50),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn sim(s: &str) -> SimArgs {
        match parse(&args(s)) {
            Ok(Command::Sim(a)) => *a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn defaults_and_flags() {
        let a = sim("sim");
        assert_eq!(a.workloads, ["shared-prefix"]);
        assert_eq!(a.policies.len(), PolicyKind::ALL.len());
        assert_eq!((a.replicas, a.threads, a.seed), (16, 2, 1));
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
        assert_eq!(parse(&args("--help")).unwrap(), Command::Help);
        let a = sim("sim --all --trace /t.jsonl");
        assert_eq!(a.workloads.len(), 4);
        assert_eq!(a.fleet, FleetKind::Uniform);
        let a = sim("sim --fleet half-slow");
        assert_eq!(a.fleet, FleetKind::HalfSlow { slow_factor: 2.0 });
        let a = sim("sim --slow-factor 3 --fleet half-slow --replicas 4");
        assert_eq!(a.fleet, FleetKind::HalfSlow { slow_factor: 3.0 });
        assert_eq!(a.grid().unwrap().fleet, a.fleet);
    }

    #[test]
    fn mistakes_are_named() {
        let err = |s: &str| parse(&args(s)).unwrap_err().to_string();
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
            parse(&args("report --from r/results.json")).unwrap(),
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
