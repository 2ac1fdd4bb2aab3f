//! The live fleet: kvoy-sim simulators with KV events, kvoy-aggregator following them, and one
//! proxy at a time in front of them (a baseline Envoy, the kvoy stack or a real router).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{free_port, http, EnvoyProcess, PoolEndpoint, Stack, StackConfig};

use super::routers::{KvEventSource, RouterKind, RouterProcess};

/// The model every simulator serves.
pub const MODEL: &str = "kvoy-bench";
/// How often kvoy-aggregator scrapes the simulators, real time.
pub const AGGREGATOR_SCRAPE_MS: u64 = 50;
/// How often the kvoy filter polls the aggregator, real time (the filter's default
/// `aggregator.poll_interval_ms`, which `envoy/kvoy.yaml` keeps).
pub const FILTER_POLL_MS: u64 = 100;

/// The baseline bootstrap template.
const BASELINE_TEMPLATE: &str = include_str!("../../envoy/baseline.yaml");

/// Simulators and their aggregator, for the whole live run.
pub struct Fleet {
    // One SimFleet per simulator: each gets KV-event ports of its own. Held, not read: dropping
    // them stops the simulators.
    #[allow(dead_code)]
    sims: Vec<SimFleet>,
    addrs: Vec<SocketAddr>,
    /// Each simulator's KV-event sockets (for vLLM's router's precise mode).
    kv_sources: Vec<KvEventSource>,
    /// The simulators' KV block size (the profile's).
    block_size: u32,
    aggregator: LocalAggregator,
    run_dir: PathBuf,
}

/// What to put in front of the fleet.
#[derive(Clone, Debug, PartialEq)]
pub enum ProxyKind {
    /// Plain Envoy with this load balancer (`ROUND_ROBIN`, ...).
    Envoy(&'static str),
    /// Envoy with the kvoy filters, polling the aggregator or not.
    Kvoy { aggregator: bool },
    /// A real router process: `binary` of `kind`, with its `policy` and `flags`; fed the
    /// simulators' KV events when `kv_events` (vLLM's router's `kv_aware`).
    Router {
        kind: RouterKind,
        policy: &'static str,
        flags: &'static [&'static str],
        binary: PathBuf,
        kv_events: bool,
    },
}

/// A proxy in front of the fleet; stopped on drop.
pub enum Proxy {
    Baseline {
        envoy: EnvoyProcess,
        listen: SocketAddr,
    },
    Kvoy(Box<Stack>),
    Router(RouterProcess),
}

impl Proxy {
    /// The Envoy process of a baseline or kvoy proxy (a router is not Envoy).
    pub fn envoy_pid(&self) -> Option<u32> {
        match self {
            Proxy::Baseline { envoy, .. } => Some(envoy.pid()),
            Proxy::Kvoy(stack) => Some(stack.envoy.pid()),
            Proxy::Router(_) => None,
        }
    }

