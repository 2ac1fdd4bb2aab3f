//! A kvoy stack: the bootstrap template `envoy/template/kvoy.yaml` (or `kvoy-separate.yaml`),
//! rendered for a pool, running in a real Envoy in front of it.
//! Used by `kvoy-stack` (`make run`), the end-to-end tests and the benchmarks; the backends are
//! started by the caller.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::bootstrap::{
    bootstrap_template, prefix_affinity_config, render_bootstrap, render_bootstrap_file,
    separate_bootstrap_template, BootstrapParams, PoolEndpoint, RunnableBootstrap,
    RUNNABLE_BOOTSTRAPS,
};
use crate::envoy::{envoy_version, wasm_failures, EnvoyProcess};
use crate::http::{self, Response};
use crate::wasm::{require_filter_wasm, stale_sources, wasm_dir, KVOY_WASM};
use crate::{free_port, SERVED_BY_HEADER};

mod lds;
use lds::Lds;
pub use lds::LDS_FILE;

/// The `allowed_destinations` of the kit's pools (simulators and echo backends on loopback).
pub const LOOPBACK_CIDR: &str = "127.0.0.0/8";

/// The bootstrap's cluster for kvoy-aggregator.
pub const AGGREGATOR_CLUSTER: &str = "kvoy_aggregator";
/// The bootstrap's cluster for a second kvoy-aggregator replica.
pub const AGGREGATOR_B_CLUSTER: &str = "kvoy_aggregator_b";

/// Which filters run the stages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FilterLayout {
    /// The combined `kvoy` filter (`envoy/kvoy.yaml`).
    #[default]
    Combined,
    /// `kvoy_session`, `kvoy_admission` and `kvoy_prefix_affinity` (`envoy/kvoy-separate.yaml`).
    Separate,
}

impl FilterLayout {
    /// The bootstrap template of this layout.
    pub fn template(self) -> PathBuf {
        match self {
            FilterLayout::Combined => bootstrap_template(),
            FilterLayout::Separate => separate_bootstrap_template(),
        }
    }

    /// The committed runnable bootstrap of this layout (`envoy/kvoy.yaml`, or
    /// `envoy/kvoy-separate.yaml`): the template rendered with
    /// [`crate::bootstrap::runnable_params`].
    pub fn runnable(self) -> RunnableBootstrap {
        match self {
            FilterLayout::Combined => RUNNABLE_BOOTSTRAPS[0],
            FilterLayout::Separate => RUNNABLE_BOOTSTRAPS[1],
        }
    }
}

/// How long a read of the filters' metrics waits: two of the combined filter's longest tick
/// (200 ms, a static pool without admission), as it keeps its metrics in the VM until then.
pub const METRICS_TICK_WAIT: std::time::Duration = std::time::Duration::from_millis(400);

/// How to start a stack.
#[derive(Clone, Debug)]
pub struct StackConfig {
    /// The filter's endpoint pool.
    pub pool: Vec<PoolEndpoint>,
    /// The filter's `max_body_bytes`, if set.
    pub max_body_bytes: Option<u64>,
    /// Further top-level fields of the filter configuration (a JSON object).
    pub extra_config: Option<Value>,
    /// The session filter's configuration (JSON; default `{}`).
    pub session_config: String,
    /// The admission filter's configuration (JSON); default: `{"endpoints": <pool size>}`,
    /// no in-flight limit, so it admits everything.
    pub admission_config: Option<String>,
    /// kvoy-aggregator's API: when set, the filter polls it through the `kvoy_aggregator`
    /// cluster (its `aggregator` section, unless `extra_config` has one) and `pool` is only the
    /// static fallback.
    pub aggregator: Option<SocketAddr>,
    /// A second kvoy-aggregator replica (with `aggregator`): cluster `kvoy_aggregator_b`, named
    /// in the default `aggregator` section's `failover_clusters`.
    pub aggregator_b: Option<SocketAddr>,
    /// Listener port on 127.0.0.1; 0 picks a free one.
    pub listen_port: u16,
    /// Admin port on 127.0.0.1; 0 picks a free one.
    pub admin_port: u16,
    /// Directory for `envoy.yaml` and `envoy.log` (created).
    pub run_dir: PathBuf,
    /// Directory holding the wasm filters.
    pub wasm_dir: PathBuf,
    /// Envoy worker threads.
    pub concurrency: u32,
    /// The combined filter (default) or the three separate ones.
    pub layout: FilterLayout,
    /// How long to wait for Envoy to become ready.
    pub ready_timeout: Duration,
    /// Another module in `wasm_dir` in the combined filter's place, with the same
    /// configuration (the overhead benchmark's floor, `kvoy_floor.wasm`); `None`: `kvoy.wasm`.
    pub filter_module: Option<String>,
    /// Serve the listener over LDS from a watched file in `run_dir/lds/` instead of in the
    /// bootstrap, so that [`Stack::reconfigure`] can change it while Envoy runs, as a control
    /// plane (Istio, Envoy Gateway) does.
    pub listeners_over_lds: bool,
}

