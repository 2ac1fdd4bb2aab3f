//! kvoy-stack: a local kvoy demo (`make run`). Starts three kvoy-sim simulators in-process
//! (vLLM-like servers with a prefix cache; `--backend echo` starts echo backends instead) and
//! kvoy-aggregator following them, renders `envoy/template/kvoy.yaml` into `.run/envoy.yaml` with the
//! filter polling the aggregator (the simulators are also its static fallback pool), runs Envoy
//! in front of them and stays up until Ctrl-C or SIGTERM.
//!
//! ```text
//! kvoy-stack [--backend sim|echo] [--backends 127.0.0.1:18001,127.0.0.1:18002,127.0.0.1:18003]
//!            [--model kvoy-demo] [--speedup 10] [--kv-events-port 5557]
//!            [--aggregator-port 18090] [--listen-port 18000] [--admin-port 18900]
//!            [--run-dir .run] [--wasm-dir DIR] [--concurrency 2]
//!            [--async] [--redis-port 16379] [--async-port 18095]
//! ```
//!
//! `--async` also starts `redis-server` (Debian's package) and kvoy-async with two lanes,
//! `async` above `batch`, both sheddable in the admission filter (docs/async.md).
//!
//! Simulator `i` publishes its KV events (vLLM's ZMQ wire format) on
//! `tcp://127.0.0.1:<kv-events-port + i>` and replays missed ones on
//! `tcp://127.0.0.1:<kv-events-port + 10 + i>`; `--kv-events-port 0` turns them off.
//! `--aggregator-port 0` runs without the aggregator (the filter uses the static pool); echo
//! backends never get one (they have no metrics).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, ValueEnum};
use kvoy_aggregator::local::{aggregator_yaml, AggregatedEndpoint, LocalAggregator};
use kvoy_sim::fleet::SimFleet;
use kvoy_testkit::{EchoConfig, EchoServer, PoolEndpoint, Stack, StackConfig};

/// Offset of the simulators' replay sockets from their KV-event ports.
const REPLAY_PORT_OFFSET: u16 = 10;

/// The curl example's system prompt: several 16-token KV blocks long (kvoy-sim's tokenizer
/// makes about 4 bytes a token), so that a repeated request shows cached tokens.
const DEMO_SYSTEM_PROMPT: &str = "You are a helpful assistant for the kvoy demo. Answer in one \
     short paragraph, name the configuration keys you rely on, and say so plainly when you do \
     not know the answer.";

/// How long the simulators may take to answer `/health`.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// kvoy-sim simulators, followed by kvoy-aggregator
    Sim,
    /// Echo backends (no metrics, so no aggregator)
    Echo,
}

/// kvoy-stack: a local kvoy demo: simulators (or echo backends), kvoy-aggregator and Envoy
/// with the filters, until Ctrl-C
#[derive(Parser)]
#[command(name = "kvoy-stack")]
struct Args {
    /// The pool's backends
    #[arg(long, value_enum, default_value_t = Backend::Sim)]
    backend: Backend,
    /// The backends' addresses, comma-separated
    #[arg(long, value_name = "ADDRS", value_delimiter = ',',
          default_values = ["127.0.0.1:18001", "127.0.0.1:18002", "127.0.0.1:18003"])]
    backends: Vec<SocketAddr>,
    /// The served model name
    #[arg(long, value_name = "NAME", default_value = "kvoy-demo")]
    model: String,
    /// The simulators run this much faster than the modelled GPU (kvoy-sim --speedup)
    #[arg(long, value_name = "F", default_value_t = 10.0,
          value_parser = kvoy_sim::cli::positive_f64)]
    speedup: f64,
    /// Simulator i publishes its KV events on tcp://127.0.0.1:<N + i> and replays missed ones
    /// on port N + 10 + i; 0 turns them off
    #[arg(long, value_name = "N", default_value_t = 5557)]
    kv_events_port: u16,
    /// kvoy-aggregator's port; 0 runs without it (the filter uses the static pool)
    #[arg(long, value_name = "N", default_value_t = 18090)]
    aggregator_port: u16,
    /// Envoy's listener port
    #[arg(long, value_name = "N", default_value_t = 18000)]
    listen_port: u16,
    /// Envoy's admin port
    #[arg(long, value_name = "N", default_value_t = 18900)]
    admin_port: u16,
    /// Where the rendered configurations and logs go
    #[arg(long, value_name = "DIR", default_value = ".run")]
    run_dir: PathBuf,
    /// Where the filters' .wasm files are (default: $KVOY_WASM_DIR, else the release build's
    /// wasm32-wasip1 directory)
    #[arg(long, value_name = "DIR")]
    wasm_dir: Option<PathBuf>,
    /// Envoy's worker threads (its --concurrency)
    #[arg(long, value_name = "N", default_value_t = 2)]
    concurrency: u32,
    /// Also run redis-server and kvoy-async: jobs from Redis streams into the pool's free
    /// capacity (lanes `async` > `batch`)
    #[arg(long = "async")]
    run_async: bool,
    /// redis-server's port with --async
    #[arg(long, value_name = "N", default_value_t = 16379)]
    redis_port: u16,
    /// kvoy-async's /metrics and /v1/status port with --async
    #[arg(long, value_name = "N", default_value_t = 18095)]
    async_port: u16,
}

