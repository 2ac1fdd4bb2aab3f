//! The overhead benchmark: how much latency the kvoy filters add to a request, measured as
//! Envoy with the filters (`envoy/kvoy.yaml`) against plain Envoy (`bench/envoy/baseline.yaml`,
//! `ROUND_ROBIN`, no filter) in front of the same echo backends, side by side in one run.
//!
//! Every (prompt size, concurrency) cell sends the same requests through each proxy in
//! alternating rounds (so a noisy neighbour hurts both alike), from a closed-loop client on
//! keep-alive connections ([`client`]), non-streamed, with a one-token reply: what remains
//! is the proxies' own work on the request. Each prompt is distinct (its first 16 bytes are
//! the request's number), so the prefix index inserts new blocks for every request, its most
//! expensive case. The backends answer at once; "direct" (no proxy) is the floor.
//!
//! A fourth target, `ext_proc`, is the external picker's architecture ([`extproc`]): the same
//! kvoy-shared picker behind Envoy's ext_proc filter, over gRPC on loopback. Every one of its
//! loads is checked: each echo backend must have received exactly the requests the picker sent
//! it, or the run fails (a picker that routes nothing must not pass for a fast one).
//!
//! A fifth, `floor`, is kvoy's bootstrap with `kvoy_floor.wasm` (`bench/floor/`) in the filter's
//! place: buffer the body, copy it into the VM, hash it, set the destination header, nothing
//! else. What it adds is what any body-routing wasm filter costs on this Envoy; kvoy's added
//! latency beyond it is kvoy's own work.

pub mod cli;
pub mod client;
pub mod extproc;
mod report;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvoy_testkit::{EchoServer, PoolEndpoint, Stack, StackConfig};

use crate::live::baseline_proxy;
use crate::metrics::percentile;
use extproc::ExtProcProxy;
use kvoy_shared::Rng;

pub use report::{chart, summary};

/// The model the echo backends serve.
const MODEL: &str = "kvoy-bench";
/// Bytes of prompt text per token: the simulator tokenizer's chunk, and about what a BPE
/// tokenizer averages on English.
pub const BYTES_PER_TOKEN: usize = 4;

/// What to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct OverheadGrid {
    pub prompt_tokens: Vec<u32>,
    pub concurrency: Vec<usize>,
    /// Requests per (cell, proxy); at least 8 per client thread.
    pub requests: usize,
    /// Alternations of the proxies per cell.
    pub rounds: usize,
    pub backends: usize,
    /// Envoy worker threads, both proxies.
    pub workers: u32,
    /// Also measure the backends without a proxy.
    pub direct: bool,
    /// Also measure the external picker (Envoy's ext_proc filter and kvoy's picker over gRPC).
    pub ext_proc: bool,
    /// Also measure the wasm floor (`kvoy_floor.wasm` in kvoy's bootstrap).
    pub floor: bool,
    /// Also measure the floor making this many more host calls per request, clock reads
    /// (`floor_calls`) and shared-data reads (`floor_shared`), see `bench/floor/`: what one
    /// crossing into Envoy costs, and one shared-data read. 0: not measured.
    pub host_calls: u32,
    /// The kvoy filter's stages besides prefix affinity (which routes, so is always on).
    pub stages: Stages,
    pub seed: u64,
    /// Bound on one proxy's share of one round, real time.
    pub load_deadline: Duration,
    /// Envoy's configurations and logs.
    pub run_dir: PathBuf,
}

impl OverheadGrid {
    /// The grid: 1k, 8k, 32k and 100k-token prompts at concurrency 1, 32 and 150.
    pub fn standard(run_dir: PathBuf) -> OverheadGrid {
        OverheadGrid {
            prompt_tokens: vec![1_000, 8_000, 32_000, 100_000],
            concurrency: vec![1, 32, 150],
            requests: 400,
            rounds: 2,
            backends: 4,
            workers: 2,
            direct: true,
            ext_proc: true,
            floor: true,
            host_calls: 0,
            stages: Stages::ALL,
            seed: 1,
            load_deadline: Duration::from_secs(60),
            run_dir,
        }
    }

    fn requests_for(&self, concurrency: usize) -> usize {
        self.requests.max(8 * concurrency)
    }
}

/// Latency figures of one (cell, proxy), milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
}

