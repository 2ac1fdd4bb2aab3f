//! `kvoy-aggregator --config FILE [--listen ADDR]`: follows the model servers listed in FILE
//! (or the Ready pods of the InferencePool its `kubernetes:` section names) and serves the
//! pool snapshot. See the crate docs and the README.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use kvoy_aggregator::config::AggregatorConfig;
use kvoy_aggregator::k8s::{Discovery, InCluster, KubernetesSource};
use kvoy_aggregator::source::{EndpointSource, FileSource};
use kvoy_aggregator::Aggregator;

const USAGE: &str = "\
kvoy-aggregator: KV events, metrics scraping and the pool snapshot for kvoy's filters

usage: kvoy-aggregator --config FILE [--listen ADDR]

  --config FILE   endpoints and settings, YAML (or JSON when FILE ends in .json); the
                  endpoint list is re-read when the file changes. With a `kubernetes:`
                  section the endpoints are the Ready pods of an InferencePool, read from
                  the API server every reload_interval_ms
  --listen ADDR   HTTP address (default: `listen` from FILE, else 127.0.0.1:9090)
  -h, --help

API: GET /v1/snapshot?epoch=E&since=V (binary, for the filters), /v1/endpoints (JSON),
     /metrics (Prometheus), /healthz, /readyz. Logs: RUST_LOG=info (default) or debug.
";

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let mut config_path: Option<PathBuf> = None;
    let mut listen: Option<SocketAddr> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{USAGE}");
                return Ok(());
            }
            "--config" => config_path = Some(args.next().context("--config needs a file")?.into()),
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
    let config = AggregatorConfig::from_file(&path)
        .with_context(|| format!("configuration {}", path.display()))?;
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
            "kvoy-aggregator: {from}, API on http://{}",
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
