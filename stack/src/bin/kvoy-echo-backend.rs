//! kvoy-echo-backend: an OpenAI-shaped HTTP/1.1 backend that says who served each request.
//!
//! ```text
//! kvoy-echo-backend --listen 127.0.0.1:18001 --model m1,m2 [--delay-ms N]
//! ```
//!
//! Answers `GET /v1/models`, `GET /health`, and `POST /v1/chat/completions`, `/v1/completions`,
//! `/v1/responses` (SSE when the body has `"stream": true`) with header `x-served-by` and a
//! `kvoy_echo` field; header `x-echo-delay-ms: N` delays one reply.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::Parser;
use kvoy_testkit::{EchoConfig, EchoServer, MAX_DELAY};

/// kvoy-echo-backend: an OpenAI-shaped HTTP/1.1 backend that says who served each request
#[derive(Parser)]
#[command(name = "kvoy-echo-backend")]
struct Cli {
    /// HTTP address, e.g. 127.0.0.1:18001
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,
    /// Served model name; repeat or separate with commas
    // `--model` as in kvoy-sim and kvoy-stack; `--models` was this binary's spelling.
    #[arg(
        long = "model",
        visible_alias = "models",
        value_name = "NAME",
        value_delimiter = ',',
        required = true
    )]
    models: Vec<String>,
    /// A delay added to every inference reply, in milliseconds
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(..=MAX_DELAY.as_millis() as u64))]
    delay_ms: u64,
}

fn main() -> anyhow::Result<()> {
    // clap prints --help and usage errors itself (exit 0 and 2).
    let cli = Cli::parse();
    let config = EchoConfig {
        listen: cli.listen,
        models: cli
            .models
            .iter()
            .map(|m| m.trim().to_owned())
            .filter(|m| !m.is_empty())
            .collect(),
        delay: Duration::from_millis(cli.delay_ms),
    };
    if config.models.is_empty() {
        bail!("--model needs at least one model name");
    }
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
