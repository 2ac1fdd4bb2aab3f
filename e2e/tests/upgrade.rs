//! End to end, issue 38's upgrade under load: steady traffic over HTTP/1.1 and HTTP/2,
//! streaming and not, through two real Envoys (the combined `kvoy` filter, `--concurrency 2`)
//! in front of four kvoy-sim simulators (KV events with replay) and two kvoy-aggregator
//! processes that both filters name (`failover_clusters`), while, phase by phase:
//!
//! 1. **steady**;
//! 2. **aggregator killed**: replica A gets SIGKILL, then comes back on its port (it answers
//!    503 `catching-up` until it has replayed the servers' buffered KV events);
//! 3. **Envoy replaced**: a new Envoy from the same bootstrap starts, the old one drains
//!    (`POST /drain_listeners?graceful`, as a pod's preStop does) with streams in flight,
//!    leaves the rotation for the newcomer, and gets SIGTERM once its last stream is done; the
//!    newcomer's index comes from the aggregator;
//! 4. **module swapped**: the first Envoy takes a new `kvoy.wasm` over LDS (a listener update,
//!    as Istio or Envoy Gateway deliver one), then a module that does not load, which Envoy
//!    refuses while the working one keeps serving;
//! 5. **steady again**.
//!
//! Every request is counted in the phase it started in, and one that is not answered 200 in
//! full (a stream must end with `[DONE]`) fails the test. Each phase's prefix-cache hit rate
//! (the simulators' `cached_tokens` over `prompt_tokens`) must stay within 2 points of the
//! steady phase's across the aggregator's loss and at 90% of it across the Envoy replacement
//! and the module swap. A table of the phases is printed (`-- --nocapture`).
//!
//! Needs `envoy` on PATH, the built wasm filters and the `kvoy-aggregator` binary beside this
//! test's (`make test` provides all three).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::replica::{agent_turn, Replica};
use common::MODEL;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

use kvoy_aggregator::local::aggregator_yaml;
use kvoy_sim::fleet::PublishingSim;
use kvoy_testkit::{free_port, http, wait_for, PoolEndpoint, Stack, StackConfig};

const NAME: &str = "upgrade";
/// Client threads, each running one conversation at a time.
const CLIENTS: usize = 12;
const TURNS: usize = 6;
/// Requests each phase runs at least.
const PER_PHASE: usize = 1_100;

const PHASES: [&str; 5] = [
    "steady",
    "aggregator A killed, restarted",
    "Envoy drained and replaced",
    "module swapped over LDS",
    "steady again",
];

/// What the requests that started in one phase saw.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    requests: usize,
    failed: usize,
    h2: usize,
    streamed: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Later turns, and those that reached their conversation's previous server.
    turns: usize,
    kept: usize,
}

impl Tally {
    fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// One request's answer: status, the server that answered, the body.
struct Answer {
    status: u16,
    served_by: Option<String>,
    body: Vec<u8>,
}

/// One POST over HTTP/2 (h2c, prior knowledge) on a connection of its own.
async fn post_h2(addr: SocketAddr, body: Vec<u8>) -> Result<Answer, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
    let conn = tokio::spawn(conn);
    let request = hyper::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let status = response.status().as_u16();
    let served_by = response
        .headers()
        .get(kvoy_testkit::SERVED_BY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("answer cut off: {e}"))?
        .to_bytes()
        .to_vec();
    drop(sender);
    conn.abort();
    Ok(Answer {
        status,
        served_by,
        body,
    })
}

/// The `usage` of a complete answer (the last chunk's, for a stream that ended with
/// `[DONE]`); `None` for an incomplete one.
fn usage(body: &[u8], streamed: bool) -> Option<serde_json::Value> {
    if !streamed {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        return Some(v["usage"].clone());
    }
    let text = String::from_utf8_lossy(body);
    let data = http::sse_data(&text);
    if data.last() != Some(&"[DONE]") {
        return None;
    }
    data.iter()
        .rev()
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .map(|v| v["usage"].clone())
}