/// One (prompt size, concurrency, proxy).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    pub prompt_tokens: u32,
    pub body_bytes: usize,
    pub concurrency: usize,
    /// `direct`, `envoy` (plain), `kvoy` (Envoy with the filters), `ext_proc` (Envoy's ext_proc
    /// filter and kvoy's picker as a gRPC server) or `floor` (the minimal wasm filter).
    pub proxy: String,
    pub requests: usize,
    pub errors: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    pub latency: Latency,
    pub requests_per_s: f64,
    /// The Envoy process's CPU time (every thread, user and system) per answered request,
    /// microseconds, over the measured loads; `None` for `direct`, and in reports from before
    /// it was measured. For `ext_proc` Envoy's alone: its picker runs in the bench's process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envoy_cpu_us_per_request: Option<f64>,
}

/// Everything the overhead run measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OverheadReport {
    pub tool: String,
    pub envoy: String,
    pub workers: u32,
    pub backends: usize,
    pub rounds: usize,
    /// The kvoy filter's stages in this run (all three unless `--stages` said otherwise).
    #[serde(default)]
    pub stages: Stages,
    /// The calibration's extra host calls per request (`floor_calls` cells); 0: not measured.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_calls: u32,
    pub cells: Vec<Cell>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Which of the kvoy filter's stages run besides prefix affinity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stages {
    pub session: bool,
    pub admission: bool,
}

impl Default for Stages {
    fn default() -> Self {
        Stages::ALL
    }
}

impl Stages {
    pub const ALL: Stages = Stages {
        session: true,
        admission: true,
    };

    /// `session,admission,prefix-affinity`, or a part of it that names `prefix-affinity`.
    pub fn parse(list: &str) -> Option<Stages> {
        let mut stages = Stages {
            session: false,
            admission: false,
        };
        let mut routes = false;
        for name in list.split(',').map(str::trim) {
            match name {
                "session" => stages.session = true,
                "admission" => stages.admission = true,
                "prefix-affinity" => routes = true,
                _ => return None,
            }
        }
        routes.then_some(stages)
    }

    /// `session, admission and prefix affinity`, or the part that ran.
    pub fn describe(&self) -> &'static str {
        match (self.session, self.admission) {
            (true, true) => "session, admission and prefix affinity",
            (true, false) => "session and prefix affinity (no admission)",
            (false, true) => "admission and prefix affinity (no session)",
            (false, false) => "prefix affinity alone",
        }
    }
}

/// The floor filter's module (`bench/floor/`, built by `make wasm`).
pub const FLOOR_WASM: &str = "kvoy_floor.wasm";

/// The proxies, in the order of the first round.
pub const PROXIES: [&str; 5] = ["envoy", "kvoy", "floor", "ext_proc", "direct"];

/// The calibration's proxies (`--host-calls N`): the floor with N more clock reads per request,
/// and with N more shared-data reads.
pub const FLOOR_CALLS: &str = "floor_calls";
pub const FLOOR_SHARED: &str = "floor_shared";

impl OverheadReport {
    pub fn cell(&self, prompt_tokens: u32, concurrency: usize, proxy: &str) -> Option<&Cell> {
        self.cells.iter().find(|c| {
            c.prompt_tokens == prompt_tokens && c.concurrency == concurrency && c.proxy == proxy
        })
    }

    /// Whether `proxy` was measured at any grid point.
    pub fn measured(&self, proxy: &str) -> bool {
        self.cells.iter().any(|c| c.proxy == proxy)
    }

    /// The (prompt size, concurrency) pairs measured, in order.
    pub fn grid(&self) -> Vec<(u32, usize)> {
        let mut out: Vec<(u32, usize)> = Vec::new();
        for c in &self.cells {
            if !out.contains(&(c.prompt_tokens, c.concurrency)) {
                out.push((c.prompt_tokens, c.concurrency));
            }
        }
        out
    }

    /// kvoy's latency minus plain Envoy's at p50 and p99, milliseconds.
    pub fn added_ms(&self, prompt_tokens: u32, concurrency: usize) -> Option<(f64, f64)> {
        self.added_ms_of("kvoy", prompt_tokens, concurrency)
    }

    /// `proxy`'s latency minus plain Envoy's at p50 and p99, milliseconds.
    pub fn added_ms_of(
        &self,
        proxy: &str,
        prompt_tokens: u32,
        concurrency: usize,
    ) -> Option<(f64, f64)> {
        let p = self.cell(prompt_tokens, concurrency, proxy)?;
        let envoy = self.cell(prompt_tokens, concurrency, "envoy")?;
        Some((
            p.latency.p50_ms - envoy.latency.p50_ms,
            p.latency.p99_ms - envoy.latency.p99_ms,
        ))
    }

