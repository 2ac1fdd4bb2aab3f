//! In-process kvoy-sim simulators (crate `kvoy-sim`, through its library API) for `kvoy-stack`
//! and the end-to-end tests: one tokio runtime (two workers) serves them all; each simulator has
//! its own engine thread. Dropping the [`SimFleet`] stops them.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use kvoy_sim::server::runtime::EngineHandle;
use kvoy_sim::server::{self, Simulator};

/// Several kvoy-sim servers on 127.0.0.1 in this process.
pub struct SimFleet {
    addrs: Vec<SocketAddr>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl SimFleet {
    /// Starts one simulator per address of `listen` (port 0 picks a free port), each configured
    /// by the `kvoy-sim` flags `args` (`--model`, `--speedup`, `--profile`, ...; not `--listen`
    /// or `--count`). With `--kv-events-endpoint tcp://ip:P`, simulator `i` publishes its KV
    /// events on port `P + i`, as `kvoy-sim --count` does.
    pub fn start(listen: &[SocketAddr], args: &[&str]) -> anyhow::Result<SimFleet> {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        // clap also takes `--flag=value`.
        let flag = |a: &String| a.split('=').next().unwrap_or_default().to_owned();
        if args
            .iter()
            .any(|a| ["--listen", "--count", "--replicas"].contains(&flag(a).as_str()))
        {
            bail!(
                "SimFleet::start takes the addresses itself: no --listen or --count (--replicas) \
                 in {args:?}"
            );
        }
        let options = kvoy_sim::cli::parse(&args)
            .context("kvoy-sim options")?
            .context("kvoy-sim options: --help is not an option here")?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvoy-sim-http")
            .enable_all()
            .build()
            .context("starting the simulators' tokio runtime")?;
        let mut addrs = Vec::with_capacity(listen.len());
        for (i, want) in listen.iter().enumerate() {
            let index = u16::try_from(i).context("too many simulators")?;
            let listener = runtime
                .block_on(tokio::net::TcpListener::bind(want))
                .with_context(|| format!("kvoy-sim cannot listen on {want}"))?;
            let addr = listener.local_addr()?;
            let sink = kvoy_sim::events::sink(&options, index, addr)
                .with_context(|| format!("KV events of the simulator on {addr}"))?;
            let engine =
                EngineHandle::start(options.profile.clone(), options.http.speedup, sink)
                    .with_context(|| format!("starting the engine of the simulator on {addr}"))?;
            let sim = Simulator::new(engine, options.http.clone(), addr.to_string());
            runtime.spawn(server::serve(listener, sim));
            addrs.push(addr);
        }
        Ok(SimFleet {
            addrs,
            runtime: Some(runtime),
        })
    }

    /// The simulators' addresses, in the order of `listen`.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Waits (bounded by `timeout`) until every simulator answers `GET /health` with 200.
    pub fn wait_healthy(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        for addr in &self.addrs {
            loop {
                let last = match crate::http::send(
                    *addr,
                    "GET",
                    "/health",
                    &[],
                    b"",
                    Duration::from_secs(2),
                ) {
                    Ok(r) if r.status == 200 => break,
                    Ok(r) => format!("status {}", r.status),
                    Err(e) => e.to_string(),
                };
                if Instant::now() >= deadline {
                    bail!("kvoy-sim on {addr} is not healthy after {timeout:?}: {last}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }
}

impl Drop for SimFleet {
    fn drop(&mut self) {
        // Cancels the servers; each engine thread ends once its handles are gone.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// Flags for a simulator serving `model` ten times faster than the modelled GPU, with a KV
/// cache of `gpu_blocks` blocks of 16 tokens: small enough that a test's prompts make it
/// evict.
pub fn small_cache_flags<'a>(model: &'a str, gpu_blocks: &'a str) -> [&'a str; 8] {
    [
        "--model",
        model,
        "--speedup",
        "10",
        "--block-size",
        "16",
        "--num-gpu-blocks",
        gpu_blocks,
    ]
}

/// One simulator publishing its KV events over ZMQ on free ports of 127.0.0.1, healthy.
pub struct PublishingSim {
    /// `None` once a test took it (to stop the simulator).
    pub fleet: Option<SimFleet>,
    pub addr: SocketAddr,
    /// Its `--kv-events-endpoint`.
    pub kv: String,
    /// Its `--kv-events-replay-endpoint`, when started with one.
    pub replay: Option<String>,
}

impl PublishingSim {
    /// Starts a simulator configured by `flags` (as [`SimFleet::start`]) that publishes its KV
    /// events, and answers replays too when `replay` is set. A port [`crate::free_port`] picked
    /// can be taken by someone else before the simulator binds it (another test's listener on
    /// port 0): then it tries again with new ports, four times at most.
    pub fn start(flags: &[&str], replay: bool) -> anyhow::Result<PublishingSim> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let kv = format!("tcp://127.0.0.1:{}", crate::free_port()?);
            let replay = if replay {
                Some(format!("tcp://127.0.0.1:{}", crate::free_port()?))
            } else {
                None
            };
            let mut args = vec!["--kv-events-endpoint", kv.as_str()];
            if let Some(r) = &replay {
                args.extend(["--kv-events-replay-endpoint", r.as_str()]);
            }
            args.extend_from_slice(flags);
            let fleet = match SimFleet::start(&["127.0.0.1:0".parse()?], &args) {
                Ok(fleet) => fleet,
                Err(e) if attempt < 4 && format!("{e:#}").contains("Address already in use") => {
                    eprintln!("kvoy-e2e: simulator ports taken, trying others: {e:#}");
                    continue;
                }
                Err(e) => return Err(e),
            };
            fleet.wait_healthy(Duration::from_secs(10))?;
            let addr = fleet.addrs()[0];
            return Ok(PublishingSim {
                fleet: Some(fleet),
                addr,
                kv,
                replay,
            });
        }
    }
}