/// The traffic: `CLIENTS` threads running conversations, each turn to the rotation's next proxy,
/// a quarter each HTTP/1.1 and HTTP/2, streaming and not; tallied by the phase a request
/// started in.
struct Load {
    rotation: Arc<Mutex<Vec<SocketAddr>>>,
    phase: Arc<AtomicUsize>,
    tallies: Arc<Mutex<Vec<Tally>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(rotation: Vec<SocketAddr>) -> Load {
        let rotation = Arc::new(Mutex::new(rotation));
        let phase = Arc::new(AtomicUsize::new(0));
        let tallies = Arc::new(Mutex::new(vec![Tally::default(); PHASES.len()]));
        let stop = Arc::new(AtomicBool::new(false));
        let next = Arc::new(AtomicUsize::new(0));
        let threads = (0..CLIENTS)
            .map(|_| {
                let (rotation, phase, tallies, stop, next) = (
                    rotation.clone(),
                    phase.clone(),
                    tallies.clone(),
                    stop.clone(),
                    next.clone(),
                );
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    while !stop.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let mut previous: Option<String> = None;
                        for t in 0..TURNS {
                            let proxy = {
                                let r = rotation.lock().unwrap();
                                r[(i + t) % r.len()]
                            };
                            let kind = (i + t) % 4;
                            let (h2, streamed) = (kind >= 2, kind % 2 == 1);
                            let body = agent_turn(MODEL, i, t, streamed);
                            let at = phase.load(Ordering::Relaxed);
                            let answer = if h2 {
                                rt.block_on(post_h2(proxy, body))
                            } else {
                                http::post_json(
                                    proxy,
                                    "/v1/chat/completions",
                                    &[],
                                    &body,
                                    common::TIMEOUT,
                                )
                                .map(|r| Answer {
                                    status: r.status,
                                    served_by: r
                                        .header(kvoy_testkit::SERVED_BY_HEADER)
                                        .map(str::to_owned),
                                    body: r.body,
                                })
                                .map_err(|e| format!("{e:#}"))
                            };
                            let used = match &answer {
                                Ok(a) if a.status == 200 => usage(&a.body, streamed),
                                _ => None,
                            };
                            let mut tallies = tallies.lock().unwrap();
                            let tally = &mut tallies[at];
                            tally.requests += 1;
                            tally.h2 += usize::from(h2);
                            tally.streamed += usize::from(streamed);
                            let Some(used) = used else {
                                tally.failed += 1;
                                match &answer {
                                    Ok(a) => eprintln!(
                                        "[{NAME}] {} in phase {at}: status {} {}",
                                        if h2 { "h2" } else { "h1" },
                                        a.status,
                                        String::from_utf8_lossy(&a.body)
                                    ),
                                    Err(e) => eprintln!("[{NAME}] phase {at}: {e}"),
                                }
                                previous = None;
                                continue;
                            };
                            tally.prompt_tokens += used["prompt_tokens"].as_u64().unwrap_or(0);
                            tally.cached_tokens += used["prompt_tokens_details"]["cached_tokens"]
                                .as_u64()
                                .unwrap_or(0);
                            let served = answer.ok().and_then(|a| a.served_by);
                            if let (Some(p), Some(s)) = (&previous, &served) {
                                tally.turns += 1;
                                tally.kept += usize::from(p == s);
                            }
                            previous = served;
                        }
                    }
                })
            })
            .collect();
        Load {
            rotation,
            phase,
            tallies,
            stop,
            threads,
        }
    }

    fn requests(&self, phase: usize) -> usize {
        self.tallies.lock().unwrap()[phase].requests
    }

    /// Waits until `phase` has run [`PER_PHASE`] requests, then starts the next phase.
    fn finish(&self, phase: usize) {
        wait_for(PHASES[phase], Duration::from_secs(300), || {
            self.requests(phase) >= PER_PHASE
        });
        // The last phase keeps what starts before the clients stop.
        self.phase
            .store((phase + 1).min(PHASES.len() - 1), Ordering::Relaxed);
    }

    fn set_rotation(&self, proxies: Vec<SocketAddr>) {
        *self.rotation.lock().unwrap() = proxies;
    }

    fn stop(mut self) -> Vec<Tally> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        self.tallies.lock().unwrap().clone()
    }
}