    /// kvoy's added p50 as a fraction of the external picker's; `None` unless both were
    /// measured and ext_proc added something.
    pub fn kvoy_over_ext_proc(&self, prompt_tokens: u32, concurrency: usize) -> Option<f64> {
        let (kvoy, _) = self.added_ms(prompt_tokens, concurrency)?;
        let (ext, _) = self.added_ms_of("ext_proc", prompt_tokens, concurrency)?;
        (ext > 0.0).then(|| kvoy / ext)
    }

    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    /// Writes `overhead.json`, `overhead.md` and `overhead.svg` into `dir`.
    pub fn write_all(&self, dir: &std::path::Path) -> std::io::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)?;
        let json = self.to_json().map_err(std::io::Error::other)?;
        let files = [
            ("overhead.json", json + "\n"),
            ("overhead.md", summary(self)),
            ("overhead.svg", chart(self)),
        ];
        let mut written = Vec::new();
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::write(&path, text)?;
            written.push(path);
        }
        Ok(written)
    }
}

/// Progress of the overhead run.
#[derive(Clone, Copy, Debug)]
pub struct OverheadProgress<'a> {
    pub prompt_tokens: u32,
    pub concurrency: usize,
    pub proxy: &'a str,
    pub done: usize,
    pub total: usize,
    pub cell: usize,
    pub cells: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum OverheadError {
    #[error("setting up the backends and proxies: {0}")]
    Setup(String),
    #[error("ext_proc at {prompt_tokens} tokens, concurrency {concurrency}: {detail}")]
    Misrouted {
        prompt_tokens: u32,
        concurrency: usize,
        detail: String,
    },
}

/// The prompt text of `tokens` tokens: seeded lowercase words, every request's own first
/// 16 bytes.
struct Prompts {
    text: String,
}

impl Prompts {
    fn new(tokens: u32, seed: u64) -> Prompts {
        let len = tokens as usize * BYTES_PER_TOKEN;
        let mut rng = Rng::derive(seed, "overhead-prompt", u64::from(tokens));
        let mut text = String::with_capacity(len + 8);
        while text.len() < len {
            for _ in 0..rng.range(2, 9) {
                text.push(char::from(b'a' + rng.below(26) as u8));
            }
            text.push(' ');
        }
        text.truncate(len);
        Prompts { text }
    }

    fn body(&self, index: usize) -> Vec<u8> {
        let stamp = format!("{index:016x}");
        let rest = self.text.get(stamp.len()..).unwrap_or("");
        serde_json::json!({
            "model": MODEL,
            "prompt": format!("{stamp}{rest}"),
            "max_tokens": 1,
        })
        .to_string()
        .into_bytes()
    }
}

struct Target {
    name: &'static str,
    addr: SocketAddr,
    /// The Envoy process serving it, whose CPU time is counted.
    envoy_pid: Option<u32>,
}

/// CPU time `pid` has used so far, every thread: the sum of `/proc/PID/task/*/schedstat`'s
/// first field (nanoseconds on the CPU; `/proc/PID/stat`'s ticks are 10 ms, too coarse for a
/// row of a few hundred requests). `None` where there is no such file (not Linux, no
/// schedstats, the process gone).
fn cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    let mut any = false;
    for task in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
            // A thread that ended between the listing and the read.
            continue;
        };
        if let Some(ns) = text
            .split_whitespace()
            .next()
            .and_then(|f| f.parse::<u64>().ok())
        {
            total = total.saturating_add(ns);
            any = true;
        }
    }
    any.then_some(total)
}

/// Requests each backend received and the picker sent to it, by backend.
struct Tally {
    received: Vec<u64>,
    sent: Vec<u64>,
}

impl Tally {
    fn take(backends: &[EchoServer], picker: &ExtProcProxy) -> Tally {
        let routed = picker.routed();
        Tally {
            received: backends
                .iter()
                .map(EchoServer::inference_requests)
                .collect(),
            sent: backends
                .iter()
                .map(|b| {
                    routed
                        .iter()
                        .find(|(a, _)| *a == b.addr())
                        .map_or(0, |(_, n)| *n)
                })
                .collect(),
        }
    }

