//! kvoy-stack: a local kvoy demo (`make run`). Starts three kvoy-sim simulators in-process
//! (vLLM-like servers with a prefix cache; `--backend echo` starts echo backends instead),
//! renders `envoy/kvoy.yaml` into `.run/envoy.yaml` with them as the prefix-affinity pool, runs
//! Envoy in front of them and stays up until Ctrl-C or SIGTERM.
//!
//! ```text
//! kvoy-stack [--backend sim|echo] [--backends 127.0.0.1:18001,127.0.0.1:18002,127.0.0.1:18003]
//!            [--model kvoy-demo] [--speedup 10] [--kv-events-port 5557]
//!            [--listen-port 18000] [--admin-port 18900] [--run-dir .run] [--wasm-dir DIR]
//!            [--concurrency 2]
//! ```
//!
//! Simulator `i` publishes its KV events (vLLM's ZMQ wire format) on
//! `tcp://127.0.0.1:<kv-events-port + i>`; `--kv-events-port 0` turns them off.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use kvoy_e2e::{EchoConfig, EchoServer, PoolEndpoint, SimFleet, Stack, StackConfig};

const USAGE: &str = "usage: kvoy-stack [--backend sim|echo] [--backends ip:port,...] \
    [--model NAME] [--speedup F] [--kv-events-port N] [--listen-port N] [--admin-port N] \
    [--run-dir DIR] [--wasm-dir DIR] [--concurrency N]";

/// The curl example's system prompt: several 16-token KV blocks long (kvoy-sim's tokenizer
/// makes about 4 bytes a token), so that a repeated request shows cached tokens.
const DEMO_SYSTEM_PROMPT: &str = "You are a helpful assistant for the kvoy demo. Answer in one \
     short paragraph, name the configuration keys you rely on, and say so plainly when you do \
     not know the answer.";

/// How long the simulators may take to answer `/health`.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sim,
    Echo,
}

struct Args {
    backend: Backend,
    backends: Vec<SocketAddr>,
    speedup: String,
    kv_events_port: u16,
    model: String,
    listen_port: u16,
    admin_port: u16,
    run_dir: PathBuf,
    wasm_dir: Option<PathBuf>,
    concurrency: u32,
}

fn parse_args(args: &[String]) -> anyhow::Result<Args> {
    let mut parsed = Args {
        backend: Backend::Sim,
        speedup: "10".into(),
        kv_events_port: 5557,
        backends: ["127.0.0.1:18001", "127.0.0.1:18002", "127.0.0.1:18003"]
            .iter()
            .map(|a| a.parse())
            .collect::<Result<_, _>>()?,
        model: "kvoy-demo".into(),
        listen_port: 18000,
        admin_port: 18900,
        run_dir: PathBuf::from(".run"),
        wasm_dir: None,
        concurrency: 2,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--backend" => {
                parsed.backend = match value("--backend")?.as_str() {
                    "sim" => Backend::Sim,
                    "echo" => Backend::Echo,
                    other => bail!("--backend: {other:?} is not `sim` or `echo`\n{USAGE}"),
                }
            }
            "--speedup" => parsed.speedup = value("--speedup")?,
            "--kv-events-port" => {
                parsed.kv_events_port = value("--kv-events-port")?
                    .parse()
                    .context("--kv-events-port")?
            }
            "--backends" => {
                parsed.backends = value("--backends")?
                    .split(',')
                    .map(|a| {
                        a.trim()
                            .parse()
                            .with_context(|| format!("--backends: {a} is not ip:port"))
                    })
                    .collect::<anyhow::Result<_>>()?;
            }
            "--model" => parsed.model = value("--model")?,
            "--listen-port" => {
                parsed.listen_port = value("--listen-port")?.parse().context("--listen-port")?
            }
            "--admin-port" => {
                parsed.admin_port = value("--admin-port")?.parse().context("--admin-port")?
            }
            "--run-dir" => parsed.run_dir = PathBuf::from(value("--run-dir")?),
            "--wasm-dir" => parsed.wasm_dir = Some(PathBuf::from(value("--wasm-dir")?)),
            "--concurrency" => {
                parsed.concurrency = value("--concurrency")?.parse().context("--concurrency")?
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    if parsed.backends.is_empty() {
        bail!("--backends needs at least one address");
    }
    Ok(parsed)
}

fn main() -> anyhow::Result<()> {
    let args = parse_args(&std::env::args().skip(1).collect::<Vec<_>>())?;
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
    let mut config = StackConfig::new(pool, args.run_dir.clone());
    config.listen_port = args.listen_port;
    config.admin_port = args.admin_port;
    config.concurrency = args.concurrency;
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
    println!("kvoy proxy    http://{}", stack.listen);
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
    stack.envoy.stop();
    drop(backends);
    Ok(())
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
            let mut sim_args = vec!["--model", args.model.as_str(), "--speedup", &args.speedup];
            if args.kv_events_port != 0 {
                sim_args.extend(["--kv-events-endpoint", endpoint.as_str()]);
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
