//! `kvoy-sim`: one or more simulated vLLM servers on loopback ports. See `kvoy-sim --help`.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use clap::Parser;
use tokio::net::TcpListener;

use kvoy_sim::cli::{Cli, Options};
use kvoy_sim::server::runtime::{EngineHandle, EventSink};
use kvoy_sim::server::{self, Simulator};

fn main() -> Result<()> {
    // clap prints --help and usage errors itself (exit 0 and 2).
    let options = Cli::parse().into_options()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run(options))
}

async fn run(options: Options) -> Result<()> {
    let mut servers = Vec::new();
    for i in 0..options.count {
        let port = options
            .listen
            .port()
            .checked_add(i)
            .context("--listen port + --count overflows")?;
        let addr = SocketAddr::new(options.listen.ip(), port);
        let sink = kvoy_sim::events::sink(&options, i, addr)?;
        servers.push(start_one(&options, addr, sink).await?);
    }
    let tokenizer = match options.http.tokenizer.hf() {
        Some(t) => t.path().display().to_string(),
        None => "stand-in".to_owned(),
    };
    println!(
        "kvoy-sim: {} simulator(s), profile {}, speedup {}, models {:?}, tokenizer {tokenizer}",
        options.count, options.profile.name, options.http.speedup, options.http.models
    );
    for (addr, _) in &servers {
        println!("kvoy-sim listening on http://{addr}");
    }
    shutdown_signal().await;
    Ok(())
}

async fn start_one(
    options: &Options,
    addr: SocketAddr,
    sink: EventSink,
) -> Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let engine = EngineHandle::start(options.profile.clone(), options.http.speedup, sink)?;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let sim = Simulator::new(engine, options.http.clone(), addr.to_string());
    Ok((addr, tokio::spawn(server::serve(listener, sim))))
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
