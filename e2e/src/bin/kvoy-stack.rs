//! kvoy-stack: a local kvoy demo (`make run`). Starts three echo backends, renders
//! `envoy/kvoy.yaml` into `.run/envoy.yaml` with those backends as the prefix-affinity pool,
//! runs Envoy in front of them and stays up until Ctrl-C or SIGTERM.
//!
//! ```text
//! kvoy-stack [--backends 127.0.0.1:18001,127.0.0.1:18002,127.0.0.1:18003] [--model kvoy-demo]
//!            [--listen-port 18000] [--admin-port 18900] [--run-dir .run] [--wasm-dir DIR]
//!            [--concurrency 2]
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use kvoy_e2e::{EchoConfig, EchoServer, PoolEndpoint, Stack, StackConfig};

const USAGE: &str = "usage: kvoy-stack [--backends ip:port,...] [--model NAME] [--listen-port N] \
                     [--admin-port N] [--run-dir DIR] [--wasm-dir DIR] [--concurrency N]";

struct Args {
    backends: Vec<SocketAddr>,
    model: String,
    listen_port: u16,
    admin_port: u16,
    run_dir: PathBuf,
    wasm_dir: Option<PathBuf>,
    concurrency: u32,
}

fn parse_args(args: &[String]) -> anyhow::Result<Args> {
    let mut parsed = Args {
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

    let mut backends = Vec::with_capacity(args.backends.len());
    for addr in &args.backends {
        let server = EchoServer::start(EchoConfig::new(*addr, &[args.model.as_str()]))
            .with_context(|| format!("starting an echo backend on {addr}"))?;
        println!("echo backend  http://{}", server.addr());
        backends.push(server);
    }
    let pool = backends
        .iter()
        .map(|b| PoolEndpoint::new(b.addr(), &[args.model.as_str()]))
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
    println!(
        "Try (run it twice: the same prompt prefix lands on the same backend, see x-served-by):"
    );
    println!(
        "  curl -si http://{}/v1/chat/completions -H 'content-type: application/json' \\\n    \
         -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"}},{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'",
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
