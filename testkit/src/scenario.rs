//! Request patterns that the real-Envoy end-to-end tests and kvoy-local's tests both run, so
//! that the two proxies meet the same requests at the same moments: a burst of same-prefix
//! requests ([`same_prefix_burst`]) and admission control's two timed runs
//! ([`priority_order`], [`held_past_ttl`]). They only send and collect; each test asserts on
//! what they return.

use std::net::SocketAddr;
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::echo::DELAY_HEADER;
use crate::http::{self, HttpError, Response};

const CHAT_PATH: &str = "/v1/chat/completions";
/// Bounds each request of the admission runs (held ones wait for a slot).
const HELD_TIMEOUT: Duration = Duration::from_secs(60);
/// Bounds the wait for each admission run's completion.
const COMPLETION_WAIT: Duration = Duration::from_secs(30);

/// `n` chat completions for `model` with the same `system` prompt (and a 1 KB question each,
/// about 260 tokens: the prefix holder's queued prefill soon outweighs computing the prefix
/// again elsewhere), sent to `listen` at once (a barrier releases them together), each asking
/// an echo backend for a 300 ms delay. Their responses, in the order they were numbered.
pub fn same_prefix_burst(
    listen: SocketAddr,
    model: &str,
    system: &str,
    n: usize,
    timeout: Duration,
) -> Vec<Result<Response, HttpError>> {
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            let question = format!("burst question {i} {}", "detail ".repeat(146));
            let body = crate::requests::chat_body(model, system, &question);
            std::thread::spawn(move || {
                barrier.wait();
                http::post_json(listen, CHAT_PATH, &[(DELAY_HEADER, "300")], &body, timeout)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join().unwrap_or_else(|_| {
                Err(HttpError::Io(std::io::Error::other(
                    "the client thread panicked",
                )))
            })
        })
        .collect()
}

/// How one request of an admission run ended: its label, status, `x-kvoy-dropped-reason`
/// header, and when it ended since the run began.
pub type Finished = (&'static str, u16, Option<String>, Duration);

/// What [`priority_order`] saw: the sheddable request's answer, and the four held or running
/// requests' ends in the order they ended.
#[derive(Debug)]
pub struct PriorityRun {
    pub shed: Response,
    pub done: Vec<Finished>,
}

/// Sends the admission runs' requests in the background, each reporting its end.
struct AdmissionClient {
    listen: SocketAddr,
    model: String,
    start: Instant,
    tx: mpsc::Sender<Result<Finished, HttpError>>,
    rx: mpsc::Receiver<Result<Finished, HttpError>>,
}

impl AdmissionClient {
    fn new(listen: SocketAddr, model: &str) -> AdmissionClient {
        let (tx, rx) = mpsc::channel();
        AdmissionClient {
            listen,
            model: model.to_owned(),
            start: Instant::now(),
            tx,
            rx,
        }
    }

    /// Sends a request of `objective` (and fairness id `label`) asking for `tokens` tokens.
    fn spawn(&self, label: &'static str, objective: &'static str, tokens: u32) {
        let (tx, listen, start) = (self.tx.clone(), self.listen, self.start);
        let body = admission_body(&self.model, tokens);
        std::thread::spawn(move || {
            let headers = [
                ("x-gateway-inference-objective", objective),
                ("x-gateway-inference-fairness-id", label),
            ];
            let finished =
                http::post_json(listen, CHAT_PATH, &headers, &body, HELD_TIMEOUT).map(|r| {
                    let reason = r.header("x-kvoy-dropped-reason").map(str::to_owned);
                    (label, r.status, reason, start.elapsed())
                });
            let _ = tx.send(finished);
        });
    }

    /// The next request's end.
    fn next(&self) -> anyhow::Result<Finished> {
        Ok(self.rx.recv_timeout(COMPLETION_WAIT)??)
    }
}

/// A chat completion for `model` asking for `tokens` tokens (kvoy-sim takes about 7 ms a token
/// at real speed).
fn admission_body(model: &str, tokens: u32) -> Vec<u8> {
    json!({"model": model, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hello there"}]})
    .to_string()
    .into_bytes()
}

fn pause(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

/// The admission filter's configuration the admission runs are written for: one endpoint, at
/// most 2 requests in flight to it, objectives interactive 10, batch 0 and scavenger -1
/// (sheddable), a queue TTL of 1.5 s.
pub fn admission_config() -> String {
    json!({"endpoints": 1, "tick_ms": 10, "flow": {
        "saturation": {"max_inflight_per_endpoint": 2},
        "objectives": {"interactive": 10, "batch": 0, "scavenger": -1},
        "queue_ttl_ms": 1500}})
    .to_string()
}

/// Against a proxy with [`admission_config`] in front of one kvoy-sim at real speed: two batch requests take both slots and end one after
/// the other (~0.7 s, ~1.4 s); then a batch request and, 50 ms later, an interactive one wait
/// (the interactive one must go first); then a sheddable (scavenger) request, answered at once.
pub fn priority_order(listen: SocketAddr, model: &str) -> anyhow::Result<PriorityRun> {
    let client = AdmissionClient::new(listen, model);
    client.spawn("batch-running-1", "batch", 100);
    client.spawn("batch-running-2", "batch", 200);
    pause(150);
    client.spawn("batch-held", "batch", 2);
    pause(50);
    client.spawn("interactive-held", "interactive", 2);
    pause(50);
    let shed = http::post_json(
        listen,
        CHAT_PATH,
        &[("x-gateway-inference-objective", "scavenger")],
        &admission_body(model, 2),
        Duration::from_secs(10),
    )?;
    let done = (0..4)
        .map(|_| client.next())
        .collect::<anyhow::Result<_>>()?;
    Ok(PriorityRun { shed, done })
}

/// Against the proxy of [`priority_order`]: one batch request held behind two long ones for
/// longer than a queue TTL of 1.5 s. How the held one ended (its time since this run began).
pub fn held_past_ttl(listen: SocketAddr, model: &str) -> anyhow::Result<Finished> {
    let client = AdmissionClient::new(listen, model);
    client.spawn("long-1", "batch", 300);
    client.spawn("long-2", "batch", 300);
    pause(150);
    client.spawn("expires", "batch", 2);
    let mut expired = None;
    for _ in 0..3 {
        let d = client.next()?;
        if d.0 == "expires" {
            expired = Some(d);
        }
    }
    expired.ok_or_else(|| anyhow::anyhow!("the held request did not end"))
}
