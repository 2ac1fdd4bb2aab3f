//! `kvoy-aggregator --config FILE [--listen ADDR]`: follows the model servers listed in FILE
//! (or the Ready pods of the InferencePool its `kubernetes:` section names) and serves the
//! pool snapshot. `kvoy-aggregator calibrate --url URL --model M`: measures one server's
//! prefill rate and prints the configuration line. See the crate docs and docs/aggregator.md.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::builder::RangedU64ValueParser;
use clap::{Args, Parser, Subcommand};

use kvoy_aggregator::calibrate::{self, Options};
use kvoy_aggregator::config::{AggregatorConfig, ApiToken};
use kvoy_aggregator::k8s::{Discovery, InCluster, KubernetesSource};
use kvoy_aggregator::source::{EndpointSource, FileSource};
use kvoy_aggregator::Aggregator;

/// kvoy-aggregator: KV events, metrics scraping and the pool snapshot for kvoy's filters
#[derive(Parser)]
#[command(
    name = "kvoy-aggregator",
    // `calibrate` is a tool of its own: the service's flags do not apply to it.
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "API: GET /v1/snapshot?epoch=E&since=V&format=F (binary, for the filters), \
                  /v1/endpoints (JSON), /metrics (Prometheus), /healthz, /readyz.\n\
                  Logs: RUST_LOG=info (default) or debug."
)]
struct Cli {
    /// Endpoints and settings, YAML (or JSON when FILE ends in .json); the endpoint list is
    /// re-read when the file changes. With a `kubernetes:` section the endpoints are the Ready
    /// pods of an InferencePool, read from the API server every reload_interval_ms
    #[arg(long, value_name = "FILE", required = true)]
    config: Option<PathBuf>,
    /// HTTP address (default: `listen` from FILE, else 127.0.0.1:9090)
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Require `Authorization: Bearer <token>` on /v1/snapshot and /v1/endpoints, the token
    /// read from FILE (a mounted Secret); also `api_token_file` in the configuration, or the
    /// environment variable KVOY_AGGREGATOR_TOKEN. 16-4096 visible ASCII chars
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Measures a model server's prefill rate for kvoy's router
    ///
    /// Sends cold prompts (random words) of growing length one at a time, max_tokens 1,
    /// streaming; times each with the server's vllm:request_prefill_time_seconds (else the
    /// client's TTFT); fits prefill time = fixed + tokens / rate + attention x tokens^2 by least
    /// squares; prints the rate at the typical prompt length as kvoy's prefill_tokens_per_s.
    /// Keep other traffic away from the server while it runs.
    Calibrate(CalibrateArgs),
}

#[derive(Args)]
struct CalibrateArgs {
    /// The server (plain HTTP), e.g. http://10.0.0.11:8000
    #[arg(long, value_name = "URL")]
    url: String,
    /// A model the server serves (checked with GET /v1/models)
    #[arg(long, value_name = "M")]
    model: String,
    /// Shortest prompt
    #[arg(long = "min-tokens", value_name = "N", default_value_t = 256,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    min: usize,
    /// Longest prompt (longer than the server's context is skipped)
    #[arg(long = "max-tokens", value_name = "N", default_value_t = 16_384)]
    max: usize,
    /// Rounds over the lengths
    #[arg(long, value_name = "N", default_value_t = 3)]
    repeat: usize,
    /// The prompt length the printed rate is for
    #[arg(long = "typical-tokens", value_name = "N", default_value_t = 2048)]
    typical: usize,
    /// Per request
    #[arg(long = "timeout-s", value_name = "N", default_value_t = 300)]
    timeout_s: u64,
    /// The server's Prometheus metrics ("" for TTFT only)
    #[arg(long, value_name = "P", default_value = "/metrics")]
    metrics_path: String,
    /// For the random prompts
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
}

/// `kvoy-aggregator calibrate ...`.
fn calibrate_command(args: CalibrateArgs) -> Result<()> {
    let CalibrateArgs {
        url,
        model,
        min,
        max,
        repeat,
        typical,
        timeout_s,
        metrics_path,
        seed,
    } = args;
    if max <= min {
        bail!("--min-tokens must be below --max-tokens");
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
    // clap prints --help and usage errors itself (exit 0 and 2).
    let cli = Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    if let Some(Command::Calibrate(args)) = cli.command {
        return calibrate_command(args);
    }
    let Cli {
        config: config_path,
        listen,
        token_file,
        ..
    } = cli;
    let Some(path) = config_path else {
        bail!("--config is required");
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