impl StackConfig {
    /// Defaults for `pool`: free ports, the built filters, two workers, a 60 s startup bound.
    pub fn new(pool: Vec<PoolEndpoint>, run_dir: PathBuf) -> Self {
        StackConfig {
            pool,
            max_body_bytes: None,
            extra_config: None,
            aggregator: None,
            aggregator_b: None,
            session_config: "{}".to_string(),
            admission_config: None,
            listen_port: 0,
            admin_port: 0,
            run_dir,
            wasm_dir: wasm_dir(),
            concurrency: 2,
            layout: FilterLayout::default(),
            ready_timeout: Duration::from_secs(60),
            filter_module: None,
            listeners_over_lds: false,
        }
    }
}

/// A running Envoy with the rendered kvoy bootstrap.
pub struct Stack {
    /// The proxy listener.
    pub listen: SocketAddr,
    /// The admin interface.
    pub admin: SocketAddr,
    /// The rendered bootstrap.
    pub config_path: PathBuf,
    /// The filter configuration it carries.
    pub filter_config: String,
    /// The Envoy process (killed on drop).
    pub envoy: EnvoyProcess,
    config: StackConfig,
    lds: Option<Lds>,
}

pub use kvoy_shared::protocol::SERVED_HEADER;

/// The backend that answered `r` through the proxy (its `x-served-by`), checked to be a member
/// of `pool` and to be what the filter reported in [`SERVED_HEADER`]; panics, naming `test` and
/// `what`, otherwise.
pub fn served_by(r: &Response, pool: &[String], test: &str, what: &str) -> String {
    let served = r
        .header(SERVED_BY_HEADER)
        .unwrap_or_else(|| panic!("[{test}] {what}: no {} header", SERVED_BY_HEADER))
        .to_string();
    assert!(
        pool.contains(&served),
        "[{test}] {what}: served by {served}, not a pool member {pool:?}"
    );
    assert_eq!(
        r.header(SERVED_HEADER),
        Some(served.as_str()),
        "[{test}] {what}: {SERVED_HEADER} should name the backend that served"
    );
    served
}

impl Stack {
    /// The end-of-test check every end-to-end test makes: panics, naming the test, if Envoy's
    /// log shows wasm panics, traps or VM failures.
    pub fn assert_no_wasm_failures(&self, test: &str) {
        let failures = wasm_failures(&self.envoy.log_text());
        assert!(
            failures.is_empty(),
            "[{test}] wasm failures in the Envoy log ({}):\n{}",
            self.envoy.log_path().display(),
            failures.join("\n")
        );
    }

    /// The end of a passing test: [`Stack::assert_no_wasm_failures`], then the run directory
    /// removed (a failing test panics first and keeps it for inspection).
    pub fn finish(&self, test: &str) {
        self.assert_no_wasm_failures(test);
        let _ = std::fs::remove_dir_all(&self.config.run_dir);
    }

