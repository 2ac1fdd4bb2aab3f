//! kvoy-async: runs jobs from Redis streams on the pool's free capacity (docs/async.md).
//!
//! ```text
//! kvoy-async --config async.yaml
//! ```

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use clap::Parser;
use kvoy_async::config::Config;
use kvoy_async::queue::RedisQueue;
use kvoy_async::service;
use kvoy_async::status::Status;

/// kvoy-async: jobs from Redis streams into the pool's free capacity, through the kvoy proxy
#[derive(Parser)]
#[command(name = "kvoy-async")]
struct Args {
    /// The configuration file (YAML; docs/async.md)
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("reading {}", args.config.display()))?;
    let mut config =
        Config::from_yaml(&text).with_context(|| format!("in {}", args.config.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let consumer = config.consumer.clone().unwrap_or_else(|| {
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            format!("kvoy-async-{}-{ms}", std::process::id())
        });
        config.consumer = Some(consumer.clone());
        let queue = RedisQueue::connect(&config, consumer.clone())
            .await
            .with_context(|| format!("connecting to {}", config.redis_url))?;
        let status = Arc::new(Mutex::new(Status::default()));
        if let Some(listen) = config.listen {
            let bound = kvoy_async::http::serve(listen, status.clone())
                .await
                .with_context(|| format!("listening on {listen}"))?;
            log::info!("metrics on http://{bound}/metrics, status on http://{bound}/v1/status");
        }
        log::info!(
            "consumer {consumer} on {} lanes ({}), sending through {}",
            config.lanes.len(),
            config
                .lanes
                .iter()
                .map(|l| l.name.as_str())
                .collect::<Vec<_>>()
                .join(" > "),
            config.proxy
        );
        let stop = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        service::run(config, queue, status, stop).await
    })
}