/// The admission objectives of kvoy-async's lanes: both sheddable, `async` above `batch`.
const ASYNC_OBJECTIVES: &str = r#"{"async": -1, "batch": -2}"#;

fn main() -> anyhow::Result<()> {
    // clap prints --help and usage errors itself (exit 0 and 2).
    let args = Args::parse();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    ctrlc::set_handler(move || {
        let _ = stop_tx.send(());
    })
    .context("installing the Ctrl-C/SIGTERM handler")?;

    let backends = start_backends(&args)?;
    let pool = backends
        .addrs()
        .into_iter()
        .map(|a| PoolEndpoint::new(a, &[args.model.as_str()]))
        .collect();
    std::fs::create_dir_all(&args.run_dir)
        .with_context(|| format!("creating {}", args.run_dir.display()))?;
    let aggregator = start_aggregator(&args, &backends)?;
    let mut config = StackConfig::new(pool, args.run_dir.clone());
    config.aggregator = aggregator.as_ref().map(LocalAggregator::addr);
    config.listen_port = args.listen_port;
    config.admin_port = args.admin_port;
    config.concurrency = args.concurrency;
    if args.run_async {
        let objectives: serde_json::Value = serde_json::from_str(ASYNC_OBJECTIVES)?;
        config.admission_config = Some(
            serde_json::json!({"endpoints": backends.addrs().len(), "flow": {"objectives": objectives}})
                .to_string(),
        );
    }
    if let Some(dir) = &args.wasm_dir {
        config.wasm_dir = dir.clone();
    }
    let mut stack = Stack::start(&config)?;
    println!(
        "envoy         pid {}, config {}, log {}",
        stack.envoy.pid(),
        stack.config_path.display(),
        stack.envoy.log_path().display()
    );
    println!("admin         http://{}", stack.admin);
    if let Some(agg) = &aggregator {
        println!(
            "aggregator    http://{}/v1/endpoints (also /metrics, /v1/snapshot), config {}",
            agg.addr(),
            args.run_dir.join("aggregator.yaml").display()
        );
    }
    println!("kvoy proxy    http://{}", stack.listen);
    let async_lane = if args.run_async {
        Some(start_async(
            &args,
            stack.listen,
            aggregator.as_ref().map(LocalAggregator::addr),
        )?)
    } else {
        None
    };
    println!();
    println!("Try it twice: the same prompt prefix lands on the same backend (x-served-by).");
    if args.backend == Backend::Sim {
        println!(
            "The second reply has usage.prompt_tokens_details.cached_tokens > 0: the simulator \
             found the prefix in its KV cache."
        );
    }
    println!(
        "  curl -si http://{}/v1/chat/completions -H 'content-type: application/json' \\\n    \
         -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"system\",\"content\":\"{DEMO_SYSTEM_PROMPT}\"}},{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'",
        stack.listen, args.model
    );
    println!();
    if async_lane.is_some() {
        println!();
        println!("Submit a job to the batch lane and read its result (docs/async.md):");
        println!(
            "  redis-cli -p {} XADD kvoy-async:jobs:batch '*' job '{{\"id\":\"job-1\",\"tenant\":\"me\",\"body\":{{\"model\":\"{}\",\"max_tokens\":32,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}}}'",
            args.redis_port, args.model
        );
        println!(
            "  redis-cli -p {} XRANGE kvoy-async:results - +",
            args.redis_port
        );
    }
    println!("Ctrl-C stops everything.");

    // Bounded wait loop: wake every second to notice an Envoy that died on its own.
    loop {
        match stop_rx.recv_timeout(Duration::from_secs(1)) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if !stack.envoy.is_running() {
                    bail!("envoy exited; log tail:\n{}", stack.envoy.log_tail(30));
                }
            }
        }
    }
    println!("stopping");
    if let Some(lane) = async_lane {
        lane.stop();
    }
    stack.envoy.stop();
    drop(aggregator);
    drop(backends);
    Ok(())
}

/// kvoy-aggregator following the simulators (none for echo backends or port 0).
fn start_aggregator(args: &Args, backends: &Backends) -> anyhow::Result<Option<LocalAggregator>> {
    if args.aggregator_port == 0 || args.backend == Backend::Echo {
        return Ok(None);
    }
    let endpoints: Vec<AggregatedEndpoint> = backends
        .addrs()
        .into_iter()
        .enumerate()
        .map(|(i, address)| {
            let kv_events = (args.kv_events_port != 0).then(|| {
                let port = u32::from(args.kv_events_port) + i as u32;
                (
                    format!("tcp://127.0.0.1:{port}"),
                    Some(format!(
                        "tcp://127.0.0.1:{}",
                        port + u32::from(REPLAY_PORT_OFFSET)
                    )),
                )
            });
            AggregatedEndpoint {
                address,
                models: vec![args.model.clone()],
                kv_events,
            }
        })
        .collect();
    let yaml = aggregator_yaml("scrape_interval_ms: 50\nstale_after_ms: 500\n", &endpoints);
    let path = args.run_dir.join("aggregator.yaml");
    let listen = SocketAddr::from(([127, 0, 0, 1], args.aggregator_port));
    Ok(Some(LocalAggregator::start(&path, &yaml, listen)?))
}

