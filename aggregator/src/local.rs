//! The aggregator in another program's process (`kvoy-stack`, the end-to-end tests, kvoy-bench,
//! kvoy-local's tests), on a tokio runtime of its own, configured by a file as the binary is.
//! [`LocalAggregator::kill`] drops the runtime at once, as a crash would: the port closes and
//! open connections reset.
//!
//! ```no_run
//! use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
//!
//! let endpoints = [AggregatedEndpoint {
//!     address: "127.0.0.1:8001".parse()?,
//!     models: vec!["m".into()],
//!     kv_events: None,
//! }];
//! let yaml = aggregator_yaml("scrape_interval_ms: 50", &endpoints);
//! let agg = LocalAggregator::start("/tmp/aggregator.yaml".as_ref(), &yaml, "127.0.0.1:0".parse()?)?;
//! println!("the pool at http://{}/v1/pool", agg.addr());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::config::{AggregatorConfig, ConfigError};
use crate::k8s::{Discovery, InCluster, K8sError, KubernetesSource};
use crate::source::{EndpointSource, FileSource};
use crate::Aggregator;

/// Why an in-process aggregator did not start.
#[derive(Debug, Error)]
pub enum LocalError {
    #[error("writing {}: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("kubernetes endpoint discovery: {0}")]
    Discovery(#[from] K8sError),
    #[error("starting the aggregator's tokio runtime: {0}")]
    Runtime(io::Error),
    #[error("kvoy-aggregator cannot listen on {listen}: {source}")]
    Listen {
        listen: SocketAddr,
        source: io::Error,
    },
}

/// One endpoint of the aggregator's configuration file.
#[derive(Clone, Debug)]
pub struct AggregatedEndpoint {
    pub address: SocketAddr,
    pub models: Vec<String>,
    /// `tcp://...` of the server's KV-event publisher, and of its replay socket.
    pub kv_events: Option<(String, Option<String>)>,
}

impl AggregatedEndpoint {
    /// Servers at `addresses` serving `model`, followed by their metrics only (no KV events).
    pub fn scraped(addresses: &[SocketAddr], model: &str) -> Vec<AggregatedEndpoint> {
        addresses
            .iter()
            .map(|a| AggregatedEndpoint {
                address: *a,
                models: vec![model.to_owned()],
                kv_events: None,
            })
            .collect()
    }
}

/// Renders the aggregator's YAML configuration: `settings` (YAML lines, e.g.
/// `scrape_interval_ms: 50`) and the endpoints.
pub fn aggregator_yaml(settings: &str, endpoints: &[AggregatedEndpoint]) -> String {
    let mut out =
        String::from("# kvoy-aggregator configuration (written by kvoy_aggregator::local)\n");
    out.push_str(settings);
    if !settings.is_empty() && !settings.ends_with('\n') {
        out.push('\n');
    }
    out.push_str("endpoints:\n");
    for e in endpoints {
        out.push_str(&format!(
            "  - address: \"{}\"\n    models: {}\n",
            e.address,
            serde_json::json!(e.models)
        ));
        if let Some((kv, replay)) = &e.kv_events {
            out.push_str(&format!("    kv_events_endpoint: \"{kv}\"\n"));
            if let Some(r) = replay {
                out.push_str(&format!("    kv_events_replay_endpoint: \"{r}\"\n"));
            }
        }
    }
    out
}

/// A kvoy-aggregator running in this process.
pub struct LocalAggregator {
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
    _aggregator: Option<Aggregator>,
}

impl LocalAggregator {
    /// Writes `yaml` to `config_path` and starts an aggregator on `listen` (port 0: any free
    /// port) that reloads the endpoints from that file when it changes, or, when `yaml` has a
    /// `kubernetes:` section, discovers them from the API server it names (as the binary does).
    pub fn start(config_path: &Path, yaml: &str, listen: SocketAddr) -> Result<Self, LocalError> {
        std::fs::write(config_path, yaml).map_err(|source| LocalError::Write {
            path: config_path.to_path_buf(),
            source,
        })?;
        let config = AggregatorConfig::from_file(config_path)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvoy-aggregator")
            .enable_all()
            .build()
            .map_err(LocalError::Runtime)?;
        let aggregator = runtime.block_on(async {
            let source: Box<dyn EndpointSource> = match &config.kubernetes {
                Some(k8s) => {
                    let discovery = Discovery::new(k8s, &InCluster::default())?;
                    Box::new(KubernetesSource::spawn(discovery, config.reload_interval))
                }
                None => Box::new(FileSource::new(config_path)),
            };
            Aggregator::start(&config, source, listen)
                .await
                .map_err(|source| LocalError::Listen { listen, source })
        })?;
        Ok(LocalAggregator {
            addr: aggregator.local_addr(),
            runtime: Some(runtime),
            _aggregator: Some(aggregator),
        })
    }

    /// Where its API listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops it abruptly (tasks cancelled, sockets closed), as a crash would.
    pub fn kill(&mut self) {
        self._aggregator = None;
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_millis(500));
        }
    }
}

impl Drop for LocalAggregator {
    fn drop(&mut self) {
        self.kill();
    }
}
