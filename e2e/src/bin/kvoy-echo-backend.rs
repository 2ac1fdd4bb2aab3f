//! kvoy-echo-backend: an OpenAI-shaped HTTP/1.1 backend that says who served each request.
//!
//! ```text
//! kvoy-echo-backend --listen 127.0.0.1:18001 --models m1,m2 [--delay-ms N]
//! ```
//!
//! Answers `GET /v1/models`, `GET /health`, and `POST /v1/chat/completions`, `/v1/completions`,
//! `/v1/responses` (SSE when the body has `"stream": true`) with header `x-served-by` and a
//! `kvoy_echo` field; header `x-echo-delay-ms: N` delays one reply.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context as _};
use kvoy_e2e::{EchoConfig, EchoServer, MAX_DELAY};

const USAGE: &str =
    "usage: kvoy-echo-backend --listen 127.0.0.1:PORT --models m1,m2 [--delay-ms N]";

fn parse_args(args: &[String]) -> anyhow::Result<EchoConfig> {
    let mut listen: Option<SocketAddr> = None;
    let mut models: Vec<String> = Vec::new();
    let mut delay = Duration::ZERO;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--listen" => {
                let v = value("--listen")?;
                listen = Some(
                    v.parse()
                        .with_context(|| format!("--listen {v}: not ip:port"))?,
                );
            }
            "--models" => {
                models = value("--models")?
                    .split(',')
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .map(String::from)
                    .collect();
            }
            "--delay-ms" => {
                let v = value("--delay-ms")?;
                let ms: u64 = v
                    .parse()
                    .with_context(|| format!("--delay-ms {v}: not a number"))?;
                delay = Duration::from_millis(ms);
                if delay > MAX_DELAY {
                    bail!("--delay-ms {ms}: at most {} ms", MAX_DELAY.as_millis());
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    let listen = listen.with_context(|| format!("--listen is required\n{USAGE}"))?;
    if models.is_empty() {
        bail!("--models needs at least one model\n{USAGE}");
    }
    Ok(EchoConfig {
        listen,
        models,
        delay,
    })
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let config = parse_args(&args)?;
    let models = config.models.join(",");
    let server = EchoServer::start(config.clone())
        .with_context(|| format!("listening on {}", config.listen))?;
    println!(
        "kvoy-echo-backend listening on {} (models: {models})",
        server.addr()
    );
    server.wait();
    Ok(())
}