    pub fn listen(&self) -> SocketAddr {
        match self {
            Proxy::Baseline { listen, .. } => *listen,
            Proxy::Kvoy(stack) => stack.listen,
            Proxy::Router(router) => router.listen,
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Proxy::Baseline { envoy, .. } = self {
            envoy.stop();
        }
    }
}

impl Fleet {
    /// Starts `replicas` simulators of `profile` at `speedup` and an aggregator following them.
    /// With `tokenizer` (a `tokenizer.json`), the simulators tokenize as vLLM does with it
    /// (kvoy-sim `--tokenizer`: chat through the chat template), so that their KV events and
    /// render answers carry the same token ids; else the stand-in tokenizer.
    pub fn start(
        replicas: usize,
        profile: &kvoy_sim_engine::Profile,
        speedup: f64,
        tokenizer: Option<&Path>,
        run_dir: &Path,
    ) -> anyhow::Result<Fleet> {
        std::fs::create_dir_all(run_dir)
            .with_context(|| format!("creating {}", run_dir.display()))?;
        let speedup = speedup.to_string();
        let mut sims = Vec::with_capacity(replicas);
        let mut endpoints = Vec::with_capacity(replicas);
        let mut kv_sources = Vec::with_capacity(replicas);
        let tokenizer = tokenizer.map(|p| p.display().to_string());
        for _ in 0..replicas {
            let kv = format!("tcp://127.0.0.1:{}", free_port()?);
            let replay = format!("tcp://127.0.0.1:{}", free_port()?);
            let mut args = vec![
                "--model",
                MODEL,
                "--profile",
                &profile.name,
                "--speedup",
                &speedup,
                "--kv-events-endpoint",
                &kv,
                "--kv-events-replay-endpoint",
                &replay,
            ];
            if let Some(t) = &tokenizer {
                args.extend(["--tokenizer", t.as_str()]);
            }
            let fleet = SimFleet::start(&["127.0.0.1:0".parse()?], &args)?;
            fleet.wait_healthy(Duration::from_secs(10))?;
            kv_sources.push(KvEventSource {
                worker: fleet.addrs()[0],
                endpoint: kv.clone(),
                replay: Some(replay.clone()),
            });
            endpoints.push(AggregatedEndpoint {
                address: fleet.addrs()[0],
                models: vec![MODEL.into()],
                kv_events: Some((kv, Some(replay))),
            });
            sims.push(fleet);
        }
        let addrs = endpoints.iter().map(|e| e.address).collect();
        let yaml = aggregator_yaml(
            &format!("scrape_interval_ms: {AGGREGATOR_SCRAPE_MS}\nstale_after_ms: 500\n"),
            &endpoints,
        );
        let aggregator = LocalAggregator::start(
            &run_dir.join("aggregator.yaml"),
            &yaml,
            "127.0.0.1:0".parse()?,
        )?;
        Ok(Fleet {
            sims,
            addrs,
            kv_sources,
            block_size: profile.block_size,
            aggregator,
            run_dir: run_dir.to_path_buf(),
        })
    }

    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Empties every simulator's prefix cache, once the fleet is idle (a simulator refuses a
    /// reset while requests run: abandoned ones may still be finishing). Bounded to 120 s.
    pub fn reset(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        for addr in &self.addrs {
            loop {
                let r = http::send(
                    *addr,
                    "POST",
                    "/reset_prefix_cache",
                    &[],
                    b"",
                    Duration::from_secs(5),
                )?;
                if r.status == 200 {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("{addr} still refuses to reset its cache: {}", r.status);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        // Let the aggregator see the reset (its KV-event follower and next scrape).
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    }

    /// Starts a proxy of `kind`; its files go under the run directory, in `name`.
    pub fn proxy(&self, kind: &ProxyKind, name: &str) -> anyhow::Result<Proxy> {
        match kind {
            ProxyKind::Envoy(lb) => baseline_proxy(lb, &self.addrs, &self.run_dir),
            ProxyKind::Kvoy { aggregator } => {
                let pool: Vec<PoolEndpoint> = self
                    .addrs
                    .iter()
                    .map(|a| PoolEndpoint::new(*a, &[MODEL]))
                    .collect();
                let mut config = StackConfig::new(pool, self.run_dir.join(name));
                config.concurrency = 2;
                if *aggregator {
                    config.aggregator = Some(self.aggregator.addr());
                }
                Ok(Proxy::Kvoy(Box::new(Stack::start(&config)?)))
            }
            ProxyKind::Router {
                kind,
                policy,
                flags,
                binary,
                kv_events,
            } => {
                let mut extra: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
                if *kv_events {
                    extra.extend(RouterKind::kv_event_args(
                        &self.kv_sources,
                        MODEL,
                        self.block_size,
                    ));
                }
                Ok(Proxy::Router(RouterProcess::start(
                    *kind,
                    binary,
                    policy,
                    &self.addrs,
                    &extra,
                    &self.run_dir.join(name),
                )?))
            }
        }
    }
}

/// Starts plain Envoy (`bench/envoy/baseline.yaml`, two workers) with load balancer `lb` over
/// `endpoints`; its configuration and log go under `run_dir`.
pub fn baseline_proxy(lb: &str, endpoints: &[SocketAddr], run_dir: &Path) -> anyhow::Result<Proxy> {
    let dir = run_dir.join(format!("baseline-{}", lb.to_lowercase()));
    std::fs::create_dir_all(&dir)?;
    let listen = free_port()?;
    let admin = free_port()?;
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, render_baseline(lb, endpoints, listen, admin))?;
    let mut envoy = EnvoyProcess::spawn(&config, &dir.join("envoy.log"), 2, &[])?;
    let listen = SocketAddr::from(([127, 0, 0, 1], listen));
    let admin = SocketAddr::from(([127, 0, 0, 1], admin));
    envoy.wait_ready(admin, listen, Duration::from_secs(60))?;
    Ok(Proxy::Baseline { envoy, listen })
}

/// The baseline bootstrap for `lb` over `endpoints`.
fn render_baseline(lb: &str, endpoints: &[SocketAddr], listen: u16, admin: u16) -> String {
    let mut lb_endpoints = String::new();
    for e in endpoints {
        lb_endpoints.push_str(&format!(
            "        - endpoint:\n            address:\n              socket_address: \
             {{address: {}, port_value: {}}}\n",
            e.ip(),
            e.port()
        ));
    }
    BASELINE_TEMPLATE
        .replace("{{LISTEN_PORT}}", &listen.to_string())
        .replace("{{ADMIN_PORT}}", &admin.to_string())
        .replace("{{LB_POLICY}}", lb)
        .replace("{{ENDPOINTS}}\n", &lb_endpoints)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_baseline_renders_every_endpoint_and_no_placeholder() {
        let eps: Vec<SocketAddr> = vec![
            "127.0.0.1:1001".parse().unwrap(),
            "127.0.0.1:1002".parse().unwrap(),
        ];
        let yaml = render_baseline("LEAST_REQUEST", &eps, 7000, 7001);
        assert!(!yaml.contains("{{"), "{yaml}");
        assert!(yaml.contains("lb_policy: LEAST_REQUEST"));
        assert_eq!(yaml.matches("port_value: 100").count(), 2);
    }
}
