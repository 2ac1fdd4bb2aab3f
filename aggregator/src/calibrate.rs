//! `kvoy-aggregator calibrate`: measures a live server's prefill rate, for the router's
//! `prefill_tokens_per_s`.
//!
//! It sends prompts of growing length (random words, a fresh nonce first, so nothing is in the
//! prefix cache), one at a time, each with `max_tokens: 1`, streaming. For each it takes the
//! server's own prefill time (`vllm:request_prefill_time_seconds`, first scheduled to first
//! token: no HTTP, tokenization or queueing) when the server exports it, else the TTFT the
//! client sees (then only the fastest of each length's `--repeat` answers, since delays on the
//! way only ever add), and the prompt tokens the server computed. Then it fits, by least squares,
//!
//! ```text
//! prefill time = fixed + tokens / rate + attention · tokens²
//! ```
//!
//! `rate` is the linear layers' rate (what a very short prompt sees per token); the attention
//! term grows with the context, so a long prompt costs more per token than a short one. What
//! the router divides pending prompt tokens by is the rate at a typical prompt length
//! (`--typical-tokens`, 2,048 by default): `typical / (t(typical) - fixed)`, which it prints as
//! the configuration line. The straight-line fit is printed too, for comparison.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvoy_aggregator::calibrate::CalibrateError> {
//! use kvoy_aggregator::calibrate::{self, Options};
//! let options = Options::new("http://127.0.0.1:8000", "llama")?;
//! let calibration = calibrate::run(&options, &mut |m| println!("{m:?}")).await?;
//! print!("{}", calibration.report());
//! # Ok(()) }
//! ```

mod client;
pub mod fit;

use kvoy_shared::protocol::MODELS_PATH;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvoy_shared::Rng;

pub use client::Server;
pub use fit::{Fit, LinearFit};

use crate::prefill::three_digits;
use crate::prom::{self, ServerMetrics};

/// Why a calibration could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error("--url {0:?}: expected http://host:port (plain HTTP; no https)")]
    BadUrl(String),
    #[error("cannot resolve {host}: {reason}")]
    Resolve { host: String, reason: String },
    #[error("{url} is unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{what}: {reason}")]
    Http { what: String, reason: String },
    #[error("{what} answered status {status}: {body}")]
    Status {
        what: String,
        status: u16,
        body: String,
    },
    #[error("{what} timed out after {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("the server does not serve model {model:?}; it serves: {}", available.join(", "))]
    ModelMissing {
        model: String,
        available: Vec<String>,
    },
    #[error("{what}: {reason}")]
    BadAnswer { what: String, reason: String },
    #[error("{what} failed in its stream: {message}")]
    Refused { what: String, message: String },
    #[error("invalid options: {0}")]
    BadOptions(String),
    #[error("only {0} prompt lengths could be measured; at least 3 are needed (is --max-tokens above the server's context?)")]
    TooFewLengths(usize),
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct Options {
    pub server: Server,
    pub model: String,
    /// Target prompt lengths in tokens, in the order sent (growing).
    pub lengths: Vec<usize>,
    /// Rounds over `lengths`.
    pub repeat: usize,
    /// The prompt length the printed rate is for.
    pub typical_tokens: usize,
    /// Per request.
    pub timeout: Duration,
    /// Path of the server's Prometheus metrics (empty: time with the client's TTFT only).
    pub metrics_path: String,
    pub seed: u64,
}

impl Options {
    /// The defaults for `url` and `model`: 256 to 16,384 tokens (doubling), 3 rounds,
    /// typical length 2,048, 300 s per request, metrics at `/metrics`.
    pub fn new(url: &str, model: &str) -> Result<Options, CalibrateError> {
        Ok(Options {
            server: Server::parse(url)?,
            model: model.to_owned(),
            lengths: doubling(256, 16_384),
            repeat: 3,
            typical_tokens: 2048,
            timeout: Duration::from_secs(300),
            metrics_path: "/metrics".to_owned(),
            seed: 1,
        })
    }

