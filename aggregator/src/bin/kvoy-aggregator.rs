//! `kvoy-aggregator --config FILE [--listen ADDR]`: follows the model servers listed in FILE
//! (or the Ready pods of the InferencePool its `kubernetes:` section names) and serves the
//! pool snapshot. `kvoy-aggregator calibrate --url URL --model M`: measures one server's
//! prefill rate and prints the configuration line. See the crate docs and the README.
//!
//! The command line is parsed by hand, as it always was (no clap in this binary).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use kvoy_aggregator::calibrate::{self, Options};
use kvoy_aggregator::config::{AggregatorConfig, ApiToken};
use kvoy_aggregator::k8s::{Discovery, InCluster, KubernetesSource};
use kvoy_aggregator::source::{EndpointSource, FileSource};
use kvoy_aggregator::Aggregator;

const USAGE: &str = "\
kvoy-aggregator: KV events, metrics scraping and the pool snapshot for kvoy's filters

usage: kvoy-aggregator --config FILE [--listen ADDR] [--token-file FILE]
       kvoy-aggregator calibrate --url http://HOST:PORT --model M [options]   (--help for them)

  --config FILE   endpoints and settings, YAML (or JSON when FILE ends in .json); the
                  endpoint list is re-read when the file changes. With a `kubernetes:`
                  section the endpoints are the Ready pods of an InferencePool, read from
                  the API server every reload_interval_ms
  --listen ADDR   HTTP address (default: `listen` from FILE, else 127.0.0.1:9090)
  --token-file F  require `Authorization: Bearer <token>` on /v1/snapshot and /v1/endpoints,
                  the token read from F (a mounted Secret); also `api_token_file` in FILE, or
                  the environment variable KVOY_AGGREGATOR_TOKEN. 16-4096 visible ASCII chars
  -h, --help

API: GET /v1/snapshot?epoch=E&since=V&format=F (binary, for the filters), /v1/endpoints (JSON),
     /metrics (Prometheus), /healthz, /readyz. Logs: RUST_LOG=info (default) or debug.
";

const CALIBRATE_USAGE: &str = "\
kvoy-aggregator calibrate: measures a model server's prefill rate for kvoy's router

usage: kvoy-aggregator calibrate --url http://HOST:PORT --model M [options]

Sends cold prompts (random words) of growing length one at a time, max_tokens 1, streaming;
times each with the server's vllm:request_prefill_time_seconds (else the client's TTFT);
fits prefill time = fixed + tokens / rate + attention x tokens^2 by least squares; prints the
rate at the typical prompt length as kvoy's prefill_tokens_per_s. Keep other traffic away
from the server while it runs.

  --url URL             the server (plain HTTP), e.g. http://10.0.0.11:8000
  --model M             a model the server serves (checked with GET /v1/models)
  --min-tokens N        shortest prompt (default 256)
  --max-tokens N        longest prompt (default 16384; longer than the server's context is
                        skipped)
  --repeat N            rounds over the lengths (default 3)
  --typical-tokens N    the prompt length the printed rate is for (default 2048)
  --timeout-s N         per request (default 300)
  --metrics-path P      the server's Prometheus metrics (default /metrics; \"\" for TTFT only)
  --seed N              for the random prompts (default 1)
  -h, --help
";

fn number<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T> {
    let v = v.with_context(|| format!("{flag} needs a value"))?;
    v.parse()
        .map_err(|_| anyhow::anyhow!("{flag}: {v:?} is not a valid number"))
}