/// `kvoy.wasm` with a custom section appended: the same filter as another module (a new code
/// hash, so Envoy starts new VMs for it), as a rebuilt release would be.
fn next_module(wasm: &[u8]) -> Vec<u8> {
    let name = b"kvoy-upgrade";
    let payload = b"the next release";
    let mut out = wasm.to_vec();
    out.push(0); // custom section
    out.push((1 + name.len() + payload.len()) as u8);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(payload);
    out
}

/// Active downstream requests on `stack`'s listener.
fn active_requests(stack: &Stack) -> u64 {
    stack
        .admin_stats("http.kvoy.downstream_rq_active")
        .map(|s| s.values().sum())
        .unwrap_or(0)
}

#[test]
fn an_upgrade_under_load_loses_no_request_and_keeps_the_routing_state() {
    let sims: Vec<PublishingSim> = (0..4)
        .map(|_| PublishingSim::start(&["--model", MODEL, "--speedup", "10"], true).unwrap())
        .collect();
    let run_dir = common::run_dir(NAME);
    let config = run_dir.join("pool.yaml");
    let port = || SocketAddr::from(([127, 0, 0, 1], free_port().unwrap()));
    let (listen_a, listen_b) = (port(), port());
    // Each replica reads the other's decisions as it starts.
    let settings = format!("scrape_interval_ms: 50\npeers: ['{listen_a}', '{listen_b}']\n");
    std::fs::write(
        &config,
        aggregator_yaml(&settings, &common::followed(&sims, MODEL, true)),
    )
    .unwrap();
    let log = |n: &str| run_dir.join(format!("aggregator-{n}.log"));
    let mut a = Replica::start(&config, listen_a, &log("a"));
    let b = Replica::start(&config, listen_b, &log("b"));
    let endpoints: Vec<PoolEndpoint> = sims
        .iter()
        .map(|s| PoolEndpoint::new(s.addr, &[MODEL]))
        .collect();
    // The modules the first Envoy will be given: this build's, the next release, a broken one.
    let wasm_dir = run_dir.join("wasm");
    std::fs::create_dir_all(&wasm_dir).unwrap();
    for entry in std::fs::read_dir(kvoy_testkit::wasm_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "wasm") {
            std::fs::copy(&path, wasm_dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    let built = std::fs::read(wasm_dir.join("kvoy.wasm")).unwrap();
    std::fs::write(wasm_dir.join("kvoy-next.wasm"), next_module(&built)).unwrap();
    std::fs::write(wasm_dir.join("kvoy-broken.wasm"), &built[..built.len() / 2]).unwrap();
    let proxy_config = |name: &str, lds: bool, dir: &Path| {
        let mut c = StackConfig::new(endpoints.clone(), run_dir.join(name));
        c.aggregator = Some(listen_a);
        c.aggregator_b = Some(listen_b);
        c.listeners_over_lds = lds;
        c.wasm_dir = dir.to_path_buf();
        c
    };
    let start =
        |c: &StackConfig| Stack::start(c).unwrap_or_else(|e| panic!("[{NAME}] Envoy: {e:#}"));
    let first_config = proxy_config("proxy-1", true, &wasm_dir);
    let mut first = start(&first_config);
    let second = start(&proxy_config("proxy-2", false, &kvoy_testkit::wasm_dir()));
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let load = Load::start(vec![first.listen, second.listen]);

    // 1. Steady.
    load.finish(0);
    // 2. Replica A dies mid-traffic and comes back.
    std::thread::sleep(Duration::from_millis(300));
    a.kill();
    wait_for("traffic without A", Duration::from_secs(120), || {
        load.requests(1) >= PER_PHASE / 2
    });
    a = Replica::start(&config, listen_a, &log("a-restarted"));
    load.finish(1);
    // 3. A new Envoy joins, the second leaves the rotation, drains and stops.
    let third = start(&proxy_config("proxy-3", false, &kvoy_testkit::wasm_dir()));
    // The drain starts while the second Envoy still serves: its streams in flight must end
    // well, and the requests it takes meanwhile too (they are told to close the connection).
    let in_flight = active_requests(&second);
    let drain = http::send(
        second.admin,
        "POST",
        "/drain_listeners?graceful",
        &[],
        b"",
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(drain.status, 200, "{}", drain.text());
    load.set_rotation(vec![first.listen, third.listen]);
    wait_for(
        "the old Envoy's streams done",
        Duration::from_secs(60),
        || active_requests(&second) == 0,
    );
    drop(second);
    load.finish(2);
    // 4. The first Envoy takes the next module over LDS, then refuses a broken one.
    let mut next = first_config.clone();
    next.filter_module = Some("kvoy-next.wasm".into());
    first.reconfigure(&next).unwrap();
    let mut broken = first_config.clone();
    broken.filter_module = Some("kvoy-broken.wasm".into());
    broken.ready_timeout = Duration::from_secs(3);
    assert!(
        first.reconfigure(&broken).is_err(),
        "Envoy took a module that does not load"
    );
    let rejected: u64 = first
        .admin_stats("listener_manager.lds.update_rejected")
        .unwrap()
        .values()
        .sum();
    load.finish(3);
    // 5. Steady again.
    load.finish(4);
    let tallies = load.stop();

    for (name, stack) in [("first", &first), ("third", &third)] {
        let stats = stack.stats("kvoy_prefix_affinity").unwrap();
        let pick: Vec<String> = stats
            .iter()
            .filter(|(k, _)| {
                [
                    "relay",
                    "removed",
                    "snapshot",
                    "pool_updates",
                    "remote_applied",
                ]
                .iter()
                .any(|w| k.contains(w))
            })
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        eprintln!("[{NAME}] {name}: {}", pick.join(" "));
    }
    let total: usize = tallies.iter().map(|t| t.requests).sum();
    eprintln!(
        "[{NAME}] {total} requests in {:.0} s; the drained Envoy had {in_flight} in flight; LDS updates rejected: {rejected}",
        started.elapsed().as_secs_f64()
    );
    eprintln!(
        "| phase | requests | HTTP/2 | streamed | failed | hit rate | turns on their server |"
    );
    eprintln!("|---|---|---|---|---|---|---|");
    for (name, t) in PHASES.iter().zip(&tallies) {
        eprintln!(
            "| {name} | {} | {} | {} | {} | {:.3} | {}/{} |",
            t.requests,
            t.h2,
            t.streamed,
            t.failed,
            t.hit_rate(),
            t.kept,
            t.turns
        );
    }
    assert!(total >= 5_000, "{total} requests");
    for (name, t) in PHASES.iter().zip(&tallies) {
        assert_eq!(t.failed, 0, "{name}: {t:?}");
        assert!(t.h2 > 0 && t.streamed > 0, "{name}: {t:?}");
    }
    assert!(
        rejected >= 1,
        "the broken module's listener was not refused"
    );
    let steady = tallies[0].hit_rate();
    assert!(
        tallies[1].hit_rate() >= steady - 0.02,
        "aggregator killed: {:.3} against {steady:.3}",
        tallies[1].hit_rate()
    );
    for p in [2, 3] {
        assert!(
            tallies[p].hit_rate() >= 0.9 * steady,
            "{}: {:.3} against {steady:.3}",
            PHASES[p],
            tallies[p].hit_rate()
        );
    }
    drop(first);
    drop(third);
    drop(a);
    drop(b);
}