/// The running pool backends; dropped after Envoy stops.
enum Backends {
    Sim(SimFleet),
    Echo(Vec<EchoServer>),
}

impl Backends {
    fn addrs(&self) -> Vec<SocketAddr> {
        match self {
            Backends::Sim(fleet) => fleet.addrs().to_vec(),
            Backends::Echo(servers) => servers.iter().map(EchoServer::addr).collect(),
        }
    }
}

fn start_backends(args: &Args) -> anyhow::Result<Backends> {
    match args.backend {
        Backend::Echo => {
            let mut servers = Vec::with_capacity(args.backends.len());
            for addr in &args.backends {
                let server = EchoServer::start(EchoConfig::new(*addr, &[args.model.as_str()]))
                    .with_context(|| format!("starting an echo backend on {addr}"))?;
                println!("echo backend  http://{}", server.addr());
                servers.push(server);
            }
            Ok(Backends::Echo(servers))
        }
        Backend::Sim => {
            let endpoint = format!("tcp://127.0.0.1:{}", args.kv_events_port);
            let replay = format!(
                "tcp://127.0.0.1:{}",
                args.kv_events_port.saturating_add(REPLAY_PORT_OFFSET)
            );
            let speedup = args.speedup.to_string();
            let mut sim_args = vec!["--model", args.model.as_str(), "--speedup", &speedup];
            if args.kv_events_port != 0 {
                sim_args.extend([
                    "--kv-events-endpoint",
                    endpoint.as_str(),
                    "--kv-events-replay-endpoint",
                    replay.as_str(),
                ]);
            }
            let fleet = SimFleet::start(&args.backends, &sim_args)?;
            fleet.wait_healthy(HEALTH_TIMEOUT)?;
            for (i, addr) in fleet.addrs().iter().enumerate() {
                let events = if args.kv_events_port == 0 {
                    String::new()
                } else {
                    let port = u32::from(args.kv_events_port) + u32::try_from(i)?;
                    format!(", KV events tcp://127.0.0.1:{port}")
                };
                println!(
                    "kvoy-sim      http://{addr} (model {}, speedup {}{events})",
                    args.model, args.speedup
                );
            }
            Ok(Backends::Sim(fleet))
        }
    }
}

/// redis-server and kvoy-async (on its own thread and runtime), until [`AsyncLane::stop`].
struct AsyncLane {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _redis: kvoy_testkit::redis::RedisServer,
}

impl AsyncLane {
    fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn start_async(
    args: &Args,
    proxy: SocketAddr,
    aggregator: Option<SocketAddr>,
) -> anyhow::Result<AsyncLane> {
    anyhow::ensure!(
        kvoy_testkit::redis::redis_available(),
        "--async needs redis-server (apt-get install redis-server)"
    );
    let redis = kvoy_testkit::redis::RedisServer::start_on(
        &args.run_dir.join("redis"),
        args.redis_port,
        true,
    )?;
    let aggregator = aggregator.map_or_else(String::new, |a| format!("aggregator: {a}\n"));
    let yaml = format!(
        "redis_url: {}\nproxy: {proxy}\n{aggregator}listen: 127.0.0.1:{}\n\
         lanes:\n  - {{name: async, objective: async}}\n  - {{name: batch, objective: batch}}\n",
        redis.url(),
        args.async_port
    );
    let path = args.run_dir.join("async.yaml");
    std::fs::write(&path, &yaml).with_context(|| format!("writing {}", path.display()))?;
    let mut config = kvoy_async::config::Config::from_yaml(&yaml)?;
    let consumer = format!("kvoy-stack-{}", std::process::id());
    config.consumer = Some(consumer.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let status = std::sync::Arc::new(std::sync::Mutex::new(kvoy_async::status::Status::default()));
    let listen = SocketAddr::from(([127, 0, 0, 1], args.async_port));
    let queue = runtime.block_on(async {
        kvoy_async::http::serve(listen, status.clone()).await?;
        anyhow::Ok(
            kvoy_async::queue::RedisQueue::connect(
                &config,
                format!("kvoy-stack-{}", std::process::id()),
            )
            .await?,
        )
    })?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("kvoy-async".into())
        .spawn(move || {
            let stop = async {
                let _ = stop_rx.await;
            };
            if let Err(e) = runtime.block_on(kvoy_async::service::run(config, queue, status, stop))
            {
                eprintln!("kvoy-async stopped: {e:#}");
            }
        })?;
    println!(
        "redis-server  redis://127.0.0.1:{} (data {})",
        args.redis_port,
        args.run_dir.join("redis").display()
    );
    println!(
        "kvoy-async    http://{listen}/metrics (also /v1/status), config {}",
        path.display()
    );
    Ok(AsyncLane {
        stop: Some(stop_tx),
        thread: Some(thread),
        _redis: redis,
    })
}