    /// Since `before`, every backend received exactly what the picker sent it, the picker
    /// routed at least every request answered, and, if any request was tried, at least one.
    fn check(
        &self,
        before: &Tally,
        answered: usize,
        tried: usize,
        addrs: &[SocketAddr],
    ) -> Result<(), String> {
        let mut sent_total = 0;
        for (i, addr) in addrs.iter().enumerate() {
            let got = self.received[i] - before.received[i];
            let sent = self.sent[i] - before.sent[i];
            if got != sent {
                return Err(format!(
                    "backend {addr} received {got} requests, the picker sent it {sent}"
                ));
            }
            sent_total += sent;
        }
        if sent_total < answered as u64 || (tried > 0 && sent_total == 0) {
            return Err(format!(
                "{tried} requests sent, {answered} answered, but the picker routed {sent_total}"
            ));
        }
        Ok(())
    }
}

/// Runs the grid: starts the echo backends, plain Envoy and the kvoy stack, measures every cell.
pub fn run(
    grid: &OverheadGrid,
    progress: &(dyn Fn(OverheadProgress<'_>) + Sync),
) -> Result<OverheadReport, OverheadError> {
    let setup = |e: &dyn std::fmt::Display| OverheadError::Setup(e.to_string());
    let envoy_version = kvoy_testkit::envoy_version()
        .map(|v| envoy_release(&v))
        .map_err(|e| setup(&format!("{e:#}")))?;
    let backends: Vec<EchoServer> =
        EchoServer::loopback(grid.backends.max(1), &[MODEL]).map_err(|e| setup(&e))?;
    let addrs: Vec<SocketAddr> = backends.iter().map(EchoServer::addr).collect();
    std::fs::create_dir_all(&grid.run_dir).map_err(|e| setup(&e))?;
    let plain = baseline_proxy("ROUND_ROBIN", &addrs, &grid.run_dir)
        .map_err(|e| setup(&format!("plain Envoy: {e:#}")))?;
    let pool: Vec<PoolEndpoint> = PoolEndpoint::all(&addrs, &[MODEL]);
    let mut config = StackConfig::new(pool.clone(), grid.run_dir.join("kvoy"));
    config.concurrency = grid.workers;
    let floor_config = config.clone();
    // A `null` section turns the combined filter's stage off.
    if !grid.stages.session {
        config.session_config = "null".to_owned();
    }
    if !grid.stages.admission {
        config.admission_config = Some("null".to_owned());
    }
    let kvoy = Stack::start(&config).map_err(|e| setup(&format!("kvoy stack: {e:#}")))?;
    let calibration = |name: &str, field: &str| {
        if grid.host_calls == 0 {
            return Ok(None);
        }
        let mut config = floor_config.clone();
        config.run_dir = grid.run_dir.join(name);
        config.filter_module = Some(FLOOR_WASM.to_owned());
        config.extra_config = Some(serde_json::json!({"floor": {field: grid.host_calls}}));
        Stack::start(&config)
            .map(Some)
            .map_err(|e| setup(&format!("{name} stack: {e:#}")))
    };
    let floor_calls = calibration(FLOOR_CALLS, "clock_reads")?;
    let floor_shared = calibration(FLOOR_SHARED, "shared_reads")?;
    let floor = if grid.floor {
        let mut config = floor_config;
        config.run_dir = grid.run_dir.join("floor");
        config.filter_module = Some(FLOOR_WASM.to_owned());
        Some(Stack::start(&config).map_err(|e| setup(&format!("floor stack: {e:#}")))?)
    } else {
        None
    };
    let ext_proc = if grid.ext_proc {
        let proxy = ExtProcProxy::start(
            &pool,
            grid.workers,
            grid.seed,
            &grid.run_dir.join("ext_proc"),
        )
        .map_err(|e| setup(&format!("ext_proc: {e:#}")))?;
        Some(proxy)
    } else {
        None
    };
    let mut targets = vec![
        Target {
            name: "envoy",
            addr: plain.listen(),
            envoy_pid: plain.envoy_pid(),
        },
        Target {
            name: "kvoy",
            addr: kvoy.listen,
            envoy_pid: Some(kvoy.envoy.pid()),
        },
    ];
    if let Some(f) = &floor {
        targets.push(Target {
            name: "floor",
            addr: f.listen,
            envoy_pid: Some(f.envoy.pid()),
        });
    }
    for (name, stack) in [(FLOOR_CALLS, &floor_calls), (FLOOR_SHARED, &floor_shared)] {
        if let Some(f) = stack {
            targets.push(Target {
                name,
                addr: f.listen,
                envoy_pid: Some(f.envoy.pid()),
            });
        }
    }
    if let Some(p) = &ext_proc {
        targets.push(Target {
            name: "ext_proc",
            addr: p.listen(),
            envoy_pid: Some(p.envoy_pid()),
        });
    }
    if grid.direct {
        targets.push(Target {
            name: "direct",
            addr: addrs[0],
            envoy_pid: None,
        });
    }

    let tally = |name: &str| match (&ext_proc, name) {
        (Some(p), "ext_proc") => Some(Tally::take(&backends, p)),
        _ => None,
    };
    let check = |name: &str,
                 before: Option<Tally>,
                 m: &client::Measured,
                 prompt_tokens: u32,
                 concurrency: usize| {
        let (Some(before), Some(after)) = (before, tally(name)) else {
            return Ok(());
        };
        let answered = m.latencies.len();
        after
            .check(&before, answered, answered + m.errors, &addrs)
            .map_err(|detail| OverheadError::Misrouted {
                prompt_tokens,
                concurrency,
                detail,
            })
    };

    let cells = grid.prompt_tokens.len() * grid.concurrency.len();
    let mut out = Vec::new();
    let mut cell = 0;
    for &tokens in &grid.prompt_tokens {
        let prompts = Prompts::new(tokens, grid.seed);
        let body_bytes = prompts.body(0).len();
        let mut next_index = 0usize;
        for &concurrency in &grid.concurrency {
            cell += 1;
            let total = grid.requests_for(concurrency);
            let rounds = grid.rounds.max(1);
            let mut measured: Vec<client::Measured> = targets
                .iter()
                .map(|_| client::Measured::default())
                .collect();
            // CPU nanoseconds of each target's Envoy over the measured loads.
            let mut cpu_spent: Vec<Option<u64>> =
                targets.iter().map(|t| t.envoy_pid.map(|_| 0)).collect();
            // Warm each path (connections, the filters' first-request work) unmeasured.
            for t in &targets {
                let body = |i: usize| prompts.body(next_index + i);
                let warm = client::Load {
                    target: t.addr,
                    concurrency,
                    requests: (2 * concurrency).max(16),
                    body: &body,
                    timeout: Duration::from_secs(30),
                    deadline: Instant::now() + grid.load_deadline,
                };
                let before = tally(t.name);
                let m = client::run(&warm, &|_| {});
                check(t.name, before, &m, tokens, concurrency)?;
                next_index += warm.requests;
            }
            for round in 0..rounds {
                let share = total / rounds + usize::from(round < total % rounds);
                // Rotate the order each round so that neither proxy always goes first.
                for k in 0..targets.len() {
                    let ti = (k + round) % targets.len();
                    let t = &targets[ti];
                    let done_before = measured[ti].latencies.len() + measured[ti].errors;
                    let base = next_index;
                    let prompts = &prompts;
                    let body = move |i: usize| prompts.body(base + i);
                    let load = client::Load {
                        target: t.addr,
                        concurrency,
                        requests: share,
                        body: &body,
                        timeout: Duration::from_secs(30),
                        deadline: Instant::now() + grid.load_deadline,
                    };
                    next_index += share;
                    let name = t.name;
                    let last = std::sync::Mutex::new(Instant::now());
                    let before = tally(name);
                    let cpu_before = t.envoy_pid.and_then(cpu_ns);
                    let m = client::run(&load, &|done| {
                        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
                        if done < share && last.elapsed() < Duration::from_secs(1) {
                            return;
                        }
                        *last = Instant::now();
                        progress(OverheadProgress {
                            prompt_tokens: tokens,
                            concurrency,
                            proxy: name,
                            done: done_before + done,
                            total,
                            cell,
                            cells,
                        });
                    });
                    let cpu_after = t.envoy_pid.and_then(cpu_ns);
                    check(name, before, &m, tokens, concurrency)?;
                    let acc = &mut measured[ti];
                    cpu_spent[ti] = match (cpu_spent[ti], cpu_before, cpu_after) {
                        (Some(sum), Some(b), Some(a)) => Some(sum + a.saturating_sub(b)),
                        _ => None,
                    };
                    acc.latencies.extend(m.latencies);
                    acc.errors += m.errors;
                    acc.wall += m.wall;
                    if acc.first_error.is_none() {
                        acc.first_error = m.first_error;
                    }
                }
            }
            for ((t, m), cpu) in targets.iter().zip(measured).zip(cpu_spent) {
                let mut c = cell_of(tokens, body_bytes, concurrency, t.name, m);
                c.envoy_cpu_us_per_request = cpu
                    .filter(|_| c.requests > 0)
                    .map(|ns| ns as f64 / 1e3 / c.requests as f64);
                out.push(c);
            }
        }
    }
    drop(ext_proc);
    drop(floor);
    drop(floor_calls);
    drop(floor_shared);
    drop(kvoy);
    drop(plain);
    Ok(OverheadReport {
        tool: "kvoy-bench overhead".into(),
        envoy: envoy_version,
        workers: grid.workers,
        backends: addrs.len(),
        rounds: grid.rounds.max(1),
        stages: grid.stages,
        host_calls: grid.host_calls,
        cells: out,
    })
}

/// `Envoy 1.40.0` from `envoy --version`'s `<path> version: <sha>/1.40.0/Clean/RELEASE/BoringSSL`.
fn envoy_release(version: &str) -> String {
    version
        .rsplit("version: ")
        .next()
        .and_then(|v| v.split('/').nth(1))
        .filter(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map_or_else(|| version.to_owned(), |v| format!("Envoy {v}"))
}

fn cell_of(
    prompt_tokens: u32,
    body_bytes: usize,
    concurrency: usize,
    proxy: &str,
    m: client::Measured,
) -> Cell {
    let mut ms: Vec<f64> = m.latencies.iter().map(|s| s * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let mean = if ms.is_empty() {
        0.0
    } else {
        ms.iter().sum::<f64>() / ms.len() as f64
    };
    Cell {
        prompt_tokens,
        body_bytes,
        concurrency,
        proxy: proxy.to_owned(),
        requests: ms.len(),
        errors: m.errors,
        first_error: m.first_error,
        latency: Latency {
            p50_ms: percentile(&ms, 0.5),
            p90_ms: percentile(&ms, 0.9),
            p99_ms: percentile(&ms, 0.99),
            mean_ms: mean,
        },
        requests_per_s: if m.wall > 0.0 {
            ms.len() as f64 / m.wall
        } else {
            0.0
        },
        envoy_cpu_us_per_request: None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_release_is_read_from_the_version_line() {
        assert_eq!(
            envoy_release("envoy  version: 9e55/1.40.0/Clean/RELEASE/BoringSSL"),
            "Envoy 1.40.0"
        );
        assert_eq!(
            envoy_release("/usr/bin/envoy  version: 9e55/1.40.0/Clean/RELEASE/BoringSSL"),
            "Envoy 1.40.0"
        );
        assert_eq!(envoy_release("odd"), "odd");
    }

    #[test]
    fn a_backend_that_did_not_get_what_the_picker_sent_fails_the_check() {
        let addrs: Vec<SocketAddr> = vec![
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ];
        let before = Tally {
            received: vec![5, 5],
            sent: vec![3, 3],
        };
        let good = Tally {
            received: vec![7, 6],
            sent: vec![5, 4],
        };
        assert_eq!(good.check(&before, 3, 3, &addrs), Ok(()));
        let wrong = Tally {
            received: vec![8, 5],
            sent: vec![5, 4],
        };
        assert!(wrong
            .check(&before, 3, 3, &addrs)
            .unwrap_err()
            .contains("127.0.0.1:1"));
        // Answered, but nothing went through the picker.
        let idle = Tally {
            received: vec![5, 5],
            sent: vec![3, 3],
        };
        assert!(idle.check(&before, 3, 3, &addrs).is_err());
        // Nothing answered and nothing routed (Envoy answered 503 to all): still a failure.
        assert!(idle.check(&before, 0, 800, &addrs).is_err());
        assert_eq!(idle.check(&before, 0, 0, &addrs), Ok(()));
    }

    #[test]
    fn prompts_have_the_asked_size_and_differ_from_the_first_block() {
        let p = Prompts::new(1000, 7);
        let (a, b) = (p.body(1), p.body(2));
        let v: serde_json::Value = serde_json::from_slice(&a).unwrap();
        let prompt = v["prompt"].as_str().unwrap();
        assert_eq!(prompt.len(), 4000);
        assert!(prompt
            .bytes()
            .all(|c| c == b' ' || c.is_ascii_hexdigit() || c.is_ascii_lowercase()));
        assert_ne!(a[..80], b[..80]);
        assert_eq!(a.len(), b.len());
        // Same seed, same text.
        assert_eq!(Prompts::new(1000, 7).body(1), a);
    }
}