    fn check(&self) -> Result<(), CalibrateError> {
        if self.model.is_empty() {
            return Err(CalibrateError::BadOptions("--model is empty".into()));
        }
        if self.lengths.len() < 3 || self.lengths.iter().any(|&n| n < 16) {
            return Err(CalibrateError::BadOptions(
                "at least 3 prompt lengths of 16 tokens or more are needed".into(),
            ));
        }
        if self.repeat == 0 || self.typical_tokens == 0 {
            return Err(CalibrateError::BadOptions(
                "--repeat and --typical-tokens must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// `from, 2·from, ...` up to `to`, and `to` itself.
pub fn doubling(from: usize, to: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut n = from.max(1);
    while n < to {
        v.push(n);
        n = n.saturating_mul(2);
    }
    v.push(to);
    v
}

/// One request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measurement {
    pub target_tokens: usize,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// Prompt tokens the server computed (cached ones excluded).
    pub computed_tokens: u64,
    /// The server's prefill time for this request, when it exports one.
    pub server_prefill: Option<Duration>,
    /// Request sent to first token received.
    pub ttft: Duration,
}

/// Where the fitted times come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// `vllm:request_prefill_time_seconds`.
    ServerPrefill,
    /// The client's time to first token (queueing, HTTP and tokenization included).
    ClientTtft,
}

/// A finished calibration.
#[derive(Clone, Debug)]
pub struct Calibration {
    pub server: Server,
    pub address: SocketAddr,
    pub model: String,
    pub measurements: Vec<Measurement>,
    pub timing: Timing,
    pub fit: Fit,
    /// Lengths refused by the server (over its context), not measured.
    pub refused: Vec<usize>,
    /// Why the server's own times were not used, when they were not.
    pub note: Option<String>,
}

/// The prefill histogram and token counters of one scrape.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    prefill: Option<(f64, f64)>,
    computed: Option<f64>,
    hits: Option<f64>,
}

impl Counters {
    fn of(m: &ServerMetrics) -> Self {
        Counters {
            prefill: m.prefill_time.map(|h| (h.sum, h.count)),
            computed: m.prefill_computed_tokens.map(|h| h.sum),
            hits: m.prefix_cache_hits,
        }
    }
}

async fn scrape(options: &Options) -> Option<Counters> {
    if options.metrics_path.is_empty() {
        return None;
    }
    let what = format!("GET {}", options.metrics_path);
    let body = options
        .server
        .get(&options.metrics_path, &what, Duration::from_secs(10))
        .await
        .ok()?;
    let text = std::str::from_utf8(&body).ok()?;
    prom::parse_server_metrics(text)
        .ok()
        .map(|m| Counters::of(&m))
}

/// Random lowercase words, starting with a nonce: no block of it is in any cache.
fn prompt_text(rng: &mut Rng, chars: usize) -> String {
    let mut s = String::with_capacity(chars + 16);
    for _ in 0..12 {
        s.push(char::from(b'a' + rng.below(26) as u8));
    }
    while s.len() < chars {
        s.push(' ');
        for _ in 0..2 + rng.below(7) {
            s.push(char::from(b'a' + rng.below(26) as u8));
        }
    }
    s
}

/// Checks that the server serves `options.model` (`GET /v1/models`).
async fn check_model(options: &Options) -> Result<(), CalibrateError> {
    let what = "GET /v1/models".to_owned();
    let body = options
        .server
        .get(&options.server.path(MODELS_PATH), &what, options.timeout)
        .await?;
    let v: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| CalibrateError::BadAnswer {
            what: what.clone(),
            reason: format!("not JSON: {e}"),
        })?;
    let available: Vec<String> = v["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if available.contains(&options.model) {
        Ok(())
    } else {
        Err(CalibrateError::ModelMissing {
            model: options.model.clone(),
            available,
        })
    }
}

/// Runs the calibration (see the module doc); `progress` hears every measurement.
pub async fn run(
    options: &Options,
    progress: &mut dyn FnMut(&Measurement),
) -> Result<Calibration, CalibrateError> {
    options.check()?;
    let address = options.server.resolve().await?;
    check_model(options).await?;
    let mut rng = Rng::new(options.seed);
    let mut chars_per_token = 4.0f64;
    let mut refused = Vec::new();
    let mut measurements = Vec::new();
    let mut note = None;
    let mut max_ok = usize::MAX;
    // a first, unmeasured request: whatever a server does the first time, it does now
    let warm = options.lengths[0];
    let text = prompt_text(&mut rng, warm * 4);
    client::complete(options, address, &text).await?;
    for _ in 0..options.repeat {
        for &target in &options.lengths {
            if target > max_ok {
                continue;
            }
            let text = prompt_text(&mut rng, (target as f64 * chars_per_token) as usize);
            let before = scrape(options).await;
            let answer = match client::complete(options, address, &text).await {
                Ok(a) => a,
                Err(
                    CalibrateError::Status { status: 400, .. } | CalibrateError::Refused { .. },
                ) if target > options.lengths[0] => {
                    // over the server's context: longer ones will be too
                    max_ok = target - 1;
                    refused.push(target);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if answer.prompt_tokens > 0 {
                chars_per_token = text.len() as f64 / answer.prompt_tokens as f64;
            }
            let after = settle(options, before).await;
            let mut server_prefill = None;
            let mut computed = answer.prompt_tokens - answer.cached_tokens.unwrap_or(0);
            if let (Some(b), Some(a)) = (before, after) {
                if let (Some((bs, bc)), Some((asum, ac))) = (b.prefill, a.prefill) {
                    if (ac - bc - 1.0).abs() < 1e-9 && asum >= bs {
                        server_prefill = Some(Duration::from_secs_f64(asum - bs));
                    } else if note.is_none() {
                        note = Some(format!(
                            "{} requests finished on the server during one of ours: other traffic; \
                             timing with the client's TTFT",
                            ac - bc
                        ));
                    }
                }
                if let (Some(bk), Some(ak)) = (b.computed, a.computed) {
                    computed = (ak - bk).max(0.0) as u64;
                } else if let (None, Some(bh), Some(ah)) = (answer.cached_tokens, b.hits, a.hits) {
                    computed = answer
                        .prompt_tokens
                        .saturating_sub((ah - bh).max(0.0) as u64);
                }
            }
            let m = Measurement {
                target_tokens: target,
                prompt_tokens: answer.prompt_tokens,
                computed_tokens: computed,
                server_prefill,
                ttft: answer.ttft,
            };
            progress(&m);
            measurements.push(m);
        }
    }
    let server_times = measurements.iter().all(|m| m.server_prefill.is_some());
    if !server_times && note.is_none() {
        note = Some(if options.metrics_path.is_empty() {
            "metrics not read (--metrics-path \"\"): timing with the client's TTFT".to_owned()
        } else {
            format!(
                "no vllm:request_prefill_time_seconds at {}: timing with the client's TTFT",
                options.metrics_path
            )
        });
    }
    let timing = if server_times {
        Timing::ServerPrefill
    } else {
        Timing::ClientTtft
    };
    let points: Vec<(f64, f64)> = match timing {
        Timing::ServerPrefill => measurements
            .iter()
            .map(|m| {
                let t = m.server_prefill.unwrap_or(m.ttft);
                (m.computed_tokens as f64, t.as_secs_f64())
            })
            .collect(),
        // A client's TTFT carries the network and the machine's scheduling delays, which only
        // ever add: the fastest answer of each length is the one closest to the prefill.
        Timing::ClientTtft => fastest_per_length(&measurements),
    };
    let mut distinct: Vec<u64> = measurements.iter().map(|m| m.computed_tokens).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let fit = fit::fit(&points, options.typical_tokens as f64)
        .ok_or(CalibrateError::TooFewLengths(distinct.len()))?;
    Ok(Calibration {
        server: options.server.clone(),
        address,
        model: options.model.clone(),
        measurements,
        timing,
        fit,
        refused,
        note,
    })
}

/// For each target length, the (computed tokens, seconds) of its fastest measurement.
fn fastest_per_length(measurements: &[Measurement]) -> Vec<(f64, f64)> {
    let mut fastest: Vec<&Measurement> = Vec::new();
    for m in measurements {
        match fastest
            .iter_mut()
            .find(|f| f.target_tokens == m.target_tokens)
        {
            Some(f) if m.ttft < f.ttft => *f = m,
            Some(_) => {}
            None => fastest.push(m),
        }
    }
    fastest
        .iter()
        .map(|m| (m.computed_tokens as f64, m.ttft.as_secs_f64()))
        .collect()
}

/// The metrics after a request: scraped until the request shows in the prefill histogram
/// (servers record it a moment after answering), at most 2 s.
async fn settle(options: &Options, before: Option<Counters>) -> Option<Counters> {
    let before_count = before.and_then(|b| b.prefill).map(|p| p.1)?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let now = scrape(options).await;
        let done = now
            .and_then(|c| c.prefill)
            .is_some_and(|p| p.1 > before_count);
        if done || Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `12345.6` as `12,346`.
fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl Calibration {
    /// The rate to configure: the fit at the typical length, 3 significant digits.
    pub fn configured_rate(&self) -> f64 {
        three_digits(self.fit.rate_at_typical)
    }

    /// The summary printed after the table.
    pub fn report(&self) -> String {
        let f = &self.fit;
        let mut out = String::new();
        let timing = match self.timing {
            Timing::ServerPrefill => {
                "the server's prefill time (vllm:request_prefill_time_seconds)"
            }
            Timing::ClientTtft => "the client's time to first token",
        };
        let (lo, hi) = self.measurements.iter().fold((u64::MAX, 0), |(lo, hi), m| {
            (lo.min(m.computed_tokens), hi.max(m.computed_tokens))
        });
        let _ = writeln!(
            out,
            "fit over {} requests of {}..{} computed tokens, timed by {timing}:",
            self.measurements.len(),
            thousands(lo as f64),
            thousands(hi as f64),
        );
        if let Some(note) = &self.note {
            let _ = writeln!(out, "  note: {note}");
        }
        if !self.refused.is_empty() {
            let _ = writeln!(
                out,
                "  note: the server refused prompts of {:?} tokens (over its context)",
                self.refused
            );
        }
        let _ = writeln!(
            out,
            "  prefill time = {:.1} ms + tokens / {} tokens/s + {:.3e} s x tokens^2",
            f.fixed_s * 1e3,
            thousands(f.rate),
            f.attention_s
        );
        let per_token = |n: f64| 1.0 / f.rate + f.attention_s * n;
        let _ = writeln!(
            out,
            "  linear layers {} tokens/s; attention makes a {}-token prompt {:.2}x as slow per token as a {}-token one",
            thousands(f.rate),
            thousands(hi as f64),
            per_token(hi as f64) / per_token(lo as f64),
            thousands(lo as f64),
        );
        let _ = writeln!(
            out,
            "  straight line: {:.1} ms + tokens / {} tokens/s (r^2 {:.4})",
            f.linear.fixed_s * 1e3,
            thousands(f.linear.rate),
            f.linear.r2
        );
        let rate = self.configured_rate();
        let _ = writeln!(
            out,
            "  at {} tokens (--typical-tokens): {} tokens/s, fixed cost {:.1} ms per request",
            thousands(f.typical_tokens),
            thousands(f.rate_at_typical),
            f.fixed_s * 1e3
        );
        let number = if rate >= 1.0 && rate.fract() == 0.0 {
            serde_json::json!(rate as u64)
        } else {
            serde_json::json!(rate)
        };
        let _ = writeln!(out, "kvoy configuration (the rate at the typical length):");
        let model = serde_json::json!({
            "cost": {"models": {self.model.as_str(): {"prefill_tokens_per_s": number}}}
        });
        let _ = writeln!(out, "  per model:  {model}");
        let endpoint = serde_json::json!({
            "address": self.address.to_string(),
            "models": [self.model],
            "prefill_tokens_per_s": number,
        });
        let _ = writeln!(out, "  endpoint:  {endpoint}");
        out
    }
}

/// One table row, for `progress`.
pub fn table_row(m: &Measurement) -> String {
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
    format!(
        "{:>8} {:>9} {:>11} {:>9}",
        m.prompt_tokens,
        m.computed_tokens,
        m.server_prefill.map_or("-".to_owned(), ms),
        ms(m.ttft)
    )
}

/// The table's header.
pub const TABLE_HEADER: &str = "  prompt  computed  prefill ms   ttft ms";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_prompts_and_numbers() {
        assert_eq!(doubling(256, 16_384).len(), 7);
        assert_eq!(doubling(256, 1000), [256, 512, 1000]);
        let mut rng = Rng::new(1);
        let a = prompt_text(&mut rng, 400);
        let b = prompt_text(&mut rng, 400);
        assert!(a.len() >= 400 && a.len() < 420, "{}", a.len());
        assert_ne!(a[..12], b[..12], "a fresh nonce each");
        assert!(a.bytes().all(|c| c == b' ' || c.is_ascii_lowercase()));
        assert_eq!(thousands(24_195.4), "24,195");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1_000_000.0), "1,000,000");
        assert_eq!(three_digits(24_195.4), 24_200.0);
    }

    #[test]
    fn options_are_checked() {
        let mut o = Options::new("http://127.0.0.1:8000", "m").unwrap();
        assert!(o.check().is_ok());
        o.lengths = vec![256, 512];
        assert!(matches!(o.check(), Err(CalibrateError::BadOptions(_))));
        o.lengths = vec![256, 512, 1024];
        o.repeat = 0;
        assert!(o.check().is_err());
        o.repeat = 1;
        o.model.clear();
        assert!(o.check().is_err());
    }
}
