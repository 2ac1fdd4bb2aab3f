//! kvoy-aggregator in-process (crate `kvoy-aggregator`, through its library API) on a tokio
//! runtime of its own, for `kvoy-stack` and the end-to-end tests. [`LocalAggregator::kill`]
//! drops the runtime at once, as a crash would: the port closes and open connections reset.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;

use kvoy_aggregator::config::AggregatorConfig;
use kvoy_aggregator::k8s::{Discovery, InCluster, KubernetesSource};
use kvoy_aggregator::source::{EndpointSource, FileSource};
use kvoy_aggregator::Aggregator;

/// One endpoint of the aggregator's configuration file.
#[derive(Clone, Debug)]
pub struct AggregatedEndpoint {
    pub address: SocketAddr,
    pub models: Vec<String>,
    /// `tcp://...` of the server's KV-event publisher, and of its replay socket.
    pub kv_events: Option<(String, Option<String>)>,
}

/// Renders the aggregator's YAML configuration: `settings` (YAML lines, e.g.
/// `scrape_interval_ms: 50`) and the endpoints.
pub fn aggregator_yaml(settings: &str, endpoints: &[AggregatedEndpoint]) -> String {
    let mut out = String::from("# kvoy-aggregator configuration (written by kvoy-e2e)\n");
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
    pub fn start(config_path: &Path, yaml: &str, listen: SocketAddr) -> anyhow::Result<Self> {
        std::fs::write(config_path, yaml)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let config = AggregatorConfig::from_file(config_path)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvoy-aggregator")
            .enable_all()
            .build()
            .context("starting the aggregator's tokio runtime")?;
        let aggregator = runtime
            .block_on(async {
                let source: Box<dyn EndpointSource> = match &config.kubernetes {
                    Some(k8s) => {
                        let discovery = Discovery::new(k8s, &InCluster::default())?;
                        Box::new(KubernetesSource::spawn(discovery, config.reload_interval))
                    }
                    None => Box::new(FileSource::new(config_path)),
                };
                Aggregator::start(&config, source, listen)
                    .await
                    .with_context(|| format!("kvoy-aggregator cannot listen on {listen}"))
            })
            .context("starting kvoy-aggregator")?;
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

    /// The JSON answer to `GET path` (`/v1/pool`, `/v1/endpoints`, ...); an error unless the
    /// answer is 200 with a JSON body.
    pub fn get_json(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let r = crate::http::send(self.addr, "GET", path, &[], b"", Duration::from_secs(5))?;
        anyhow::ensure!(r.status == 200, "GET {path}: {} {}", r.status, r.text());
        Ok(r.json()?)
    }

    /// The value of one sample of its `/metrics` (the name with its labels, as written there),
    /// 0 when absent.
    pub fn metric(&self, sample: &str) -> anyhow::Result<f64> {
        let text = crate::http::send(
            self.addr,
            "GET",
            "/metrics",
            &[],
            b"",
            Duration::from_secs(5),
        )?
        .text();
        let prefix = format!("{sample} ");
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0))
    }

    /// Waits (at most `timeout`) until its `/readyz` counts `endpoints` ready; panics past it,
    /// as [`crate::wait_for`] does.
    pub fn wait_ready(&self, endpoints: usize, timeout: Duration) {
        let want = format!("{endpoints} ready");
        crate::wait_for("the endpoints ready in the aggregator", timeout, || {
            crate::http::send(
                self.addr,
                "GET",
                "/readyz",
                &[],
                b"",
                Duration::from_secs(5),
            )
            .map(|r| r.text().contains(&want))
            .unwrap_or(false)
        });
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

/// Simulators publishing their KV events and an in-process aggregator following them, the
/// pool most aggregator tests start from. Fields drop in order: the aggregator, then the
/// simulators.
pub struct FollowedPool {
    pub agg: LocalAggregator,
    pub sims: Vec<crate::PublishingSim>,
    /// A fresh directory for this run's configuration files and proxies.
    pub run_dir: std::path::PathBuf,
}

impl FollowedPool {
    /// `sims` simulators started with `sim_args` (serving `model`), an aggregator with
    /// `settings` (YAML lines before its `endpoints`) following them, ready; files under
    /// `$CARGO_TARGET_TMPDIR/kvoy-e2e/{run}-{pid}`.
    pub fn start(
        target_tmp: &str,
        run: &str,
        sims: usize,
        sim_args: &[&str],
        model: &str,
        settings: &str,
    ) -> anyhow::Result<FollowedPool> {
        let sims: Vec<crate::PublishingSim> = (0..sims)
            .map(|_| crate::PublishingSim::start(sim_args, false))
            .collect::<anyhow::Result<_>>()
            .with_context(|| format!("[{run}] could not start a simulator"))?;
        let run_dir = std::path::PathBuf::from(target_tmp)
            .join("kvoy-e2e")
            .join(format!("{run}-{}", std::process::id()));
        std::fs::create_dir_all(&run_dir)?;
        let aggregated: Vec<AggregatedEndpoint> = sims
            .iter()
            .map(|s| AggregatedEndpoint {
                address: s.addr,
                models: vec![model.into()],
                kv_events: Some((s.kv.clone(), None)),
            })
            .collect();
        let agg = LocalAggregator::start(
            &run_dir.join("aggregator.yaml"),
            &aggregator_yaml(settings, &aggregated),
            "127.0.0.1:0".parse()?,
        )?;
        agg.wait_ready(sims.len(), std::time::Duration::from_secs(10));
        Ok(FollowedPool { agg, sims, run_dir })
    }

    /// The simulators as a proxy's configured pool.
    pub fn endpoints(&self, model: &str) -> Vec<crate::PoolEndpoint> {
        self.sims
            .iter()
            .map(|s| crate::PoolEndpoint::new(s.addr, &[model]))
            .collect()
    }
}
