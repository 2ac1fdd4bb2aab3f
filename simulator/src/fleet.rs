//! Simulators in-process, for programs and tests that embed them (`kvoy-stack`, the end-to-end
//! tests, kvoy-bench, kvoy-local's tests): one tokio runtime (two workers) serves them all; each
//! simulator has its own engine thread. Dropping the [`SimFleet`] stops them.
//!
//! ```no_run
//! use kvoy_sim::fleet::SimFleet;
//! use std::time::Duration;
//!
//! let fleet = SimFleet::start(&["127.0.0.1:0".parse()?], &["--model", "m", "--speedup", "10"])?;
//! fleet.wait_healthy(Duration::from_secs(10))?;
//! println!("a simulator on http://{}", fleet.addrs()[0]);
//! // Or, on free ports and healthy:
//! let three = SimFleet::loopback(3, &["--model", "m", "--speedup", "10"])?;
//! # anyhow::Ok(())
//! ```

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;

use crate::server::runtime::EngineHandle;
use crate::server::{self, Simulator};

/// Several kvoy-sim servers on 127.0.0.1 in this process.
pub struct SimFleet {
    addrs: Vec<SocketAddr>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// How long [`SimFleet::loopback`] and [`PublishingSim::start`] wait for `/health`.
pub const HEALTHY_WITHIN: Duration = Duration::from_secs(10);

impl SimFleet {
    /// `count` simulators on free ports of 127.0.0.1, configured by `args` as in
    /// [`SimFleet::start`], each answering `/health` (within [`HEALTHY_WITHIN`]).
    pub fn loopback(count: usize, args: &[&str]) -> anyhow::Result<SimFleet> {
        let fleet = SimFleet::start(&vec![SocketAddr::from(([127, 0, 0, 1], 0)); count], args)?;
        fleet.wait_healthy(HEALTHY_WITHIN)?;
        Ok(fleet)
    }

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
        let options = crate::cli::parse(&args)
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
            let sink = crate::events::sink(&options, index, addr)
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
        let runtime = self
            .runtime
            .as_ref()
            .context("the simulators are stopped")?;
        let deadline = Instant::now() + timeout;
        for addr in &self.addrs {
            loop {
                let last = match runtime.block_on(health(*addr, Duration::from_secs(2))) {
                    Ok(()) => break,
                    Err(e) => e,
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

/// One `GET /health` to `addr`, bounded by `timeout`: Ok on 200, else what went wrong.
async fn health(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    let probe = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        // Ends when the sender is dropped or the server closes.
        tokio::spawn(conn);
        let request = hyper::Request::get("/health")
            .header(hyper::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let status = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?
            .status();
        if status == hyper::StatusCode::OK {
            Ok(())
        } else {
            Err(format!("status {}", status.as_u16()))
        }
    };
    tokio::time::timeout(timeout, probe)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
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
    /// events, and answers replays too when `replay` is set. A port [`free_port`] picked
    /// can be taken by someone else before the simulator binds it (another test's listener on
    /// port 0): then it tries again with new ports, four times at most.
    pub fn start(flags: &[&str], replay: bool) -> anyhow::Result<PublishingSim> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let kv = format!("tcp://127.0.0.1:{}", free_port()?);
            let replay = if replay {
                Some(format!("tcp://127.0.0.1:{}", free_port()?))
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
                    eprintln!("kvoy-sim fleet: simulator ports taken, trying others: {e:#}");
                    continue;
                }
                Err(e) => return Err(e),
            };
            fleet.wait_healthy(HEALTHY_WITHIN)?;
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

/// A free TCP port on 127.0.0.1 for a KV-event socket (ZMQ binds it itself, by number): bound
/// and released, so another process can take it first (see [`PublishingSim::start`]).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}