    /// Envoy's stats whose names contain `filter`, from the admin interface (`name: value`
    /// lines; counters and gauges, histograms skipped), once the filters have ticked: the
    /// combined filter gives Envoy its metrics on its tick ([`METRICS_TICK_WAIT`]).
    pub fn stats(&self, filter: &str) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
        std::thread::sleep(METRICS_TICK_WAIT);
        self.admin_stats(filter)
    }

    /// Envoy's stats whose names contain `filter`, read now (Envoy's own, e.g. the listener
    /// manager's; the filters' may lag by a tick, see [`Stack::stats`]).
    pub fn admin_stats(
        &self,
        filter: &str,
    ) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
        let path = format!("/stats?filter={filter}");
        let reply = http::get(self.admin, &path, std::time::Duration::from_secs(5))?;
        anyhow::ensure!(reply.status == 200, "GET {path}: {}", reply.status);
        Ok(reply
            .text()
            .lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(": ")?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect())
    }

    /// For a test fixture's `Drop`: when the test is failing, prints the tail of Envoy's log.
    pub fn print_log_tail_if_panicking(&self, test: &str) {
        if std::thread::panicking() {
            eprintln!(
                "[{test}] --- Envoy log tail ({}) ---\n{}\n--- end of Envoy log ---",
                self.envoy.log_path().display(),
                self.envoy.log_tail(60)
            );
        }
    }

    /// Renders the template `envoy/template/kvoy.yaml` (or `kvoy-separate.yaml`, per `layout`) into
    /// `run_dir/envoy.yaml`, starts Envoy and waits until it is ready.
    pub fn start(config: &StackConfig) -> anyhow::Result<Stack> {
        envoy_version()?;
        let wasm = require_filter_wasm(&config.wasm_dir)?;
        let stale = stale_sources(&wasm);
        if !stale.is_empty() {
            eprintln!(
                "warning: {} is older than {} source file(s), e.g. {}: run `make wasm`",
                wasm.display(),
                stale.len(),
                stale[0].display()
            );
        }
        std::fs::create_dir_all(&config.run_dir)
            .with_context(|| format!("creating {}", config.run_dir.display()))?;
        let listen_port = pick(config.listen_port)?;
        let admin_port = pick(config.admin_port)?;
        let (mut rendered, filter_config) = render(config, listen_port, admin_port)?;
        let lds = if config.listeners_over_lds {
            let dir = config.run_dir.join("lds");
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let lds = Lds {
                path: dir.join(LDS_FILE),
                dir,
                listen_port,
                admin_port,
            };
            rendered = lds.split(&rendered)?;
            Some(lds)
        } else {
            None
        };
        let config_path = config.run_dir.join("envoy.yaml");
        std::fs::write(&config_path, rendered)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let log_path = config.run_dir.join("envoy.log");
        let _ = std::fs::remove_file(&log_path);
        let mut envoy = EnvoyProcess::spawn(&config_path, &log_path, config.concurrency, &[])?;
        let listen = SocketAddr::from(([127, 0, 0, 1], listen_port));
        let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
        envoy.wait_ready(admin, listen, config.ready_timeout)?;
        Ok(Stack {
            listen,
            admin,
            config_path,
            filter_config,
            envoy,
            config: config.clone(),
            lds,
        })
    }

    /// Gives the running Envoy a new listener through LDS, as a control plane does: the
    /// bootstrap rendered from `config` (whose ports, layout and wasm are this stack's), its
    /// listener written to the watched file by an atomic rename. Returns once Envoy has taken
    /// it (`listener_manager.listener_modified` moved on) and warmed it, so new connections
    /// from then on meet the new filter configuration. Needs
    /// [`StackConfig::listeners_over_lds`].
    pub fn reconfigure(&mut self, config: &StackConfig) -> anyhow::Result<()> {
        let Some(lds) = &self.lds else {
            bail!("the stack was started with its listener in the bootstrap, not over LDS");
        };
        let (rendered, filter_config) = render(config, lds.listen_port, lds.admin_port)?;
        let updates = |stack: &Stack| -> anyhow::Result<u64> {
            let stats = stack.admin_stats("listener_manager")?;
            let stat = |name: &str| stats.get(name).copied().unwrap_or(0);
            // A modified listener serves once warm (its filters configured); until then the
            // old one takes the new connections.
            Ok(if stat("listener_manager.total_listeners_warming") == 0 {
                stat("listener_manager.listener_modified")
            } else {
                0
            })
        };
        let before = updates(self)?;
        lds.write(&rendered)?;
        let deadline = std::time::Instant::now() + config.ready_timeout;
        // While Envoy compiles a new module its main thread (and so its admin) may not answer
        // for seconds: that is "not yet", up to the deadline.
        while updates(self).unwrap_or(before) <= before {
            if std::time::Instant::now() > deadline {
                bail!(
                    "Envoy did not take the new listener from {} within {:?}",
                    lds.path.display(),
                    config.ready_timeout
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.filter_config = filter_config;
        self.config = config.clone();
        Ok(())
    }

    /// How this stack was started (or last reconfigured).
    pub fn config(&self) -> &StackConfig {
        &self.config
    }
}

/// The bootstrap of `config` on these ports, and the filter configuration it carries.
fn render(
    config: &StackConfig,
    listen_port: u16,
    admin_port: u16,
) -> anyhow::Result<(String, String)> {
    let mut extra = config
        .extra_config
        .clone()
        .unwrap_or_else(|| Value::Object(Default::default()));
    if let Value::Object(map) = &mut extra {
        if config.aggregator.is_some() {
            map.entry("aggregator")
                .or_insert_with(|| match config.aggregator_b {
                    Some(_) => serde_json::json!({"cluster": AGGREGATOR_CLUSTER,
                    "failover_clusters": [AGGREGATOR_B_CLUSTER]}),
                    None => serde_json::json!({"cluster": AGGREGATOR_CLUSTER}),
                });
        }
        // Everything of this kit listens on loopback: the pool may be nowhere else.
        map.entry("allowed_destinations")
            .or_insert_with(|| serde_json::json!([{"cidr": LOOPBACK_CIDR}]));
    }
    let filter_config = prefix_affinity_config(&config.pool, config.max_body_bytes, Some(&extra));
    let wasm_dir = config
        .wasm_dir
        .canonicalize()
        .with_context(|| format!("resolving {}", config.wasm_dir.display()))?;
    let params = BootstrapParams {
        listen_port,
        admin_port,
        wasm_dir,
        prefix_affinity_config: filter_config.clone(),
        session_config: config.session_config.clone(),
        admission_config: config.admission_config.clone().unwrap_or_else(|| {
            serde_json::json!({"endpoints": config.pool.len().max(1)}).to_string()
        }),
        // Without an aggregator the cluster is unused; any port will do.
        aggregator_port: config.aggregator.map_or(9, |a| a.port()),
        aggregator_b_port: config
            .aggregator_b
            .or(config.aggregator)
            .map_or(9, |a| a.port()),
    };
    let rendered = match &config.filter_module {
        None => render_bootstrap_file(&config.layout.template(), &params)?,
        Some(module) => {
            let path = config.layout.template();
            let template = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let combined = format!("\"{{{{WASM_DIR}}}}/{KVOY_WASM}\"");
            if config.layout != FilterLayout::Combined || template.matches(&combined).count() != 1 {
                bail!(
                    "{module} can only stand in for the one {KVOY_WASM} of the combined bootstrap"
                );
            }
            if module.contains(['"', '\\', '/']) {
                bail!("{module:?} is not a plain file name");
            }
            if !config.wasm_dir.join(module).is_file() {
                bail!(
                    "the module {module} is not in {}: run `make wasm`",
                    config.wasm_dir.display()
                );
            }
            let template = template.replace(&combined, &format!("\"{{{{WASM_DIR}}}}/{module}\""));
            render_bootstrap(&template, &params)?
        }
    };
    Ok((rendered, filter_config))
}

fn pick(port: u16) -> std::io::Result<u16> {
    if port == 0 {
        free_port()
    } else {
        Ok(port)
    }
}