/// `kvoy-aggregator calibrate ...`.
fn calibrate_command(mut args: impl Iterator<Item = String>) -> Result<()> {
    let mut url = None;
    let mut model = None;
    let (mut min, mut max) = (256usize, 16_384usize);
    let (mut repeat, mut typical, mut timeout_s, mut seed) = (3usize, 2048usize, 300u64, 1u64);
    let mut metrics_path = "/metrics".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{CALIBRATE_USAGE}");
                return Ok(());
            }
            "--url" => url = Some(args.next().context("--url needs a value")?),
            "--model" => model = Some(args.next().context("--model needs a value")?),
            "--min-tokens" => min = number(&arg, args.next())?,
            "--max-tokens" => max = number(&arg, args.next())?,
            "--repeat" => repeat = number(&arg, args.next())?,
            "--typical-tokens" => typical = number(&arg, args.next())?,
            "--timeout-s" => timeout_s = number(&arg, args.next())?,
            "--seed" => seed = number(&arg, args.next())?,
            "--metrics-path" => {
                metrics_path = args.next().context("--metrics-path needs a value")?
            }
            other => bail!("unknown argument {other:?}\n\n{CALIBRATE_USAGE}"),
        }
    }
    let (Some(url), Some(model)) = (url, model) else {
        bail!("--url and --model are required\n\n{CALIBRATE_USAGE}");
    };
    if min == 0 || max <= min {
        bail!("--min-tokens must be at least 1 and below --max-tokens");
    }
    let mut options = Options::new(&url, &model)?;
    options.lengths = calibrate::doubling(min, max);
    options.repeat = repeat;
    options.typical_tokens = typical;
    options.timeout = std::time::Duration::from_secs(timeout_s);
    options.metrics_path = metrics_path;
    options.seed = seed;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!(
        "kvoy-aggregator calibrate: {} model {model:?}, {} lengths x {repeat} ({min}..{max} tokens)",
        options.server.url,
        options.lengths.len(),
    );
    let mut rows = 0;
    let calibration = runtime
        .block_on(calibrate::run(&options, &mut |m| {
            if rows == 0 {
                println!("{}", calibrate::TABLE_HEADER);
            }
            rows += 1;
            println!("{}", calibrate::table_row(m))
        }))
        .with_context(|| format!("calibrating {url}"))?;
    print!("{}", calibration.report());
    Ok(())
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let mut config_path: Option<PathBuf> = None;
    let mut listen: Option<SocketAddr> = None;
    let mut token_file: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().is_some_and(|a| a == "calibrate") {
        args.next();
        return calibrate_command(args);
    }
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{USAGE}");
                return Ok(());
            }
            "--config" => config_path = Some(args.next().context("--config needs a file")?.into()),
            "--token-file" => {
                token_file = Some(args.next().context("--token-file needs a file")?.into())
            }
            "--listen" => {
                let v = args.next().context("--listen needs an address")?;
                listen = Some(
                    v.parse()
                        .with_context(|| format!("--listen {v:?} is not ip:port"))?,
                );
            }
            other => bail!("unknown argument {other:?}\n\n{USAGE}"),
        }
    }
    let Some(path) = config_path else {
        bail!("--config is required\n\n{USAGE}");
    };
    let mut config = AggregatorConfig::from_file(&path)
        .with_context(|| format!("configuration {}", path.display()))?;
    // The command line, then the environment, then the file.
    if let Some(file) = &token_file {
        config.api_token = Some(ApiToken::from_file(file).context("--token-file")?);
    } else if let Ok(text) = std::env::var("KVOY_AGGREGATOR_TOKEN") {
        config.api_token = Some(
            ApiToken::new(&text)
                .context("KVOY_AGGREGATOR_TOKEN must be 16 to 4096 visible ASCII characters")?,
        );
    }
    let protected = if config.api_token.is_some() || config.api_token_file.is_some() {
        "bearer token required"
    } else {
        "no token required"
    };
    let listen = listen
        .or(config.listen)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9090)));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let (source, from): (Box<dyn EndpointSource>, String) = match &config.kubernetes {
            Some(k8s) => {
                let discovery = Discovery::new(k8s, &InCluster::from_env())
                    .context("kubernetes endpoint discovery")?;
                let from = format!("InferencePool {}", discovery.pool());
                (
                    Box::new(KubernetesSource::spawn(discovery, config.reload_interval)),
                    from,
                )
            }
            None => (
                Box::new(FileSource::new(&path)),
                format!(
                    "{} endpoints from {}",
                    config.endpoints.len(),
                    path.display()
                ),
            ),
        };
        let aggregator = Aggregator::start(&config, source, listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        println!(
            "kvoy-aggregator: {from}, API on http://{} ({protected})",
            aggregator.local_addr()
        );
        wait_for_signal().await;
        aggregator.shutdown().await;
        Ok(())
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
